"""The priority executor: the most urgent job first, and threads held for demand work."""

from __future__ import annotations

import contextvars
import threading
import time
import weakref
from concurrent.futures import Future

import pytest

from kvtier.tiers.base import Priority
from kvtier.tiers.executor import PriorityExecutor, Urgency


def _hold_the_thread(pool: PriorityExecutor, gate: threading.Event) -> Future[bool]:
    """A background job that holds the pool's one thread until ``gate``; returns once it
    runs, so that every job submitted after it queues (had the thread not taken it yet, it
    would pop whichever job was most urgent at that moment: the order under test)."""
    running = threading.Event()

    def hold() -> bool:
        running.set()
        return gate.wait(10)

    blocker = pool.submit(Priority.BACKGROUND, hold)
    assert running.wait(5)
    return blocker


def test_queued_jobs_run_most_urgent_first():
    pool = PriorityExecutor(1, "t", reserved=0)
    gate = threading.Event()
    order: list[str] = []
    blocker = _hold_the_thread(pool, gate)
    jobs = [
        pool.submit(Priority.BACKGROUND, order.append, "background-1"),
        pool.submit(Priority.PREFETCH, order.append, "prefetch"),
        pool.submit(Priority.DEMAND, order.append, "demand"),
        pool.submit(Priority.BACKGROUND, order.append, "background-2"),
    ]
    gate.set()
    for j in [blocker, *jobs]:
        j.result(5)
    assert order == ["demand", "prefetch", "background-1", "background-2"]
    pool.shutdown()


def test_a_demand_job_never_waits_for_background_jobs_to_free_a_thread():
    """Regression: demand reads and background writes shared one pool, so a read could
    queue behind writes that held every thread."""
    pool = PriorityExecutor(3, "t", reserved=1)
    gate = threading.Event()
    started = threading.Semaphore(0)

    def slow() -> None:
        started.release()
        gate.wait(10)

    background = [pool.submit(Priority.BACKGROUND, slow) for _ in range(5)]
    for _ in range(2):  # two of three threads take background work...
        assert started.acquire(timeout=5)
    assert not started.acquire(timeout=0.2)  # ...and the third is held back for demand
    t0 = time.monotonic()
    assert pool.submit(Priority.DEMAND, lambda: "read").result(5) == "read"
    assert time.monotonic() - t0 < 5
    gate.set()
    for f in background:
        f.result(5)
    pool.shutdown()


def test_exceptions_reach_the_caller_and_the_pool_carries_on():
    pool = PriorityExecutor(2, "t")

    def boom() -> None:
        raise OSError("EIO")

    with pytest.raises(OSError, match="EIO"):
        pool.submit(Priority.DEMAND, boom).result(5)
    assert pool.submit(Priority.BACKGROUND, lambda: 7).result(5) == 7
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(Priority.DEMAND, lambda: 1)


def test_within_a_class_a_higher_rank_goes_first_and_never_crosses_a_class():
    """A prefetch's rank orders it among the queued prefetches (higher first, equal ranks in
    submission order); the extremes of int32 still leave a demand job ahead of every
    prefetch and a background job behind them."""
    pool = PriorityExecutor(1, "t", reserved=0)
    gate = threading.Event()
    order: list[str] = []
    blocker = _hold_the_thread(pool, gate)
    jobs = [
        pool.submit(Priority.PREFETCH, order.append, "prefetch 0", rank=0),
        pool.submit(Priority.BACKGROUND, order.append, "background", rank=2**31 - 1),
        pool.submit(Priority.PREFETCH, order.append, "prefetch 5", rank=5),
        pool.submit(Priority.PREFETCH, order.append, "prefetch -3", rank=-3),
        pool.submit(Priority.PREFETCH, order.append, "prefetch 0 again"),
        pool.submit(Priority.DEMAND, order.append, "demand", rank=-(2**31)),
        pool.submit(Priority.PREFETCH, order.append, "prefetch max", rank=2**31 - 1),
        pool.submit(Priority.PREFETCH, order.append, "prefetch min", rank=-(2**31)),
    ]
    gate.set()
    for j in [blocker, *jobs]:
        j.result(5)
    assert order == [
        "demand",
        "prefetch max",
        "prefetch 5",
        "prefetch 0",
        "prefetch 0 again",
        "prefetch -3",
        "prefetch min",
        "background",
    ]
    pool.shutdown()


def test_a_raised_urgency_moves_its_queued_jobs_up_and_its_later_ones_start_there():
    """A move's jobs follow its urgency: raised to DEMAND while one of them waits behind
    prefetches of a higher rank, that job runs next, on the thread held for demand work;
    a job of the move submitted afterwards queues as DEMAND too; jobs of other moves keep
    their places, and the replaced entry is not counted as queued."""
    pool = PriorityExecutor(2, "t", reserved=1)
    gate = threading.Event()
    order: list[str] = []
    running = threading.Event()

    def hold() -> bool:
        running.set()
        return gate.wait(10)

    blocker = pool.submit(Priority.PREFETCH, hold)  # the one thread for non-demand work
    assert running.wait(5)
    move = Urgency(Priority.PREFETCH, -5)
    low = pool.submit(Priority.PREFETCH, order.append, "low", rank=-5, urgency=move)
    high = [pool.submit(Priority.PREFETCH, order.append, f"high {i}", rank=10) for i in range(3)]
    assert pool.queued == 4
    move.raise_to(Priority.DEMAND)
    low.result(5)  # on the demand thread, the non-demand one still held
    assert order == ["low"]
    assert pool.queued == 3
    move.raise_to(Priority.PREFETCH, 99)  # less urgent than it stands: no change
    assert move.now() == (Priority.DEMAND, 0)
    later = pool.submit(Priority.PREFETCH, order.append, "later", urgency=move)
    later.result(5)
    assert order == ["low", "later"]
    gate.set()
    for f in [blocker, *high]:
        f.result(5)
    assert order == ["low", "later", "high 0", "high 1", "high 2"]
    assert pool.queued == 0
    pool.shutdown()


def test_raising_an_urgency_only_ever_moves_a_job_up_and_never_reruns_one():
    """A job already running or done is left alone; a raise within the job's own class
    reorders it among the waiting ones by rank; every job runs once."""
    pool = PriorityExecutor(1, "t", reserved=0)
    gate = threading.Event()
    order: list[str] = []
    blocker = _hold_the_thread(pool, gate)
    done = Urgency(Priority.PREFETCH)
    first = pool.submit(Priority.PREFETCH, order.append, "first", rank=3, urgency=done)
    move = Urgency(Priority.PREFETCH)
    mine = pool.submit(Priority.PREFETCH, order.append, "mine", urgency=move)
    other = pool.submit(Priority.PREFETCH, order.append, "other", rank=5)
    background = pool.submit(Priority.BACKGROUND, order.append, "background", urgency=move)
    move.raise_to(Priority.PREFETCH, 7)  # mine and the background job: to prefetch 7
    gate.set()
    for f in [blocker, first, mine, other, background]:
        f.result(5)
    done.raise_to(Priority.DEMAND)  # its job ran: nothing to move, nothing run again
    assert order == ["mine", "background", "other", "first"]
    assert pool.queued == 0
    pool.shutdown()


def test_regression_an_urgency_kept_what_its_jobs_held_after_they_ran():
    """An Urgency lists its jobs while it lives; a job that ran, and the entry a raise left
    behind, hold nothing of their arguments once the caller hears that the job ran: they
    held a copy's batch, views of the L1 arena, until the Urgency went a loop turn after
    its move (a stop right after a flush awaited without that turn found the arena still
    in use)."""

    class Batch:
        pass

    pool = PriorityExecutor(1, "t", reserved=0)
    gate = threading.Event()
    blocker = _hold_the_thread(pool, gate)
    move = Urgency(Priority.BACKGROUND)
    batches = [Batch(), Batch()]
    alive = [weakref.ref(b) for b in batches]
    jobs = [pool.submit(Priority.BACKGROUND, id, b, urgency=move) for b in batches]
    move.raise_to(Priority.PREFETCH)  # both entries replaced while they wait
    del batches
    gate.set()
    for f in [blocker, *jobs]:
        f.result(5)
    assert [ref() for ref in alive] == [None, None]
    pool.shutdown()


def test_regression_an_urgency_kept_what_a_job_that_raised_held():
    """A job that raised hands its caller the exception, whose traceback held the job's
    frames and in them its arguments (a copy's batch, views of the L1 arena) for as long as
    the Urgency that lists the job lived. The exception still reaches the caller, with its
    traceback, but its frames hold nothing."""

    class Batch:
        pass

    def copy(batch: Batch) -> None:
        raise OSError("the copy failed")

    pool = PriorityExecutor(1, "t", reserved=0)
    move = Urgency(Priority.BACKGROUND)
    batch = Batch()
    alive = weakref.ref(batch)
    job = pool.submit(Priority.BACKGROUND, copy, batch, urgency=move)
    del batch
    with pytest.raises(OSError, match="the copy failed") as raised:
        job.result(5)
    assert raised.value.__traceback__ is not None
    assert alive() is None
    pool.shutdown()


def test_regression_an_urgency_kept_a_job_s_result_after_its_caller_had_it():
    """An Urgency lists its jobs while it lives (a move's, for the whole move), and each
    listed job kept its future and so its result: on a GPU host the page-locked staging
    buffers ``bridge.host_buffers`` made for one copy group lived until the move's last
    group was done. Once the caller has the result and lets it go, nothing keeps it."""

    class Buffers:
        pass

    pool = PriorityExecutor(1, "t", reserved=0)
    move = Urgency(Priority.PREFETCH)
    job = pool.submit(Priority.PREFETCH, Buffers, urgency=move)
    alive = weakref.ref(job.result(5))
    del job
    # The worker holds the future until its job's bookkeeping ends, a few bytecodes after
    # the caller wakes: once the thread has run the next job, it holds nothing of this one.
    pool.submit(Priority.PREFETCH, int).result(5)
    assert alive() is None
    move.raise_to(Priority.DEMAND)  # the move goes on, listing the job that ran
    pool.shutdown()


def test_regression_a_raised_job_s_old_entry_kept_its_result_while_it_waited_in_the_heap():
    """A raised urgency queues a job again, at its new place, and leaves the old entry in
    the heap (marked gone) until it reaches the top. That entry let go of the callable and
    its arguments but kept the future, and so the result once the job had run at its new
    place: behind a job that could not run yet, the result (a copy group's staging
    buffers) outlived its caller's use of it."""

    class Buffers:
        pass

    pool = PriorityExecutor(2, "t", reserved=1)  # one thread for non-demand jobs
    gate = threading.Event()
    blocker = _hold_the_thread(pool, gate)
    ahead = pool.submit(Priority.PREFETCH, int)  # waits: the non-demand thread is taken
    move = Urgency(Priority.BACKGROUND)
    job = pool.submit(Priority.BACKGROUND, Buffers, urgency=move)
    move.raise_to(Priority.DEMAND)  # runs on the demand thread; its old entry stays queued
    alive = weakref.ref(job.result(5))
    del job
    pool.submit(Priority.DEMAND, int).result(5)  # the same thread is done with the job
    assert alive() is None
    gate.set()
    for f in (blocker, ahead):
        f.result(5)
    pool.shutdown()


def test_regression_a_job_ran_without_the_context_it_was_submitted_in():
    """Regression: the workers ran a job in their own thread's context, so a disk run that a
    request's read or write split off (several runs, or one over 1 MiB) logged its lines
    (an L2 fault) without the request's ids, which the move's own thread carries. A job now
    sees the context variables of its submitter, and nothing of an earlier job's."""
    ids: contextvars.ContextVar[str] = contextvars.ContextVar("ids", default="")
    pool = PriorityExecutor(1, "t")
    try:

        def submitted_as(value: str) -> Future[str]:
            token = ids.set(value)
            try:
                return pool.submit(Priority.DEMAND, ids.get)
            finally:
                ids.reset(token)

        assert [submitted_as(v).result(timeout=10) for v in ("req-a", "req-b")] == [
            "req-a",
            "req-b",
        ]
        assert pool.submit(Priority.DEMAND, ids.get).result(timeout=10) == ""
        # A job's own changes stay in it: the next job on that worker does not see them.
        pool.submit(Priority.DEMAND, ids.set, "set-in-a-job").result(timeout=10)
        assert pool.submit(Priority.DEMAND, ids.get).result(timeout=10) == ""
    finally:
        pool.shutdown()
