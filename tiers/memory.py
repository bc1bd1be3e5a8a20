"""In-memory tiers for tests of the tier stack: a slot tier that can stand in for any tier
kind, and a key-addressed one that stands in for L3.

It behaves as the interface says a tier of its capabilities behaves, without a device: a
``persistent`` instance keeps an index of written blocks that ``reopen()`` hands to a new
instance (a daemon restart in process), a ``checksummed`` one returns and verifies xxh3
checksums, and a non-``addressable`` one exposes no buffers (like a disk: bytes reach host
memory only through ``read``). Faults are injected by the test: reads of chosen slots fail
(the block is then dropped, as a disk tier quarantines it), writes or removes fail, health
changes.

Thread-safety: ``write``, ``read`` and ``remove`` may run on any threads for distinct slots;
the allocator is thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvtier.tiers.base import (
    HEALTHY,
    PROBE_ABSENT,
    PROBE_UNKNOWN,
    BlockRef,
    Health,
    HostBuffers,
    ReadBatch,
    RecoveredBlock,
    RecoveredBlocks,
    TierHealth,
    TierKind,
    TierStats,
    WriteBatch,
    WriteOutcome,
    leading_sizes,
)
from kvtier.tiers.buffers import get_block, load_into, put_block, store_from
from kvtier.tiers.remote.state import TokenBucket
from kvtier.tiers.slab import LockedSlab


@dataclass
class _Medium:
    """What survives ``reopen``: the bytes and the index of written blocks."""

    arena: np.ndarray
    index: dict[int, RecoveredBlock] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)


class MemoryTier:
    def __init__(
        self,
        kind: TierKind,
        capacity_bytes: int,
        segment_bytes: int,
        *,
        persistent: bool = False,
        checksummed: bool = True,
        addressable: bool = False,
        _medium: _Medium | None = None,
    ) -> None:
        self.kind = kind
        self.persistent = persistent
        self.checksummed = checksummed
        self.addressable = addressable
        self.allocator = LockedSlab(capacity_bytes, segment_bytes)
        self._medium = _medium or _Medium(np.zeros(self.allocator.capacity_bytes, np.uint8))
        self._lock = threading.Lock()
        self._sums: dict[int, int] = {}
        self._recovered: list[RecoveredBlock] = []
        self.counters: Counter[str] = Counter()
        # Fault injection, set by tests.
        self.fail_reads: set[int] = set()
        self.fail_writes = False
        # While set, ``remove`` fails as a disk tier's index delete can: nothing is freed
        # (the slots it was given are kept in ``unremoved``).
        self.fail_removes = False
        self.unremoved: list[int] = []
        # Slots given to ``removing``, or whose ``remove`` failed -> the key of their block
        # (None: not known): a write of that key (of any, for None) drops their rows, as a
        # disk tier's commit deletes them in its own transaction (``DiskTier._unremoved``).
        self._unremoved_rows: dict[int, bytes | None] = {}
        self.forced_health: TierHealth | None = None
        self.read_hook: object = None  # called with the batch before a read (tests block on it)
        self.quarantined: set[int] = set()
        if _medium is not None:
            for blk in sorted(_medium.index.values(), key=lambda b: b.slot):
                self.allocator.claim(blk.slot, blk.nbytes)
                self._sums[blk.slot] = blk.checksum
                self._recovered.append(blk)

    def reopen(self) -> MemoryTier:
        """A new instance over the same medium, as after a restart: it recovers every block
        written (persistent tiers) and nothing else."""
        medium = self._medium if self.persistent else None
        return MemoryTier(
            self.kind,
            self.allocator.capacity_bytes,
            self.allocator.segment_bytes,
            persistent=self.persistent,
            checksummed=self.checksummed,
            addressable=self.addressable,
            _medium=medium,
        )

    # ------------------------------------------------------------------ verbs

    def buffers(self, slots: Sequence[int], nbytes: int) -> HostBuffers | None:
        if not self.addressable:
            return None
        arena = self._medium.arena.data
        size = self.allocator.slot_bytes_for(nbytes)
        return HostBuffers(
            [arena[o : o + size] for o in self.allocator.offsets(np.asarray(slots)).tolist()]
        )

    def write(self, batch: WriteBatch) -> list[WriteOutcome]:
        if self.fail_writes or not self.health().accepts_writes:
            self.counters["write_failures"] += len(batch.slots)
            return [WriteOutcome(int(s), False) for s in batch.slots]
        starts = self.allocator.offsets(np.asarray(batch.slots, dtype=np.int64))
        store_from(batch.src, range(len(batch.slots)), self._medium.arena, starts, batch.nbytes)
        out = []
        now = time.time()
        with self._lock:
            if self._unremoved_rows:  # the written keys' set only where rows wait
                written = {bytes(ref[1]) for ref in batch.blocks}
                for slot, key in list(self._unremoved_rows.items()):
                    if key is None or key in written:
                        self._medium.index.pop(slot, None)
                        del self._unremoved_rows[slot]
            for slot, start, ref in zip(batch.slots, starts.tolist(), batch.blocks, strict=True):
                data = self._medium.arena[start : start + batch.nbytes]
                csum = int(xxhash.xxh3_64_intdigest(data.data)) if self.checksummed else 0
                self._sums[int(slot)] = csum
                if self.persistent:
                    self._medium.index[int(slot)] = _recovered(ref, int(slot), batch, csum, now)
                out.append(WriteOutcome(int(slot), True, csum))
        self.counters["blocks_written"] += len(out)
        return out

    def read(self, batch: ReadBatch) -> list[bool]:
        if callable(self.read_hook):
            self.read_hook(batch)
        starts = self.allocator.offsets(np.asarray(batch.slots, dtype=np.int64))
        ok = []
        for j, (slot, start) in enumerate(zip(batch.slots, starts.tolist(), strict=True)):
            data = self._medium.arena[start : start + batch.nbytes]
            good = int(slot) not in self.fail_reads and self.health().serves_reads
            if good and self.checksummed and batch.checksums:
                good = int(xxhash.xxh3_64_intdigest(data.data)) == int(batch.checksums[j])
            if good:
                load_into(batch.dest, [j], self._medium.arena, np.asarray([start]), batch.nbytes)
            else:
                self.counters["read_failures"] += 1
                with self._lock:
                    # Dropped and held out of service, as a disk quarantines a bad slot.
                    self._medium.index.pop(int(slot), None)
                    self.quarantined.add(int(slot))
            ok.append(good)
        self.counters["blocks_read"] += sum(ok)
        return ok

    def remove(self, slots: Sequence[int]) -> bool:
        if self.fail_removes:
            self.counters["remove_failures"] += len(slots)
            self.unremoved += [int(s) for s in slots]
            with self._lock:
                for slot in slots:
                    self._unremoved_rows.setdefault(int(slot), None)
            return False
        with self._lock:
            for slot in slots:
                self._unremoved_rows.pop(int(slot), None)
                self._medium.index.pop(int(slot), None)
                self._sums.pop(int(slot), None)
            slots = [int(s) for s in slots if int(s) not in self.quarantined]
        for slot in slots:
            self.allocator.free(int(slot))
        self.counters["removed_slots"] += len(slots)
        return True

    def removing(self, slots: Sequence[int], refs: Sequence[BlockRef] | None = None) -> None:
        keys = [bytes(r[1]) for r in refs] if refs is not None else [None] * len(slots)
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} blocks named for {len(slots)} slots on their way out")
        with self._lock:
            for slot, key in zip(slots, keys, strict=True):
                self._unremoved_rows.setdefault(int(slot), key)

    def rows_left(self, refs: Sequence[BlockRef]) -> bool:
        with self._lock:
            return bool(self._rows_of(refs))

    def drop_rows_left(self, refs: Sequence[BlockRef]) -> bool:
        with self._lock:
            mine = self._rows_of(refs)
            if mine and self.fail_removes:  # the index takes no deletion
                return False
            for slot in mine:
                self._medium.index.pop(slot, None)
                del self._unremoved_rows[slot]
        return True

    def _rows_of(self, refs: Sequence[BlockRef]) -> list[int]:
        """The slots of ``_unremoved_rows`` whose row is of one of ``refs``' blocks (namespace
        and key: read, as the disk tier's ``drop_rows_left`` does); the lock held."""
        if not self._unremoved_rows:
            return []
        named = {(int(ref[0]), bytes(ref[1])) for ref in refs}
        index = self._medium.index
        return [
            s
            for s in self._unremoved_rows
            if (row := index.get(s)) is not None and (int(row.ns), bytes(row.key)) in named
        ]

    def recover_chunks(self, rows: int = 65536) -> Iterator[RecoveredBlocks]:
        out, self._recovered = self._recovered, []
        for start in range(0, len(out), rows):
            yield RecoveredBlocks.of(out[start : start + rows])

    def namespaces(self) -> dict[int, str]:
        return dict(self._medium.names) if self.persistent else {}

    def remember_namespace(self, ns: int, label: str) -> None:
        self._medium.names[ns] = label

    def forget_namespaces(self, names: list[int]) -> None:
        for ns in names:
            self._medium.names.pop(ns, None)

    def recover(self) -> RecoveredBlocks:
        return RecoveredBlocks.concat(list(self.recover_chunks()))

    def health(self) -> TierHealth:
        return self.forced_health or HEALTHY

    def stats(self) -> TierStats:
        return TierStats(
            self.kind,
            self.health(),
            self.allocator.capacity_bytes,
            self.allocator.used_bytes,
            dict(self.counters),
            {"quarantined_slots": float(len(self.quarantined))},
        )

    def close(self) -> None:
        pass

    def corrupt(self, slot: int) -> None:
        """Flip a byte of a slot's stored bytes (a checksum failure on the next read)."""
        self._medium.arena[self.allocator.offset(slot)] ^= 0xFF

    def set_health(self, state: Health, detail: str = "") -> None:
        self.forced_health = None if state is Health.OK else TierHealth(state, detail)


def _recovered(
    ref: BlockRef, slot: int, batch: WriteBatch, csum: int, now: float
) -> RecoveredBlock:
    return RecoveredBlock(ref.ns, bytes(ref.key), slot, batch.nbytes, csum, now)


class MemoryKeyTier:
    """A key-addressed tier in process memory, standing in for L3 in tests: its own index
    of ``(ns, key) -> bytes``, asynchronous verbs, and faults the test switches on (``down``
    makes every call a miss, as a remote store that cannot be reached). ``write_bytes_s``: a
    write budget as L3's (blocks beyond it are dropped). ``ttl_s``: how long L3 keeps a
    value, for ``value_ages`` (values here never expire; 0: ages unknown, as L3's)."""

    kind = TierKind.REMOTE

    def __init__(
        self,
        write_bytes_s: int = 0,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = 0.0,
    ) -> None:
        self.values: dict[tuple[int, bytes], bytes] = {}
        self.written_at: dict[tuple[int, bytes], float] = {}
        self.ttl_s = ttl_s
        self.down = False
        self.counters: Counter[str] = Counter()
        self._clock = clock
        self._budget = TokenBucket(write_bytes_s, 0, clock())

    def set_write_rate(self, bytes_s: int) -> None:
        self._budget.set_rate(bytes_s, 0)

    async def probe(self, blocks: Sequence[BlockRef]) -> list[int]:
        return leading_sizes(await self.probe_each(blocks))

    async def probe_each(self, blocks: Sequence[BlockRef]) -> list[int]:
        self.counters["probes"] += 1
        if self.down:
            return [PROBE_UNKNOWN] * len(blocks)
        values = self.values
        return [
            PROBE_ABSENT if (v := values.get((ref.ns, bytes(ref.key)))) is None else len(v)
            for ref in blocks
        ]

    async def value_ages(self, blocks: Sequence[BlockRef]) -> list[float]:
        now = self._clock()
        if self.down or not self.ttl_s:
            return [0.0] * len(blocks)
        # A value a test set by hand has no write time: written now.
        return [now - self.written_at.get((ref.ns, bytes(ref.key)), now) for ref in blocks]

    async def read(
        self, blocks: Sequence[BlockRef], nbytes: int, dest: object
    ) -> list[bool | None]:
        if self.down:
            return [None] * len(blocks)  # the store did not answer: nothing said of them
        out: list[bool | None] = []
        for j, ref in enumerate(blocks):
            data = self.values.get((ref.ns, bytes(ref.key)))
            good = data is not None and len(data) == nbytes
            if good:
                put_block(dest, j, data, nbytes)  # type: ignore[arg-type]
            out.append(good)
        self.counters["blocks_read"] += out.count(True)
        return out

    async def write(self, blocks: Sequence[BlockRef], nbytes: int, src: object) -> list[bool]:
        if self.down:
            return [False] * len(blocks)
        now = self._clock()
        out = []
        for j, ref in enumerate(blocks):
            if not self._budget.take(nbytes, now):
                out.append(False)
                continue
            self.values[(ref.ns, bytes(ref.key))] = bytes(get_block(src, j, nbytes))  # type: ignore[arg-type]
            self.written_at[(ref.ns, bytes(ref.key))] = now
            out.append(True)
        self.counters["blocks_written"] += sum(out)
        self.counters["write_dropped_budget"] += len(out) - sum(out)
        return out

    async def remove(self, blocks: Sequence[BlockRef]) -> None:
        for ref in blocks:
            self.values.pop((ref.ns, bytes(ref.key)), None)
            self.written_at.pop((ref.ns, bytes(ref.key)), None)

    def unserved(self, blocks: Sequence[BlockRef]) -> list[int]:
        return list(range(len(blocks))) if self.down else []

    def health(self) -> TierHealth:
        return TierHealth(Health.DOWN, "test: down") if self.down else HEALTHY

    def stats(self) -> TierStats:
        used = sum(len(v) for v in self.values.values())
        return TierStats(self.kind, self.health(), 0, used, dict(self.counters))

    async def close(self) -> None:
        pass
