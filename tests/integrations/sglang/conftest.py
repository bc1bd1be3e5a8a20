"""The SGLang suite: run by `make test-sglang` in its own environment (SGLang's storage
classes on the CPU build of torch).

This folder's helpers import by plain name (``sglang_harness``); ``tests/`` itself is already
on the path (``harness``). The torchvision shim must come before any SGLang import.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torchvision_shim  # noqa: F401
