"""The L0 device tier's slot and batch logic, run on CPU tensors: its CUDA part (memory,
streams, events, launches) is replaced at its one boundary by ``CpuOps``; the plans, slot
checks, copies, accounting and fault handling are the tier's own."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from kv_pools import LAYOUTS, make_pool

from kvtier.kernels.runs import SegmentMap
from kvtier.tiers import device
from kvtier.tiers.base import (
    BlockRef,
    DevicePages,
    Health,
    HostBuffers,
    PoolPages,
    ReadBatch,
    TierKind,
    TierMemoryExhausted,
    TierUnavailable,
    WriteBatch,
)
from kvtier.tiers.device import CpuOps, DeviceTier

CAP, SEG = 8 << 20, 1 << 20


def _tier(ops: CpuOps | None = None, **kw) -> DeviceTier:
    """A tier on ``ops``, whose records start after the tier's self-test at start."""
    ops = ops or CpuOps()
    tier = DeviceTier(CAP, SEG, streams=kw.pop("streams", 3), ops=ops, **kw)
    ops.lanes_used.clear()
    if isinstance(ops, _CountingOps):
        ops.copies.clear()
    return tier


def _refs(n: int) -> list[BlockRef]:
    return [BlockRef(1, bytes([i]) * 32) for i in range(n)]


def _pages(pool, pages) -> DevicePages:
    return DevicePages(
        SegmentMap.build(pool.layout, pool.buffers), pool.segments, np.asarray(pages, np.int64)
    )


def _alloc(tier: DeviceTier, n: int, nbytes: int) -> list[int]:
    slots = [tier.allocator.allocate(nbytes) for _ in range(n)]
    assert all(s is not None for s in slots)
    return slots  # type: ignore[return-value]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_engine_pool_to_l0_to_host_and_back_to_the_pool(kind):
    ops = CpuOps()
    tier = _tier(ops)
    pool = make_pool(kind, layers=4, pages=12, dtype="bfloat16", gap=8192)
    pool.fill_random(9)
    nbytes = pool.layout.block_bytes
    pages = [7, 2, 11, 0, 5]
    slots = _alloc(tier, len(pages), nbytes)
    out = tier.write(WriteBatch(slots, _refs(5), nbytes, _pages(pool, pages)))
    assert [o.ok for o in out] == [True] * 5 and [o.slot for o in out] == slots

    # L0 -> host buffers (a demotion to L1), poisoned first.
    host = [bytearray(b"\xee" * nbytes) for _ in pages]
    assert tier.read(ReadBatch(slots, _refs(5), nbytes, HostBuffers([memoryview(h) for h in host])))
    for h, p in zip(host, pages, strict=True):
        assert bytes(h) == pool.block(p).numpy().tobytes()

    # L0 -> other pages of a poisoned pool.
    originals = {p: pool.block(p) for p in pages}
    pool.poison()
    targets = [1, 3, 4, 6, 8]
    assert tier.read(ReadBatch(slots, _refs(5), nbytes, _pages(pool, targets))) == [True] * 5
    for t, p in zip(targets, pages, strict=True):
        assert torch.equal(pool.block(t), originals[p])
    for untouched in set(range(12)) - set(targets):
        assert bool((pool.block(untouched) == 0xA5).all())

    # Host buffers -> L0 (a promotion from L1) into fresh slots -> the pool again.
    slots2 = _alloc(tier, 5, nbytes)
    tier.write(WriteBatch(slots2, _refs(5), nbytes, HostBuffers([bytes(h) for h in host])))
    pool.poison()
    tier.read(ReadBatch(slots2, _refs(5), nbytes, _pages(pool, pages)))
    for p in pages:
        assert torch.equal(pool.block(p), originals[p])

    # Engine traffic on the pool streams in turn; host traffic on its own streams.
    assert ops.lanes_used == ["pool0", "d2h", "pool1", "h2d", "pool2"]
    stats = tier.stats()
    assert stats.kind is TierKind.GPU and stats.used_bytes == 10 * tier.allocator.slot_bytes_for(
        nbytes
    )
    assert stats.counters["blocks_written_d2d"] == 5 and stats.counters["blocks_written_h2d"] == 5
    assert stats.counters["bytes_read_d2h"] == 5 * nbytes
    assert stats.counters["blocks_read_d2d"] == 10


def test_shared_memory_pools_are_staged_through_the_host():
    tier = _tier()
    pool = make_pool("flashinfer", layers=2, pages=6, dtype="float16")
    pool.fill_random(1)
    # The same bytes as a host pool: one mapping laid out as the pool space.
    space = np.zeros(pool.layout.extent_bytes, dtype=np.uint8)
    for seg, buf in zip(pool.segments, pool.buffers, strict=True):
        space[buf.pool_offset : buf.end] = seg.numpy()
    nbytes = pool.layout.block_bytes
    slots = _alloc(tier, 3, nbytes)
    src = PoolPages(pool.layout.chunk_table, space, np.array([5, 0, 3]))
    assert all(o.ok for o in tier.write(WriteBatch(slots, _refs(3), nbytes, src)))
    back = np.full_like(space, 0x77)
    dest = PoolPages(pool.layout.chunk_table, back, np.array([1, 2, 4]))
    assert tier.read(ReadBatch(slots, _refs(3), nbytes, dest)) == [True] * 3
    host = [bytearray(nbytes) for _ in range(3)]
    tier.read(ReadBatch(slots, _refs(3), nbytes, HostBuffers([memoryview(h) for h in host])))
    for h, p in zip(host, [5, 0, 3], strict=True):
        assert bytes(h) == pool.block(p).numpy().tobytes()
    table = pool.layout.chunk_table
    for t, p in zip([1, 2, 4], [5, 0, 3], strict=True):
        for off_t, off_p, n in zip(
            table.pool_offsets(np.array([t])),
            table.pool_offsets(np.array([p])),
            table.length,
            strict=True,
        ):
            assert np.array_equal(back[off_t : off_t + n], space[off_p : off_p + n])


class _KernelOps(CpuOps):
    """Records each copy_pages launch; ``fault`` breaks them: ``raise`` fails the launch (a
    kernel that does not compile), ``flip`` corrupts a scattered byte (one that copies wrong)."""

    def __init__(self, fault: str = "") -> None:
        super().__init__()
        self.fault = fault
        self.launches: list[tuple[int, bool]] = []

    def copy_pages(self, pages, slots, starts, *, gather) -> str:
        self.launches.append((pages.smap.columns, gather))
        if self.fault == "raise":
            raise RuntimeError("Failed to find C compiler. Please specify via CC")
        used = super().copy_pages(pages, slots, starts, gather=gather)
        if self.fault == "flip" and not gather:
            pages.segments[0][7] ^= 0xFF
        return used


def test_at_start_the_tier_checks_its_copy_kernel_for_two_pool_shapes():
    ops = _KernelOps()
    DeviceTier(CAP, SEG, ops=ops)
    assert ops.launches == [(2, True), (2, False), (16, True), (16, False)]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("raise", r"failed its self-test .*RuntimeError: Failed to find C compiler"),
        ("flip", r"copied wrong bytes in its self-test"),
    ],
)
def test_a_copy_kernel_that_fails_or_copies_wrong_stops_the_start(fault, message):
    with pytest.raises(TierUnavailable, match=message):
        DeviceTier(CAP, SEG, ops=_KernelOps(fault))


class _CountingOps(CpuOps):
    def __init__(self) -> None:
        super().__init__()
        self.copies: list[int] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append(dst.numel())
        super().copy(dst, src)


def test_blocks_next_to_each_other_on_both_sides_move_as_one_copy():
    from kvtier.tiers.host import HostArena

    ops = _CountingOps()
    tier = _tier(ops)
    l1 = HostArena(4 << 20, 1 << 20, pin_cuda=False)
    nbytes = 64 << 10
    try:
        slots = _alloc(tier, 8, nbytes)  # in a row in L0
        host = [l1.allocator.allocate(nbytes) for _ in range(8)]  # and in L1
        rng = np.random.default_rng(4)
        for h in host:
            l1.view(h, nbytes)[:] = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        want = [bytes(l1.view(h, nbytes)) for h in host]
        # The batch in another order than the slots: still one copy each way.
        order = [3, 0, 1, 2, 7, 4, 5, 6]
        views = HostBuffers([l1.view(host[j], nbytes) for j in order])
        batch_slots = [slots[j] for j in order]
        assert all(o.ok for o in tier.write(WriteBatch(batch_slots, _refs(8), nbytes, views)))
        assert ops.copies == [8 * nbytes]
        for h in host:
            l1.view(h, nbytes)[:] = b"\x00" * nbytes
        ops.copies.clear()
        assert tier.read(ReadBatch(batch_slots, _refs(8), nbytes, views)) == [True] * 8
        assert ops.copies == [8 * nbytes]
        assert [bytes(l1.view(h, nbytes)) for h in host] == want
        # L1 slots apart from each other (every other one): a copy per block, bytes right.
        ops.copies.clear()
        apart = HostBuffers([l1.view(host[j], nbytes) for j in (0, 2, 4, 6)])
        assert tier.read(ReadBatch(slots[:4], _refs(4), nbytes, apart)) == [True] * 4
        assert ops.copies == [nbytes] * 4
        assert [bytes(l1.view(host[j], nbytes)) for j in (0, 2, 4, 6)] == want[:4]
        # Through a scratch buffer (a GPU pool's pages to and from L1, no L0 slot).
        pool = make_pool("vllm", layers=2, pages=6, tokens=16, head_dim=32, dtype="float16")
        pool.fill_random(5)
        block = pool.layout.block_bytes  # 8 KiB: whole pages, so L1's slots follow each other
        dest = [l1.allocator.allocate(block) for _ in range(3)]
        ops.copies.clear()
        bufs = HostBuffers([l1.view(d, block) for d in dest])
        assert tier.pool_to_host(_pages(pool, [4, 1, 2]), bufs, block)
        assert ops.copies == [3 * block]
        for d, p in zip(dest, [4, 1, 2], strict=True):
            assert bytes(l1.view(d, block)) == pool.block(p).numpy().tobytes()
        del views, apart, bufs
    finally:
        tier.close()
        l1.close()


def test_a_view_of_the_map_from_elsewhere_is_not_joined_past_its_own_buffer():
    """A host buffer over L1's first bytes that is not a memoryview of the map (a numpy
    array's) has a tensor of its own, over those bytes only, that starts where the map's
    tensor starts; the next slot, a view of the map, then seems to continue it. Joined, the
    copy would reach past that tensor's buffer (torch refuses: a RuntimeError, which the
    tier takes for a device fault)."""
    from kvtier.tiers.host import HostArena

    ops = _CountingOps()
    tier = _tier(ops)
    l1 = HostArena(1 << 20, 1 << 20, pin_cuda=False)
    nbytes = 64 << 10
    try:
        slots = _alloc(tier, 2, nbytes)
        host = [l1.allocator.allocate(nbytes) for _ in range(2)]
        assert l1.allocator.offsets(np.array(host)).tolist() == [0, nbytes]
        l1.array[: 2 * nbytes] = np.random.default_rng(3).integers(0, 256, 2 * nbytes, np.uint8)
        want = l1.array[: 2 * nbytes].copy()
        views = HostBuffers([l1.array[:nbytes].data, l1.view(host[1], nbytes)])
        assert all(o.ok for o in tier.write(WriteBatch(slots, _refs(2), nbytes, views)))
        assert tier.health().state is Health.OK
        l1.array[: 2 * nbytes] = 0
        assert tier.read(ReadBatch(slots, _refs(2), nbytes, views)) == [True] * 2
        assert np.array_equal(l1.array[: 2 * nbytes], want)
        del views
    finally:
        tier.close()
        l1.close()


def test_pool_and_host_without_an_l0_slot():
    tier = _tier()
    pool = make_pool("mla", layers=3, pages=8, dtype="float32")
    pool.fill_random(2)
    nbytes = pool.layout.block_bytes
    host = [bytearray(nbytes) for _ in range(4)]
    assert tier.pool_to_host(
        _pages(pool, [6, 1, 0, 7]), HostBuffers([memoryview(h) for h in host]), nbytes
    )
    for h, p in zip(host, [6, 1, 0, 7], strict=True):
        assert bytes(h) == pool.block(p).numpy().tobytes()
    originals = [pool.block(p) for p in [6, 1, 0, 7]]
    pool.poison()
    assert tier.host_to_pool(
        HostBuffers([bytes(h) for h in host]), _pages(pool, [2, 3, 4, 5]), nbytes
    )
    for t, want in zip([2, 3, 4, 5], originals, strict=True):
        assert torch.equal(pool.block(t), want)
    assert tier.allocator.used_slots == 0
    assert tier.stats().counters["blocks_host_to_pool"] == 4


class _SizedOps(CpuOps):
    """CpuOps that records the size of every device allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[int] = []

    def empty(self, nbytes: int) -> torch.Tensor:
        self.allocated.append(nbytes)
        return super().empty(nbytes)


def test_the_bridge_moves_a_batch_larger_than_its_scratch_in_groups(monkeypatch):
    """The device scratch of a copy between pool pages and host memory stays within
    BRIDGE_SCRATCH_BYTES whatever the batch (it was the whole batch: device memory past
    the arena, kept by torch's allocator after the copy, that the engine on that GPU could
    not have); the groups take its two halves in turn and every byte lands."""
    monkeypatch.setattr(device, "BRIDGE_SCRATCH_BYTES", 64 << 10)
    ops = _SizedOps()
    tier = _tier(ops)
    pool = make_pool("vllm", layers=2, pages=48, tokens=8, heads=4, head_dim=32)
    pool.fill_random(6)
    nbytes = pool.layout.block_bytes
    assert nbytes == 8 << 10  # groups of 4 blocks: 12 groups, each half taken 6 times
    host = [bytearray(nbytes) for _ in range(48)]
    order = [int(p) for p in np.random.default_rng(6).permutation(48)]
    want = [pool.block(p) for p in order]
    ops.allocated.clear()
    assert tier.pool_to_host(
        _pages(pool, order), HostBuffers([memoryview(h) for h in host]), nbytes
    )
    for h, w in zip(host, want, strict=True):
        assert bytes(h) == w.numpy().tobytes()
    pool.poison()
    assert tier.host_to_pool(HostBuffers([bytes(h) for h in host]), _pages(pool, order), nbytes)
    for p, w in zip(order, want, strict=True):
        assert torch.equal(pool.block(p), w)
    assert ops.allocated == [64 << 10, 64 << 10]
    counters = tier.stats().counters
    assert counters["blocks_pool_to_host"] == counters["blocks_host_to_pool"] == 48


class StreamOps(CpuOps):
    """CpuOps whose launches run as on a GPU's streams: queued per stream, in order, none
    before an event its stream was ordered after (``after``) has fired, and nothing until a
    wait needs it. Then the ``eager`` streams (those that fill the scratch) run as far
    ahead of the others as their events let them: the schedule in which a scratch half
    taken again before the previous group's copies out of it have run is overwritten,
    whatever a GPU's timing would be. Logs every step as (stream, what)."""

    def __init__(self, eager: Callable[[str], bool]) -> None:
        super().__init__()
        self.eager = eager
        self.queues: dict[str, deque[tuple[str, Any]]] = {}
        self.log: list[tuple[str, str, Any]] = []
        self.fired: set[int] = set()
        self.allocated: list[int] = []
        self._stream = "default"
        self._events = itertools.count()

    def empty(self, nbytes: int) -> torch.Tensor:
        self.allocated.append(nbytes)
        return super().empty(nbytes)

    @contextlib.contextmanager
    def lane(self, name: str) -> Iterator[None]:
        outer, self._stream = self._stream, name
        try:
            yield
        finally:
            self._stream = outer

    def _queue(self, what: str, arg: Any) -> None:
        self.queues.setdefault(self._stream, deque()).append((what, arg))
        self.log.append((self._stream, what, arg))

    def copy_pages(self, pages, slots, starts, *, gather) -> str:
        self._queue("launch", lambda: CpuOps.copy_pages(self, pages, slots, starts, gather=gather))
        return "torch"

    def copy(self, dst, src) -> None:
        self._queue("launch", lambda: dst.copy_(src))

    def record(self) -> Any:
        event = next(self._events)
        self._queue("record", event)
        return event

    def after(self, event) -> None:
        self._queue("after", event)

    def wait(self, event) -> None:
        self._run(lambda: event in self.fired)

    def synchronize(self) -> None:
        self._run(lambda: False)

    def _run(self, done: Callable[[], bool]) -> None:
        """One step at a time on the first stream that can take one, eager streams first,
        until ``done`` or every queue is empty."""
        while not done():
            ready = [n for n, q in self.queues.items() if q and self._can_step(q[0])]
            if not ready:
                assert not any(self.queues.values()), "streams wait on events never recorded"
                return
            queue = self.queues[min(ready, key=lambda n: not self.eager(n))]
            what, arg = queue.popleft()
            if what == "launch":
                arg()
            elif what == "record":
                self.fired.add(arg)

    def _can_step(self, op: tuple[str, Any]) -> bool:
        return op[0] != "after" or op[1] in self.fired


def _scratch_fillers(to_host: bool) -> Callable[[str], bool]:
    """The streams that write the bridge's scratch: the pool's (a gather) into host
    memory, the host-to-device one the other way."""
    if to_host:
        return lambda name: name.startswith("pool")
    return lambda name: name == device.H2D


@pytest.mark.parametrize("bound", [64 << 10, 12 << 10], ids=["groups_of_4", "over_half"])
def test_the_bridge_takes_a_scratch_half_again_only_after_its_copies_out_ran(monkeypatch, bound):
    """The ordering of the bridge's groups, stream by stream (StreamOps runs the streams
    that fill the scratch as far ahead as events let them): a group takes a half again only
    after an event the other stream recorded past the previous group's copies out of it,
    each stream waits only on the other's events, and every launch has run when the verb
    returns (its scratch then goes back to torch's allocator), and the scratch stays within
    the bound. 46 blocks of 8 KiB: groups of 4 through two 32 KiB halves, the last of 2; a
    block over half the bound: one block at a time through one block of scratch (it took
    two blocks, past the bound)."""
    monkeypatch.setattr(device, "BRIDGE_SCRATCH_BYTES", bound)
    pool = make_pool("vllm", layers=2, pages=48, tokens=8, heads=4, head_dim=32)
    pool.fill_random(9)
    nbytes = pool.layout.block_bytes
    assert nbytes == 8 << 10
    order = [int(p) for p in np.random.default_rng(9).permutation(48)[:46]]
    want = [pool.block(p).clone() for p in order]
    host = [bytearray(nbytes) for _ in order]

    ops = StreamOps(_scratch_fillers(to_host=True))
    tier = _tier(ops)
    ops.log.clear()
    ops.allocated.clear()
    assert tier.pool_to_host(
        _pages(pool, order), HostBuffers([memoryview(h) for h in host]), nbytes
    )
    _assert_ordered(ops)
    assert ops.allocated and max(ops.allocated) <= bound
    for h, w in zip(host, want, strict=True):
        assert bytes(h) == w.numpy().tobytes()

    pool.poison()
    ops = StreamOps(_scratch_fillers(to_host=False))
    tier = _tier(ops)
    ops.log.clear()
    ops.allocated.clear()
    assert tier.host_to_pool(HostBuffers([bytes(h) for h in host]), _pages(pool, order), nbytes)
    _assert_ordered(ops)
    assert ops.allocated and max(ops.allocated) <= bound
    for p, w in zip(order, want, strict=True):
        assert torch.equal(pool.block(p), w)


def _assert_ordered(ops: StreamOps) -> None:
    """Nothing left to run, and every ``after`` names another stream's event."""
    assert not any(ops.queues.values())
    recorded_on = {arg: stream for stream, what, arg in ops.log if what == "record"}
    waits = [(stream, arg) for stream, what, arg in ops.log if what == "after"]
    assert waits and all(recorded_on[e] != stream for stream, e in waits)


class _ShortStreamOps(StreamOps):
    """StreamOps whose ``short_at``-th gather or scatter launch from now (``short``) finds
    no device memory for its plan; its waits for the whole device then fail with ``fault``
    when one is given (a CUDA fault of a copy launched before)."""

    def __init__(self, fault: str = "") -> None:
        super().__init__(_scratch_fillers(to_host=True))
        self.fault = fault
        self.short_at = self.launches = 0

    def short(self, at: int) -> None:
        self.short_at, self.launches = at, 0

    def copy_pages(self, pages, slots, starts, *, gather) -> str:
        self.launches += 1
        if self.launches == self.short_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return super().copy_pages(pages, slots, starts, gather=gather)

    def synchronize(self) -> None:
        super().synchronize()
        if self.fault:
            raise RuntimeError(self.fault)


def _grouped_batch(monkeypatch) -> tuple[object, list[int], int]:
    """A pool and 24 of its pages in an order, 8 KiB blocks: 6 groups of 4 through the
    bridge's scratch."""
    monkeypatch.setattr(device, "BRIDGE_SCRATCH_BYTES", 64 << 10)
    pool = make_pool("vllm", layers=2, pages=24, tokens=8, heads=4, head_dim=32)
    pool.fill_random(11)
    order = [int(p) for p in np.random.default_rng(11).permutation(24)]
    return pool, order, pool.layout.block_bytes


def test_out_of_memory_in_the_middle_of_a_grouped_batch_fails_it_after_its_copies_ran(
    monkeypatch,
):
    """The third group of a bridge copy finds no device memory for its plan: the batch
    fails (TierMemoryExhausted, none of it counted as moved), once every copy the groups
    before it launched has run (their scratch goes back to torch's allocator when the
    verb returns); the tier stays OK and the same batch then passes."""
    pool, order, nbytes = _grouped_batch(monkeypatch)
    ops = _ShortStreamOps()
    tier = _tier(ops)
    ops.short(at=3)
    host = [bytearray(nbytes) for _ in order]
    with pytest.raises(TierMemoryExhausted, match="out of memory"):
        tier.pool_to_host(_pages(pool, order), HostBuffers([memoryview(h) for h in host]), nbytes)
    assert not any(ops.queues.values())
    for h, p in zip(host[:8], order[:8], strict=True):  # the two groups before it landed
        assert bytes(h) == pool.block(p).numpy().tobytes()
    assert tier.health().state is Health.OK
    counters = tier.stats().counters
    assert counters["out_of_memory"] == 1 and "blocks_pool_to_host" not in counters
    assert tier.pool_to_host(
        _pages(pool, order), HostBuffers([memoryview(h) for h in host]), nbytes
    )
    for h, p in zip(host, order, strict=True):
        assert bytes(h) == pool.block(p).numpy().tobytes()


def test_a_fault_surfacing_in_the_wait_after_out_of_memory_takes_the_tier_down(monkeypatch):
    """Out of memory in the middle of a grouped batch, and the wait for what the groups
    before it launched fails with a CUDA fault (one of those copies faulted): the tier is
    DOWN and the batch failed as a fault (False: FAILED_PRECONDITION naming L0's state),
    not RESOURCE_EXHAUSTED with the tier OK (the fault was swallowed by that wait: the
    tier served on, through a dead context, until its next verb faulted again)."""
    pool, order, nbytes = _grouped_batch(monkeypatch)
    fault = "CUDA error: an illegal memory access was encountered"
    ops = _ShortStreamOps(fault=fault)
    tier = _tier(ops)
    ops.short(at=3)
    host = [bytearray(nbytes) for _ in order]
    assert not tier.pool_to_host(
        _pages(pool, order), HostBuffers([memoryview(h) for h in host]), nbytes
    )
    assert tier.health().state is Health.DOWN and "illegal memory access" in tier.health().detail
    counters = tier.stats().counters
    assert counters["faults"] == 1 and "out_of_memory" not in counters


class _FailingStreamOps(StreamOps):
    """StreamOps whose ``fail_at``-th copy launch from ``fail(at)`` fails as a launch can
    without breaking the context (the copies launched before it still run)."""

    def __init__(self, to_host: bool) -> None:
        super().__init__(_scratch_fillers(to_host))
        self.fail_at = self.copies = 0

    def fail(self, at: int) -> None:
        self.fail_at, self.copies = at, 0

    def copy(self, dst, src) -> None:
        self.copies += 1
        if self.copies == self.fail_at:
            raise RuntimeError("CUDA error: invalid argument")
        super().copy(dst, src)


@pytest.mark.parametrize("to_host", [True, False], ids=["pool_to_host", "host_to_pool"])
def test_a_failed_launch_in_a_grouped_batch_returns_once_the_groups_before_it_ran(
    monkeypatch, to_host
):
    """A copy launch of the third group fails: the tier is DOWN and the batch failed, but
    only once what the groups before it launched has run. Their copies write the caller's
    host buffers (L1 slots, freed again when the batch fails, then another block's) and
    read the scratch (back to torch's allocator at the return); they were left running."""
    pool, order, nbytes = _grouped_batch(monkeypatch)
    ops = _FailingStreamOps(to_host)
    tier = _tier(ops)
    host = [bytearray(nbytes) for _ in order]
    ops.fail(at=9)  # four copies a group (the host buffers lie apart): the third group
    if to_host:
        ok = tier.pool_to_host(
            _pages(pool, order), HostBuffers([memoryview(h) for h in host]), nbytes
        )
    else:
        ok = tier.host_to_pool(HostBuffers([bytes(h) for h in host]), _pages(pool, order), nbytes)
    assert ops.copies == 9 and not ok and tier.health().state is Health.DOWN
    assert not any(ops.queues.values())


def test_bad_slots_are_refused_before_any_copy():
    tier = _tier()
    pool = make_pool("vllm", layers=2, pages=4)
    pool.fill_random(3)
    nbytes = pool.layout.block_bytes
    (slot,) = _alloc(tier, 1, nbytes)
    before = tier.arena.clone()
    with pytest.raises(ValueError, match="not allocated"):
        tier.write(WriteBatch([slot, slot + 1], _refs(2), nbytes, _pages(pool, [0, 1])))
    with pytest.raises(ValueError, match="one slot twice"):
        tier.write(WriteBatch([slot, slot], _refs(2), nbytes, _pages(pool, [0, 1])))
    with pytest.raises(ValueError, match="smaller than"):
        tier.write(
            WriteBatch([slot], _refs(1), tier.allocator.slot_size(slot) + 1, _pages(pool, [0]))
        )
    with pytest.raises(ValueError, match="source blocks"):
        tier.write(WriteBatch([slot], _refs(1), nbytes, _pages(pool, [0, 1])))
    with pytest.raises(IndexError):
        tier.write(WriteBatch([slot], _refs(1), nbytes, _pages(pool, [4])))
    with pytest.raises(ValueError, match="shorter than the block"):
        tier.write(WriteBatch([slot], _refs(1), nbytes, HostBuffers([b"x" * (nbytes - 1)])))
    with pytest.raises(ValueError, match="read-only"):
        tier.read(ReadBatch([slot], _refs(1), nbytes, HostBuffers([b"x" * nbytes])))
    assert torch.equal(tier.arena, before)


def test_remove_frees_slots_and_nothing_is_recovered():
    tier = _tier()
    slots = _alloc(tier, 3, 10_000)
    assert tier.allocator.used_slots == 3
    assert tier.remove(slots)
    assert tier.allocator.used_slots == 0
    assert list(tier.recover_chunks()) == []
    assert not tier.persistent and not tier.checksummed


class FailingOps(CpuOps):
    """A device whose copies fail, as after a CUDA fault."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def copy(self, dst, src) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().copy(dst, src)

    def copy_pages(self, pages, slots, starts, *, gather) -> str:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().copy_pages(pages, slots, starts, gather=gather)


def test_a_device_fault_fails_the_batch_and_takes_the_tier_down():
    ops = FailingOps()
    tier = _tier(ops)
    pool = make_pool("vllm", layers=1, pages=2)
    nbytes = pool.layout.block_bytes
    slots = _alloc(tier, 2, nbytes)
    ops.fail = True
    out = tier.write(WriteBatch(slots, _refs(2), nbytes, _pages(pool, [0, 1])))
    assert [o.ok for o in out] == [False, False]
    health = tier.health()
    assert health.state is Health.DOWN and "illegal memory access" in health.detail
    ops.fail = False
    # DOWN: nothing is written or served any more, without touching the device.
    assert not any(
        o.ok for o in tier.write(WriteBatch(slots, _refs(2), nbytes, _pages(pool, [0, 1])))
    )
    assert tier.read(ReadBatch(slots, _refs(2), nbytes, _pages(pool, [0, 1]))) == [False, False]
    assert tier.stats().counters["faults"] == 1
    assert (
        not tier.pool_to_host(_pages(pool, [0]), HostBuffers([bytearray(nbytes)]), nbytes) or True
    )


class ShortOps(CpuOps):
    """A device that has no memory to spare once ``short`` is set (the engine on the same
    GPU holds the rest): its allocations and its launches' plan uploads fail as torch's
    caching allocator reports it. Counts the waits for the whole device."""

    def __init__(self) -> None:
        super().__init__()
        self.short = False
        self.synchronized = 0

    def _allocate(self) -> None:
        if self.short:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    def empty(self, nbytes: int) -> torch.Tensor:
        self._allocate()
        return super().empty(nbytes)

    def copy_pages(self, pages, slots, starts, *, gather) -> str:
        self._allocate()
        return super().copy_pages(pages, slots, starts, gather=gather)

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_device_out_of_memory_fails_the_batch_and_the_tier_serves_on():
    """Out of memory is not a fault: the CUDA context is intact, so the batch fails (a
    read and the bridge's copies with TierMemoryExhausted: a read's False would drop its
    blocks), after waiting for what the verb launched, and the tier stays OK; the same
    batches pass once memory is there."""
    ops = ShortOps()
    tier = _tier(ops)
    pool = make_pool("vllm", layers=2, pages=6)
    pool.fill_random(4)
    nbytes = pool.layout.block_bytes
    slots = _alloc(tier, 2, nbytes)
    host = [bytearray(nbytes) for _ in range(2)]

    def attempts() -> tuple[list[bool], list[bool]]:
        written = tier.write(WriteBatch(slots, _refs(2), nbytes, _pages(pool, [0, 1])))
        read = tier.read(ReadBatch(slots, _refs(2), nbytes, _pages(pool, [2, 3])))
        return [o.ok for o in written], read

    ops.short = True
    written = tier.write(WriteBatch(slots, _refs(2), nbytes, _pages(pool, [0, 1])))
    assert [o.ok for o in written] == [False, False]
    with pytest.raises(TierMemoryExhausted, match="out of memory"):  # not misses: kept
        tier.read(ReadBatch(slots, _refs(2), nbytes, _pages(pool, [2, 3])))
    with pytest.raises(TierMemoryExhausted, match="out of memory"):
        tier.pool_to_host(_pages(pool, [0, 1]), HostBuffers([memoryview(h) for h in host]), nbytes)
    with pytest.raises(TierMemoryExhausted, match="out of memory"):
        tier.host_to_pool(HostBuffers([bytes(h) for h in host]), _pages(pool, [4, 5]), nbytes)
    assert tier.health().state is Health.OK
    counters = tier.stats().counters
    assert counters["out_of_memory"] == 4 and "faults" not in counters
    assert ops.synchronized == 4

    ops.short = False
    assert attempts() == ([True, True], [True, True])
    assert tier.pool_to_host(
        _pages(pool, [0, 1]), HostBuffers([memoryview(h) for h in host]), nbytes
    )
    assert tier.host_to_pool(HostBuffers([bytes(h) for h in host]), _pages(pool, [4, 5]), nbytes)
    for p in (2, 3, 4, 5):
        assert torch.equal(pool.block(p), pool.block(p - 2))


class PinnedShortOps(CpuOps):
    """A host whose page-locked staging cannot be allocated once ``error`` is set, raised
    as torch raises a failed CUDA call outside its caching allocator (cudaHostAlloc under
    C10_CUDA_CHECK): an AcceleratorError carrying the CUDA error code, not OutOfMemoryError."""

    def __init__(self) -> None:
        super().__init__()
        self.error = 0

    def host_empty(self, nbytes: int) -> torch.Tensor:
        if self.error:
            e = torch.AcceleratorError(f"CUDA error: {_CUDA_ERRORS[self.error]}")
            e.error_code = self.error  # type: ignore[attr-defined]
            raise e
        return super().host_empty(nbytes)


_CUDA_ERRORS = {2: "out of memory", 700: "an illegal memory access was encountered"}


@pytest.mark.parametrize("error", [2, 700], ids=["memory_allocation", "illegal_address"])
def test_a_cuda_call_short_of_memory_is_no_fault_whatever_exception_carries_it(error):
    """Page-locked staging for a shared-memory pool that cannot be allocated
    (cudaErrorMemoryAllocation, 2: a RuntimeError saying "out of memory" that is no
    OutOfMemoryError) fails the batch as out of memory, the tier OK and its blocks kept
    (it was a fault: L0 DOWN for good); a real fault (700) still takes the tier down."""
    ops = PinnedShortOps()
    tier = _tier(ops)
    pool = make_pool("flashinfer", layers=2, pages=6, dtype="float16")
    space = np.zeros(pool.layout.extent_bytes, dtype=np.uint8)
    nbytes = pool.layout.block_bytes
    slots = _alloc(tier, 2, nbytes)
    pages = PoolPages(pool.layout.chunk_table, space, np.array([0, 1]))
    ops.error = error
    written = tier.write(WriteBatch(slots, _refs(2), nbytes, pages))
    assert [o.ok for o in written] == [False, False]
    if error == 700:
        assert tier.health().state is Health.DOWN
        assert tier.stats().counters == {"faults": 1}
        return
    with pytest.raises(TierMemoryExhausted, match="out of memory"):
        tier.read(ReadBatch(slots, _refs(2), nbytes, pages))
    assert tier.health().state is Health.OK
    assert tier.stats().counters == {"out_of_memory": 2}
    ops.error = 0
    assert all(o.ok for o in tier.write(WriteBatch(slots, _refs(2), nbytes, pages)))


def test_concurrent_batches_on_distinct_slots():
    tier = _tier(streams=2)
    pool = make_pool("vllm", layers=3, pages=64, dtype="float16")
    pool.fill_random(5)
    nbytes = pool.layout.block_bytes
    slots = _alloc(tier, 64, nbytes)
    barrier = threading.Barrier(8)

    def worker(i: int) -> bool:
        mine = slots[i * 8 : (i + 1) * 8]
        pages = list(range(i * 8, (i + 1) * 8))
        barrier.wait()
        tier.write(WriteBatch(mine, _refs(8), nbytes, _pages(pool, pages)))
        host = [bytearray(nbytes) for _ in mine]
        tier.read(ReadBatch(mine, _refs(8), nbytes, HostBuffers([memoryview(h) for h in host])))
        return all(
            bytes(h) == pool.block(p).numpy().tobytes() for h, p in zip(host, pages, strict=True)
        )

    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(worker, range(8)))
    assert tier.stats().counters["blocks_written_d2d"] == 64


@pytest.mark.no_cuda
def test_without_cuda_the_tier_cannot_start():
    assert not torch.cuda.is_available()
    with pytest.raises(TierUnavailable, match="no CUDA device"):
        DeviceTier(CAP, SEG)


# ------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", LAYOUTS)
def test_on_a_gpu_round_trips_are_bit_exact_and_use_the_triton_kernel(kind):
    tier = DeviceTier(64 << 20, 8 << 20, streams=2)
    pool = make_pool(kind, layers=4, pages=32, dtype="bfloat16", device="cuda")
    pool.fill_random(11)
    nbytes = pool.layout.block_bytes
    pages = list(range(31, -1, -2))
    slots = _alloc(tier, len(pages), nbytes)
    assert all(
        o.ok for o in tier.write(WriteBatch(slots, _refs(len(pages)), nbytes, _pages(pool, pages)))
    )
    host = torch.empty((len(pages), nbytes), dtype=torch.uint8, pin_memory=True)
    views = [memoryview(host[j].numpy()) for j in range(len(pages))]
    assert all(tier.read(ReadBatch(slots, _refs(len(pages)), nbytes, HostBuffers(views))))
    for j, p in enumerate(pages):
        assert torch.equal(host[j], pool.block(p).cpu())
    originals = {p: pool.block(p) for p in pages}
    pool.poison()
    assert all(tier.read(ReadBatch(slots, _refs(len(pages)), nbytes, _pages(pool, pages))))
    for p in pages:
        assert torch.equal(pool.block(p), originals[p])
    from kvtier.kernels.paged import _triton_ready

    assert _triton_ready()
    tier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [1 << 20, 192 << 10], ids=["groups_of_4", "over_half"])
def test_on_a_gpu_the_bridge_takes_its_scratch_halves_in_turn_bit_exact(monkeypatch, bound):
    """Groups of blocks through the two scratch halves, on three streams (the pool's, H2D,
    D2H): a half is taken again only once the copies out of it have run (events), so no
    group's bytes are overwritten by the next one's before they left. 128 KiB blocks: 16
    groups of 4; over half the bound, 64 blocks one at a time through one block."""
    monkeypatch.setattr(device, "BRIDGE_SCRATCH_BYTES", bound)
    tier = DeviceTier(64 << 20, 8 << 20, streams=2)
    pool = make_pool("vllm", layers=4, pages=64, tokens=16, heads=8, head_dim=64, device="cuda")
    pool.fill_random(12)
    nbytes = pool.layout.block_bytes
    assert nbytes == 128 << 10
    order = [int(p) for p in np.random.default_rng(12).permutation(64)]
    want = [pool.block(p).cpu() for p in order]
    host = tier.host_buffers(64, nbytes)
    assert tier.pool_to_host(_pages(pool, order), host, nbytes)
    for view, w in zip(host.views, want, strict=True):
        assert bytes(view[:nbytes]) == w.numpy().tobytes()
    pool.poison()
    assert tier.host_to_pool(host, _pages(pool, order), nbytes)
    for p, w in zip(order, want, strict=True):
        assert torch.equal(pool.block(p).cpu(), w)
    tier.close()


@pytest.mark.gpu
def test_the_l1_arena_is_page_locked_with_cuda():
    from kvtier.tiers.host import HostArena

    pinned = HostArena(16 << 20, 4 << 20, pin_cuda=True)
    plain = HostArena(16 << 20, 4 << 20, pin_cuda=False)
    try:
        assert torch.frombuffer(pinned.buffer, dtype=torch.uint8).is_pinned()
        assert not torch.frombuffer(plain.buffer, dtype=torch.uint8).is_pinned()
        src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
        host = torch.frombuffer(pinned.buffer, dtype=torch.uint8)[: 4 << 20]
        host.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host, src.cpu())
    finally:
        pinned.close()
        plain.close()
