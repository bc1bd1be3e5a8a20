"""The transfer engine: every byte the store moves, routed by (source, destination).

Three kinds of move, all batched:
- from an engine pool's pages into a level's slots (a Put), and from a level into pool pages
  (a Get, from whichever tier holds the block: the top tier, or a lower one straight into the
  pages when the top tier has no room);
- between two levels (promotion, demotion, write-through, flush, prefetch, readahead),
  routed by what the two tiers can do: when the destination's slots are host memory the source
  reads straight into them; when the source's slots are, the destination writes from them;
  otherwise the bytes are staged through host memory. Key-addressed tiers are awaited on the
  event loop; slot tiers' blocking verbs run on the engine's worker threads.

A GPU pool's pages (``DevicePages``) are reachable only by a tier whose slots are device
memory (L0, the stack's ``device`` level, handed to the engine as ``device``): L0 reads and
writes them itself; every other tier's traffic with them goes through L0's bridge verbs,
straight into (or out of) the tier's slots when they are host memory (L1), else through host
staging (page-locked, from L0) and the tier's own verbs (L2, L3). Staging between L0 and a
tier without host slots comes from L0 too. A device fault on the bridge is an error
(FAILED_PRECONDITION naming the GPU tier's state), never a miss: the lower tier's copy is
intact and must not be dropped; so is a device without memory for the bridge's scratch,
or for L0's own copy into the pages (RESOURCE_EXHAUSTED: that request fails, L0 serves on
and keeps its blocks).

Priorities hold all the way down: jobs run on a ``PriorityExecutor`` in which DEMAND jobs have
reserved threads, tiers are handed the batch's priority (and rank: a prefetch's, ordering it
among the other prefetches waiting) for their own I/O threads, and a
transfer whose deadline (a prefetch's, the stop flush's) passed before it could start is
dropped (``PrefetchExpired``). Between levels, each source's read limit and each
destination's write limit (bytes/s) apply before a job starts; one whose turn under them
would come after its deadline is dropped at once. Moves of one block into one tier are de-duplicated while in flight:
``claim`` tells a caller which blocks it moves and which it waits for, and ``hurry`` raises
the moves it waits for to its own priority and rank where it is the more urgent (a Get
behind a prefetch's move): their queued jobs move up in every pool (``Urgency``).

Thread-safety: event loop only; the worker threads run only tier verbs on batches whose
slots the store has marked in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, NoReturn

import numpy as np

from kvtier.daemon.errors import FailedPrecondition, ResourceExhausted
from kvtier.daemon.latency import Histograms, Series
from kvtier.daemon.stack import Level, TokenBucket
from kvtier.daemon.stats import Counters
from kvtier.tiers.base import (
    BlockRef,
    DeviceBridge,
    DevicePages,
    HostBuffers,
    PoolPages,
    Priority,
    ReadBatch,
    TierKind,
    TierMemoryExhausted,
    WriteBatch,
    WriteOutcome,
    WriteOutcomes,
)
from kvtier.tiers.buffers import host_side
from kvtier.tiers.executor import PriorityExecutor, Urgency

log = logging.getLogger(__name__)

# Threads held for demand jobs: a request never waits for background work to free a thread.
# A write to a persistent tier holds its thread until its group's fdatasync and commit, and a
# durable put keeps several parts' writes going while it copies the next part in (store:
# PUT_FIRST_PART_BYTES): with 2, the copy of a later part waited for a thread behind them
# and the disk stood idle meanwhile.
DEMAND_THREADS = 6
# A copy between a pool and host memory smaller than this runs on the event loop itself: the
# hand-off to a worker thread and back costs more than copying a few pages.
INLINE_BYTES = 256 << 10


class PrefetchExpired(Exception):
    """A transfer's deadline (a prefetch's, or the flush's at stop) passed before it could
    start, or would pass while it waits for its turn under a tier's rate."""


class TransferEngine:
    def __init__(
        self,
        counters: Counters,
        *,
        background_workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
        latency: Histograms | None = None,
        device: Level | None = None,
    ) -> None:
        """``device``: the level whose slots are device memory (L0), when there is one."""
        self.counters = counters
        self.device = device
        # transfer_seconds{direction}: one observation per batch, for metrics.
        self.latency = latency if latency is not None else Histograms()
        # Its series for copies from a pool and into one, per tier label (``_observe_pool``).
        self._from_pool_series: dict[str, Series] = {}
        self._to_pool_series: dict[str, Series] = {}
        self._clock = clock
        self.executor = PriorityExecutor(
            background_workers + DEMAND_THREADS, "kvtier-xfer", reserved=DEMAND_THREADS
        )
        # Per destination: block ref -> the future of the claim moving it there.
        self._moving: dict[TierKind, dict[int, asyncio.Future[bool]]] = {}
        # A claim's (and its groups') future -> the urgency of its move, for ``hurry``.
        self._urgency: dict[asyncio.Future[bool], Urgency] = {}
        self._running = 0

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    @property
    def queued(self) -> int:
        return self.executor.queued

    @property
    def running(self) -> int:
        return self._running

    # ------------------------------------------------------------ de-duplication

    def claim(
        self, refs: Sequence[int], dst: TierKind, urgency: Urgency | None = None
    ) -> tuple[list[int], list[asyncio.Future[bool]]]:
        """Of the distinct blocks ``refs`` bound for ``dst``: the positions this caller now
        moves (it must ``settle`` them, all at once), and the futures of the moves already
        under way that it must wait for (one per claim that holds any of the others).
        ``urgency``: the caller's move's, which a later, more urgent waiter raises
        (``hurry``)."""
        moving = self._moving.setdefault(dst, {})
        if not refs:
            return [], []
        shared = asyncio.get_running_loop().create_future()
        if not moving.keys() & refs:
            # Nothing of it moves yet (a put's new blocks): claimed whole, without a Python
            # step per block.
            moving.update(dict.fromkeys(refs, shared))
            self._follow(shared, urgency)
            return list(range(len(refs))), []
        mine: list[int] = []
        waits: dict[asyncio.Future[bool], None] = {}  # each once, in order
        for i, ref in enumerate(refs):
            fut = moving.get(ref)
            if fut is not None:
                waits[fut] = None
                continue
            moving[ref] = shared
            mine.append(i)
        if mine:
            self._follow(shared, urgency)
        return mine, list(waits)

    def hurry(self, waits: Sequence[asyncio.Future[bool]], priority: int, rank: int) -> None:
        """A caller of ``priority`` and ``rank`` waits for the moves of ``waits`` (``claim``'s):
        each that is less urgent goes at least as urgently from now on, both its jobs still
        queued and those it has yet to submit."""
        for fut in waits:
            urgency = self._urgency.get(fut)
            if urgency is not None:
                urgency.raise_to(priority, rank)

    def _follow(self, fut: asyncio.Future[bool], urgency: Urgency | None) -> None:
        """``hurry`` raises ``urgency`` for the waiters of ``fut``, until it is done."""
        if urgency is not None:
            self._urgency[fut] = urgency
            fut.add_done_callback(self._forget_urgency)

    def _forget_urgency(self, fut: asyncio.Future[bool]) -> None:
        self._urgency.pop(fut, None)

    def regroup(self, refs: Sequence[int], dst: TierKind) -> None:
        """Some refs of one claim, moved by one copy group of it, get a future of their
        own, which ``wake`` resolves as that group ends: a caller that needs a few blocks of
        a large move (a Get behind a prefetch of hundreds) waits for the group holding them,
        not for the whole claim. A waiter that already holds the claim's future is woken with
        the first group that ends (early, which is safe: a waiter reads the table for what
        arrived, and reads what did not from where it is). The refs stay the claim's until
        its ``settle``."""
        moving = self._moving.get(dst)
        if not moving or not refs:
            return
        old = moving.get(refs[0])
        if old is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._follow(fut, self._urgency.get(old))
        for ref in refs:
            if moving.get(ref) is old:
                moving[ref] = fut

        def wake_the_claims_waiters(_: asyncio.Future[bool]) -> None:
            if not old.done():
                old.set_result(True)

        fut.add_done_callback(wake_the_claims_waiters)

    def wake(self, refs: Sequence[int], dst: TierKind) -> None:
        """A copy group of a claim (``regroup``) ended: wake its waiters, but keep its refs
        claimed until the claim's ``settle``. Were they forgotten here, a caller could claim
        a block the group failed to move, and the claim's ``settle`` would then forget that
        caller's move too, and a third caller would move the block again (two copies in
        ``dst``, one slot leaked). A newcomer meanwhile gets the resolved future: it reads
        the table at once."""
        moving = self._moving.get(dst, {})
        for fut in {moving.get(ref) for ref in refs}:
            if fut is not None and not fut.done():
                fut.set_result(True)

    def settle(self, refs: Sequence[int], dst: TierKind) -> None:
        """The moves of ``refs`` (one claim's) ended, done or not: wake their waiters."""
        moving = self._moving.get(dst, {})
        # One claim's refs share one future: each distinct one is woken once.
        for fut in set(map(moving.pop, refs, repeat(None))):
            if fut is not None and not fut.done():
                fut.set_result(True)

    def moving(self, ref: int, dst: TierKind) -> bool:
        return ref in self._moving.get(dst, ())

    def in_flight(self, dst: TierKind) -> int:
        return len(self._moving.get(dst, ()))

    # ------------------------------------------------------------------- moves

    async def from_pool(
        self,
        level: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        pages: PoolPages | DevicePages,
        priority: Priority = Priority.DEMAND,
    ) -> Sequence[WriteOutcome]:
        """Copy pool pages into a level's slots (exceptions from the copy propagate: the
        caller abandons the blocks)."""
        batch = WriteBatch(slots, refs, nbytes, pages, priority)
        started = time.perf_counter()
        try:
            if isinstance(pages, DevicePages) and not level.device_memory:
                return await self._from_device_pool(level, slots, refs, nbytes, pages, priority)
            if level.keyed:
                ok = await level.keys.write(refs, nbytes, host_side(pages))
                return [WriteOutcome(-1, bool(g)) for g in ok]
            if self._inline(level, len(slots) * nbytes):
                return level.slots.write(batch)
            return await self._run(priority, level.slots.write, batch)  # type: ignore[no-any-return]
        finally:
            self._observe_pool(started, level.label, to_pool=False)

    async def to_pool(
        self,
        level: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        checksums: Sequence[int],
        pages: PoolPages | DevicePages,
        priority: Priority = Priority.DEMAND,
    ) -> list[bool | None]:
        """Copy blocks held by a level into pool pages; per block True, or a miss: False, the
        level has lost the block (a failed read, absent), None, the level could not tell (a
        key-addressed tier whose store did not answer: ``KeyTier.read``)."""
        started = time.perf_counter()
        if isinstance(pages, DevicePages) and not level.device_memory:
            got = await self._to_device_pool(level, slots, refs, nbytes, checksums, pages, priority)
            self._observe_pool(started, level.label, to_pool=True)
            if not level.host_memory:
                self._count_move(level.label, "pool", sum(map(bool, got)), nbytes)
            return got
        if level.keyed:
            got = list(await level.keys.read(refs, nbytes, host_side(pages)))
            self._observe_pool(started, level.label, to_pool=True)
            return got
        batch = ReadBatch(slots, refs, nbytes, pages, checksums, priority)
        if self._inline(level, len(slots) * nbytes):
            ok = level.slots.read(batch)
        else:
            try:
                ok = await self._run(priority, level.slots.read, batch)
            except TierMemoryExhausted as e:
                # L0 short of memory for the copy: its blocks are intact, so an error, never
                # misses.
                what = f"{level.label}->pool"
                self.counters.inc("transfer_failures", direction=what)
                raise ResourceExhausted(
                    f"the GPU tier could not copy its blocks into the pool's pages ({what}): {e}"
                ) from None
        self._observe_pool(started, level.label, to_pool=True)
        if not level.host_memory:
            self._count_move(level.label, "pool", sum(ok), nbytes)
        return list(ok)

    async def copy(
        self,
        src: Level,
        dst: Level,
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        checksums: Sequence[int],
        priority: Priority,
        deadline: float | None = None,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> tuple[Sequence[WriteOutcome], list[bool]]:
        """Copy blocks from ``src`` into reserved ``dst_slots`` (ignored by a keyed ``dst``),
        at ``priority`` and, within it, ``rank`` (higher sooner), or as ``urgency`` (the
        move's) says where that is more urgent.
        Returns an outcome per block and whether the *source* failed it (its read missed: the
        source tier dropped the block), as opposed to the destination refusing it or the
        source not answering (a key-addressed tier's store unreachable: it may hold the block).
        Never raises for a tier's failure. Raises PrefetchExpired when ``deadline`` passed
        before the copy could start."""
        n = len(refs)
        direction = f"{src.label}->{dst.label}"
        await self._throttle(src.reads, dst.writes, n * nbytes, direction, priority, deadline)
        self._check_deadline(deadline, priority)
        started = time.perf_counter()
        try:
            outcomes, src_failed = await self._copy(
                src,
                dst,
                src_slots,
                dst_slots,
                refs,
                nbytes,
                checksums,
                priority,
                deadline,
                rank,
                urgency,
            )
            self._observe(started, direction)
        except PrefetchExpired:
            raise
        except Exception:
            log.exception("%s transfer of %d blocks failed", direction, n)
            self.counters.inc("transfer_failures", direction=direction)
            return [WriteOutcome(int(s), False) for s in dst_slots], [False] * n
        ok = int(np.count_nonzero(WriteOutcomes.of(outcomes).ok))
        self._count_move(src.label, dst.label, ok, nbytes)
        return outcomes, src_failed

    async def _copy(
        self,
        src: Level,
        dst: Level,
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        checksums: Sequence[int],
        priority: Priority,
        deadline: float | None,
        rank: int,
        urgency: Urgency | None,
    ) -> tuple[Sequence[WriteOutcome], list[bool]]:
        into = None if dst.keyed else dst.buffers(dst_slots, nbytes)
        if into is not None:
            # The destination's slots are host memory: the source reads straight into them.
            if src.keyed:
                ok = list(await src.keys.read(refs, nbytes, into))
            else:
                batch = ReadBatch(src_slots, refs, nbytes, into, checksums, priority, rank, urgency)
                ok = await self._run(
                    priority, src.slots.read, batch, deadline=deadline, rank=rank, urgency=urgency
                )
            outcomes = [WriteOutcome(int(s), bool(g)) for s, g in zip(dst_slots, ok, strict=True)]
            return outcomes, [_dropped(g) for g in ok]
        source = self._source_buffers(src, src_slots, nbytes)
        good: list[bool | None] = [True] * len(refs)
        if source is None:
            # Neither side is host memory: stage through host buffers (page-locked ones of
            # the GPU tier when either side is device memory).
            device = dst if dst.device_memory else src if src.device_memory else None
            bridge = device.bridge if device is not None else None
            source, good = await self._stage(
                src, src_slots, refs, nbytes, checksums, priority, bridge, rank, urgency
            )
        if all(good):  # a host source, or all staged
            stored = await self._write(
                dst, dst_slots, refs, nbytes, source, priority, deadline, rank, urgency
            )
            return stored, [False] * len(good)
        # A block the source could not read left its staging buffer as it was (np.empty's
        # leftovers): written, those bytes would be stored and indexed with their own
        # checksum, and served as the block after a crash that came before its slot was
        # freed again. Only the blocks read are written.
        read = [j for j, g in enumerate(good) if g]
        written = iter(
            await self._write(
                dst,
                [dst_slots[j] for j in read],
                [refs[j] for j in read],
                nbytes,
                HostBuffers([source.views[j] for j in read]),
                priority,
                deadline,
                rank,
                urgency,
            )
            if read
            else ()
        )
        outcomes = [
            next(written) if g else WriteOutcome(-1 if dst.keyed else int(slot), False)
            for slot, g in zip(dst_slots, good, strict=True)
        ]
        return outcomes, [_dropped(g) for g in good]

    async def _write(
        self,
        dst: Level,
        dst_slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        source: HostBuffers,
        priority: Priority,
        deadline: float | None,
        rank: int,
        urgency: Urgency | None,
    ) -> Sequence[WriteOutcome]:
        if dst.keyed:
            written = await dst.keys.write(refs, nbytes, source)
            return [WriteOutcome(-1, bool(w)) for w in written]
        wbatch = WriteBatch(dst_slots, refs, nbytes, source, priority, rank, urgency)
        outcomes: Sequence[WriteOutcome] = await self._run(
            priority, dst.slots.write, wbatch, deadline=deadline, rank=rank, urgency=urgency
        )
        return outcomes

    @staticmethod
    def _source_buffers(level: Level, slots: Sequence[int], nbytes: int) -> HostBuffers | None:
        return None if level.keyed else level.buffers(slots, nbytes)

    # ------------------------------------------------------------- GPU pools

    def _bridge(self) -> DeviceBridge:
        if self.device is None:
            # Registration refuses GPU pools without a GPU tier; this is a safety net.
            raise FailedPrecondition(
                "a GPU pool's pages can be reached only through the GPU tier (L0), which "
                "this daemon does not run (tiers.l0.enabled)"
            )
        return self.device.bridge

    async def _bridge_move(
        self,
        priority: Priority,
        bridge: DeviceBridge,
        what: str,
        fn: Callable[..., bool],
        *args: Any,
    ) -> None:
        """One of the bridge's copies (``fn``: its ``pool_to_host`` or ``host_to_pool``):
        FailedPrecondition when the device failed, ResourceExhausted when it had no memory
        for the copy (the tier serves on: a later request may pass)."""
        try:
            ok = await self._run(priority, fn, *args)
        except TierMemoryExhausted as e:
            self._count_bridge_failure(what)
            raise ResourceExhausted(
                f"the GPU tier could not move a GPU pool's pages ({what}): {e}"
            ) from None
        if not ok:
            self._count_bridge_failure(what)
            raise FailedPrecondition(
                f"the GPU tier could not move a GPU pool's pages ({what}): {bridge.health()}"
            )

    def _count_bridge_failure(self, what: str) -> None:
        direction = f"{what} via {self.device.label if self.device else 'L0'}"
        self.counters.inc("transfer_failures", direction=direction)

    async def _from_device_pool(
        self,
        level: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        pages: DevicePages,
        priority: Priority,
    ) -> Sequence[WriteOutcome]:
        """GPU pool pages into a tier that cannot reach device memory: gathered by L0 into
        the tier's host slots, or into staging that the tier then writes."""
        bridge = self._bridge()
        into = None if level.keyed else level.buffers(slots, nbytes)
        what = f"pool->{level.label}"
        if into is not None:
            await self._bridge_move(
                priority, bridge, what, bridge.pool_to_host, pages, into, nbytes
            )
            return [WriteOutcome(int(s), True) for s in slots]
        # Page-locked memory is allocated off the event loop (a first allocation of a size
        # can take milliseconds).
        staging: HostBuffers = await self._run(priority, bridge.host_buffers, len(pages), nbytes)
        await self._bridge_move(priority, bridge, what, bridge.pool_to_host, pages, staging, nbytes)
        if level.keyed:
            written = await level.keys.write(refs, nbytes, staging)
            return [WriteOutcome(-1, bool(w)) for w in written]
        batch = WriteBatch(slots, refs, nbytes, staging, priority)
        return await self._run(priority, level.slots.write, batch)  # type: ignore[no-any-return]

    async def _to_device_pool(
        self,
        level: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        checksums: Sequence[int],
        pages: DevicePages,
        priority: Priority,
    ) -> list[bool | None]:
        """Blocks of a tier that cannot reach device memory into GPU pool pages: scattered
        by L0 from the tier's host slots, or read by the tier into staging first (its
        misses stay misses; only the blocks it read are scattered)."""
        bridge = self._bridge()
        src = None if level.keyed else level.buffers(slots, nbytes)
        what = f"{level.label}->pool"
        if src is not None:
            await self._bridge_move(priority, bridge, what, bridge.host_to_pool, src, pages, nbytes)
            return [True] * len(pages)
        staging, good = await self._stage(level, slots, refs, nbytes, checksums, priority, bridge)
        idx = [j for j, g in enumerate(good) if g]
        if idx:
            got = HostBuffers([staging.views[j] for j in idx])
            dest = DevicePages(pages.smap, pages.segments, pages.pages[idx])
            await self._bridge_move(priority, bridge, what, bridge.host_to_pool, got, dest, nbytes)
        return good

    async def _stage(
        self,
        src: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        checksums: Sequence[int],
        priority: Priority,
        bridge: DeviceBridge | None = None,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> tuple[HostBuffers, list[bool | None]]:
        """Read blocks of a tier without host-memory slots into fresh host buffers (the
        GPU tier's page-locked staging when ``bridge`` is given: one side is device
        memory); per block as ``to_pool`` answers."""
        if bridge is not None:
            bufs: HostBuffers = await self._run(
                priority, bridge.host_buffers, len(refs), nbytes, rank=rank, urgency=urgency
            )
        else:
            bufs = HostBuffers([np.empty(nbytes, dtype=np.uint8).data for _ in refs])
        if src.keyed:
            ok = await src.keys.read(refs, nbytes, bufs)
        else:
            batch = ReadBatch(slots, refs, nbytes, bufs, checksums, priority, rank, urgency)
            ok = await self._run(priority, src.slots.read, batch, rank=rank, urgency=urgency)
        return bufs, [None if g is None else bool(g) for g in ok]

    # ----------------------------------------------------------------- plumbing

    @staticmethod
    def _inline(level: Level, nbytes: int) -> bool:
        """Small copies of a tier whose slots are host memory run on the caller's thread."""
        return nbytes < INLINE_BYTES and level.host_memory

    async def run(self, priority: Priority, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking call on the engine's threads at ``priority``."""
        return await self._run(priority, fn, *args)

    async def _run(
        self,
        priority: Priority,
        fn: Callable[..., Any],
        *args: Any,
        deadline: float | None = None,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> Any:
        # The request's log context (request, session, pool ids) follows it onto the thread:
        # the executor runs each job in the context it was submitted in.
        def job() -> Any:
            self._check_deadline(deadline, priority)
            return fn(*args)

        self._running += 1
        future = self.executor.submit(priority, job, rank=rank, urgency=urgency)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The cancel reached the job: one not started never runs. One running goes on (a
            # thread cannot be stopped) copying into the caller's slots from its pool's
            # memory, which the caller gives back as it unwinds: it waits for the job first.
            if not future.cancelled():
                await _until_done(future)
            raise
        finally:
            self._running -= 1

    def _check_deadline(self, deadline: float | None, priority: Priority) -> None:
        if deadline is not None and self._clock() > deadline:
            self._expire(priority)

    def _expire(self, priority: Priority) -> NoReturn:
        # Only prefetches count here; the stop's flush, the other user of deadlines, logs
        # what it left unwritten itself.
        if priority == Priority.PREFETCH:
            self.counters.inc("prefetch_expired")
        raise PrefetchExpired()

    async def _throttle(
        self,
        reads: TokenBucket,
        writes: TokenBucket,
        nbytes: int,
        direction: str,
        priority: Priority,
        deadline: float | None,
    ) -> None:
        """Wait until both the source's read and the destination's write rate allow
        ``nbytes``. A copy whose turn would come after its ``deadline`` expires now instead
        of sleeping until then to be dropped: the flush at stop, bounded by
        ``tiers.l2.flush_timeout_s``, lasted as long as its throttled writes. Its bytes stay
        taken, so the turns of the copies after it keep growing and they expire too: a
        smaller one given the room would be written past a hole in its chain. A copy starts
        whole or not at all: the space manager sizes the groups of a copy with a deadline to
        what the limits let through before it (``SpaceManager._budget``)."""
        delay = max(reads.delay_for(nbytes), writes.delay_for(nbytes))
        if delay <= 0:
            return
        if deadline is not None and self._clock() + delay > deadline:
            self._expire(priority)
        self.counters.inc("throttled_ms", int(delay * 1000), direction=direction)
        await asyncio.sleep(delay)

    def _observe(self, started: float, direction: str) -> None:
        self.latency.observe("transfer_seconds", time.perf_counter() - started, direction=direction)

    def _observe_pool(self, started: float, label: str, *, to_pool: bool) -> None:
        """``_observe`` of a copy between a pool and the tier labelled ``label``, into the
        pool with ``to_pool``: every Put and Get makes one, so its series is resolved once
        per tier and direction."""
        cache = self._to_pool_series if to_pool else self._from_pool_series
        series = cache.get(label)
        if series is None:
            direction = f"{label}->pool" if to_pool else f"pool->{label}"
            series = cache[label] = self.latency.series("transfer_seconds", direction=direction)
        series.add(time.perf_counter() - started)

    def _count_move(self, src: str, dst: str, blocks: int, nbytes: int) -> None:
        direction = f"{src}->{dst}"
        self.counters.inc("transferred_blocks", blocks, direction=direction)
        self.counters.inc("transferred_bytes", blocks * nbytes, direction=direction)


async def _until_done(future: concurrent.futures.Future[Any]) -> None:
    """Wait for a worker thread's job to end, whatever it returns or raises, through any
    number of cancels (the caller re-raises the first once the job is done)."""
    done = asyncio.wrap_future(future)
    while not done.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(done)
    if not done.cancelled():
        done.exception()  # retrieved: the caller's cancel is what goes on


def _dropped(read: bool | None) -> bool:
    """Whether a read's answer says the tier lost the block (not: read, or not answered)."""
    return read is not None and not read
