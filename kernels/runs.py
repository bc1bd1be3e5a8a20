"""Copy plans between an engine's paged pool and contiguous block slots, as runs of bytes.

A pool may be several buffers (one per layer tensor exported over CUDA IPC, or one shared
memory region). ``SegmentMap`` says, for every chunk column of a layout's ``ChunkTable``,
which buffer (segment) holds it and where page 0's chunk starts inside that buffer; the
layout's offsets are in *pool space*, where buffer ``s`` occupies
``[pool_offset[s], pool_offset[s] + size[s])``.

A ``CopyRuns`` is what a copy kernel executes: run ``i`` copies ``length[i]`` bytes from
``src_off[i]`` of source segment ``src_seg[i]`` to ``dst_off[i]`` of destination segment
``dst_seg[i]``. A batch of blocks is one ``CopyRuns`` of ``blocks * chunks`` runs, built
with numpy and never with a Python loop over chunks.

Invariants: every run of a plan built here lies inside its segments (``SegmentMap.build``
proves each layer's chunks stay inside one buffer for every page, and the caller checks
page indices and slot bounds); runs of one plan never write the same byte twice as long as
the destination pages (gather: slots) are distinct. Pure numpy: no torch, no device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

import numpy as np

from kvtier.kernels.layout import ChunkTable, LayoutError, PoolLayout, layer_numbers


@dataclass(frozen=True, slots=True)
class Buffer:
    """One buffer of a pool in pool space."""

    pool_offset: int
    size: int

    @property
    def end(self) -> int:
        return self.pool_offset + self.size


@dataclass(frozen=True)
class SegmentMap:
    """Chunk columns of a layout, resolved to (segment, offset in segment)."""

    segment: np.ndarray  # int64 per column
    base: np.ndarray  # int64 per column: page 0's chunk, bytes from the segment's start
    page_stride: np.ndarray  # int64 per column
    length: np.ndarray  # int64 per column
    block_offset: np.ndarray  # int64 per column: where the chunk sits within a block
    num_pages: int
    block_bytes: int

    @classmethod
    def single(cls, layout: PoolLayout) -> SegmentMap:
        """The whole layout in one buffer that starts at pool offset 0."""
        return cls.build(layout, [Buffer(0, layout.extent_bytes)])

    @classmethod
    def build(cls, layout: PoolLayout, buffers: Sequence[Buffer]) -> SegmentMap:
        """Resolve ``layout`` against ``buffers``.

        Raises LayoutError when buffers overlap in pool space or when the chunks of one
        (layer, kv) for pages ``0..num_pages-1`` do not all lie inside one buffer.
        """
        if not buffers:
            raise LayoutError("a pool needs at least one buffer")
        order = sorted(range(len(buffers)), key=lambda i: buffers[i].pool_offset)
        for a, b in itertools.pairwise(order):
            if buffers[a].end > buffers[b].pool_offset:
                raise LayoutError(
                    f"buffers {a} and {b} overlap in pool space "
                    f"([{buffers[a].pool_offset}, {buffers[a].end}) and "
                    f"[{buffers[b].pool_offset}, {buffers[b].end}))"
                )
        for i, buf in enumerate(buffers):
            if buf.size <= 0 or buf.pool_offset < 0:
                raise LayoutError(f"buffer {i} has size {buf.size} at offset {buf.pool_offset}")
        starts = np.array([buffers[i].pool_offset for i in order], dtype=np.int64)
        table = layout.chunk_table
        first = table.pool_base.astype(np.int64)
        stride = table.page_stride.astype(np.int64)
        length = table.length.astype(np.int64)
        last_end = first + (layout.num_pages - 1) * stride + length
        pos = np.searchsorted(starts, first, side="right") - 1
        seg = np.asarray(order, dtype=np.int64)[np.maximum(pos, 0)]
        ends = np.array([buffers[i].end for i in range(len(buffers))], dtype=np.int64)
        offs = np.array([buffers[i].pool_offset for i in range(len(buffers))], dtype=np.int64)
        bad = (pos < 0) | (last_end > ends[seg])
        if bad.any():
            c = int(np.flatnonzero(bad)[0])
            layer, kv = _column_name(layout, c)
            raise LayoutError(
                f"layer {layer} {'KV'[kv] if layout.layers[layer].kv_count == 2 else 'latent'}: "
                f"chunks span pool bytes [{int(first[c])}, {int(last_end[c])}), "
                "which is not inside one buffer"
            )
        return cls(
            segment=seg,
            base=first - offs[seg],
            page_stride=stride,
            length=length,
            block_offset=table.block_offset.astype(np.int64),
            num_pages=layout.num_pages,
            block_bytes=layout.block_bytes,
        )

    @classmethod
    def from_table(cls, table: ChunkTable, num_pages: int) -> SegmentMap:
        """One segment holding the whole table (a host pool's mapping)."""
        length = table.length.astype(np.int64)
        return cls(
            segment=np.zeros(len(length), dtype=np.int64),
            base=table.pool_base.astype(np.int64),
            page_stride=table.page_stride.astype(np.int64),
            length=length,
            block_offset=table.block_offset.astype(np.int64),
            num_pages=num_pages,
            block_bytes=int(length.sum()),
        )

    @property
    def columns(self) -> int:
        return len(self.length)

    def check_pages(self, pages: np.ndarray) -> None:
        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
            raise IndexError(f"page index outside 0..{self.num_pages - 1}")


@dataclass(frozen=True)
class CopyRuns:
    """Runs of bytes to copy, one per (block, chunk), block-major."""

    src_seg: np.ndarray
    src_off: np.ndarray
    dst_seg: np.ndarray
    dst_off: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def unit(self, *extra: int) -> int:
        """The largest number of bytes that divides every offset, length and ``extra``: the
        widest word a kernel may move without splitting a run."""
        g = 0
        for arr in (self.src_off, self.dst_off, self.length):
            if len(arr):
                g = gcd(g, int(np.gcd.reduce(arr)))
        for e in extra:
            g = gcd(g, int(e))
        return g or 1

    def check(self, src_sizes: Sequence[int], dst_sizes: Sequence[int]) -> None:
        """Raise IndexError unless every run lies inside its source and destination
        segment. A device kernel checks nothing, and an out-of-bounds access there would
        poison the whole CUDA context, so every plan passes here before it runs."""
        if not len(self):
            return
        for name, seg, off, sizes in (
            ("source", self.src_seg, self.src_off, src_sizes),
            ("destination", self.dst_seg, self.dst_off, dst_sizes),
        ):
            limits = np.asarray(sizes, dtype=np.int64)
            if int(seg.min()) < 0 or int(seg.max()) >= len(limits):
                raise IndexError(f"a run names a {name} segment that does not exist")
            end = off + self.length
            bad = (off < 0) | (self.length < 0) | (end > limits[seg])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise IndexError(
                    f"run {i} reaches {name} bytes [{int(off[i])}, {int(end[i])}) of a "
                    f"segment of {int(limits[seg[i]])}"
                )

    def split_by_segments(self) -> list[tuple[int, int, np.ndarray]]:
        """``(src_seg, dst_seg, run indices)`` for each pair of segments the runs touch."""
        if not len(self):
            return []
        key = self.src_seg * (int(self.dst_seg.max()) + 1) + self.dst_seg
        out = []
        for k in np.unique(key):
            idx = np.flatnonzero(key == k)
            out.append((int(self.src_seg[idx[0]]), int(self.dst_seg[idx[0]]), idx))
        return out


def gather_runs(
    smap: SegmentMap, pages: np.ndarray, dst_seg: int, dst_starts: np.ndarray
) -> CopyRuns:
    """Runs that copy the chunks of ``pages[j]`` into one contiguous block at
    ``dst_starts[j]`` of destination segment ``dst_seg``."""
    pool_seg, pool_off, blk_off, length = _chunk_grid(smap, pages, dst_starts)
    return CopyRuns(
        src_seg=pool_seg,
        src_off=pool_off,
        dst_seg=np.full(len(length), dst_seg, dtype=np.int64),
        dst_off=blk_off,
        length=length,
    )


def scatter_runs(
    smap: SegmentMap, src_seg: int, src_starts: np.ndarray, pages: np.ndarray
) -> CopyRuns:
    """Runs that copy the contiguous block at ``src_starts[j]`` of segment ``src_seg`` into
    the chunks of ``pages[j]``."""
    pool_seg, pool_off, blk_off, length = _chunk_grid(smap, pages, src_starts)
    return CopyRuns(
        src_seg=np.full(len(length), src_seg, dtype=np.int64),
        src_off=blk_off,
        dst_seg=pool_seg,
        dst_off=pool_off,
        length=length,
    )


def block_runs(
    src_seg: int, src_starts: np.ndarray, dst_seg: int, dst_starts: np.ndarray, nbytes: int
) -> CopyRuns:
    """Whole blocks between two contiguous arenas (slot to slot)."""
    n = len(src_starts)
    return CopyRuns(
        src_seg=np.full(n, src_seg, dtype=np.int64),
        src_off=np.asarray(src_starts, dtype=np.int64),
        dst_seg=np.full(n, dst_seg, dtype=np.int64),
        dst_off=np.asarray(dst_starts, dtype=np.int64),
        length=np.full(n, nbytes, dtype=np.int64),
    )


def _chunk_grid(
    smap: SegmentMap, pages: np.ndarray, block_starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    pages = np.asarray(pages, dtype=np.int64)
    starts = np.asarray(block_starts, dtype=np.int64)
    if len(pages) != len(starts):
        raise ValueError(f"{len(pages)} pages for {len(starts)} blocks")
    smap.check_pages(pages)
    n, c = len(pages), smap.columns
    pool_off = (smap.base[None, :] + pages[:, None] * smap.page_stride[None, :]).ravel()
    blk_off = (starts[:, None] + smap.block_offset[None, :]).ravel()
    pool_seg = np.broadcast_to(smap.segment[None, :], (n, c)).ravel().copy()
    length = np.broadcast_to(smap.length[None, :], (n, c)).ravel().copy()
    return pool_seg, pool_off, blk_off, length


def _column_name(layout: PoolLayout, column: int) -> tuple[int, int]:
    c = column
    for i, layer in enumerate(layout.layers):
        if c < layer.kv_count:
            return i, c
        c -= layer.kv_count
    raise IndexError(column)


def mla_layout(
    *,
    num_layers: int,
    num_pages: int,
    block_tokens: int,
    latent_dim: int,
    dtype: str,
    base_offset: int = 0,
) -> PoolLayout:
    """An MLA pool: per layer one latent ``[num_pages, block_tokens, latent_dim]`` (the
    compressed KV plus the rope part), one chunk per page (``kv_count == 1``)."""
    from kvtier.kernels.layout import LayerLayout, dtype_itemsize

    chunk = block_tokens * latent_dim * dtype_itemsize(dtype)
    layer_bytes = num_pages * chunk
    layers = tuple(
        LayerLayout(base_offset + i * layer_bytes, 1, 0, chunk, chunk)
        for i in layer_numbers(num_layers)
    )
    return PoolLayout(layers, num_pages, block_tokens, dtype)
