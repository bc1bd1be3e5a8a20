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

Priorities hold all the way down: jobs run on a ``PriorityExecutor`` in which DEMAND jobs have
reserved threads, tiers are handed the batch's priority for their own I/O threads, and a
prefetch whose deadline passed before it could start is dropped (``PrefetchExpired``).
Between levels, each source's read limit and each destination's write limit (bytes/s) apply
before a job starts. Moves of one block into one tier are de-duplicated while in flight:
``claim`` tells a caller which blocks it moves and which it waits for.

Thread-safety: event loop only; the worker threads run only tier verbs on batches whose
slots the store has marked in flight.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.daemon.latency import Histograms
from kvtier.daemon.stack import Level, TokenBucket
from kvtier.daemon.stats import Counters
from kvtier.tiers.base import (
    BlockRef,
    HostBuffers,
    PoolPages,
    Priority,
    ReadBatch,
    TierKind,
    WriteBatch,
    WriteOutcome,
)
from kvtier.tiers.executor import PriorityExecutor

log = logging.getLogger(__name__)

# Threads held for demand jobs: a request never waits for background work to free a thread.
DEMAND_THREADS = 2
# A copy between a pool and host memory smaller than this runs on the event loop itself: the
# hand-off to a worker thread and back costs more than copying a few pages.
INLINE_BYTES = 256 << 10


class PrefetchExpired(Exception):
    """The prefetch's deadline passed before it could start."""


class TransferEngine:
    def __init__(
        self,
        counters: Counters,
        *,
        background_workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
        latency: Histograms | None = None,
    ) -> None:
        self.counters = counters
        # transfer_seconds{direction}: one observation per batch, for metrics.
        self.latency = latency if latency is not None else Histograms()
        self._clock = clock
        self.executor = PriorityExecutor(
            background_workers + DEMAND_THREADS, "kvtier-xfer", reserved=DEMAND_THREADS
        )
        self._moving: dict[tuple[int, TierKind], asyncio.Future[bool]] = {}
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
        self, refs: Sequence[int], dst: TierKind
    ) -> tuple[list[int], list[asyncio.Future[bool]]]:
        """Of the blocks ``refs`` bound for ``dst``: the positions this caller now moves
        (it must ``settle`` them), and the futures of those already moving."""
        loop = asyncio.get_running_loop()
        mine: list[int] = []
        waits: list[asyncio.Future[bool]] = []
        for i, ref in enumerate(refs):
            fut = self._moving.get((ref, dst))
            if fut is not None:
                waits.append(fut)
            else:
                self._moving[(ref, dst)] = loop.create_future()
                mine.append(i)
        return mine, waits

    def settle(self, refs: Sequence[int], dst: TierKind, ok: Sequence[bool]) -> None:
        for ref, good in zip(refs, ok, strict=True):
            fut = self._moving.pop((ref, dst), None)
            if fut is not None and not fut.done():
                fut.set_result(bool(good))

    def moving(self, ref: int, dst: TierKind) -> bool:
        return (ref, dst) in self._moving

    def in_flight(self, dst: TierKind) -> int:
        return sum(1 for _, kind in self._moving if kind == dst)

    # ------------------------------------------------------------------- moves

    async def from_pool(
        self,
        level: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        pages: PoolPages,
        priority: Priority = Priority.DEMAND,
    ) -> list[WriteOutcome]:
        """Copy pool pages into a level's slots (exceptions from the copy propagate: the
        caller abandons the blocks)."""
        batch = WriteBatch(slots, refs, nbytes, pages, priority)
        started = time.perf_counter()
        try:
            if level.keyed:
                ok = await level.keys.write(refs, nbytes, pages)
                return [WriteOutcome(-1, bool(g)) for g in ok]
            if self._inline(level, len(slots) * nbytes):
                return level.slots.write(batch)
            return await self._run(priority, level.slots.write, batch)  # type: ignore[no-any-return]
        finally:
            self._observe(started, f"pool->{level.label}")

    async def to_pool(
        self,
        level: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        checksums: Sequence[int],
        pages: PoolPages,
        priority: Priority = Priority.DEMAND,
    ) -> list[bool]:
        """Copy blocks held by a level into pool pages; False per block is a miss."""
        started = time.perf_counter()
        if level.keyed:
            got = list(await level.keys.read(refs, nbytes, pages))
            self._observe(started, f"{level.label}->pool")
            return got
        batch = ReadBatch(slots, refs, nbytes, pages, checksums, priority)
        if self._inline(level, len(slots) * nbytes):
            ok = level.slots.read(batch)
        else:
            ok = await self._run(priority, level.slots.read, batch)
        self._observe(started, f"{level.label}->pool")
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
    ) -> tuple[list[WriteOutcome], list[bool]]:
        """Copy blocks from ``src`` into reserved ``dst_slots`` (ignored by a keyed ``dst``).
        Returns an outcome per block and whether the *source* failed it (its read missed: the
        source tier dropped the block), as opposed to the destination refusing it.
        Never raises for a tier's failure. Raises PrefetchExpired when ``deadline`` passed
        before the copy could start."""
        n = len(refs)
        direction = f"{src.label}->{dst.label}"
        await self._throttle(src.reads, n * nbytes, direction)
        await self._throttle(dst.writes, n * nbytes, direction)
        self._check_deadline(deadline)
        started = time.perf_counter()
        try:
            outcomes, src_failed = await self._copy(
                src, dst, src_slots, dst_slots, refs, nbytes, checksums, priority, deadline
            )
            self._observe(started, direction)
        except PrefetchExpired:
            raise
        except Exception:
            log.exception("%s transfer of %d blocks failed", direction, n)
            self.counters.inc("transfer_failures", direction=direction)
            return [WriteOutcome(int(s), False) for s in dst_slots], [False] * n
        self._count_move(src.label, dst.label, sum(o.ok for o in outcomes), nbytes)
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
    ) -> tuple[list[WriteOutcome], list[bool]]:
        into = None if dst.keyed else dst.buffers(dst_slots, nbytes)
        if into is not None:
            # The destination's slots are host memory: the source reads straight into them.
            if src.keyed:
                ok = list(await src.keys.read(refs, nbytes, into))
            else:
                batch = ReadBatch(src_slots, refs, nbytes, into, checksums, priority)
                ok = await self._run(priority, src.slots.read, batch, deadline=deadline)
            outcomes = [WriteOutcome(int(s), bool(g)) for s, g in zip(dst_slots, ok, strict=True)]
            return outcomes, [not g for g in ok]
        source = self._source_buffers(src, src_slots, nbytes)
        good = [True] * len(refs)
        if source is None:
            # Neither side is host memory: stage through host buffers.
            source, good = await self._stage(src, src_slots, refs, nbytes, checksums, priority)
        if dst.keyed:
            written = await dst.keys.write(refs, nbytes, source)
            outcomes = [WriteOutcome(-1, bool(w)) for w in written]
        else:
            wbatch = WriteBatch(dst_slots, refs, nbytes, source, priority)
            outcomes = await self._run(priority, dst.slots.write, wbatch, deadline=deadline)
        outcomes = [
            o if g else WriteOutcome(o.slot, False) for o, g in zip(outcomes, good, strict=True)
        ]
        return outcomes, [not g for g in good]

    @staticmethod
    def _source_buffers(level: Level, slots: Sequence[int], nbytes: int) -> HostBuffers | None:
        return None if level.keyed else level.buffers(slots, nbytes)

    async def _stage(
        self,
        src: Level,
        slots: Sequence[int],
        refs: Sequence[BlockRef],
        nbytes: int,
        checksums: Sequence[int],
        priority: Priority,
    ) -> tuple[HostBuffers, list[bool]]:
        """Read blocks of a tier without host-memory slots into fresh host buffers."""
        bufs = HostBuffers([np.empty(nbytes, dtype=np.uint8).data for _ in refs])
        if src.keyed:
            ok = await src.keys.read(refs, nbytes, bufs)
        else:
            batch = ReadBatch(slots, refs, nbytes, bufs, checksums, priority)
            ok = await self._run(priority, src.slots.read, batch)
        return bufs, [bool(g) for g in ok]

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
    ) -> Any:
        # The request's log context (request, session, pool ids) follows it onto the thread.
        context = contextvars.copy_context()

        def job() -> Any:
            self._check_deadline(deadline)
            return context.run(fn, *args)

        self._running += 1
        try:
            return await asyncio.wrap_future(self.executor.submit(priority, job))
        finally:
            self._running -= 1

    def _check_deadline(self, deadline: float | None) -> None:
        if deadline is not None and self._clock() > deadline:
            self.counters.inc("prefetch_expired")
            raise PrefetchExpired()

    async def _throttle(self, bucket: TokenBucket, nbytes: int, direction: str) -> None:
        delay = bucket.delay_for(nbytes)
        if delay > 0:
            self.counters.inc("throttled_ms", int(delay * 1000), direction=direction)
            await asyncio.sleep(delay)

    def _observe(self, started: float, direction: str) -> None:
        self.latency.observe("transfer_seconds", time.perf_counter() - started, direction=direction)

    def _count_move(self, src: str, dst: str, blocks: int, nbytes: int) -> None:
        direction = f"{src}->{dst}"
        self.counters.inc("transferred_blocks", blocks, direction=direction)
        self.counters.inc("transferred_bytes", blocks * nbytes, direction=direction)
