"""The mover: one scheduler for every tier-to-tier transfer.

Transfers wait in one priority queue: a read a request is blocked on goes first, then
prefetches (by the engine's priority, then deadline), then demotion and write-back. Each
direction (for example ``l2_read``, ``l2_write``) may have a bandwidth limit, enforced with a
token bucket before a transfer starts. A transfer that fails is logged with its traceback and
counted, its waiter gets the exception, and the mover carries on.

Invariants:
- Every submitted transfer runs exactly once or is cancelled (``stop``); its future always
  resolves.
- A prefetch whose deadline passed before it could start is dropped (counted as expired):
  the request it was for has already read the block or recomputed it.

Thread-safety: asyncio only; every method runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    DEMAND = 0  # a request waits on it
    PREFETCH = 1  # ahead of use
    BACKGROUND = 2  # demotion, write-back, write-through


class PrefetchExpired(Exception):
    """The prefetch's deadline passed before it could start."""


class TokenBucket:
    """Bytes per second with a burst of one second's worth; 0 means unlimited."""

    def __init__(self, rate_bytes_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate_bytes_s)
        self._clock = clock
        self._tokens = self.rate
        self._last = clock()

    def delay_for(self, nbytes: int) -> float:
        """Take ``nbytes`` and return how long to wait before using them."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


@dataclass(order=True)
class _Job:
    sort_key: tuple[float, ...]
    seq: int
    direction: str = field(compare=False)
    nbytes: int = field(compare=False)
    run: Callable[[], Awaitable[Any]] = field(compare=False)
    future: asyncio.Future[Any] = field(compare=False)
    deadline: float | None = field(compare=False, default=None)
    submitted: float = field(compare=False, default=0.0)


class Mover:
    def __init__(
        self,
        limits_bytes_s: dict[str, float] | None = None,
        *,
        workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = {d: TokenBucket(r, clock) for d, r in (limits_bytes_s or {}).items()}
        self._workers = workers
        self._clock = clock
        self._queue: asyncio.PriorityQueue[_Job] = asyncio.PriorityQueue()
        self._seq = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self.counters: Counter[str] = Counter()
        self._busy = 0

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"mover-{i}") for i in range(self._workers)
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        while not self._queue.empty():
            job = self._queue.get_nowait()
            job.future.cancel()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return self._busy

    @property
    def idle(self) -> bool:
        return self._queue.empty() and self._busy == 0

    def submit(
        self,
        priority: Priority,
        direction: str,
        nbytes: int,
        run: Callable[[], Awaitable[Any]],
        *,
        engine_priority: int = 0,
        deadline: float | None = None,
    ) -> asyncio.Future[Any]:
        """Queue a transfer; the future resolves with ``run()``'s result or exception."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # Among prefetches: higher engine priority first, then the earlier deadline.
        sort_key = (
            float(priority),
            float(-engine_priority),
            deadline if deadline is not None else float("inf"),
        )
        now = self._clock()
        self._queue.put_nowait(
            _Job(sort_key, next(self._seq), direction, nbytes, run, future, deadline, now)
        )
        self.counters[f"{direction}_queued"] += 1
        return future

    async def _worker(self) -> None:
        while True:
            job = await self._queue.get()
            if job.future.cancelled():
                continue
            self._busy += 1
            try:
                await self._execute(job)
            finally:
                self._busy -= 1
                # The job's closure may hold views of tier memory: drop it now, not when the
                # next job arrives (an idle worker would keep the tier from closing).
                del job

    async def _execute(self, job: _Job) -> None:
        if job.deadline is not None and self._clock() > job.deadline:
            self.counters["prefetch_expired"] += 1
            job.future.set_exception(PrefetchExpired())
            job.future.exception()  # retrieved: nobody may be waiting on a prefetch
            return
        bucket = self._limits.get(job.direction)
        if bucket is not None and (delay := bucket.delay_for(job.nbytes)) > 0:
            self.counters[f"{job.direction}_throttled_s_x1000"] += int(delay * 1000)
            await asyncio.sleep(delay)
        try:
            result = await job.run()
        except asyncio.CancelledError:
            job.future.cancel()
            raise
        except Exception as e:
            log.exception("%s transfer of %d bytes failed", job.direction, job.nbytes)
            self.counters[f"{job.direction}_failures"] += 1
            if not job.future.done():
                job.future.set_exception(e)
                job.future.exception()  # marked retrieved; a waiter still sees it
            return
        self.counters[f"{job.direction}_transfers"] += 1
        self.counters[f"{job.direction}_bytes"] += job.nbytes
        if not job.future.done():
            job.future.set_result(result)
