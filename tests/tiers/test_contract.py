"""The contract every tier passes: slots, byte-exact round trips, free and reuse, accounting,
concurrency.

Tiers differ in how bytes move (L1 copies one block at a time, L2 moves verified batches), so
each tier comes with a small driver that speaks the contract's four verbs. A new tier adds a
driver and one line to ``TIERS``; every test below then runs against it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import pytest

from kvtier.tiers.base import TierKind
from kvtier.tiers.disk import DiskTier, PersistItem, ReadItem
from kvtier.tiers.host import HostArena

CAPACITY = 16 << 20
SEGMENT = 4 << 20
SIZES = [4096, 10_000, 65_536, 2 << 20]


class Driver(Protocol):
    tier: Any

    def store(self, blocks: list[tuple[int, bytes]]) -> list[bool]:
        """Write each ``(slot, data)`` so that ``load`` can return it."""

    def load(self, blocks: list[tuple[int, int]]) -> list[bytes | None]:
        """The bytes of each ``(slot, nbytes)``, or None for a miss."""

    def free(self, slots: list[int]) -> None: ...

    def close(self) -> None: ...


class HostDriver:
    def __init__(self, tier: HostArena) -> None:
        self.tier = tier

    def store(self, blocks: list[tuple[int, bytes]]) -> list[bool]:
        for slot, data in blocks:
            self.tier.write(slot, memoryview(data), len(data))
        return [True] * len(blocks)

    def load(self, blocks: list[tuple[int, int]]) -> list[bytes | None]:
        out = []
        for slot, nbytes in blocks:
            buf = bytearray(nbytes)
            self.tier.read(slot, memoryview(buf), nbytes)
            out.append(bytes(buf))
        return out

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            self.tier.allocator.free(slot)

    def close(self) -> None:
        self.tier.close()


class DiskDriver:
    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self._sums: dict[int, int] = {}
        self._lock = threading.Lock()

    def store(self, blocks: list[tuple[int, bytes]]) -> list[bool]:
        items = [
            PersistItem(1, slot.to_bytes(32, "little"), slot, data, len(data))
            for slot, data in blocks
        ]
        outcomes = self.tier.persist(items)
        with self._lock:
            for o in outcomes:
                self._sums[o.slot] = o.checksum
        return [o.ok for o in outcomes]

    def load(self, blocks: list[tuple[int, int]]) -> list[bytes | None]:
        bufs = [bytearray(nbytes) for _, nbytes in blocks]
        with self._lock:
            sums = [self._sums[slot] for slot, _ in blocks]
        items = [
            ReadItem(slot, buf, nbytes, s, slot.to_bytes(32, "little"))
            for (slot, nbytes), buf, s in zip(blocks, bufs, sums, strict=True)
        ]
        ok = self.tier.read(items)
        return [bytes(b) if good else None for b, good in zip(bufs, ok, strict=True)]

    def free(self, slots: list[int]) -> None:
        assert self.tier.remove(slots)

    def close(self) -> None:
        self.tier.close()


def _host(_: Path) -> Driver:
    return HostDriver(HostArena(CAPACITY, SEGMENT))


def _disk(directory: Path) -> Driver:
    return DiskDriver(DiskTier(directory, CAPACITY, SEGMENT, file_bytes=8 << 20))


TIERS: dict[str, Callable[[Path], Driver]] = {
    "L1-host": _host,
    "L2-disk": _disk,
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


def test_kind_and_state(driver: Driver) -> None:
    assert isinstance(driver.tier.kind, TierKind)
    assert driver.tier.state() == "ok"


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
    assert driver.tier.state() == "ok"
