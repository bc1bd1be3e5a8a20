"""Batched copies of ``CopyRuns`` between torch tensors, on any device.

``copy_runs`` moves a whole plan (many blocks, every layer) at once. Segments are 1-D uint8
tensors: the buffers of an engine pool (one per layer tensor, or one for the whole pool) and
a tier's arena. Two executors:

- **torch** (any device, the only one on a CPU): the runs are cut into rows of the widest
  size that divides every offset and length, and each pair of segments is one
  ``index_select`` plus one ``index_copy_``, so the number of calls depends on the number of
  buffers, never on the number of blocks or chunks. It passes the data twice.
- **triton** (CUDA only, ``kernels/triton_copy.py``): one launch for the whole plan, whatever
  the number of segments, one pass over the data.

``copy_pages`` is the same copies between an engine pool's pages and block slots, given as
the pool's ``SegmentMap`` and the pages rather than as runs: the triton executor computes
every chunk's address on the GPU (the host's work grows with the blocks of a batch, not
with blocks times chunks), the torch executor builds the runs.

Every plan is bounds-checked on the host before it runs (``CopyRuns.check``): a device
kernel checks nothing, and one stray address would poison the CUDA context for every pool.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.kernels.runs import CopyRuns, SegmentMap, gather_runs, scatter_runs

_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_DTYPE_OF_WORD = dict(_WORD_DTYPES)


def copy_runs(
    runs: CopyRuns,
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    *,
    executor: str = "auto",
) -> str:
    """Copy every run of ``runs``; returns the executor that did it (``torch``/``triton``).

    ``executor``: ``auto`` takes triton for CUDA tensors when it is installed, else torch.
    Raises IndexError (copying nothing) when a run falls outside its segment, ValueError for
    segments that are not contiguous 1-D uint8 tensors on one device.
    """
    _check_segments(src, dst)
    runs.check([t.numel() for t in src], [t.numel() for t in dst])
    if not len(runs):
        return "none"
    if executor == "auto":
        executor = "triton" if dst[0].is_cuda and _triton_ready() else "torch"
    if executor == "triton":
        from kvtier.kernels.triton_copy import copy_runs_triton

        copy_runs_triton(runs, src, dst)
    elif executor == "torch":
        copy_runs_torch(runs, src, dst)
    else:
        raise ValueError(f"unknown executor {executor!r}")
    return executor


def copy_pages(
    smap: SegmentMap,
    segments: Sequence[torch.Tensor],
    pages: np.ndarray,
    slots: torch.Tensor,
    starts: np.ndarray,
    block_bytes: int,
    *,
    gather: bool,
    executor: str = "auto",
) -> str:
    """Gather the chunks of ``pages[j]`` (laid out in ``segments`` as ``smap`` says) into
    ``slots[starts[j] : starts[j] + block_bytes]``, or with ``gather=False`` scatter those
    blocks back into the pages; returns the executor that did it.

    The same copies as ``copy_runs`` of ``gather_runs``/``scatter_runs``, checked as
    strictly but in time that grows with the blocks, not blocks times chunks: the page
    indices, the slot extents, and every column's chunks for its first and last page against
    its segment and its place against the block (``_check_columns``). The triton executor
    then makes the plan on the GPU in the same launch that copies.
    Raises IndexError (copying nothing) when a page, slot or chunk is out of range.
    """
    _check_segments(segments, [slots])
    pages = np.asarray(pages, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    if len(pages) != len(starts):
        raise ValueError(f"{len(pages)} pages for {len(starts)} blocks")
    if block_bytes != smap.block_bytes:
        raise ValueError(f"blocks of {block_bytes} bytes, the layout's are {smap.block_bytes}")
    if not len(pages) or not smap.columns:
        return "none"
    smap.check_pages(pages)
    if int(starts.min()) < 0 or int(starts.max()) + block_bytes > slots.numel():
        raise IndexError(f"a block slot lies outside the {slots.numel()}-byte buffer")
    _check_columns(smap, [t.numel() for t in segments])
    if executor == "auto":
        executor = "triton" if slots.is_cuda and _triton_ready() else "torch"
    if executor == "triton":
        from kvtier.kernels.triton_copy import copy_pages_triton

        copy_pages_triton(smap, segments, pages, slots, starts, gather=gather)
        return executor
    if gather:
        return copy_runs(gather_runs(smap, pages, 0, starts), segments, [slots], executor=executor)
    return copy_runs(scatter_runs(smap, 0, starts, pages), [slots], segments, executor=executor)


def _check_columns(smap: SegmentMap, sizes: Sequence[int]) -> None:
    """IndexError unless every page's chunk of every column lies inside its segment and
    inside its block, whatever the map (a pool's registration proves this for the maps it
    builds; the kernel checks nothing, and would copy a hand-made map's stray chunks). Per
    column, so the time grows with the chunks of one block, never with the pages."""
    seg = smap.segment
    if int(seg.min()) < 0 or int(seg.max()) >= len(sizes):
        raise IndexError("a page's chunk lies outside its segment (a segment that does not exist)")
    # A chunk's first and last page bound it either way a stride runs (or none, stride 0).
    last = smap.base + (smap.num_pages - 1) * smap.page_stride
    low = np.minimum(smap.base, last)
    high = np.maximum(smap.base, last) + smap.length
    limits = np.asarray(sizes, dtype=np.int64)[seg]
    if bool(((smap.length < 0) | (low < 0) | (high > limits)).any()):
        raise IndexError("a page's chunk lies outside its segment")
    end = smap.block_offset + smap.length
    if bool(((smap.block_offset < 0) | (end > smap.block_bytes)).any()):
        raise IndexError(f"a chunk lies outside its {smap.block_bytes}-byte block")


def copy_runs_torch(
    runs: CopyRuns, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]
) -> None:
    """The torch executor (see the module docstring). The caller has checked the runs."""
    device = dst[0].device
    unit = runs.unit()
    for s, d, idx in runs.split_by_segments():
        src_off, dst_off, length = runs.src_off[idx], runs.dst_off[idx], runs.length[idx]
        # Rows of `unit` bytes, viewed as the widest integer that divides them, so each
        # copied row is a few wide loads rather than `unit` byte loads.
        size = _word(unit, src[s], dst[d])
        src_rows = _rows(src[s], unit, size)
        dst_rows = _rows(dst[d], unit, size)
        per_run = length // unit
        src_idx = _expand(src_off // unit, per_run)
        dst_idx = _expand(dst_off // unit, per_run)
        src_t = torch.from_numpy(src_idx).to(device, non_blocking=True)
        dst_t = torch.from_numpy(dst_idx).to(device, non_blocking=True)
        dst_rows.index_copy_(0, dst_t, src_rows.index_select(0, src_t))


def _word(unit: int, *segs: torch.Tensor) -> int:
    """The widest integer size that divides ``unit`` and where every segment (its address
    and its offset in its storage, which a view as that type needs) starts: one for both
    sides of a copy, whose rows must be of one type."""
    for size, _ in _WORD_DTYPES:
        if unit % size == 0 and all(
            t.data_ptr() % size == 0 and t.storage_offset() % size == 0 for t in segs
        ):
            return size
    return 1


def _rows(seg: torch.Tensor, unit: int, size: int) -> torch.Tensor:
    n = seg.numel() // unit
    return seg[: n * unit].view(_DTYPE_OF_WORD[size]).view(n, unit // size)


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[s, s+1, ..., s+k-1]`` for every (start s, count k), concatenated, as int64."""
    starts = starts.astype(np.int64, copy=False)
    counts = counts.astype(np.int64, copy=False)
    if len(counts) and bool(np.all(counts == counts[0])):
        k = int(counts[0])
        return (starts[:, None] + np.arange(k, dtype=np.int64)[None, :]).ravel()
    total = int(counts.sum())
    first = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return first + np.arange(total, dtype=np.int64)


def _check_segments(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    if not src or not dst:
        raise ValueError("copy_runs needs at least one source and one destination segment")
    device = dst[0].device
    for t in (*src, *dst):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError("segments must be contiguous 1-D uint8 tensors")
        if t.device != device:
            raise ValueError(f"segments on {t.device} and {device}: one device per copy")


@functools.cache
def _triton_ready() -> bool:
    from kvtier.kernels.triton_copy import available

    return available()
