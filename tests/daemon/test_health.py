"""The health service's state (daemon/health.py): watchers hear each change, and one that
cannot be written to holds up no change and no other watcher."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from kvtier.daemon.health import NOT_SERVING, SERVICE_UNKNOWN, SERVING, HealthService


class Recorder:
    """A watch's context that keeps what is written; ``stuck``: writes never return (a
    client that grants no flow-control window)."""

    def __init__(self, stuck: bool = False) -> None:
        self.stuck = stuck
        self.seen: list[int] = []

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        self.seen.append(message.status)
        if self.stuck:
            await asyncio.Event().wait()


def test_watchers_hear_each_change_and_a_stuck_one_holds_up_nothing():
    async def run() -> None:
        health = HealthService()
        stuck, live, other = Recorder(stuck=True), Recorder(), Recorder()
        watches = [
            asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(service=s), c))
            for s, c in (("", stuck), ("", live), ("other", other))
        ]
        await asyncio.sleep(0)
        health.set("", NOT_SERVING)  # returns at once, the stuck write pending
        await asyncio.sleep(0)
        health.set("", SERVING)
        await asyncio.sleep(0)
        health.enter_graceful_shutdown()
        health.set("", SERVING)  # ignored from now on
        await asyncio.sleep(0)
        assert stuck.seen == [SERVING]
        assert live.seen == [SERVING, NOT_SERVING, SERVING, NOT_SERVING]
        assert other.seen == [SERVICE_UNKNOWN]
        for watch in watches:
            assert not watch.done()
            watch.cancel()
        await asyncio.gather(*watches, return_exceptions=True)

    asyncio.run(run())


def test_a_change_during_a_write_is_answered_after_it():
    async def run() -> None:
        health = HealthService()

        class Slow(Recorder):
            async def write(self, message: health_pb2.HealthCheckResponse) -> None:
                self.seen.append(message.status)
                if len(self.seen) == 1:
                    health.set("", NOT_SERVING)  # while the first answer is being written

        slow = Slow()
        watch = asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(), slow))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert slow.seen == [SERVING, NOT_SERVING]
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(run())
