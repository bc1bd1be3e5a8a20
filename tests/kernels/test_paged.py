"""Batched gather/scatter between engine paged pools and contiguous block slots, on CPU
tensors, for every layout and dtype: bit-exact against blocks built from the engine's own
tensor indexing and against offsets computed with the layout's ChunkTable and numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from kv_pools import DTYPES, LAYOUTS, make_pool

from kvtier.kernels.layout import LayoutError
from kvtier.kernels.paged import copy_pages, copy_runs
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


PAGE_CASES = [(d, ex) for d in ("float16", "float8_e4m3fn") for ex in ("torch", "triton")] + [
    ("float32", "triton")
]


@pytest.mark.parametrize(("dtype", "executor"), PAGE_CASES)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_copy_pages_gathers_and_scatters_what_the_runs_do(kind, dtype, executor, monkeypatch):
    """``copy_pages`` (the plan made per column on the device) against the runs built on the
    host, byte for byte: the whole arena after a gather, the whole pool after a scatter."""
    if executor == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(hash((kind, dtype, 7)) & 0xFFFF)
    pool = make_pool(kind, dtype=dtype, gap=4096 if kind != "staging" else 0)
    pool.fill_random(4)
    smap = SegmentMap.build(pool.layout, pool.buffers)
    nbytes = pool.layout.block_bytes
    pages = rng.permutation(pool.layout.num_pages)[:5].astype(np.int64)
    starts, arena_bytes = _slots(len(pages), nbytes, rng)
    want = torch.full((arena_bytes,), 0x5A, dtype=torch.uint8)
    copy_runs(gather_runs(smap, pages, 0, starts), pool.segments, [want], executor="torch")
    arena = torch.full((arena_bytes,), 0x5A, dtype=torch.uint8)
    used = copy_pages(
        smap, pool.segments, pages, arena, starts, nbytes, gather=True, executor=executor
    )
    assert used == executor
    assert torch.equal(arena, want)

    targets = rng.permutation(pool.layout.num_pages)[: len(pages)].astype(np.int64)
    pool.poison()
    copy_runs(scatter_runs(smap, 0, starts, targets), [arena], pool.segments, executor="torch")
    expected = [seg.clone() for seg in pool.segments]
    pool.poison()
    copy_pages(smap, pool.segments, targets, arena, starts, nbytes, gather=False, executor=executor)
    for seg, exp in zip(pool.segments, expected, strict=True):
        assert torch.equal(seg, exp)
    for j, page in enumerate(targets):
        start = int(starts[j])
        assert torch.equal(pool.block(int(page)), arena[start : start + nbytes])


@pytest.mark.parametrize("executor", ["torch", "triton"])
def test_copy_pages_of_some_layers_touch_only_their_chunks(executor, monkeypatch):
    import dataclasses

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pool = make_pool("vllm", layers=4, pages=6, dtype="float16")
    pool.fill_random(6)
    full = SegmentMap.build(pool.layout, pool.buffers)
    cols = slice(2, 6)  # layers 1 and 2, K and V
    smap = dataclasses.replace(
        full,
        segment=full.segment[cols],
        base=full.base[cols],
        page_stride=full.page_stride[cols],
        length=full.length[cols],
        block_offset=full.block_offset[cols],
    )
    nbytes = pool.layout.block_bytes
    arena = torch.full((2 * nbytes,), 0x5A, dtype=torch.uint8)
    starts = np.array([nbytes, 0], dtype=np.int64)
    copy_pages(
        smap, pool.segments, np.array([3, 1]), arena, starts, nbytes, gather=True, executor=executor
    )
    want = torch.full_like(arena, 0x5A)
    for j, page in enumerate([3, 1]):
        block = pool.block(page)
        for c in range(2, 6):
            a, n = int(full.block_offset[c]), int(full.length[c])
            want[starts[j] + a : starts[j] + a + n] = block[a : a + n]
    assert torch.equal(arena, want)


@pytest.mark.parametrize("executor", ["torch", "triton"])
def test_copy_pages_of_a_map_without_columns_copy_nothing(executor, monkeypatch):
    import dataclasses

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pool = make_pool("vllm", layers=2, pages=4, dtype="float16")
    full = SegmentMap.build(pool.layout, pool.buffers)
    none = slice(0, 0)
    empty = dataclasses.replace(
        full,
        segment=full.segment[none],
        base=full.base[none],
        page_stride=full.page_stride[none],
        length=full.length[none],
        block_offset=full.block_offset[none],
    )
    arena = torch.zeros(pool.layout.block_bytes, dtype=torch.uint8)
    nbytes = pool.layout.block_bytes
    args = (empty, pool.segments, np.array([1]), arena, np.array([0]), nbytes)
    assert copy_pages(*args, gather=True, executor=executor) == "none"
    assert not arena.any()


def test_copy_pages_outside_a_page_slot_or_segment_copy_nothing():
    pool = make_pool("vllm", layers=2, pages=4, dtype="float16")
    pool.fill_random(8)
    smap = SegmentMap.build(pool.layout, pool.buffers)
    nbytes = pool.layout.block_bytes
    arena = torch.zeros(2 * nbytes, dtype=torch.uint8)

    def gather(pages, starts, segments=pool.segments, n=nbytes):
        copy_pages(smap, segments, np.array(pages), arena, np.array(starts), n, gather=True)

    with pytest.raises(IndexError, match="page index"):
        gather([0, 4], [0, nbytes])
    with pytest.raises(IndexError, match="page index"):
        gather([-1], [0])
    with pytest.raises(IndexError, match="outside the"):
        gather([0], [nbytes + 1])
    with pytest.raises(IndexError, match="outside the"):
        gather([0], [-1])
    short = [pool.segments[0], pool.segments[1][:-1]]
    with pytest.raises(IndexError, match="outside its segment"):
        gather([0], [0], short)
    with pytest.raises(IndexError, match="outside its segment"):
        gather([0], [0], pool.segments[:1])
    with pytest.raises(ValueError, match="2 pages for 1 blocks"):
        gather([0, 1], [0])
    with pytest.raises(ValueError, match="the layout's are"):
        gather([0], [0], n=nbytes - 2)
    assert not arena.any()


# Columns a pool's registration never builds (it proves a validated layout), made by hand:
# the checks must not rest on that proof. ``memory`` holds the segment and the slots with
# guard bytes around both, so a copy that strays lands in a guard (and the test sees it).
BENT_COLUMNS = {
    # Pages in reverse: page 0's chunk at the segment's end, past it ([64, 96) of 64 bytes);
    # the furthest byte of the last page stays inside.
    "negative stride": {"base": [64], "page_stride": [-32]},
    # A chunk reaching past its block (the block is 32 bytes, the chunk ends at 48).
    "chunk past its block": {"block_offset": [16]},
    "negative block offset": {"block_offset": [-16]},
    "negative length": {"length": [-32]},
    # Segment -1: numpy's last one, which the runs refuse as not existing.
    "negative segment": {"segment": [-1]},
}


@pytest.mark.parametrize("bend", sorted(BENT_COLUMNS))
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "scatter"])
@pytest.mark.parametrize("executor", ["torch", "triton"])
def test_copy_pages_refuses_columns_that_leave_their_segment_or_block(
    executor, gather, bend, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    memory = torch.zeros(512, dtype=torch.uint8)
    segment, slots = memory[128:192], memory[320:384]  # 64 bytes each
    segment.fill_(7)
    slots.fill_(9)
    fields = {
        "segment": [0],
        "base": [0],
        "page_stride": [32],
        "length": [32],
        "block_offset": [0],
    }
    fields |= BENT_COLUMNS[bend]
    smap = SegmentMap(
        **{k: np.array(v, dtype=np.int64) for k, v in fields.items()},
        num_pages=2,
        block_bytes=32,
    )
    before = memory.clone()
    with pytest.raises(IndexError):
        copy_pages(
            smap,
            [segment],
            np.array([0, 1]),
            slots,
            np.array([32, 0]),
            32,
            gather=gather,
            executor=executor,
        )
    assert torch.equal(memory, before)


@pytest.mark.parametrize("executor", ["torch", "triton"])
def test_copy_pages_takes_pages_laid_out_in_reverse(executor, monkeypatch):
    """A negative stride that stays inside the segment is a layout like any other."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    segment = torch.arange(64, dtype=torch.uint8)
    slots = torch.zeros(64, dtype=torch.uint8)
    smap = SegmentMap(
        *(np.array([v], dtype=np.int64) for v in (0, 32, -32, 32, 0)), num_pages=2, block_bytes=32
    )
    copy_pages(
        smap,
        [segment],
        np.array([0, 1]),
        slots,
        np.array([0, 32]),
        32,
        gather=True,
        executor=executor,
    )
    assert torch.equal(slots, torch.cat([segment[32:], segment[:32]]))


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


@pytest.fixture(scope="module")
def compiled_kernels() -> dict[str, dict[str, object]]:
    """Every variant of the Triton kernels compiled for sm_80 and sm_90, in a child process
    (``triton_compile.py`` says why)."""
    script = os.path.join(os.path.dirname(__file__), "triton_compile.py")
    done = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The interpreter runs the kernel's Python and ignores what only the compiler reads (its
# annotations once failed to compile on the first GPU it met, while every interpreted test
# passed), so the kernels are also compiled here, to the machine code of the GPUs kvtier
# runs on: Triton's compiler and ptxas need no GPU.
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(("word", "align_words"), [("i64", 2), ("i64", 1), ("u8", 1)])
@pytest.mark.parametrize("kernel", ["runs", "pages gather", "pages scatter"])
def test_the_triton_kernels_compile_for_the_gpu(compiled_kernels, arch, word, align_words, kernel):
    got = compiled_kernels[f"{kernel}/{word}/{align_words}/sm_{arch}"]
    assert got["targets_arch"]
    assert got["cubin_bytes"] > 0
    # 16-byte vector accesses where the plan is 16-byte aligned (scalar 8-byte ones moved a
    # sixth of a device-to-device copy's bytes on an H200), plain ones elsewhere.
    assert (got["vector_accesses"] > 0) == (word == "i64" and align_words == 2)


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


@pytest.mark.parametrize("executor", ["torch", "triton"])
@pytest.mark.parametrize("shift", [1, 2, 4, 3])
def test_segments_at_addresses_of_different_alignment(executor, shift, monkeypatch):
    """Offsets and lengths all multiples of 8 while one segment starts ``shift`` bytes past
    an 8-byte boundary and the other on one: the words must suit both (the torch executor
    once viewed each segment with its own widest word, and index_copy_ refused the pair)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(shift)
    memory = torch.from_numpy(rng.integers(0, 256, 4096 + 8, dtype=np.uint8))
    src = memory[shift : shift + 4096]
    dst = torch.zeros(4096, dtype=torch.uint8)
    runs = block_runs(0, np.array([0, 1024, 2048]), 0, np.array([2048, 0, 3072]), 1024)
    for a, b in ((src, dst), (dst, src)):
        ref = b.clone()
        copy_runs(runs, [a], [b], executor=executor)
        for s_off, d_off in ((0, 2048), (1024, 0), (2048, 3072)):
            ref[d_off : d_off + 1024] = a[s_off : s_off + 1024]
        assert torch.equal(b, ref)


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
