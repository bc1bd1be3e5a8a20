"""Host copies between a registered pool and block slots.

One call moves a whole batch: offsets are computed with numpy from the pool's ChunkTable and
handed to the native kernel, which checks every range, releases the GIL and splits the bytes
across threads. Python never loops over chunks.

Either buffer may be a client's shared mapping that its owner truncates at any moment. The
kernel copies under a SIGBUS guard: a copy that touches memory that is gone raises
``MemoryFault`` (with ``.address``, ``.side`` and ``.offset``) instead of killing the process,
and the destination's bytes are then undefined. The guard's signal handler is installed when
the kernel is imported; ``ensure_fault_handler`` takes it back if something replaced it since.
"""

from __future__ import annotations

from array import array

import numpy as np

from kvtier.kernels import _copy
from kvtier.kernels.layout import ChunkTable

# Below this many bytes a second thread costs more to start than it saves.
PARALLEL_MIN_BYTES = 8 << 20
# Chunk copies one kernel call plans at most. A gather or scatter of more is planned and run
# page range by page range: offsets take 16 bytes per chunk copy, and a layout of thousands of
# one-byte chunks per block made one Put of 4096 pages build 800 MB of them.
MAX_RUNS_PER_CALL = 1 << 20

MemoryFault = _copy.MemoryFault


def ensure_fault_handler() -> bool:
    """Make the guarded-copy SIGBUS handler current again; True if something had replaced
    it (it then chains to that handler for faults outside a copy)."""
    return bool(_copy.install_fault_handler())


def copy_ranges(
    dst: object,
    src: object,
    dst_offsets: np.ndarray | array[int],
    src_offsets: np.ndarray | array[int],
    lengths: np.ndarray | int,
    threads: int = 1,
) -> int:
    """Copy ``lengths[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``.

    Raises ValueError, copying nothing, when any range falls outside its buffer, and
    MemoryFault when the memory behind a buffer disappears during the copy. Offsets given
    as ``array("Q")`` go to the kernel as they are (``_copy_pages``' single page).
    """
    if not isinstance(dst_offsets, array):
        dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.uint64)
    if not isinstance(src_offsets, array):
        src_offsets = np.ascontiguousarray(src_offsets, dtype=np.uint64)
    if not isinstance(lengths, int):
        lengths = np.ascontiguousarray(lengths, dtype=np.uint64)
        total = int(lengths.sum())
    else:
        total = lengths * len(dst_offsets)
    if total < PARALLEL_MIN_BYTES:
        threads = 1
    return int(_copy.copy(dst, src, dst_offsets, src_offsets, lengths, threads))


def _page_parts(table: ChunkTable, npages: int) -> range:
    """Starts of the page ranges a batch is copied in, each planning at most
    ``MAX_RUNS_PER_CALL`` chunk copies (one range for any common layout)."""
    return range(0, npages, max(1, MAX_RUNS_PER_CALL // max(1, len(table.length))))


def pool_to_blocks(
    table: ChunkTable,
    pool: object,
    pages: np.ndarray,
    blocks: object,
    block_starts: np.ndarray,
    threads: int = 1,
) -> int:
    """Gather the chunks of ``pages`` into contiguous blocks starting at ``block_starts``.
    A range outside its buffer raises ValueError before its page range copies anything."""
    return _copy_pages(table, pool, pages, blocks, block_starts, threads, to_blocks=True)


def blocks_to_pool(
    table: ChunkTable,
    blocks: object,
    block_starts: np.ndarray,
    pool: object,
    pages: np.ndarray,
    threads: int = 1,
) -> int:
    """Scatter contiguous blocks starting at ``block_starts`` into the chunks of ``pages``.
    A range outside its buffer raises ValueError before its page range copies anything."""
    return _copy_pages(table, pool, pages, blocks, block_starts, threads, to_blocks=False)


def _copy_pages(
    table: ChunkTable,
    pool: object,
    pages: np.ndarray,
    blocks: object,
    block_starts: np.ndarray,
    threads: int,
    to_blocks: bool,
) -> int:
    """Copy between ``pages`` and the blocks at ``block_starts``, page range by page range
    (``_page_parts``): pool to blocks with ``to_blocks``, else blocks to pool."""
    if len(pages) == 1:
        # One block (a single-key request): with few chunks, its offsets in Python ints
        # (``ChunkTable.few``), else in three array operations, with Python ints for the page
        # and start (a numpy scalar first tries its own arithmetic, then falls back to the
        # array's; both stay uint64). No offset passes 64 bits: the request's page was
        # checked against the pool's page count, whose every chunk the registration fitted
        # in the pool's region.
        page, start = int(pages[0]), int(block_starts[0])
        few = table.few
        at_pool: np.ndarray | array[int]
        at_blocks: np.ndarray | array[int]
        if few is not None:
            bases, strides, offsets = few
            at_pool = array("Q", [b + page * s for b, s in zip(bases, strides, strict=True)])
            at_blocks = array("Q", [start + o for o in offsets])
        else:
            at_pool = table.pool_base + page * table.page_stride
            at_blocks = table.block_offset + start
        lengths = table.lengths(1)
        if to_blocks:
            return copy_ranges(blocks, pool, at_blocks, at_pool, lengths, threads)
        return copy_ranges(pool, blocks, at_pool, at_blocks, lengths, threads)
    parts = _page_parts(table, len(pages))
    copied = 0
    for first in parts:
        part = slice(first, first + parts.step)
        at_pool = table.pool_offsets(pages[part])
        at_blocks = table.block_offsets(block_starts[part])
        lengths = table.lengths(len(pages[part]))
        if to_blocks:
            copied += copy_ranges(blocks, pool, at_blocks, at_pool, lengths, threads)
        else:
            copied += copy_ranges(pool, blocks, at_pool, at_blocks, lengths, threads)
    return copied
