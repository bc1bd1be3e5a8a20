"""The contract every slot tier passes: slots, byte-exact round trips through host buffers and
through an engine pool's pages, free and reuse, accounting, health, concurrency.

Every tier is driven through the same verbs of ``tiers.base.SlotTier`` (``write``, ``read``,
``remove``); a new tier adds one line to ``TIERS`` and every test below runs against it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.kernels.layout import PoolLayout
from kvtier.tiers.base import (
    BlockRef,
    Health,
    HostBuffers,
    PoolPages,
    ReadBatch,
    SlotTier,
    TierKind,
    WriteBatch,
)
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostArena
from kvtier.tiers.memory import MemoryTier

CAPACITY = 16 << 20
SEGMENT = 4 << 20
SIZES = [4096, 10_000, 65_536, 2 << 20]


class Driver:
    """Stores and loads ``(slot, bytes)`` through a tier's batch verbs, remembering the
    checksums a checksumming tier hands back."""

    def __init__(self, tier: Any) -> None:
        self.tier: SlotTier = tier
        self._sums: dict[int, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _ref(slot: int) -> BlockRef:
        return BlockRef(1, slot.to_bytes(32, "little"))

    def store(self, blocks: list[tuple[int, bytes]]) -> list[bool]:
        ok: list[bool] = []
        for nbytes in sorted({len(d) for _, d in blocks}):
            group = [(s, d) for s, d in blocks if len(d) == nbytes]
            batch = WriteBatch(
                [s for s, _ in group],
                [self._ref(s) for s, _ in group],
                nbytes,
                HostBuffers([memoryview(d) for _, d in group]),
            )
            outcomes = self.tier.write(batch)
            with self._lock:
                for o in outcomes:
                    self._sums[o.slot] = o.checksum
            ok += [o.ok for o in outcomes]
        return ok

    def load(self, blocks: list[tuple[int, int]]) -> list[bytes | None]:
        out: dict[int, bytes | None] = {}
        for nbytes in sorted({n for _, n in blocks}):
            slots = [s for s, n in blocks if n == nbytes]
            bufs = [bytearray(nbytes) for _ in slots]
            with self._lock:
                sums = [self._sums[s] for s in slots]
            batch = ReadBatch(
                slots,
                [self._ref(s) for s in slots],
                nbytes,
                HostBuffers([memoryview(b) for b in bufs]),
                sums,
            )
            for s, b, good in zip(slots, bufs, self.tier.read(batch), strict=True):
                out[s] = bytes(b) if good else None
        return [out[s] for s, _ in blocks]

    def free(self, slots: list[int]) -> None:
        assert self.tier.remove(slots)

    def close(self) -> None:
        self.tier.close()


def _host(_: Path) -> Driver:
    return Driver(HostArena(CAPACITY, SEGMENT))


def _disk(directory: Path) -> Driver:
    return Driver(DiskTier(directory, CAPACITY, SEGMENT, file_bytes=8 << 20))


def _memory(_: Path) -> Driver:
    return Driver(MemoryTier(TierKind.DISK, CAPACITY, SEGMENT, persistent=True))


TIERS: dict[str, Callable[[Path], Driver]] = {
    "L1-host": _host,
    "L2-disk": _disk,
    "memory": _memory,
}


@pytest.fixture(params=list(TIERS))
def driver(request: pytest.FixtureRequest, disk_dir: Path) -> Iterator[Driver]:
    d = TIERS[request.param](disk_dir)
    yield d
    d.close()


def _payload(slot: int, nbytes: int, round_: int = 0) -> bytes:
    seed = (slot * 1_000_003 + round_ * 7919 + nbytes).to_bytes(8, "little")
    return (seed * (nbytes // 8 + 1))[:nbytes]


def _fill(driver: Driver, nbytes: int) -> list[int]:
    slots = []
    while (slot := driver.tier.allocator.allocate(nbytes)) is not None:
        slots.append(slot)
    return slots


def test_kind_health_and_stats(driver: Driver) -> None:
    assert isinstance(driver.tier.kind, TierKind)
    assert driver.tier.health().state is Health.OK
    stats = driver.tier.stats()
    assert stats.kind == driver.tier.kind
    assert (stats.capacity_bytes, stats.used_bytes) == (CAPACITY, 0)


@pytest.mark.parametrize("layout_name", ["vllm", "staging"])
def test_blocks_move_between_a_pool_s_pages_and_slots(driver: Driver, layout_name: str) -> None:
    """A batch written from an engine pool's pages reads back into other pages of a pool of
    another layout with the same chunks, byte for byte."""
    vllm = PoolLayout.vllm(
        num_layers=3, num_pages=8, block_tokens=4, num_kv_heads=2, head_dim=64, dtype="float16"
    )
    other = (
        vllm
        if layout_name == "vllm"
        else PoolLayout.staging(
            num_layers=3, num_pages=8, block_tokens=4, chunk_bytes=vllm.layers[0].chunk_bytes
        )
    )
    src = np.random.default_rng(7).integers(0, 256, vllm.extent_bytes, dtype=np.uint8)
    dst = np.zeros(other.extent_bytes, dtype=np.uint8)
    nbytes = vllm.block_bytes
    slots = [driver.tier.allocator.allocate(nbytes) for _ in range(5)]
    assert None not in slots
    refs = [Driver._ref(int(s)) for s in slots]  # type: ignore[arg-type]
    pages_in, pages_out = np.array([0, 2, 3, 5, 7]), np.array([6, 1, 0, 4, 3])
    outcomes = driver.tier.write(
        WriteBatch(slots, refs, nbytes, PoolPages(vllm.chunk_table, src, pages_in))  # type: ignore[arg-type]
    )
    assert all(o.ok for o in outcomes)
    ok = driver.tier.read(
        ReadBatch(
            slots,  # type: ignore[arg-type]
            refs,
            nbytes,
            PoolPages(other.chunk_table, dst, pages_out),
            [o.checksum for o in outcomes],
        )
    )
    assert ok == [True] * 5
    for p_in, p_out in zip(pages_in.tolist(), pages_out.tolist(), strict=True):
        want = _gather(vllm, src, p_in)
        assert _gather(other, dst, p_out).tobytes() == want.tobytes()


def _gather(layout: PoolLayout, mem: np.ndarray, page: int) -> np.ndarray:
    """A page's block, gathered independently of the copy kernel."""
    parts = []
    for layer in layout.layers:
        for kv in range(layer.kv_count):
            start = layer.offset + kv * layer.kv_stride + page * layer.page_stride
            parts.append(mem[start : start + layer.chunk_bytes])
    return np.concatenate(parts)


@pytest.mark.parametrize("nbytes", [4096, 10_000, 2 << 20])
def test_allocate_until_full_then_free_and_reuse(driver: Driver, nbytes: int) -> None:
    alloc = driver.tier.allocator
    slot_bytes = alloc.slot_bytes_for(nbytes)
    slots = _fill(driver, nbytes)
    per_segment = SEGMENT // slot_bytes
    assert len(slots) == (CAPACITY // SEGMENT) * per_segment
    assert len(set(slots)) == len(slots)
    assert alloc.used_bytes == len(slots) * slot_bytes
    assert alloc.allocate(nbytes) is None

    for start in range(0, len(slots), 256):
        chunk = slots[start : start + 256]
        assert all(driver.store([(s, _payload(s, nbytes)) for s in chunk]))
    sample = list(dict.fromkeys([*slots[:: max(1, len(slots) // 64)], slots[-1]]))
    assert driver.load([(s, nbytes) for s in sample]) == [_payload(s, nbytes) for s in sample]

    driver.free(slots)
    assert alloc.used_bytes == 0
    assert alloc.stats().free_segments == CAPACITY // SEGMENT
    again = _fill(driver, nbytes)
    assert len(again) == len(slots)
    reused = again[:32]
    assert all(driver.store([(s, _payload(s, nbytes, 1)) for s in reused]))
    assert driver.load([(s, nbytes) for s in reused]) == [_payload(s, nbytes, 1) for s in reused]


def test_round_trips_of_several_sizes_side_by_side(driver: Driver) -> None:
    alloc = driver.tier.allocator
    placed: list[tuple[int, int]] = []
    for nbytes in SIZES:
        for _ in range(2):  # two of each fit one segment per size class
            slot = alloc.allocate(nbytes)
            assert slot is not None
            placed.append((slot, nbytes))
    # Each size class holds its own segments.
    assert set(alloc.stats().size_classes) == {alloc.slot_bytes_for(n) for n in SIZES}
    assert all(driver.store([(s, _payload(s, n)) for s, n in placed]))
    assert driver.load(placed) == [_payload(s, n) for s, n in placed]
    # Overwrite with new contents: the latest write wins.
    assert all(driver.store([(s, _payload(s, n, 2)) for s, n in placed]))
    assert driver.load(placed) == [_payload(s, n, 2) for s, n in placed]


def test_capacity_accounting(driver: Driver) -> None:
    alloc = driver.tier.allocator
    stats = alloc.stats()
    assert stats.capacity_bytes == CAPACITY
    assert (stats.used_bytes, stats.used_slots, stats.free_segments) == (0, 0, CAPACITY // SEGMENT)
    a = alloc.allocate(10_000)
    b = alloc.allocate(10_000)
    c = alloc.allocate(2 << 20)
    assert None not in (a, b, c)
    stats = alloc.stats()
    assert stats.used_bytes == 2 * 12_288 + (2 << 20)
    assert stats.used_slots == 3
    assert stats.free_segments == CAPACITY // SEGMENT - 2
    assert all(driver.store([(a, _payload(a, 10_000))]))
    driver.free([a, b])
    stats = alloc.stats()
    assert (stats.used_bytes, stats.used_slots) == (2 << 20, 1)
    assert stats.free_segments == CAPACITY // SEGMENT - 1


def test_concurrent_reads_and_writes(driver: Driver) -> None:
    threads, per_thread, rounds = 4, 6, 8
    sizes = [65_536, 10_000]
    owned: list[list[tuple[int, int]]] = []
    for t in range(threads):
        mine = []
        for j in range(per_thread):
            nbytes = sizes[(t + j) % len(sizes)]
            slot = driver.tier.allocator.allocate(nbytes)
            assert slot is not None
            mine.append((slot, nbytes))
        owned.append(mine)
    start = threading.Barrier(threads)

    def worker(t: int) -> int:
        start.wait()
        checked = 0
        for r in range(rounds):
            blocks = owned[t]
            assert all(driver.store([(s, _payload(s, n, r)) for s, n in blocks]))
            got = driver.load(blocks)
            assert got == [_payload(s, n, r) for s, n in blocks], f"thread {t} round {r}"
            checked += len(blocks)
        return checked

    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(worker, range(threads)))
    assert done == [per_thread * rounds] * threads
    assert driver.tier.health().state is Health.OK
