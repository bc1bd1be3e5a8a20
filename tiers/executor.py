"""Worker threads that always take the most urgent job first.

Every byte a tier moves moves on one of these pools, so the mover's priorities hold all the way
down: a job waits in a heap ordered by ``(priority, -rank, submission order)``, and jobs that
are not DEMAND may occupy at most ``threads - reserved`` workers, so a read a request waits on
never queues behind background writes or removals that took every thread. The rank orders jobs
within one priority class only (a prefetch's ``priority`` from the engine: higher sooner, equal
ranks in submission order); no rank moves a job into or past another class.

A job may also follow an ``Urgency``: the urgency of the move it is part of, which a more
urgent caller waiting for that move raises (``Urgency.raise_to``); the job's queued entry is
then moved up, in whichever pool it waits, so that the waiter does not wait at the move's
first, lower place (a Get behind a prefetch's claim waits as a demand read).

A job runs in the context (``contextvars``) it was submitted in: the log lines of a disk run a
request's move split off carry that request's ids, as the move's own lines do.

Thread-safety: ``submit`` and ``shutdown`` may be called from any thread.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.tiers.base import Priority


@dataclass(order=True)
class _Job:
    priority: int
    behind: int  # minus the rank: a higher rank sorts first within its class
    seq: int
    fn: Callable[..., Any] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    future: Future[Any] = field(compare=False)
    # Replaced in the heap by a more urgent entry (``Urgency.raise_to``), or taken off it.
    gone: bool = field(default=False, compare=False)


def _ran() -> None:
    """What a job that ran, or moved up, holds in place of its callable."""


# What a job that was taken, or the entry a raised urgency left behind, holds in place of its
# future (never completed, never awaited).
_HANDED: Future[Any] = Future()


def _drop_locals(exc: BaseException) -> None:
    """Clear the finished frames of ``exc``'s traceback, and of the exceptions it chains: the
    caller gets it with every line of its traceback, but its frames no longer hold the job's
    arguments (an Urgency keeps the job's future, and so the exception, while it lives)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # the frame still running is left as it is
        todo += [e.__cause__, e.__context__]


class Urgency:
    """The class and rank of one move, which may only rise; every job of the move submitted
    with it runs at least this urgently, and raising it moves up the ones still queued.

    Thread-safety: any thread (lock order: an urgency, then a pool's)."""

    def __init__(self, priority: int, rank: int = 0) -> None:
        self.key = (int(priority), -rank)
        self._lock = threading.Lock()
        self._queued: list[tuple[PriorityExecutor, _Job]] = []

    def now(self) -> tuple[int, int]:
        """The class and rank it stands at."""
        return self.key[0], -self.key[1]

    def raise_to(self, priority: int, rank: int = 0) -> None:
        """At least ``priority`` and, within it, ``rank`` from now on."""
        key = (int(priority), -rank)
        with self._lock:
            if key >= self.key:
                return
            self.key = key
            queued, self._queued = self._queued, []
            for pool, job in queued:
                entry = pool._lift(job, key)
                if entry is not None:
                    self._queued.append((pool, entry))

    def _submit(self, pool: PriorityExecutor, job: _Job) -> None:
        with self._lock:
            if self.key < (job.priority, job.behind):
                job.priority, job.behind = self.key
            pool._push(job)
            self._queued.append((pool, job))  # those gone are dropped by ``raise_to``


class PriorityExecutor:
    def __init__(self, threads: int, name: str, *, reserved: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        self.threads = threads
        # With one thread nothing can be held back for demand: it would never run the rest.
        self._urgent_only = min(reserved, threads - 1)
        self._heap: list[_Job] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._busy_other = 0
        self._stale = 0  # heap entries a raised urgency replaced
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for w in self._workers:
            w.start()

    def submit(
        self,
        priority: int,
        fn: Callable[..., Any],
        *args: Any,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> Future[Any]:
        """Queue ``fn(*args)`` at ``priority`` (a ``Priority`` class), and within the class at
        ``rank`` (higher sooner; equal ranks in submission order), or as ``urgency`` says
        where that is more urgent, now or once raised while the job waits."""
        future: Future[Any] = Future()
        run = contextvars.copy_context().run
        job = _Job(int(priority), -rank, next(self._seq), run, (fn, *args), future)
        if urgency is not None:
            urgency._submit(self, job)
            return future
        with self._cv:  # ``_push``, inline: every transfer and disk run comes this way
            if self._closed:
                raise RuntimeError("executor is shut down")
            heapq.heappush(self._heap, job)
            self._cv.notify()
        return future

    def _push(self, job: _Job) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("executor is shut down")
            heapq.heappush(self._heap, job)
            self._cv.notify()

    def _lift(self, job: _Job, key: tuple[int, int]) -> _Job | None:
        """Queue ``job``, if it still waits, at ``key`` where that is more urgent; the
        job's entry now (None: it no longer waits)."""
        with self._cv:
            if job.gone:
                return None
            if key < (job.priority, job.behind):
                job.gone = True
                self._stale += 1
                moved = replace(job, priority=key[0], behind=key[1], gone=False)
                # The entry left behind holds nothing either: it waits in the heap until it
                # reaches the top, and its future would hold the result of the job run here.
                job.fn, job.args, job.future = _ran, (), _HANDED
                job = moved
                heapq.heappush(self._heap, job)
                self._cv.notify_all()
            return job

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._heap) - self._stale

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the workers."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if wait:
            for w in self._workers:
                w.join()

    def _runnable(self) -> bool:
        while self._heap and self._heap[0].gone:
            heapq.heappop(self._heap)
            self._stale -= 1
        if not self._heap:
            return False
        if self._heap[0].priority <= Priority.DEMAND:
            return True
        return self._busy_other < self.threads - self._urgent_only

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._runnable():
                    if self._closed and not self._heap:
                        return
                    self._cv.wait()
                job = heapq.heappop(self._heap)
                job.gone = True  # taken: no urgency moves it now
                other = job.priority > Priority.DEMAND
                if other:
                    self._busy_other += 1
            # An Urgency lists the jobs it submitted for as long as it lives (a move's, for
            # the whole move, and a finished one's until a callback of its claim runs): a
            # job lets go of what it holds (a batch and its buffers, views of a tier's
            # memory) before its caller hears that it ran, or a stop right after a flush
            # found the L1 arena still in use; and of its future, which holds the result
            # (a copy group's staging buffers) once the caller is done with it.
            fn, args, future = job.fn, job.args, job.future
            job.fn, job.args, job.future = _ran, (), _HANDED
            try:
                if not future.set_running_or_notify_cancel():
                    del fn, args
                else:
                    try:
                        result = fn(*args)
                    except BaseException as e:
                        del fn, args
                        _drop_locals(e)
                        future.set_exception(e)
                    else:
                        del fn, args
                        future.set_result(result)
                        del result
            finally:
                del job, future
                with self._cv:
                    if other:
                        self._busy_other -= 1
                    self._cv.notify_all()
