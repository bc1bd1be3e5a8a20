"""Worker threads shared between keys (the pool registry's tenants) round robin.

A plain thread pool runs jobs in the order they came: one client that queues many slow jobs
(mapping a pool of a GiB, 32 times) holds every other client's job, however small, behind
all of them. Here each job belongs to a key:

- at most ``per_key`` jobs of one key run at once; with ``per_key`` below the number of
  threads, a key with many jobs queued leaves a thread to the others;
- a thread that comes free takes the oldest job of the next key in turn (round robin over
  the keys with jobs queued), not the oldest job: a job of another key waits for at most
  one job of each key ahead of it, never for a key's whole queue.

Jobs of one key run in the order they came, each in the context (``contextvars``) it was
submitted in: a request's log ids, whichever thread hands the job to a worker.

Thread-safety: ``submit`` may be called from any thread; the jobs run on the worker
threads, and so do the callbacks of their futures.
"""

from __future__ import annotations

import contextvars
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


class FairThreads:
    def __init__(self, threads: int, per_key: int, name: str) -> None:
        if not 1 <= per_key <= threads:
            raise ValueError(f"per_key must be within [1, {threads}], not {per_key}")
        self._threads = threads
        self._per_key = per_key
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        # The keys with jobs queued, in the order they are served next (a dict keeps it).
        self._queued: dict[str, deque[_Job]] = {}
        self._running: Counter[str] = Counter()
        self._busy = 0

    def submit(self, key: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a worker thread when ``key``'s turn comes."""
        future: Future[T] = Future()
        # Run in the submitter's context: a job is handed to a worker by whichever thread
        # frees one, often another key's job's.
        job: _Job = (future, contextvars.copy_context().run, (fn, *args))
        with self._lock:
            self._queued.setdefault(key, deque()).append(job)
            self._dispatch()
        return future

    def running(self, key: str) -> int:
        """Jobs of ``key`` running now."""
        with self._lock:
            return self._running[key]

    def shutdown(self) -> None:
        """End the threads once the jobs handed to them are done; jobs still queued fail
        (RuntimeError) when their turn comes."""
        self._executor.shutdown(wait=False)

    def _dispatch(self) -> None:
        """Hand jobs to free threads, round robin over the keys below their limit; under
        the lock."""
        while self._busy < self._threads:
            key = next((k for k in self._queued if self._running[k] < self._per_key), None)
            if key is None:
                return
            jobs = self._queued.pop(key)
            job = jobs.popleft()
            if jobs:
                self._queued[key] = jobs  # to the back of the turn
            self._running[key] += 1
            self._busy += 1
            try:
                self._executor.submit(self._run, key, job)
            except RuntimeError as e:  # shut down
                self._done(key)
                # A job cancelled while queued takes no exception (InvalidStateError).
                if job[0].set_running_or_notify_cancel():
                    job[0].set_exception(e)

    def _run(self, key: str, job: _Job) -> None:
        future, fn, args = job
        # The future completes once the thread is counted free again, so that whoever waits
        # on it sees the key's running count without this job.
        outcome: tuple[bool, Any] | None = None
        try:
            if future.set_running_or_notify_cancel():
                try:
                    outcome = (True, fn(*args))
                except BaseException as e:
                    outcome = (False, e)
        finally:
            try:
                with self._lock:
                    self._done(key)
                    self._dispatch()
            finally:  # whatever the dispatch raised, this job's waiter learns its outcome
                if outcome is not None:
                    if outcome[0]:
                        future.set_result(outcome[1])
                    else:
                        future.set_exception(outcome[1])

    def _done(self, key: str) -> None:
        self._busy -= 1
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]
