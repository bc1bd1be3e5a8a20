"""Worker threads that always take the most urgent job first.

Every byte a tier moves moves on one of these pools, so the mover's priorities hold all the way
down: a job waits in a heap ordered by ``(priority, -rank, submission order)``, and jobs that
are not DEMAND may occupy at most ``threads - reserved`` workers, so a read a request waits on
never queues behind background writes or removals that took every thread. The rank orders jobs
within one priority class only (a prefetch's ``priority`` from the engine: higher sooner, equal
ranks in submission order); no rank moves a job into or past another class.

Thread-safety: ``submit`` and ``shutdown`` may be called from any thread.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
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
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for w in self._workers:
            w.start()

    def submit(
        self, priority: int, fn: Callable[..., Any], *args: Any, rank: int = 0
    ) -> Future[Any]:
        """Queue ``fn(*args)`` at ``priority`` (a ``Priority`` class), and within the class at
        ``rank`` (higher sooner; equal ranks in submission order)."""
        future: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("executor is shut down")
            job = _Job(int(priority), -rank, next(self._seq), fn, args, future)
            heapq.heappush(self._heap, job)
            self._cv.notify()
        return future

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._heap)

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the workers."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if wait:
            for w in self._workers:
                w.join()

    def _runnable(self) -> bool:
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
                other = job.priority > Priority.DEMAND
                if other:
                    self._busy_other += 1
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(job.fn(*job.args))
                    except BaseException as e:
                        job.future.set_exception(e)
            finally:
                del job
                with self._cv:
                    if other:
                        self._busy_other -= 1
                    self._cv.notify_all()
