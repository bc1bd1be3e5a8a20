"""The CUDA executor of ``CopyRuns``: one Triton launch for a whole plan.

Every segment (a layer tensor opened over CUDA IPC, the L0 arena, a scratch buffer) is
addressed from one base pointer: a run's source and destination are word offsets from it,
computed on the host from the segments' addresses, so one launch covers every block, layer
and buffer of a batch. Program ``(r, t)`` copies tiles ``t, t + T, t + 2T, ...`` of run ``r``.
The word is the widest integer (up to 8 bytes) that divides every address and length; with
16-byte alignment the kernel is told so, and the compiler emits 16-byte vector accesses.

The kernel checks no bounds: ``paged.copy_runs`` has checked every run against its segments
before this is called. On a host without CUDA the same kernel runs under Triton's
interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the tests check it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from math import gcd
from typing import Any

import numpy as np
import torch

from kvtier.kernels.runs import CopyRuns

BLOCK_WORDS = 1024  # words one program moves per step: 8 KiB of int64
MAX_TILE_PROGRAMS = 1 << 15  # grid dimension 1 is limited to 65535

_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None
    tl = None


def available() -> bool:
    """Whether the kernel can run on CUDA tensors here."""
    return triton is not None and torch.cuda.is_available()


def _copy_runs_kernel(
    base: Any,
    src_off: Any,
    dst_off: Any,
    length: Any,
    BLOCK: tl.constexpr,  # type: ignore[name-defined]
    ALIGN_WORDS: tl.constexpr,  # type: ignore[name-defined]
) -> None:
    run = tl.program_id(0)
    n = tl.load(length + run)
    s = tl.multiple_of(tl.load(src_off + run), ALIGN_WORDS)
    d = tl.multiple_of(tl.load(dst_off + run), ALIGN_WORDS)
    # 64-bit tile offsets: a run may be longer than 2**31 words' worth of tiles * BLOCK.
    first = tl.program_id(1).to(tl.int64) * BLOCK
    step = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(first, n, step):
        i = start + tl.arange(0, BLOCK)
        mask = i < n
        tl.store(base + d + i, tl.load(base + s + i, mask=mask), mask=mask)


@functools.cache
def _kernel(interpret: bool) -> Any:
    # triton.jit reads TRITON_INTERPRET when it decorates; one compiled object per mode.
    del interpret
    return triton.jit(_copy_runs_kernel)


def plan_words(
    runs: CopyRuns, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """``(word, base segment address, src, dst, length)`` of a plan in words from the base.

    The base is the first destination segment; offsets to other segments may be negative.
    """
    src_ptr = np.array([t.data_ptr() for t in src], dtype=np.int64)
    dst_ptr = np.array([t.data_ptr() for t in dst], dtype=np.int64)
    src_addr = src_ptr[runs.src_seg] + runs.src_off
    dst_addr = dst_ptr[runs.dst_seg] + runs.dst_off
    g = 8
    for arr in (src_addr, dst_addr, runs.length):
        g = gcd(g, int(np.gcd.reduce(arr)))
    word = 1 << (g.bit_length() - 1)  # the power of two dividing everything, at most 8
    base = int(dst_ptr[0])
    return (
        word,
        base,
        (src_addr - base) // word,
        (dst_addr - base) // word,
        runs.length // word,
    )


def copy_runs_triton(
    runs: CopyRuns, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]
) -> None:
    """Launch the copy on the current stream; returns without waiting for it."""
    if triton is None:
        raise RuntimeError("the triton executor needs the triton package")
    word, _, s, d, n = plan_words(runs, src, dst)
    aligned16 = word == 8 and _all_multiples(16, src, dst, runs)
    device = dst[0].device
    base = dst[0][: dst[0].numel() // word * word].view(_WORD[word])
    args = [torch.from_numpy(a).to(device, non_blocking=True) for a in (s, d, n)]
    tiles = max(1, min(-(-int(n.max()) // BLOCK_WORDS), MAX_TILE_PROGRAMS))
    kernel = _kernel(os.environ.get("TRITON_INTERPRET", "0") == "1")
    kernel[(len(runs), tiles)](base, *args, BLOCK=BLOCK_WORDS, ALIGN_WORDS=2 if aligned16 else 1)


def _all_multiples(
    align: int, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], runs: CopyRuns
) -> bool:
    ptrs = [t.data_ptr() for t in (*src, *dst)]
    return all(p % align == 0 for p in ptrs) and runs.unit(align) == align
