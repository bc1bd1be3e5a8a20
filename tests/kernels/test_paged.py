"""Batched gather/scatter between engine paged pools and contiguous block slots, on CPU
tensors, for every layout and dtype: bit-exact against blocks built from the engine's own
tensor indexing and against offsets computed with the layout's ChunkTable and numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_pools import DTYPES, LAYOUTS, make_pool

from kvtier.kernels.layout import LayoutError
from kvtier.kernels.paged import copy_runs
from kvtier.kernels.runs import (
    Buffer,
    CopyRuns,
    SegmentMap,
    block_runs,
    gather_runs,
    mla_layout,
    scatter_runs,
)

SLOT = 4096


def _slots(n: int, block_bytes: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    slot_bytes = -(-block_bytes // SLOT) * SLOT
    total = 3 * n
    starts = rng.permutation(total)[:n].astype(np.int64) * slot_bytes
    return starts, total * slot_bytes


def _numpy_gather(pool, pages: np.ndarray, starts: np.ndarray, arena_bytes: int) -> np.ndarray:
    """Independent reference: pool space as one numpy buffer, offsets from the ChunkTable."""
    space = np.zeros(pool.layout.extent_bytes, dtype=np.uint8)
    for seg, buf in zip(pool.segments, pool.buffers, strict=True):
        space[buf.pool_offset : buf.end] = seg.numpy()
    table = pool.layout.chunk_table
    src = table.pool_offsets(pages.astype(np.uint64)).astype(np.int64)
    dst = table.block_offsets(starts.astype(np.uint64)).astype(np.int64)
    lens = np.tile(table.length.astype(np.int64), len(pages))
    out = np.zeros(arena_bytes, dtype=np.uint8)
    for s, d, n in zip(src, dst, lens, strict=True):
        out[d : d + n] = space[s : s + n]
    return out


# The Triton kernel moves bytes, so for it the dtype only changes chunk sizes and word
# widths: two dtypes (2- and 1-byte items) cover it under the (slow) interpreter.
CASES = [(d, "torch") for d in DTYPES] + [(d, "triton") for d in ("float16", "float8_e4m3fn")]


@pytest.mark.parametrize(("dtype", "executor"), CASES)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_gather_then_scatter_is_bit_exact(kind, dtype, executor, monkeypatch):
    if executor == "triton":
        # The CUDA kernel itself, run by Triton's interpreter on CPU tensors.
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(hash((kind, dtype)) & 0xFFFF)
    pool = make_pool(kind, dtype=dtype, gap=4096 if kind != "staging" else 0)
    pool.fill_random(1)
    smap = SegmentMap.build(pool.layout, pool.buffers)
    pages = rng.permutation(pool.layout.num_pages)[:6].astype(np.int64)
    starts, arena_bytes = _slots(len(pages), pool.layout.block_bytes, rng)
    arena = torch.full((arena_bytes,), 0x5A, dtype=torch.uint8)
    expected_arena = _numpy_gather(pool, pages, starts, arena_bytes)
    untouched = np.ones(arena_bytes, dtype=bool)
    for s in starts:
        untouched[s : s + pool.layout.block_bytes] = False
    expected_arena[untouched] = 0x5A  # bytes outside the blocks keep their poison

    used = copy_runs(gather_runs(smap, pages, 0, starts), pool.segments, [arena], executor=executor)
    assert used == executor
    assert np.array_equal(arena.numpy(), expected_arena)
    for j, page in enumerate(pages):
        block = arena[starts[j] : starts[j] + pool.layout.block_bytes]
        assert torch.equal(block, pool.block(int(page)))

    # Scatter the blocks back into a poisoned copy of the pool, at other pages.
    original = {int(p): pool.block(int(p)) for p in range(pool.layout.num_pages)}
    pool.poison()
    targets = rng.permutation(pool.layout.num_pages)[: len(pages)].astype(np.int64)
    copy_runs(scatter_runs(smap, 0, starts, targets), [arena], pool.segments, executor=executor)
    for j, page in enumerate(targets):
        assert torch.equal(pool.block(int(page)), original[int(pages[j])])
    for page in set(range(pool.layout.num_pages)) - {int(p) for p in targets}:
        assert bool((pool.block(page) == 0xA5).all()), f"page {page} was written"


@pytest.mark.parametrize("kind", LAYOUTS)
def test_many_blocks_and_all_layers_take_one_call_per_buffer_pair(kind, monkeypatch):
    pool = make_pool(kind, layers=8, pages=64, dtype="bfloat16")
    pool.fill_random(2)
    smap = SegmentMap.build(pool.layout, pool.buffers)
    pages = np.arange(64, dtype=np.int64)[::-1].copy()
    starts = np.arange(64, dtype=np.int64) * pool.layout.block_bytes
    arena = torch.zeros(64 * pool.layout.block_bytes, dtype=torch.uint8)
    calls = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(
        torch.Tensor, "index_select", lambda self, *a: calls.append(1) or real(self, *a)
    )
    runs = gather_runs(smap, pages, 0, starts)
    assert len(runs) == 64 * sum(layer.kv_count for layer in pool.layout.layers)
    copy_runs(runs, pool.segments, [arena], executor="torch")
    assert len(calls) == len(pool.segments)  # one per layer tensor, never per block or chunk
    for j, page in enumerate(pages):
        blk = arena[starts[j] : starts[j] + pool.layout.block_bytes]
        assert torch.equal(blk, pool.block(int(page)))


def test_one_buffer_pool_is_one_call_for_every_layer():
    pool = make_pool("staging", layers=6, pages=16)
    pool.fill_random(3)
    smap = SegmentMap.single(pool.layout)
    runs = gather_runs(smap, np.arange(16), 0, np.arange(16) * pool.layout.block_bytes)
    assert len(runs.split_by_segments()) == 1


def test_triton_plan_words_use_the_widest_common_word(monkeypatch):
    from kvtier.kernels.triton_copy import plan_words

    a = torch.zeros(4096, dtype=torch.uint8)
    b = torch.zeros(4096, dtype=torch.uint8)
    runs = block_runs(0, np.array([0, 64]), 0, np.array([128, 1024]), 64)
    word, base, s, d, n = plan_words(runs, [a], [b])
    assert word == 8 and base == b.data_ptr()
    assert (s * word + base).tolist() == [a.data_ptr(), a.data_ptr() + 64]
    assert (d * word + base).tolist() == [b.data_ptr() + 128, b.data_ptr() + 1024]
    assert n.tolist() == [8, 8]
    odd = block_runs(0, np.array([3]), 0, np.array([0]), 6)
    assert plan_words(odd, [a], [b])[0] == 1


@pytest.mark.parametrize("executor", ["torch", "triton"])
def test_odd_sizes_and_offsets(executor, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(5)
    src = torch.from_numpy(rng.integers(0, 256, 10_000, dtype=np.uint8))
    dst = torch.zeros(10_000, dtype=torch.uint8)
    runs = CopyRuns(
        src_seg=np.zeros(3, dtype=np.int64),
        src_off=np.array([1, 3001, 7777]),
        dst_seg=np.zeros(3, dtype=np.int64),
        dst_off=np.array([9000, 11, 5000]),
        length=np.array([999, 5, 2001]),
    )
    copy_runs(runs, [src], [dst], executor=executor)
    ref = np.zeros(10_000, dtype=np.uint8)
    for s, d, n in zip(runs.src_off, runs.dst_off, runs.length, strict=True):
        ref[d : d + n] = src.numpy()[s : s + n]
    assert np.array_equal(dst.numpy(), ref)


def test_runs_outside_a_segment_copy_nothing():
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    good = block_runs(0, np.array([0]), 0, np.array([0]), 10)
    over = block_runs(0, np.array([0, 95]), 0, np.array([0, 20]), 10)
    with pytest.raises(IndexError, match="source"):
        copy_runs(over, [src], [dst])
    assert not dst.any()
    with pytest.raises(IndexError, match="destination"):
        copy_runs(block_runs(0, np.array([0]), 0, np.array([91]), 10), [src], [dst])
    with pytest.raises(IndexError, match="segment that does not exist"):
        copy_runs(block_runs(1, np.array([0]), 0, np.array([0]), 10), [src], [dst])
    with pytest.raises(ValueError, match="uint8"):
        copy_runs(good, [src.view(torch.int8)], [dst])
    with pytest.raises(ValueError, match="contiguous"):
        copy_runs(good, [src[::2]], [dst])


def test_page_indices_are_checked():
    pool = make_pool("vllm")
    smap = SegmentMap.build(pool.layout, pool.buffers)
    with pytest.raises(IndexError):
        gather_runs(smap, np.array([pool.layout.num_pages]), 0, np.array([0]))
    with pytest.raises(IndexError):
        scatter_runs(smap, 0, np.array([0]), np.array([-1]))


def test_segment_map_rejects_overlaps_and_layers_across_buffers():
    pool = make_pool("vllm", layers=2)
    b0, b1 = pool.buffers
    with pytest.raises(LayoutError, match="overlap"):
        SegmentMap.build(pool.layout, [b0, Buffer(b0.pool_offset + 8, b1.size)])
    # The second layer's chunks reach past a buffer that is too short.
    with pytest.raises(LayoutError, match="not inside one buffer"):
        SegmentMap.build(pool.layout, [b0, Buffer(b1.pool_offset, b1.size - 1)])
    # A layer whose chunks start outside every buffer.
    with pytest.raises(LayoutError, match="not inside one buffer"):
        SegmentMap.build(pool.layout, [Buffer(b0.pool_offset + 1, b0.size * 3)])
    smap = SegmentMap.build(pool.layout, [b1, b0])  # order of buffers does not matter
    assert smap.segment.tolist() == [1, 1, 0, 0]


def test_mla_layout_builder_matches_tensor_indexing():
    layout = mla_layout(num_layers=2, num_pages=5, block_tokens=4, latent_dim=12, dtype="bfloat16")
    pool = make_pool("mla", layers=2, pages=5, tokens=4, heads=3, head_dim=4, dtype="bfloat16")
    assert layout == pool.layout
    layout.validate(pool.layout.extent_bytes)
