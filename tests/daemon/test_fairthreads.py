"""FairThreads: worker threads shared between keys round robin, a few per key at most.

Jobs wait on ``threading.Event``s the tests set, so "a key's jobs hold threads" is a state
the test controls, not a race it times.
"""

from __future__ import annotations

import contextvars
import threading

import pytest

from kvtier.daemon.fairthreads import FairThreads

WAIT_S = 20.0


def test_a_key_with_many_jobs_leaves_threads_to_the_others():
    """Key a queues six jobs that block; it runs at most ``per_key`` of them, so key b's
    job runs meanwhile on the thread left."""
    threads = FairThreads(3, 2, "test-fair")
    gate = threading.Event()
    try:
        blocked = [threads.submit("a", gate.wait, WAIT_S) for _ in range(6)]
        assert threads.submit("b", lambda: "b ran").result(WAIT_S) == "b ran"
        assert threads.running("a") == 2
        assert not any(job.done() for job in blocked)
    finally:
        gate.set()
    assert all(job.result(WAIT_S) for job in blocked)
    assert threads.running("a") == 0
    threads.shutdown()


def test_a_free_thread_takes_the_next_key_in_turn_not_the_oldest_job():
    """One thread: while a's first job runs, a queues two more, then b and c one each. A
    queue served in order would run a's three first; taking turns, b and c run after one
    more of a's, and a's jobs keep their order."""
    threads = FairThreads(1, 1, "test-fair")
    gate = threading.Event()
    ran: list[str] = []

    def job(name: str) -> None:
        if name == "a1":
            assert gate.wait(WAIT_S)
        ran.append(name)

    try:
        jobs = [threads.submit(name[0], job, name) for name in ("a1", "a2", "a3", "b1", "c1")]
    finally:
        gate.set()
    for done in jobs:
        done.result(WAIT_S)
    assert ran == ["a1", "a2", "b1", "c1", "a3"]
    threads.shutdown()


def test_a_failing_job_fails_its_future_and_frees_its_thread():
    threads = FairThreads(1, 1, "test-fair")

    def fail() -> None:
        raise OSError("no")

    with pytest.raises(OSError, match="no"):
        threads.submit("a", fail).result(WAIT_S)
    assert threads.submit("a", lambda: 1).result(WAIT_S) == 1
    threads.shutdown()


def test_jobs_still_queued_at_shutdown_fail_instead_of_waiting_forever():
    threads = FairThreads(1, 1, "test-fair")
    gate = threading.Event()
    running = threads.submit("a", gate.wait, WAIT_S)
    queued = threads.submit("b", lambda: 1)
    threads.shutdown()
    gate.set()
    assert running.result(WAIT_S)
    with pytest.raises(RuntimeError):
        queued.result(WAIT_S)


def test_per_key_must_fit_the_threads():
    with pytest.raises(ValueError):
        FairThreads(2, 3, "test-fair")


def test_a_job_cancelled_in_the_queue_at_shutdown_leaves_the_running_jobs_future_to_complete():
    """A job cancelled while queued (its asyncio waiter went away) cannot take the
    shutdown's RuntimeError; trying raised InvalidStateError out of the running job's
    thread before that job's future was completed, so the running job's waiter hung."""
    threads = FairThreads(1, 1, "test-fair")
    gate = threading.Event()
    running = threads.submit("a", gate.wait, WAIT_S)
    cancelled = threads.submit("b", lambda: 1)
    queued = threads.submit("c", lambda: 1)
    assert cancelled.cancel()
    threads.shutdown()
    gate.set()
    assert running.result(WAIT_S)
    with pytest.raises(RuntimeError):
        queued.result(WAIT_S)


def test_regression_a_job_ran_without_its_submitters_context():
    """Regression: jobs ran in their worker thread's context, so the lines a pool's mapping
    or unmapping logged there carried no request ids. A job now runs in the context it was
    submitted in, also when another key's finishing job hands it to the thread."""
    ids: contextvars.ContextVar[str] = contextvars.ContextVar("ids", default="")
    workers = FairThreads(1, 1, "t")
    try:
        release = threading.Event()

        def submitted_as(value: str, key: str, fn, *args):
            token = ids.set(value)
            try:
                return workers.submit(key, fn, *args)
            finally:
                ids.reset(token)

        def held() -> str:
            release.wait(10)
            return ids.get()

        first = submitted_as("req-a", "a", held)
        queued = submitted_as("req-b", "b", ids.get)  # waits for the one thread
        release.set()
        assert (first.result(timeout=10), queued.result(timeout=10)) == ("req-a", "req-b")
        assert workers.submit("c", ids.get).result(timeout=10) == ""
    finally:
        workers.shutdown()
