"""The request ids bound for log lines (daemon/logs.py) around streaming handlers."""

from __future__ import annotations

import asyncio
import gc

from kvtier.daemon import logs


async def _stream():
    with logs.request_context("r1", "s1", 7):
        while True:
            yield logs.request_id.get()


def test_regression_a_session_stream_closed_by_the_finalizer_logged_a_traceback():
    """Found by the soak: when a client ended its session, asyncio's async-generator
    finalizer sometimes closed the OpenSession stream's generator in a task of its own, whose
    context had never bound the ids; resetting them raised ValueError there, logged as "Task
    exception was never retrieved" with a traceback."""
    errors: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))

        async def consume() -> None:
            gen = _stream()
            assert await gen.__anext__() == "r1"
            # Dropped unclosed, as gRPC drops a cancelled stream's generator.

        await asyncio.create_task(consume())
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)
        assert logs.request_id.get() == ""  # nothing leaked into this context

    asyncio.run(main())
    assert errors == []
