"""Copy kernels of the data plane (kvtier.kernels).

Top-level ``kernels`` is also the name of the Hugging Face Hub's kernels distribution, which
transformers (5.25 and later) imports. A process whose sys.path holds the checkout's root
(``python -m ...`` or ``python -c ...`` run in it, as ``make test`` does) would find this folder
under that name, and transformers would fail to import. Imported so, this module puts the
distribution in its place, found on sys.path without the checkout. Where no other package has
the name, it stays this empty package, as before: transformers versions that import
``kernels`` to read its version then find none and take the Hub's kernels as absent.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
