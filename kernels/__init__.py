"""Copy kernels of the data plane (kvtier.kernels).

Top-level ``kernels`` is also the name of the Hugging Face Hub's kernels distribution, which
transformers (5.25 and later) imports. A process whose sys.path holds the checkout's root
(``python -m ...`` or ``python -c ...`` run in it, as ``make test`` does) would find this folder
under that name, and transformers would fail to import. Imported so, this module puts the
distribution in its place, found on sys.path without the checkout, or raises
ModuleNotFoundError as if this folder were not there.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
