"""The request ids bound for log lines (daemon/logs.py) around streaming handlers."""

from __future__ import annotations

import asyncio
import gc
import logging

from kvtier.daemon import logs


async def _stream():
    with logs.request_context("r1", "s1", 7):
        while True:
            yield logs.current_request_id()


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
        assert logs.current_request_id() == ""  # nothing leaked into this context

    asyncio.run(main())
    assert errors == []


def test_the_daemons_own_request_id_is_written_in_hex_only_when_a_line_is_logged():
    """A request's id is bound as the daemon's number (formatting 12 hex digits for every
    request cost more than binding its ids); a record shows it as those digits, and a
    client's id as sent."""
    record = logging.makeLogRecord({"msg": "m"})
    with logs.request_context(0x2A, "s1", 7):
        logs.RequestContextFilter().filter(record)
    assert (record.request_id, record.session_id, record.pool_id) == ("00000000002a", "s1", 7)
    with logs.request_context("client-id.1"):
        logs.RequestContextFilter().filter(record)
    assert (record.request_id, record.session_id, record.pool_id) == ("client-id.1", "", 0)
    logs.RequestContextFilter().filter(record)
    assert (record.request_id, record.session_id, record.pool_id) == ("", "", 0)
