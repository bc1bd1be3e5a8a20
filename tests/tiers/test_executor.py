"""The priority executor: the most urgent job first, and threads held for demand work."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from kvtier.tiers.base import Priority
from kvtier.tiers.executor import PriorityExecutor


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
