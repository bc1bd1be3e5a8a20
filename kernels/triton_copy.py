"""The CUDA executor of ``CopyRuns``: one Triton launch for a whole plan.

Every segment (a layer tensor opened over CUDA IPC, the L0 arena, a scratch buffer) is
addressed from one base pointer: a run's source and destination are word offsets from it,
computed on the host from the segments' addresses, so one launch covers every block, layer
and buffer of a batch. Program ``(r, t)`` copies tiles ``t, t + T, t + 2T, ...`` of run ``r``.
The word is the widest integer (up to 8 bytes) that divides every address and length; with
16-byte alignment the kernel is told so, and the compiler emits 16-byte vector accesses.

``_copy_pages_kernel`` does the same for the copies between an engine pool's pages and block
slots, with the plan made on the GPU: program ``(j * columns + c, t)`` copies chunk column
``c`` of block ``j``, its addresses computed from the pool's segment map (four words per
column) and the block's page and slot (a word each), so the host uploads ``4 * columns +
2 * blocks`` words instead of three per chunk.

The kernels check no bounds: ``paged.copy_runs`` has checked every run against its segments
(``paged.copy_pages`` the pages, the slots and each segment's reach) before they are
called. On a host without CUDA the same kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors, which is how the tests check them; the tests also
compile them for the GPU (the compiler reads what the interpreter ignores).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from math import gcd
from typing import Any

import numpy as np
import torch

from kvtier.kernels.runs import CopyRuns, SegmentMap

BLOCK_WORDS = 1024  # words one program moves per step: 8 KiB of int64
# Launches are taken one at a time: the first launch of each specialisation compiles it, and
# the GPU tier launches from several worker threads (one per pool stream); Triton's compiler
# is not documented as safe to enter from several threads at once. The launch path holds the
# GIL for nearly all of its few tens of microseconds anyway.
_LAUNCH = threading.Lock()
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


# No annotations but constexpr ones: Triton's compiler resolves a parameter's annotation as a
# name in this module (``Any`` fails to compile), where the interpreter ignores it.
def _copy_runs_kernel(  # type: ignore[no-untyped-def]
    base,
    src_off,
    dst_off,
    length,
    BLOCK: tl.constexpr,  # type: ignore[name-defined]
    ALIGN_WORDS: tl.constexpr,  # type: ignore[name-defined]
):
    run = tl.program_id(0)
    # Every length is a multiple of ALIGN_WORDS too (copy_runs_triton checks it), which
    # lets the compiler vectorise the masked accesses.
    n = tl.multiple_of(tl.load(length + run), ALIGN_WORDS)
    s = tl.multiple_of(tl.load(src_off + run), ALIGN_WORDS)
    d = tl.multiple_of(tl.load(dst_off + run), ALIGN_WORDS)
    # 64-bit tile offsets: a run may be longer than 2**31 words' worth of tiles * BLOCK.
    first = tl.program_id(1).to(tl.int64) * BLOCK
    step = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(first, n, step):
        i = start + tl.arange(0, BLOCK)
        mask = i < n
        tl.store(base + d + i, tl.load(base + s + i, mask=mask), mask=mask)


def _copy_pages_kernel(  # type: ignore[no-untyped-def]
    base,
    cols,
    pages,
    starts,
    num_cols,
    BLOCK: tl.constexpr,  # type: ignore[name-defined]
    ALIGN_WORDS: tl.constexpr,  # type: ignore[name-defined]
    GATHER: tl.constexpr,  # type: ignore[name-defined]
):
    # Program (r, t): chunk column c of block j, r = j * num_cols + c. ``cols`` holds four
    # rows of num_cols words each: where page 0's chunk is, the page stride, where the chunk
    # sits in a block, its length; ``pages`` and ``starts`` one word per block.
    r = tl.program_id(0)
    j = r // num_cols
    c = r % num_cols
    page = tl.load(pages + j)
    pool = tl.load(cols + c) + page * tl.load(cols + num_cols + c)
    slot = tl.load(starts + j) + tl.load(cols + 2 * num_cols + c)
    n = tl.multiple_of(tl.load(cols + 3 * num_cols + c), ALIGN_WORDS)
    if GATHER:
        s = tl.multiple_of(pool, ALIGN_WORDS)
        d = tl.multiple_of(slot, ALIGN_WORDS)
    else:
        s = tl.multiple_of(slot, ALIGN_WORDS)
        d = tl.multiple_of(pool, ALIGN_WORDS)
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


@functools.cache
def _pages_kernel(interpret: bool) -> Any:
    del interpret
    return triton.jit(_copy_pages_kernel)


def copy_pages_triton(
    smap: SegmentMap,
    segments: Sequence[torch.Tensor],
    pages: np.ndarray,
    slots: torch.Tensor,
    starts: np.ndarray,
    *,
    gather: bool,
) -> None:
    """Gather the chunks of ``pages[j]`` into ``slots`` at byte ``starts[j]`` (or scatter them
    back) in one launch on the current stream; returns without waiting. The plan is made on
    the GPU from the segment map's columns: the host's work grows with the blocks of a batch,
    not with its blocks times chunks. The caller (``paged.copy_pages``) has checked bounds."""
    if triton is None:
        raise RuntimeError("the triton executor needs the triton package")
    base_addr = slots.data_ptr()
    seg_addr = np.array([t.data_ptr() for t in segments], dtype=np.int64)
    col_src = seg_addr[smap.segment] + smap.base - base_addr
    starts = np.asarray(starts, dtype=np.int64)
    # The widest power of two (up to 16 bytes) dividing every address, offset and length.
    cols = (col_src, smap.page_stride, smap.block_offset, smap.length)
    bits = int(np.bitwise_or.reduce(np.concatenate([seg_addr, *cols, starts])))
    align = (bits | base_addr | 16) & -(bits | base_addr | 16)
    word = min(align, 8)
    pages = np.asarray(pages, dtype=np.int64)
    plan = np.concatenate([*(a // word for a in cols), pages, starts // word])
    dev = torch.from_numpy(plan).to(slots.device, non_blocking=True)
    c, n = smap.columns, len(pages)
    base = slots[: slots.numel() // word * word].view(_WORD[word])
    tiles = max(1, min(-(-int(smap.length.max()) // (word * BLOCK_WORDS)), MAX_TILE_PROGRAMS))
    kernel = _pages_kernel(os.environ.get("TRITON_INTERPRET", "0") == "1")
    with _LAUNCH:
        kernel[(n * c, tiles)](
            base,
            dev[: 4 * c],
            dev[4 * c : 4 * c + n],
            dev[4 * c + n :],
            c,
            BLOCK=BLOCK_WORDS,
            ALIGN_WORDS=2 if align >= 16 else 1,
            GATHER=gather,
        )


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
    with _LAUNCH:
        kernel[(len(runs), tiles)](
            base, *args, BLOCK=BLOCK_WORDS, ALIGN_WORDS=2 if aligned16 else 1
        )


def _all_multiples(
    align: int, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], runs: CopyRuns
) -> bool:
    ptrs = [t.data_ptr() for t in (*src, *dst)]
    return all(p % align == 0 for p in ptrs) and runs.unit(align) == align
