from __future__ import annotations

import numpy as np
import pytest

from kvtier.kernels import _copy
from kvtier.kernels import copy as copy_module
from kvtier.kernels.copy import (
    MAX_RUNS_PER_CALL,
    PARALLEL_MIN_BYTES,
    blocks_to_pool,
    copy_ranges,
    pool_to_blocks,
)
from kvtier.kernels.layout import FEW_CHUNKS, MAX_LAYERS, LayerLayout, PoolLayout


def _reference(dst, src, doff, soff, lens):
    out = dst.copy()
    for d, s, n in zip(doff, soff, np.broadcast_to(lens, len(doff)), strict=True):
        out[d : d + n] = src[s : s + n]
    return out


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_copy_matches_reference(threads):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    n = 200
    lens = rng.integers(1, 100, n).astype(np.uint64)
    # Non-overlapping destinations, arbitrary sources.
    doff = np.cumsum(np.concatenate(([0], lens[:-1] + 3))).astype(np.uint64)
    soff = rng.integers(0, len(src) - 100, n).astype(np.uint64)
    expected = _reference(dst, src, doff, soff, lens)
    assert _copy.copy(dst, src, doff, soff, lens, threads) == int(lens.sum())
    assert np.array_equal(dst, expected)


def test_uniform_length_and_merging_of_adjacent_ranges():
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    # Four adjacent 16-byte ranges (merged into one memcpy) and one apart.
    doff = np.array([0, 16, 32, 48, 200], dtype=np.uint64)
    soff = np.array([100, 116, 132, 148, 0], dtype=np.uint64)
    copy_ranges(dst, src, doff, soff, 16)
    assert np.array_equal(dst[:64], src[100:164])
    assert np.array_equal(dst[200:216], src[:16])


def test_out_of_bounds_copies_nothing():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    doff = np.array([0, 60], dtype=np.uint64)
    soff = np.array([0, 0], dtype=np.uint64)
    with pytest.raises(ValueError, match="exceeds destination"):
        copy_ranges(dst, src, doff, soff, 8)
    assert not dst.any()
    with pytest.raises(ValueError, match="exceeds source"):
        copy_ranges(dst, src, np.array([0], np.uint64), np.array([2**63], np.uint64), 8)


def test_bad_arguments_raise_clear_errors():
    src = np.zeros(8, np.uint8)
    with pytest.raises(TypeError, match="uint64"):
        _copy.copy(np.zeros(8, np.uint8), src, np.zeros(1, np.int32), np.zeros(1, np.uint64), 1)
    with pytest.raises(ValueError, match="differ in size"):
        _copy.copy(np.zeros(8, np.uint8), src, np.zeros(2, np.uint64), np.zeros(1, np.uint64), 1)
    with pytest.raises(BufferError, match="not writable"):
        _copy.copy(b"read-only", src, np.zeros(1, np.uint64), np.zeros(1, np.uint64), 1)


def test_gather_and_scatter_through_a_layout_round_trip():
    layout = PoolLayout.vllm(
        num_layers=32, num_pages=32, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="float16"
    )
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 256, layout.extent_bytes, dtype=np.uint8)
    pages = np.array([5, 0, 31, 7], dtype=np.int64)
    blocks = np.zeros(len(pages) * layout.block_bytes, dtype=np.uint8)
    starts = np.arange(len(pages), dtype=np.uint64) * layout.block_bytes
    assert len(pages) * layout.block_bytes >= PARALLEL_MIN_BYTES  # exercises the threaded path
    pool_to_blocks(layout.chunk_table, pool, pages, blocks, starts, threads=2)
    # Block p is the page's chunks, layer-major, K before V.
    t = layout.chunk_table
    for i, p in enumerate(pages):
        expected = b"".join(
            pool[int(b + p * s) : int(b + p * s + n)].tobytes()
            for b, s, n in zip(t.pool_base, t.page_stride, t.length, strict=True)
        )
        assert blocks[i * layout.block_bytes : (i + 1) * layout.block_bytes].tobytes() == expected
    out = np.zeros_like(pool)
    blocks_to_pool(layout.chunk_table, blocks, starts, out, pages[::-1].copy(), threads=2)
    for i, p in enumerate(pages[::-1]):
        src_page = pages[i]  # block i holds page pages[i]
        for b, s, n in zip(t.pool_base, t.page_stride, t.length, strict=True):
            assert np.array_equal(
                out[int(b + p * s) : int(b + p * s + n)],
                pool[int(b + src_page * s) : int(b + src_page * s + n)],
            )


@pytest.mark.parametrize("num_layers", [1, FEW_CHUNKS // 2, FEW_CHUNKS // 2 + 1, 32])
def test_a_single_page_is_gathered_and_scattered_whatever_its_chunk_count(num_layers):
    """One page's offsets are Python ints up to FEW_CHUNKS chunks, numpy's past it: the same
    bytes either way, the last page included."""
    layout = PoolLayout.vllm(
        num_layers=num_layers,
        num_pages=8,
        block_tokens=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float16",
    )
    t = layout.chunk_table
    assert (t.few is None) == (len(t.length) > FEW_CHUNKS)
    pool = np.random.default_rng(2).integers(0, 256, layout.extent_bytes, dtype=np.uint8)
    start = 3 * layout.block_bytes
    for page in (0, 5, 7):
        blocks = np.zeros(4 * layout.block_bytes, dtype=np.uint8)
        pool_to_blocks(t, pool, np.array([page]), blocks, np.array([start], dtype=np.uint64))
        expected = b"".join(
            pool[int(b + page * s) : int(b + page * s + n)].tobytes()
            for b, s, n in zip(t.pool_base, t.page_stride, t.length, strict=True)
        )
        assert blocks[start : start + layout.block_bytes].tobytes() == expected
        assert not blocks[:start].any() and not blocks[start + layout.block_bytes :].any()
        out = np.zeros_like(pool)
        blocks_to_pool(t, blocks, np.array([start], dtype=np.uint64), out, np.array([page]))
        for b, s, n in zip(t.pool_base, t.page_stride, t.length, strict=True):
            at = int(b + page * s)
            assert np.array_equal(out[at : at + int(n)], pool[at : at + int(n)])
        assert int(out.astype(bool).sum()) <= layout.block_bytes


def test_regression_a_batch_of_many_tiny_chunks_planned_all_its_offsets_at_once(monkeypatch):
    """A layout of MAX_LAYERS layers of two one-byte chunks (8,192 chunks per block) made one
    Put of 4,096 pages build 33 million offsets per side: 800 MB of the daemon's memory for
    a 150 KB request, several GB for a few at once. A gather or scatter now plans at most
    MAX_RUNS_PER_CALL chunk copies per kernel call, and the bytes are the same."""
    npages = 300
    layout = PoolLayout(
        tuple(
            LayerLayout(
                offset=layer * 2 * npages,
                kv_count=2,
                kv_stride=npages,
                page_stride=1,
                chunk_bytes=1,
            )
            for layer in range(MAX_LAYERS)
        ),
        num_pages=npages,
        block_tokens=1,
        dtype="uint8",
    )
    table = layout.chunk_table
    assert npages * len(table.length) > 2 * MAX_RUNS_PER_CALL
    planned: list[int] = []

    def recording(dst, src, dst_offsets, src_offsets, lengths, threads=1):
        planned.append(len(dst_offsets))
        return copy_ranges(dst, src, dst_offsets, src_offsets, lengths, threads)

    monkeypatch.setattr(copy_module, "copy_ranges", recording)
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 256, layout.extent_bytes, dtype=np.uint8)
    pages = rng.permutation(npages).astype(np.int64)
    starts = np.arange(npages, dtype=np.uint64) * layout.block_bytes
    blocks = np.zeros(npages * layout.block_bytes, dtype=np.uint8)
    pool_to_blocks(table, pool, pages, blocks, starts)
    # One-byte chunks: byte c of the block of page p is the pool's byte at base[c] + p.
    expected = pool[(table.pool_base[None, :] + pages.astype(np.uint64)[:, None]).ravel()]
    assert np.array_equal(blocks, expected)
    out = np.zeros_like(pool)
    blocks_to_pool(table, blocks, starts, out, pages)
    assert np.array_equal(out, pool)
    assert sum(planned) == 2 * npages * len(table.length)
    assert max(planned) <= MAX_RUNS_PER_CALL
