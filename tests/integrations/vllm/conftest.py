"""The vLLM suite: run by `make test-vllm` in its own environment (vLLM's CPU build).

This folder's helpers import by plain name (``vllm_harness``); ``tests/`` itself is already
on the path (``harness``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
