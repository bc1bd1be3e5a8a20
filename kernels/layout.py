"""Pool layout descriptors: where each KV chunk of a page sits in a registered region.

An engine's KV pool is a set of per-layer arrays in one memory region. For layer ``l``, the
chunk of ``(kv, page)`` starts at ``offset + kv * kv_stride + page * page_stride`` and is
``chunk_bytes`` long (``kv`` is 0 for K and 1 for V; MLA pools have ``kv_count == 1``).

A stored block is the concatenation, layer by layer and K before V, of one page's chunks. Two
pools whose chunks hold the same bytes therefore produce the same block, whatever their
physical layout (vLLM ``[2, pages, ...]`` or FlashInfer ``[pages, 2, ...]`` per layer, or a
contiguous staging buffer ``[pages, layers, kv, ...]``).

This module is pure arithmetic, shared by the client (to describe its pool) and the daemon (to
validate a registration and compute copy offsets). It imports no torch and no I/O.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

MAX_LAYERS = 4096
# The bits of the widest integer a layout's field holds on the wire (its offsets and strides
# are uint64): ``validate`` refuses more before its checks name a value.
FIELD_BITS = 64


class LayoutError(ValueError):
    """A layout that is malformed or does not fit its region."""


@dataclass(frozen=True, slots=True)
class LayerLayout:
    offset: int
    kv_count: int
    kv_stride: int
    page_stride: int
    chunk_bytes: int

    def end(self, num_pages: int) -> int:
        """One past the last byte this layer touches."""
        return (
            self.offset
            + (self.kv_count - 1) * self.kv_stride
            + (num_pages - 1) * self.page_stride
            + self.chunk_bytes
        )


# Chunks per block up to which one page's copy offsets are computed in Python ints
# (``ChunkTable.few``); past it numpy's arithmetic, whose cost hardly grows with the count,
# is the cheaper.
FEW_CHUNKS = 8


@dataclass(frozen=True)
class ChunkTable:
    """Copy offsets of one block's chunks, in block order (layer-major, K before V).

    For page ``p`` the chunk ``c`` sits at ``pool_base[c] + p * page_stride[c]`` in the pool
    and at ``block_offset[c]`` within the block.
    """

    pool_base: np.ndarray
    page_stride: np.ndarray
    length: np.ndarray
    block_offset: np.ndarray
    uniform_length: int | None

    def pool_offsets(self, pages: np.ndarray) -> np.ndarray:
        """Flat uint64 offsets of every chunk of every page, page-major."""
        p = pages.astype(np.uint64, copy=False)[:, None]
        return (self.pool_base[None, :] + p * self.page_stride[None, :]).ravel()

    def block_offsets(self, block_starts: np.ndarray) -> np.ndarray:
        """Flat uint64 offsets of every chunk of blocks that start at ``block_starts``."""
        b = block_starts.astype(np.uint64, copy=False)[:, None]
        return (b + self.block_offset[None, :]).ravel()

    def lengths(self, nblocks: int) -> np.ndarray | int:
        if self.uniform_length is not None:
            return self.uniform_length
        return np.tile(self.length, nblocks)

    @cached_property
    def nbytes(self) -> int:
        """Bytes these chunks hold for one block (asked on every Get: kept)."""
        return int(self.length.sum())

    @cached_property
    def few(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
        """``pool_base``, ``page_stride`` and ``block_offset`` as Python ints, for a table of
        at most ``FEW_CHUNKS`` chunks (None past it): one page's offsets are then a few
        integer operations, where numpy's arithmetic on arrays of a few elements costs
        about a microsecond an operation (kept: asked by every single-block copy)."""
        if len(self.length) > FEW_CHUNKS:
            return None
        return (
            tuple(self.pool_base.tolist()),
            tuple(self.page_stride.tolist()),
            tuple(self.block_offset.tolist()),
        )

    def subset(self, first: int, stop: int) -> ChunkTable:
        """Chunks ``first .. stop - 1`` of the block; offsets stay relative to the whole
        block, so copies address the same block slots."""
        length = self.length[first:stop]
        uniform = int(length[0]) if len(length) and bool(np.all(length == length[0])) else None
        return ChunkTable(
            pool_base=self.pool_base[first:stop],
            page_stride=self.page_stride[first:stop],
            length=length,
            block_offset=self.block_offset[first:stop],
            uniform_length=uniform,
        )


@dataclass(frozen=True)
class PoolLayout:
    layers: tuple[LayerLayout, ...]
    num_pages: int
    block_tokens: int
    dtype: str

    @cached_property
    def block_bytes(self) -> int:
        return sum(layer.kv_count * layer.chunk_bytes for layer in self.layers)

    @property
    def extent_bytes(self) -> int:
        """Smallest region size that holds every chunk."""
        return max(layer.end(self.num_pages) for layer in self.layers)

    def validate(self, region_bytes: int) -> None:
        """Raise LayoutError unless every chunk of every page lies inside the region.

        Also rejects chunks of one layer that overlap each other: a Get into such a pool
        would write two blocks over the same bytes; and, before it names a value, a layer
        that is no LayerLayout, a field that is no int or one past ``FIELD_BITS`` bits
        (``field_int``) and a dtype that is no name of ``DTYPE_ITEMSIZE``.
        """
        if not self.layers:
            raise LayoutError("layout has no layers")
        if len(self.layers) > MAX_LAYERS:
            raise LayoutError(f"layout has {len(self.layers)} layers; at most {MAX_LAYERS}")
        if field_int(self.num_pages, "num_pages") < 1:
            raise LayoutError("num_pages must be at least 1")
        if field_int(self.block_tokens, "block_tokens") < 1:
            raise LayoutError("block_tokens must be at least 1")
        itemsize = dtype_itemsize(self.dtype)
        for i, layer in enumerate(self.layers):
            where = f"layer {i}"
            if not isinstance(layer, LayerLayout):
                raise LayoutError(f"{where}: expected LayerLayout, not {type(layer).__name__}")
            for name in ("offset", "kv_count", "kv_stride", "page_stride", "chunk_bytes"):
                field_int(getattr(layer, name), f"{where}: {name}")
            if layer.kv_count not in (1, 2):
                raise LayoutError(f"{where}: kv_count must be 1 or 2, not {layer.kv_count}")
            if layer.chunk_bytes <= 0:
                raise LayoutError(f"{where}: chunk_bytes must be positive")
            if layer.chunk_bytes % itemsize:
                raise LayoutError(
                    f"{where}: chunk_bytes {layer.chunk_bytes} is not a multiple of the "
                    f"{self.dtype} item size {itemsize}"
                )
            if min(layer.offset, layer.kv_stride, layer.page_stride) < 0:
                raise LayoutError(f"{where}: offsets and strides must not be negative")
            if self.num_pages > 1 and layer.page_stride < layer.chunk_bytes:
                raise LayoutError(
                    f"{where}: page_stride {layer.page_stride} is smaller than chunk_bytes "
                    f"{layer.chunk_bytes}, so pages overlap"
                )
            if layer.kv_count == 2 and _kv_chunks_overlap(layer, self.num_pages):
                raise LayoutError(f"{where}: K and V chunks overlap (kv_stride {layer.kv_stride})")
            end = layer.end(self.num_pages)
            if end > region_bytes:
                raise LayoutError(
                    f"{where}: chunks reach byte {end}, beyond the region of {region_bytes} bytes"
                )

    def layer_range_table(self, begin: int, end: int) -> ChunkTable:
        """The chunks of layers ``[begin, end)``: a contiguous part of every block, since a
        block is layer-major. Raises LayoutError for an empty or out-of-range span."""
        if not 0 <= begin < end <= len(self.layers):
            raise LayoutError(
                f"layer range [{begin}, {end}) is not a non-empty part of the "
                f"{len(self.layers)} layers"
            )
        if (begin, end) == (0, len(self.layers)):
            return self.chunk_table
        first = sum(layer.kv_count for layer in self.layers[:begin])
        stop = first + sum(layer.kv_count for layer in self.layers[begin:end])
        return self.chunk_table.subset(first, stop)

    @cached_property
    def chunk_table(self) -> ChunkTable:
        base, stride, length = [], [], []
        for layer in self.layers:
            for kv in range(layer.kv_count):
                base.append(layer.offset + kv * layer.kv_stride)
                stride.append(layer.page_stride)
                length.append(layer.chunk_bytes)
        lengths = np.asarray(length, dtype=np.uint64)
        block_offset = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
        uniform = int(lengths[0]) if bool(np.all(lengths == lengths[0])) else None
        return ChunkTable(
            pool_base=np.asarray(base, dtype=np.uint64),
            page_stride=np.asarray(stride, dtype=np.uint64),
            length=lengths,
            block_offset=block_offset,
            uniform_length=uniform,
        )

    # Builders for the layouts engines use. Each describes `num_layers` per-layer arrays
    # placed one after another from `base_offset`.

    @classmethod
    def vllm(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        block_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        base_offset: int = 0,
    ) -> PoolLayout:
        """vLLM's per-layer ``[2, num_pages, block_tokens, num_kv_heads, head_dim]``."""
        chunk = block_tokens * num_kv_heads * head_dim * dtype_itemsize(dtype)
        return cls._kv_layers(
            num_layers,
            num_pages,
            block_tokens,
            dtype,
            base_offset,
            chunk,
            kv_stride=num_pages * chunk,
            page_stride=chunk,
        )

    @classmethod
    def flashinfer(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        block_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        base_offset: int = 0,
    ) -> PoolLayout:
        """FlashInfer's per-layer ``[num_pages, 2, block_tokens, num_kv_heads, head_dim]``."""
        chunk = block_tokens * num_kv_heads * head_dim * dtype_itemsize(dtype)
        return cls._kv_layers(
            num_layers,
            num_pages,
            block_tokens,
            dtype,
            base_offset,
            chunk,
            kv_stride=chunk,
            page_stride=2 * chunk,
        )

    @classmethod
    def _kv_layers(
        cls,
        num_layers: int,
        num_pages: int,
        block_tokens: int,
        dtype: str,
        base_offset: int,
        chunk: int,
        *,
        kv_stride: int,
        page_stride: int,
    ) -> PoolLayout:
        """Per-layer arrays of ``2 * num_pages`` chunks, one after another; the strides say
        where K and V of a page sit within a layer."""
        layer_bytes = 2 * num_pages * chunk
        layers = tuple(
            LayerLayout(base_offset + i * layer_bytes, 2, kv_stride, page_stride, chunk)
            for i in layer_numbers(num_layers)
        )
        return cls(layers, num_pages, block_tokens, dtype)

    @classmethod
    def staging(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        block_tokens: int,
        chunk_bytes: int,
        kv_count: int = 2,
        dtype: str = "uint8",
        base_offset: int = 0,
    ) -> PoolLayout:
        """A contiguous staging buffer ``[num_pages, num_layers, kv_count, chunk]``: each page
        is one whole block, so a copy is one range per block."""
        page_bytes = num_layers * kv_count * chunk_bytes
        layers = tuple(
            LayerLayout(
                base_offset + i * kv_count * chunk_bytes,
                kv_count,
                chunk_bytes,
                page_bytes,
                chunk_bytes,
            )
            for i in layer_numbers(num_layers)
        )
        return cls(layers, num_pages, block_tokens, dtype)


def layer_numbers(num_layers: int) -> range:
    """``range(num_layers)``, refused past ``MAX_LAYERS`` before a layer is built: a layout
    of ``num_layers=10**5000`` built layers until memory ran out, long before ``validate``
    could refuse the count; one that is no int (``field_int``) too. Every builder of a
    layout layer by layer counts through here (also ``runs.mla_layout`` and
    ``staging.layer_major_layout``)."""
    if field_int(num_layers, "num_layers", bits=None) > MAX_LAYERS:
        raise LayoutError(f"num_layers must be at most {MAX_LAYERS}")
    return range(num_layers)


def dtype_itemsize(dtype: str) -> int:
    """The item size of a dtype a layout may name; LayoutError otherwise, naming it as
    ``shown`` does (a list is no key: TypeError; an int past 4,300 digits has no repr)."""
    itemsize = DTYPE_ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise LayoutError(f"unknown dtype {shown(dtype)}; one of {sorted(DTYPE_ITEMSIZE)}")
    return itemsize


def field_int(value: object, what: str, bits: int | None = FIELD_BITS) -> int:
    """``value`` as an integer field of a layout (``operator.index``: Python's, NumPy's, no
    bool or float) of at most ``bits`` bits and its sign, or LayoutError naming
    ``what``: a str or a float failed a comparison or ``range`` with a TypeError, and a
    refusal naming an int past 4,300 digits with Python's ValueError (it has no repr)."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError  # an int to operator.index
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        kind = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
        raise LayoutError(f"{what}: expected int, not {kind}") from None
    if bits is not None and abs(number).bit_length() > bits:
        raise LayoutError(f"{what}: {shown(number)} does not fit in {bits} bits")
    return number


def shown(value: object) -> str:
    """``repr(value)`` for an error's message, but for an int too long to read its sign and
    size, and for a container holding one its type: Python refuses the repr of an int past
    4,300 digits (ValueError), so a message naming one failed with that, untyped."""
    if isinstance(value, int) and value.bit_length() > 1000:
        return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"
    try:
        return repr(value)
    except ValueError:
        return f"a {type(value).__name__} holding an int of more than 4,300 digits"


def _kv_chunks_overlap(layer: LayerLayout, num_pages: int) -> bool:
    """Whether a K chunk of some page overlaps a V chunk of some page.

    V of page q starts kv_stride + (q - p) * page_stride after K of page p; the chunks overlap
    when that distance is within chunk_bytes of zero for some page difference in range.
    """
    ks, ps, c = layer.kv_stride, layer.page_stride, layer.chunk_bytes
    span = num_pages - 1
    if ps == 0 or span == 0:
        return abs(ks) < c
    nearest = -ks // ps
    for m in (nearest - 1, nearest, nearest + 1, nearest + 2):
        m = max(-span, min(span, m))
        if abs(ks + m * ps) < c:
            return True
    return False
