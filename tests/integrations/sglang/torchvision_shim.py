"""Make PyPI's torchvision importable beside the CPU build of torch.

SGLang imports torchvision (through transformers and its multimodal helpers) when its memory
pools are imported. PyPI's torchvision is a CUDA build: its compiled operators need CUDA
torch, and registering their fake implementations fails with "operator torchvision::nms does
not exist". Nothing the HiCache storage tests touch uses those operators, so this module
imports torchvision once with the failing registrations skipped. Import it before anything
that imports SGLang (the conftest does; subprocess scripts do it first).
"""

from __future__ import annotations

import importlib.util

import torch.library


def _import_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is None:
        return
    original = torch.library.register_fake

    def tolerant(op, fn=None, /, **kwargs):  # type: ignore[no-untyped-def]
        def decorate(f):  # type: ignore[no-untyped-def]
            try:
                return original(op, **kwargs)(f)
            except RuntimeError:  # the operator's CUDA build did not load
                return f

        return decorate(fn) if fn is not None else decorate

    torch.library.register_fake = tolerant
    try:
        import torchvision  # noqa: F401
    finally:
        torch.library.register_fake = original


_import_torchvision()
