"""Moving blocks between a tier's contiguous bytes and a batch's buffers.

Every tier stores a block as one contiguous extent; a batch's buffers are either contiguous
host buffers (``HostBuffers``) or an engine pool's pages (``PoolPages``), where a block is
gathered from or scattered to its page's chunks. These helpers do both with the native copy
kernel, one call per batch (or per block when the caller's bytes arrive one at a time), and
never loop over chunks in Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.kernels.copy import blocks_to_pool, copy_ranges, pool_to_blocks
from kvtier.tiers.base import Buffers, DevicePages, HostBuffers, PoolPages


def _as_bytes(buf: object) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]


def host_side(buffers: Buffers) -> HostBuffers | PoolPages:
    """``buffers`` when a host tier can copy them itself; a GPU pool's pages reach a host
    tier only staged through host buffers by the transfer engine."""
    if isinstance(buffers, DevicePages):
        raise TypeError("a GPU pool's pages go through the transfer engine's staging")
    return buffers


def _every(idx: Sequence[int] | np.ndarray, n: int) -> bool:
    """Whether ``idx`` names blocks ``0 .. n - 1`` in order as a range (a tier's whole
    batch): its pages are then taken as they are, without an index array."""
    return isinstance(idx, range) and idx == range(n)


def store_from(
    src: Buffers,
    idx: Sequence[int] | np.ndarray,
    arena: np.ndarray,
    starts: np.ndarray,
    nbytes: int,
) -> None:
    """Copy blocks ``idx`` of ``src`` into ``arena`` at byte offsets ``starts`` (one each)."""
    src = host_side(src)
    if isinstance(src, PoolPages):
        pages = src.pages if _every(idx, len(src)) else src.pages[np.asarray(idx, dtype=np.int64)]
        pool_to_blocks(src.table, src.memory, pages, arena, starts, src.threads)
        return
    idx = np.asarray(idx, dtype=np.int64)
    for j, start in zip(idx.tolist(), np.asarray(starts).tolist(), strict=True):
        arena[start : start + nbytes] = _as_bytes(src.views[j])[:nbytes]


def load_into(
    dest: Buffers,
    idx: Sequence[int] | np.ndarray,
    arena: np.ndarray,
    starts: np.ndarray,
    nbytes: int,
) -> None:
    """Copy blocks at byte offsets ``starts`` of ``arena`` into blocks ``idx`` of ``dest``."""
    dest = host_side(dest)
    if isinstance(dest, PoolPages):
        every = _every(idx, len(dest))
        pages = dest.pages if every else dest.pages[np.asarray(idx, dtype=np.int64)]
        blocks_to_pool(dest.table, arena, starts, dest.memory, pages, dest.threads)
        return
    idx = np.asarray(idx, dtype=np.int64)
    for j, start in zip(idx.tolist(), np.asarray(starts).tolist(), strict=True):
        _as_bytes(dest.views[j])[:nbytes] = arena[start : start + nbytes]


def put_block(dest: Buffers, j: int, data: object, nbytes: int) -> None:
    """Copy one block's contiguous bytes (``data``, at least ``nbytes`` long) into block ``j``
    of ``dest``."""
    load_into(dest, [j], _as_bytes(data), np.zeros(1, dtype=np.uint64), nbytes)


def get_block(
    src: HostBuffers | PoolPages, j: int, nbytes: int, out: bytearray | None = None
) -> memoryview:
    """Block ``j`` of ``src`` as contiguous bytes: a view of a host buffer, or a gathered copy
    of a pool page (into ``out`` when given, ``nbytes`` long: a buffer the caller reuses)."""
    if isinstance(src, HostBuffers):
        return memoryview(src.views[j]).cast("B")[:nbytes]
    arena = np.empty(nbytes, dtype=np.uint8) if out is None else np.frombuffer(out, np.uint8)
    store_from(src, [j], arena, np.zeros(1, dtype=np.uint64), nbytes)
    return arena.data


def copy_host(
    dst: np.ndarray, src: np.ndarray, dst_starts: np.ndarray, src_starts: np.ndarray, nbytes: int
) -> None:
    """Contiguous block copies between two host arenas, one kernel call."""
    copy_ranges(dst, src, dst_starts, src_starts, nbytes)
