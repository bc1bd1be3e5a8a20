"""The store with a GPU tier and CUDA IPC pools, in process: the GPU tier (L0) runs on
``CpuOps`` and the engine's pool is CPU tensors opened through the CPU stand-in of the CUDA
IPC calls (tests/cpu_ipc.py); everything above those two boundaries is the daemon's code.

Blocks travel pool -> L0 -> L1 -> L2 -> back for every layout, byte-exact; reads from L1,
L2 and L3 reach GPU pages through L0's bridge when L0 cannot take them; puts that L0
cannot take reach L1 through it; a device fault is an error that keeps the lower copies.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from cpu_ipc import CpuMapper
from kv_pools import LAYOUTS, EnginePool, make_pool

from kvtier.client.cuda import CudaIpcExport, IpcBuffer
from kvtier.daemon.config import load_config
from kvtier.daemon.cuda_pools import CudaPool, CudaPoolOpener
from kvtier.daemon.errors import FailedPrecondition, ResourceExhausted
from kvtier.daemon.pools import Pool
from kvtier.daemon.store import BlockStore, PutResult
from kvtier.daemon.table import keys_to_words
from kvtier.kernels.layout import PoolLayout
from kvtier.tiers import device
from kvtier.tiers.base import Health, Priority, TierKind
from kvtier.tiers.device import CpuOps, DeviceOps, DeviceTier
from kvtier.tiers.host import HostArena
from kvtier.tiers.memory import MemoryKeyTier, MemoryTier

SEG = 256 * 1024
POISON = 0xA5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FaultyOps(CpuOps):
    """CpuOps whose launches fail once ``broken`` is set, as after a CUDA fault."""

    broken = False

    def copy_pages(self, pages, slots, starts, *, gather):  # type: ignore[no-untyped-def]
        self._check()
        return super().copy_pages(pages, slots, starts, gather=gather)

    def copy(self, dst, src):  # type: ignore[no-untyped-def]
        self._check()
        super().copy(dst, src)

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


@dataclass
class Node:
    store: BlockStore
    l0: DeviceTier
    l1: HostArena
    l2: MemoryTier | None
    ops: DeviceOps


Factory = Callable[..., Node]


@pytest.fixture
async def make_node() -> AsyncIterator[Factory]:
    made: list[BlockStore] = []

    def factory(
        *,
        l0_segments: int = 4,
        l1_segments: int = 4,
        l2_segments: int = 8,
        l3: MemoryKeyTier | None = None,
        ops: DeviceOps | None = None,
        sets: tuple[str, ...] = (),
    ) -> Node:
        config = load_config(None, ["policy.name=lru", "policy.protect_s=0", *sets])
        ops = ops or CpuOps()
        l0 = DeviceTier(l0_segments * SEG, SEG, streams=2, ops=ops)
        l1 = HostArena(l1_segments * SEG, SEG)
        tiers: list[object] = [l0, l1]
        l2 = None
        if l2_segments:
            l2 = MemoryTier(TierKind.DISK, l2_segments * SEG, SEG, persistent=True)
            tiers.append(l2)
        if l3 is not None:
            tiers.append(l3)
        store = BlockStore(config, clock=Clock(), tiers=tiers)
        made.append(store)
        return Node(store, l0, l1, l2, ops)

    yield factory
    for store in made:
        await store.stop(flush=False)
        assert store.check() == [], store.check()
        store.close()


def open_gpu_pool(engine: EnginePool, mapper: CpuMapper | None = None) -> CudaPool:
    """The engine's tensors exported (one allocation per layer tensor) and opened as the
    daemon opens a CUDA IPC registration."""
    mapper = mapper or CpuMapper()
    buffers = tuple(
        IpcBuffer(mapper.adopt(t), 0, seg.numel(), b.pool_offset)
        for t, seg, b in zip(engine.tensors, engine.segments, engine.buffers, strict=True)
    )
    region = CudaIpcExport(buffers, 0, b"\x11" * 16).region()
    return CudaPoolOpener(mapper).open(7, "s", region, engine.layout)


def engine_pool(kind: str = "vllm", pages: int = 24, device: str = "cpu") -> EnginePool:
    engine = make_pool(
        kind, layers=3, pages=pages, tokens=8, heads=2, head_dim=32, gap=4096, device=device
    )
    engine.fill_random(int.from_bytes(kind.encode()[:4], "little"))
    return engine


def keys(n: int) -> np.ndarray:
    return keys_to_words([os.urandom(32) for _ in range(n)])


def where(store: BlockStore, words: np.ndarray) -> list[str]:
    ids = store.table.lookup(0, words)
    kinds = store._fastest_kind(np.maximum(ids, 0)) * (ids >= 0)
    return ["-" if k == 0 else TierKind(int(k)).label for k in kinds.tolist()]


def poison(engine: EnginePool, pages: list[int]) -> None:
    for t in engine.tensors:
        raw = t.view(torch.uint8)
        if engine.kind == "vllm":
            raw[:, pages] = POISON
        else:
            raw[pages] = POISON
    if engine.tensors[0].is_cuda:
        torch.cuda.synchronize()  # the engine finishes writing its pages before a request


async def put(store: BlockStore, pool: object, words: np.ndarray, pages: list[int]) -> list[int]:
    res, _ = await store.put(pool, 0, words, np.asarray(pages), None)  # type: ignore[arg-type]
    return res.tolist()


async def get(store: BlockStore, pool: object, words: np.ndarray, pages: list[int]) -> list[bool]:
    got = await store.get(pool, 0, words, np.asarray(pages), touch=True)  # type: ignore[arg-type]
    return got.tolist()


async def fill_l0(node: Node, pool: CudaPool) -> None:
    """Put new blocks until L0 has no free slot; each is held only there, so L0 cannot take
    a promotion without waiting (a Get then reads lower tiers straight into the pages)."""
    page = 0
    while node.l0.allocator.can_allocate(pool.block_bytes):
        assert await put(node.store, pool, keys(1), [page]) == [PutResult.STORED]
        page = (page + 1) % pool.layout.num_pages


async def evict(store: BlockStore, kind: TierKind, words: np.ndarray) -> None:
    """Take the blocks out of ``kind`` (demoting those held only there)."""
    level = store.stack[kind]
    await store.space.evict(level, store.table.lookup(0, words), Priority.BACKGROUND)


def assert_pages(engine: EnginePool, pages: list[int], want: list[torch.Tensor]) -> None:
    for p, w in zip(pages, want, strict=True):
        assert torch.equal(engine.block(p), w), f"page {p} holds other bytes"


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", LAYOUTS)
async def test_gpu_pool_to_l0_to_l1_to_l2_and_back_is_byte_exact(make_node, kind):
    await round_trip(make_node(), kind, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", LAYOUTS)
async def test_on_a_gpu_the_round_trip_is_byte_exact(make_node, kind):
    """The same round trip with the GPU tier's CUDA side (streams, events, the Triton
    kernel) and the engine's tensors on the GPU; only the IPC mapping is the in-process
    stand-in (a process cannot open its own IPC handles)."""
    from kvtier.tiers.device import CudaOps

    await round_trip(make_node(ops=CudaOps(0, 2)), kind, "cuda")


async def round_trip(node: Node, kind: str, device: str) -> None:
    store = node.store
    engine = engine_pool(kind, device=device)
    pool = open_gpu_pool(engine)
    src, dst = [5, 0, 17, 9, 22, 3], [1, 2, 4, 6, 7, 8]
    before = [engine.block(p).clone() for p in range(24)]
    want = [before[p] for p in src]
    words = keys(len(src))

    assert await put(store, pool, words, src) == [PutResult.STORED] * 6
    assert where(store, words) == ["L0"] * 6
    assert node.l0.stats().counters["blocks_written_d2d"] == 6

    await evict(store, TierKind.GPU, words)  # demoted: L0 -> L1
    assert where(store, words) == ["L1"] * 6
    for bid, w in zip(store.table.lookup(0, words).tolist(), want, strict=True):
        slot = int(store.table.slot[bid, store.stack[TierKind.HOST].col])
        assert bytes(node.l1.view(slot, pool.block_bytes)) == w.cpu().numpy().tobytes()

    await evict(store, TierKind.HOST, words)  # demoted: L1 -> L2
    assert where(store, words) == ["L2"] * 6

    poison(engine, dst)
    assert await get(store, pool, words, dst) == [True] * 6
    assert_pages(engine, dst, want)
    others = sorted(set(range(24)) - set(dst))  # sources and the rest: only ever read
    assert_pages(engine, others, [before[p] for p in others])
    # The Get promoted the blocks into L0 (L2 -> pinned staging -> L0) and read them from
    # there into the pages in one scatter.
    assert where(store, words) == ["L0"] * 6
    assert node.l0.stats().counters["blocks_read_d2d"] == 6
    assert store.counters.get("loaded_from", tier="L0") == 6
    pool.close()


@pytest.mark.parametrize("kind", LAYOUTS)
async def test_l1_and_l2_blocks_reach_gpu_pages_through_l0_when_it_has_no_room(make_node, kind):
    """L0 full of blocks held nowhere else cannot take promotions without waiting: the Get
    reads the L1 blocks straight from L1's slots and the L2 blocks through host staging,
    and L0 scatters both into the pages."""
    node = make_node(l0_segments=1)
    store = node.store
    engine = engine_pool(kind, pages=40)
    pool = open_gpu_pool(engine)
    in_l1, in_l2 = keys(3), keys(3)
    want = [engine.block(p).clone() for p in range(6)]
    assert await put(store, pool, in_l1, [0, 1, 2]) == [PutResult.STORED] * 3
    assert await put(store, pool, in_l2, [3, 4, 5]) == [PutResult.STORED] * 3
    await evict(store, TierKind.GPU, np.concatenate([in_l1, in_l2]))
    await evict(store, TierKind.HOST, in_l2)
    assert where(store, in_l1) == ["L1"] * 3 and where(store, in_l2) == ["L2"] * 3
    await fill_l0(node, pool)
    words = np.concatenate([in_l1, in_l2])
    dst = [30, 31, 32, 33, 34, 35]
    before = dict(node.l0.stats().counters)
    poison(engine, dst)
    assert await get(store, pool, words, dst) == [True] * 6
    assert_pages(engine, dst, want)
    after = node.l0.stats().counters
    assert after["blocks_host_to_pool"] - before.get("blocks_host_to_pool", 0) == 6
    assert where(store, in_l1) == ["L1"] * 3 and where(store, in_l2) == ["L2"] * 3
    assert store.counters.get("loaded_from", tier="L1") == 3
    assert store.counters.get("loaded_from", tier="L2") == 3
    pool.close()


async def test_puts_l0_cannot_take_reach_l1_through_l0(make_node):
    node = make_node(l0_segments=1)
    store = node.store
    engine = engine_pool("flashinfer", pages=64)
    pool = open_gpu_pool(engine)
    held = keys(64)
    assert await put(store, pool, held, list(range(64))) == [PutResult.STORED] * 64
    in_l0 = held[np.asarray(where(store, held)) == "L0"]
    assert 0 < len(in_l0) < 64  # L0 took what it could; the rest went to L1 through it
    store.pin(store.table.lookup(0, in_l0))  # L0 cannot evict anything now
    below_before = store.counters.get("stored_below", tier="L1")
    words = keys(4)
    src = [60, 61, 62, 63]
    want = [engine.block(p).clone() for p in src]
    assert await put(store, pool, words, src) == [PutResult.STORED] * 4
    assert where(store, words) == ["L1"] * 4
    assert store.counters.get("stored_below", tier="L1") - below_before == 4
    assert node.l0.stats().counters["blocks_pool_to_host"] >= 4
    for bid, w in zip(store.table.lookup(0, words).tolist(), want, strict=True):
        slot = int(store.table.slot[bid, store.stack[TierKind.HOST].col])
        assert bytes(node.l1.view(slot, pool.block_bytes)) == w.numpy().tobytes()
    poison(engine, [0, 1, 2, 3])
    assert await get(store, pool, words, [0, 1, 2, 3]) == [True] * 4
    assert_pages(engine, [0, 1, 2, 3], want)
    store.unpin(store.table.refs(store.table.lookup(0, in_l0)))
    pool.close()


async def test_a_failed_lower_read_is_a_miss_and_the_rest_of_the_batch_loads(make_node):
    node = make_node(l0_segments=1)
    store = node.store
    engine = engine_pool("mla", pages=64)
    pool = open_gpu_pool(engine)
    words = keys(4)
    want = [engine.block(p).clone() for p in range(4)]
    await put(store, pool, words, [0, 1, 2, 3])
    await evict(store, TierKind.GPU, words)
    await evict(store, TierKind.HOST, words)
    await fill_l0(node, pool)  # the Get reads L2 straight into the pages
    assert node.l2 is not None
    bad = int(
        store.table.slot[store.table.lookup(0, words[1:2])[0], store.stack[TierKind.DISK].col]
    )
    node.l2.fail_reads.add(bad)
    poison(engine, [40, 41, 42, 43])
    assert await get(store, pool, words, [40, 41, 42, 43]) == [True, False, True, True]
    assert_pages(engine, [40, 42, 43], [want[0], want[2], want[3]])
    assert bool((engine.block(41) == POISON).all())  # a miss is never scattered
    assert where(store, words) == ["L2", "-", "L2", "L2"]
    pool.close()


async def test_l3_blocks_reach_gpu_pages(make_node):
    """A block another node stored in the shared key-addressed tier: probed, then read into
    the GPU pool (promoted into L0 on the way, or through host staging when L0 is full)."""
    shared = MemoryKeyTier()
    a = make_node(l3=shared)
    engine = engine_pool("vllm")
    pool_a = open_gpu_pool(engine)
    words = keys(4)
    want = [engine.block(p).clone() for p in range(4)]
    await put(a.store, pool_a, words, [0, 1, 2, 3])
    await a.store.lookup(0, words)  # read twice: L3's admission writes them behind
    a.store.space.apply_touches()
    await a.store.space.drain()
    assert len(shared.values) == 4
    pool_a.close()

    for l0_full in (False, True):
        b = make_node(l3=shared, l0_segments=1, l2_segments=0)
        other = engine_pool("vllm", pages=48)
        pool_b = open_gpu_pool(other)
        if l0_full:
            await fill_l0(b, pool_b)
        prefix, tiers, _ = await b.store.lookup(0, words)
        assert prefix == 4 and tiers.tolist() == [int(TierKind.REMOTE)] * 4
        poison(other, [0, 1, 2, 3])
        assert await get(b.store, pool_b, words, [0, 1, 2, 3]) == [True] * 4
        assert_pages(other, [0, 1, 2, 3], want)
        assert where(b.store, words) == (["L3"] * 4 if l0_full else ["L0"] * 4)
        pool_b.close()


async def test_a_device_fault_is_an_error_and_lower_copies_stay(make_node):
    ops = FaultyOps()
    node = make_node(ops=ops)
    store = node.store
    engine = engine_pool("vllm")
    pool = open_gpu_pool(engine)
    words = keys(3)
    await put(store, pool, words, [0, 1, 2])
    await evict(store, TierKind.GPU, words)
    assert where(store, words) == ["L1"] * 3
    ops.broken = True  # the promotion into L0 fails first, then L1 -> pages via L0
    with pytest.raises(FailedPrecondition, match=r"GPU tier .*down: "):
        await get(store, pool, words, [3, 4, 5])
    assert node.l0.health().state is Health.DOWN
    assert where(store, words) == ["L1"] * 3  # L1's copies are intact and kept
    with pytest.raises(FailedPrecondition, match="GPU tier"):
        await put(store, pool, keys(2), [6, 7])
    pool.close()


class ShortOps(CpuOps):
    """CpuOps with no device memory to spare once ``short`` is set (the engine on the same
    GPU holds the rest), as torch's caching allocator reports it."""

    short = False

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.short:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return super().empty(nbytes)


async def test_a_device_short_of_memory_fails_the_request_and_l0_serves_on(make_node):
    """A Get from L1 into GPU pages through L0's scratch, on a device with no memory to
    spare: RESOURCE_EXHAUSTED, not a fault; L0 stays OK and the next Get loads the blocks
    (it went DOWN for good: every later request into a GPU pool failed until a restart)."""
    ops = ShortOps()
    node = make_node(l0_segments=1, ops=ops)
    store = node.store
    engine = engine_pool("vllm", pages=40)
    pool = open_gpu_pool(engine)
    words = keys(3)
    want = [engine.block(p).clone() for p in range(3)]
    assert await put(store, pool, words, [0, 1, 2]) == [PutResult.STORED] * 3
    await evict(store, TierKind.GPU, words)
    await fill_l0(node, pool)  # the Get reads L1 straight into the pages, through scratch
    ops.short = True
    with pytest.raises(ResourceExhausted, match=r"GPU tier .*out of memory"):
        await get(store, pool, words, [30, 31, 32])
    assert node.l0.health().state is Health.OK
    assert where(store, words) == ["L1"] * 3
    ops.short = False
    poison(engine, [30, 31, 32])
    assert await get(store, pool, words, [30, 31, 32]) == [True] * 3
    assert_pages(engine, [30, 31, 32], want)
    pool.close()


class PlanShortOps(CpuOps):
    """CpuOps whose gathers and scatters cannot allocate their plan on the device from the
    ``at``-th launch after ``short(at)`` until ``enough()`` (the engine on the same GPU
    holds the rest), as torch's caching allocator reports it."""

    def __init__(self) -> None:
        super().__init__()
        self.short_at = self.launches = 0

    def short(self, at: int = 1) -> None:
        self.short_at, self.launches = at, 0

    def enough(self) -> None:
        self.short_at = 0

    def copy_pages(self, pages, slots, starts, *, gather):  # type: ignore[no-untyped-def]
        self.launches += 1
        if self.short_at and self.launches >= self.short_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return super().copy_pages(pages, slots, starts, gather=gather)


async def test_a_device_short_of_memory_reading_l0_keeps_its_blocks(make_node):
    """A Get of blocks held only in L0, whose scatter into the GPU pages finds no device
    memory for its plan: RESOURCE_EXHAUSTED, and L0's copies stay, intact (the failed read
    was taken for a lost copy: the blocks were dropped, the Get answered misses)."""
    ops = PlanShortOps()
    node = make_node(ops=ops)
    store = node.store
    engine = engine_pool("vllm")
    pool = open_gpu_pool(engine)
    words = keys(3)
    want = [engine.block(p).clone() for p in range(3)]
    assert await put(store, pool, words, [0, 1, 2]) == [PutResult.STORED] * 3
    ids = store.table.lookup(0, words)
    assert (store.table.slot[ids, store.stack[TierKind.HOST].col] < 0).all()  # only in L0
    ops.short()
    with pytest.raises(ResourceExhausted, match=r"GPU tier .*out of memory"):
        await get(store, pool, words, [3, 4, 5])
    assert node.l0.health().state is Health.OK
    assert where(store, words) == ["L0"] * 3
    ops.enough()
    poison(engine, [3, 4, 5])
    assert await get(store, pool, words, [3, 4, 5]) == [True] * 3
    assert_pages(engine, [3, 4, 5], want)
    pool.close()


async def test_a_put_through_l0_short_of_memory_stores_nothing_and_frees_its_l1_slots(
    make_node, monkeypatch
):
    """A Put that L0 has no room for goes to L1 through the bridge, in groups of two
    blocks; the third group finds no device memory for its plan: RESOURCE_EXHAUSTED, none
    of the keys stored, the L1 slots taken for them (two groups of them written) given
    back; the same Put then stores them all."""
    ops = PlanShortOps()
    node = make_node(l0_segments=1, ops=ops)
    store = node.store
    engine = engine_pool("vllm", pages=40)
    pool = open_gpu_pool(engine)
    monkeypatch.setattr(device, "BRIDGE_SCRATCH_BYTES", 4 * pool.block_bytes)
    await fill_l0(node, pool)
    in_l0 = store.table.holders(store.stack[TierKind.GPU].col)
    store.pin(in_l0)  # L0 cannot evict anything now
    l1_used = node.l1.allocator.used_slots
    words = keys(8)
    src = list(range(20, 28))
    want = [engine.block(p).clone() for p in src]
    ops.short(at=3)
    with pytest.raises(ResourceExhausted, match=r"GPU tier .*out of memory"):
        await put(store, pool, words, src)
    assert ops.launches == 3  # the groups before it ran
    assert where(store, words) == ["-"] * 8
    assert node.l1.allocator.used_slots == l1_used
    assert node.l0.health().state is Health.OK
    ops.enough()
    assert await put(store, pool, words, src) == [PutResult.STORED] * 8
    assert where(store, words) == ["L1"] * 8
    poison(engine, src)
    assert await get(store, pool, words, src) == [True] * 8
    assert_pages(engine, src, want)
    store.unpin(store.table.refs(in_l0))
    pool.close()


# --------------------------------------------------- shared memory with an L0 on top


async def test_a_shared_memory_pool_round_trips_through_l0(make_node):
    node = make_node()
    store = node.store
    layout = PoolLayout.staging(
        num_layers=2, num_pages=16, block_tokens=4, chunk_bytes=3000, kv_count=2
    )
    pool = Pool(1, "s", "test", layout, mmap.mmap(-1, layout.extent_bytes))
    pool.array[:] = np.random.default_rng(3).integers(0, 256, len(pool.array), dtype=np.uint8)
    n = layout.block_bytes
    want = [pool.array[p * n : (p + 1) * n].tobytes() for p in range(4)]
    words = keys(4)
    assert await put(store, pool, words, [0, 1, 2, 3]) == [PutResult.STORED] * 4
    assert where(store, words) == ["L0"] * 4
    pool.array[4 * n : 8 * n] = POISON
    assert await get(store, pool, words, [4, 5, 6, 7]) == [True] * 4
    assert [pool.array[p * n : (p + 1) * n].tobytes() for p in range(4, 8)] == want
    counters = node.l0.stats().counters
    assert counters["blocks_written_h2d"] == 4 and counters["blocks_read_d2h"] == 4
    pool.close()


# --------------------------------------------------------------- lookup and stats


async def test_lookup_reports_l0_and_stats_show_it(make_node):
    node = make_node()
    store = node.store
    engine = engine_pool("vllm")
    pool = open_gpu_pool(engine)
    a, b = keys(2), keys(2)
    await put(store, pool, a, [0, 1])
    await put(store, pool, b, [2, 3])
    await evict(store, TierKind.GPU, b)
    prefix, tiers, _ = await store.lookup(0, np.concatenate([a, b, keys(1)]))
    from kvtier.proto import kvtier_pb2 as pb

    assert prefix == 4
    assert tiers.tolist() == [pb.TIER_L0_GPU] * 2 + [pb.TIER_L1_HOST] * 2 + [0]
    usage = {u.kind: u for u in store.usage()}
    assert usage[TierKind.GPU].blocks == 2 and usage[TierKind.GPU].used_bytes > 0
    assert store.counters.get("hits", tier="L0") == 2
    gauges = store.gauges()
    assert gauges["l0_blocks"] == 2 and gauges["l0_l2_gds"] == 0.0
    assert store.all_counters()["l0_blocks_written_d2d"] == 4
    pool.close()


# ------------------------------------------------------------ GPUDirect Storage choice


def _l0_after_choice(tmp_path, *sets: str) -> DeviceTier:
    from kvtier.daemon.stack import choose_l2_path

    base = ["tiers.l0.enabled=true", "tiers.l2.enabled=false", f"tiers.l2.path={tmp_path}"]
    config = load_config(None, [*base, *sets])
    l0 = DeviceTier(1 << 20, 1 << 20, ops=CpuOps())
    choose_l2_path(config, l0)
    return l0


def test_without_kvikio_l2_and_l0_meet_through_pinned_host_memory_and_stats_say_why(tmp_path):
    from kvtier.tiers.base import TierUnavailable

    l0 = _l0_after_choice(tmp_path, "tiers.l2.enabled=true")
    assert (l0.l2_path, l0.gds_usable) == ("pinned_l1", False)
    assert "kvikio is not installed" in l0.l2_path_reason
    gauges = l0.stats().gauges
    assert gauges["l2_gds"] == 0.0 and gauges["gds_usable"] == 0.0
    off = _l0_after_choice(tmp_path, "tiers.l2.enabled=true", "tiers.l0.gds=false")
    assert off.l2_path == "pinned_l1" and "disabled" in off.l2_path_reason
    with pytest.raises(TierUnavailable, match="kvikio is not installed"):
        _l0_after_choice(tmp_path, "tiers.l2.enabled=true", "tiers.l0.gds=true")
    alone = _l0_after_choice(tmp_path)
    assert (alone.l2_path, alone.l2_path_reason) == ("none", "no disk tier")
    with pytest.raises(TierUnavailable, match=r"needs the disk tier"):
        _l0_after_choice(tmp_path, "tiers.l0.gds=true")


def test_a_usable_gds_is_reported_as_usable_but_not_as_the_path_taken(tmp_path, monkeypatch):
    """The direct L2 <-> L0 route is not wired: transfers go through host staging even when
    GPUDirect Storage is usable, and the gauges must not claim otherwise."""
    from kvtier.tiers import gds

    monkeypatch.setattr(gds, "_unusable", lambda directory, device: None)
    l0 = _l0_after_choice(tmp_path, "tiers.l2.enabled=true")
    assert l0.gds_usable and l0.l2_path == "pinned_l1"
    assert "not wired" in l0.l2_path_reason
    gauges = l0.stats().gauges
    assert gauges["gds_usable"] == 1.0 and gauges["l2_gds"] == 0.0


# ---------------------------------------------------------------- layer-range Gets


@pytest.mark.parametrize("kind", ["vllm", "mla"])
@pytest.mark.parametrize("source", ["L0", "L1", "L2"])
async def test_a_layer_range_get_writes_only_those_layers_of_gpu_pages(make_node, kind, source):
    node = make_node(l0_segments=1)
    store = node.store
    engine = engine_pool(kind, pages=64)
    pool = open_gpu_pool(engine)
    words = keys(3)
    want = [engine.block(p).clone() for p in (0, 1, 2)]
    await put(store, pool, words, [0, 1, 2])
    if source != "L0":
        await evict(store, TierKind.GPU, words)
        if source == "L2":
            await evict(store, TierKind.HOST, words)
        await fill_l0(node, pool)  # read from the lower tier straight into the pages
    assert where(store, words) == [source] * 3
    dst = [60, 61, 62]
    poison(engine, dst)
    got = await store.get(pool, 0, words, np.asarray(dst), touch=True, layers=(1, 3))
    assert got.tolist() == [True] * 3
    layer = pool.block_bytes // 3
    for p, w in zip(dst, want, strict=True):
        block = engine.block(p)
        assert bool((block[:layer] == POISON).all())  # layer 0 untouched
        assert torch.equal(block[layer:], w[layer:])
    pool.close()
