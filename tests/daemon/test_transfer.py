"""The transfer engine's scheduling rules: de-duplication, deadlines, bandwidth limits."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.daemon.stack import TokenBucket
from kvtier.daemon.stats import Counters
from kvtier.daemon.transfer import PrefetchExpired, TransferEngine
from kvtier.tiers.base import Priority, TierKind


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_block_moving_into_a_tier_is_moved_once():
    engine = TransferEngine(Counters())
    try:
        mine, waits = engine.claim([1, 2, 3], TierKind.HOST)
        assert (mine, waits) == ([0, 1, 2], [])
        again, waits = engine.claim([2, 4, 3], TierKind.HOST)
        assert again == [1] and len(waits) == 1  # one wait for the one claim holding 2 and 3
        other, _ = engine.claim([2], TierKind.DISK)  # another destination is another move
        assert other == [0]
        assert not waits[0].done()
        engine.settle([1, 2, 3], TierKind.HOST)
        assert await waits[0] is True  # settled (the waiter reads the table for the outcome)
        assert not engine.moving(2, TierKind.HOST) and engine.moving(2, TierKind.DISK)
        assert engine.moving(4, TierKind.HOST)
    finally:
        engine.close()


async def test_a_regrouped_claims_blocks_are_woken_by_their_own_group():
    engine = TransferEngine(Counters())
    try:
        engine.claim([1, 2, 3, 4], TierKind.HOST)
        _, early = engine.claim([4], TierKind.HOST)  # took the claim's own future
        engine.regroup([1, 2], TierKind.HOST)
        engine.regroup([3], TierKind.HOST)
        _, first = engine.claim([1], TierKind.HOST)
        _, second = engine.claim([3], TierKind.HOST)
        _, rest = engine.claim([4], TierKind.HOST)  # in no group: the claim's future
        assert rest == early
        engine.wake([1, 2], TierKind.HOST)  # the first group ends
        await asyncio.sleep(0)
        assert first[0].done() and not second[0].done()
        assert early[0].done()  # woken early by the first group: it rereads the table
        # Still the claim's until it ends: a newcomer waits (not at all), never moves it.
        assert engine.moving(1, TierKind.HOST)
        mine, again = engine.claim([1], TierKind.HOST)
        assert mine == [] and again == first
        engine.settle([1, 2, 3, 4], TierKind.HOST)  # the claim ends
        assert second[0].done() and engine.in_flight(TierKind.HOST) == 0
    finally:
        engine.close()


async def test_a_prefetch_past_its_deadline_is_dropped_before_it_runs():
    clock = Clock()
    counters = Counters()
    engine = TransferEngine(counters, clock=clock)
    try:
        ran: list[int] = []
        clock.now = 101.0
        with pytest.raises(PrefetchExpired):
            await engine._run(Priority.PREFETCH, ran.append, 1, deadline=100.5)
        assert ran == [] and counters.get("prefetch_expired") == 1
        await engine._run(Priority.PREFETCH, ran.append, 2, deadline=200.0)
        assert ran == [2]
    finally:
        engine.close()


def test_token_bucket_spaces_transfers_to_the_rate():
    clock = Clock()
    bucket = TokenBucket(1000, clock)
    assert bucket.delay_for(1000) == 0.0  # a second's burst
    assert bucket.delay_for(500) == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.delay_for(500) == pytest.approx(0.5)
    assert TokenBucket(0, clock).delay_for(10**12) == 0.0


async def test_a_limited_direction_waits_and_counts_the_wait():
    counters = Counters()
    engine = TransferEngine(counters)
    try:
        unlimited = TokenBucket(0)
        bucket = TokenBucket(1 << 20)  # 1 MiB/s, 1 MiB burst
        await engine._throttle(unlimited, bucket, 1 << 20, "L1->L2", Priority.BACKGROUND, None)
        t0 = asyncio.get_running_loop().time()
        await engine._throttle(bucket, unlimited, 1 << 18, "L1->L2", Priority.BACKGROUND, None)
        assert asyncio.get_running_loop().time() - t0 >= 0.2
        assert counters.get("throttled_ms", direction="L1->L2") >= 200
    finally:
        engine.close()


async def test_a_copy_whose_turn_comes_after_its_deadline_is_dropped_without_waiting():
    """The flush at stop (tiers.l2.flush_timeout_s) and prefetches pass a deadline: a copy
    the rate limit would start past it expires at once, instead of sleeping until its turn
    only to be dropped (which made a throttled flush outlast any timeout). Its bytes stay
    taken: a smaller copy after it expires too rather than slipping into its room."""
    clock = Clock()
    counters = Counters()
    engine = TransferEngine(counters, clock=clock)
    try:
        reads, writes = TokenBucket(0, clock), TokenBucket(1 << 20, clock)
        await engine._throttle(reads, writes, 1 << 20, "L1->L2", Priority.BACKGROUND, None)
        for priority in (Priority.BACKGROUND, Priority.PREFETCH):
            with pytest.raises(PrefetchExpired):  # its turn: in 4 s; its deadline: in 1 s
                await engine._throttle(
                    reads, writes, 4 << 20, "L1->L2", priority, deadline=clock.now + 1
                )
        # Neither waited (a wait is counted as it starts); only the prefetch counts as an
        # expired prefetch.
        assert counters.get("prefetch_expired") == 1
        assert counters.get("throttled_ms", direction="L1->L2") == 0
        with pytest.raises(PrefetchExpired):  # 256 KiB would have fitted before the 4 MiB
            await engine._throttle(
                reads, writes, 1 << 18, "L1->L2", Priority.BACKGROUND, deadline=clock.now + 1
            )
    finally:
        engine.close()


async def test_gpu_pages_without_a_gpu_tier_are_refused_not_touched():
    """Registration refuses GPU pools where no tier can reach GPU memory; if one ever
    reached the engine, the copy must be an error, not a host copy of device pointers."""
    import numpy as np
    from kv_pools import make_pool

    from kvtier.daemon.config import Config
    from kvtier.daemon.errors import FailedPrecondition
    from kvtier.daemon.stack import build_stack
    from kvtier.kernels.runs import SegmentMap
    from kvtier.tiers.base import BlockRef, DevicePages
    from kvtier.tiers.host import HostArena

    stack = build_stack(Config(), [HostArena(1 << 20, 1 << 20)])
    assert stack.device is None
    engine = TransferEngine(Counters(), device=stack.device)
    pool = make_pool("vllm", layers=1, pages=2)
    smap = SegmentMap.build(pool.layout, pool.buffers)
    pages = DevicePages(smap, pool.segments, np.zeros(1, dtype=np.int64))
    try:
        with pytest.raises(FailedPrecondition, match=r"tiers\.l0\.enabled"):
            await engine.from_pool(stack.top, [0], [BlockRef(0, bytes(32))], 4096, pages)
        with pytest.raises(FailedPrecondition, match=r"tiers\.l0\.enabled"):
            await engine.to_pool(stack.top, [0], [BlockRef(0, bytes(32))], 4096, [0], pages)
    finally:
        engine.close()
        stack.close()


async def test_a_cancelled_transfer_ends_only_when_its_running_job_does():
    """A put cancelled while its copy job ran (the daemon stopping) gave its slots back at
    once, while the worker thread still copied into them from the engine's pool. Now the
    cancelled caller waits for a job that already runs (through further cancels), and a job
    that had not started never runs."""
    import threading

    engine = TransferEngine(Counters())
    try:
        started, release = threading.Event(), threading.Event()
        ran: list[str] = []

        def copy() -> None:
            started.set()
            release.wait(10)
            ran.append("copy")

        call = asyncio.ensure_future(engine.run(Priority.DEMAND, copy))
        while not started.is_set():
            await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.sleep(0.05)
        assert not call.done()  # still waiting for the thread
        call.cancel()  # a second cancel changes nothing
        await asyncio.sleep(0.05)
        assert not call.done() and ran == []
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert ran == ["copy"]
    finally:
        engine.close()
