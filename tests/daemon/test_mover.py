from __future__ import annotations

import asyncio

import pytest

from kvtier.daemon.mover import Mover, PrefetchExpired, Priority, TokenBucket


def test_priorities_order_demand_before_prefetch_before_background():
    async def scenario() -> list[str]:
        mover = Mover(workers=1)
        order: list[str] = []
        gate = asyncio.Event()

        async def blocker() -> None:
            await gate.wait()

        def job(name: str):
            async def run() -> str:
                order.append(name)
                return name

            return run

        mover.start()
        first = mover.submit(Priority.BACKGROUND, "x", 0, blocker)
        await asyncio.sleep(0)  # the worker takes the blocker
        futures = [
            mover.submit(Priority.BACKGROUND, "x", 0, job("demote")),
            mover.submit(Priority.PREFETCH, "x", 0, job("prefetch-low"), engine_priority=1),
            mover.submit(Priority.PREFETCH, "x", 0, job("prefetch-high"), engine_priority=5),
            mover.submit(Priority.DEMAND, "x", 0, job("demand")),
        ]
        gate.set()
        await first
        assert await asyncio.gather(*futures) == [
            "demote",
            "prefetch-low",
            "prefetch-high",
            "demand",
        ]
        await mover.stop()
        return order

    assert asyncio.run(scenario()) == ["demand", "prefetch-high", "prefetch-low", "demote"]


def test_a_failed_transfer_is_counted_and_the_mover_carries_on():
    async def scenario() -> None:
        mover = Mover(workers=1)
        mover.start()

        async def boom() -> None:
            raise OSError("disk on fire")

        async def fine() -> int:
            return 7

        bad = mover.submit(Priority.DEMAND, "l2_read", 10, boom)
        good = mover.submit(Priority.DEMAND, "l2_read", 10, fine)
        with pytest.raises(OSError, match="fire"):
            await bad
        assert await good == 7
        assert mover.counters["l2_read_failures"] == 1
        assert mover.counters["l2_read_transfers"] == 1
        await mover.stop()

    asyncio.run(scenario())


def test_a_prefetch_past_its_deadline_is_dropped():
    async def scenario() -> None:
        now = [0.0]
        mover = Mover(workers=1, clock=lambda: now[0])
        ran = []

        async def run() -> None:
            ran.append(1)

        fut = mover.submit(Priority.PREFETCH, "l2_read", 1, run, deadline=5.0)
        now[0] = 6.0
        mover.start()
        with pytest.raises(PrefetchExpired):
            await fut
        assert ran == [] and mover.counters["prefetch_expired"] == 1
        await mover.stop()

    asyncio.run(scenario())


def test_token_bucket_spaces_transfers_to_the_rate():
    now = [0.0]
    bucket = TokenBucket(100.0, clock=lambda: now[0])
    assert bucket.delay_for(100) == 0.0  # one second of burst
    assert bucket.delay_for(50) == pytest.approx(0.5)
    now[0] = 1.5
    assert bucket.delay_for(50) == 0.0
    assert TokenBucket(0).delay_for(10**12) == 0.0


def test_stop_cancels_what_is_still_queued():
    async def scenario() -> None:
        mover = Mover(workers=1)

        async def run() -> None:
            return None

        fut = mover.submit(Priority.BACKGROUND, "x", 0, run)
        await mover.stop()
        assert fut.cancelled()

    asyncio.run(scenario())
