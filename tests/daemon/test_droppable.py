"""unchanged_wait: a request waiting where it has changed nothing is droppable there only."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from kvtier.daemon.droppable import Request, mark_request, unchanged_wait, unmark_request
from kvtier.daemon.eager import eager_future


def _start(handler: Callable[[], Coroutine[Any, Any, Any]]) -> tuple[Request, asyncio.Future]:
    """Start ``handler`` as ``server._rpc`` starts a request: marked, and eagerly."""
    mark, token = mark_request()
    try:
        work = eager_future(handler())
    finally:
        unmark_request(token)
    return mark, work


async def test_a_request_is_droppable_only_while_it_waits_where_it_changed_nothing():
    gate, changed, later = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler() -> str:
        await unchanged_wait(gate.wait())  # before its first suspension: on the caller's stack
        changed.set()
        await later.wait()  # a wait after a change: the request runs to its end
        return "done"

    mark, work = _start(handler)
    assert mark.droppable(work)
    gate.set()
    await changed.wait()
    assert not mark.droppable(work)
    later.set()
    assert await work == "done"


async def test_a_wait_after_the_first_suspension_is_droppable_and_the_drop_undoes_nothing():
    gate, waiting = asyncio.Event(), asyncio.Event()
    steps: list[str] = []

    async def handler() -> None:
        await asyncio.sleep(0)  # now in its own task
        waiting.set()
        await unchanged_wait(gate.wait())
        steps.append("changed")

    mark, work = _start(handler)
    assert not mark.droppable(work)
    await waiting.wait()
    assert mark.droppable(work)
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    assert work.cancelled() and steps == []


async def test_a_request_started_on_the_stack_of_another_eager_start_is_droppable():
    """``_rpc`` itself starts eagerly for a request of 16 KiB or more (its turn's step): the
    wait before the first suspension runs in the task that took up the call, and the cancel
    reaches ``_rpc`` in a task of its own."""
    gate = asyncio.Event()
    asked: list[bool] = []
    started: list[asyncio.Future] = []

    async def rpc() -> None:
        mark, work = _start(lambda: unchanged_wait(gate.wait()))
        started.append(work)
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            asked.append(mark.droppable(work))
            work.cancel()
            raise

    outer = eager_future(rpc())
    assert isinstance(outer, asyncio.Task)
    await asyncio.sleep(0)  # the rest of rpc runs in its task now
    outer.cancel()
    await asyncio.gather(outer, return_exceptions=True)
    assert asked == [True]
    await asyncio.gather(*started, return_exceptions=True)
    assert started[0].cancelled()


async def test_a_wait_in_a_task_the_request_started_does_not_make_it_droppable():
    gate, own = asyncio.Event(), asyncio.Event()
    spawned: list[asyncio.Task] = []

    async def handler() -> None:
        # The task runs in a copy of the request's context, which holds its mark.
        spawned.append(asyncio.ensure_future(unchanged_wait(gate.wait())))
        await own.wait()

    mark, work = _start(handler)
    assert len(spawned) == 1
    await asyncio.sleep(0)  # the spawned task waits now
    assert not spawned[0].done() and not mark.droppable(work)
    gate.set()
    own.set()
    await asyncio.gather(work, *spawned)


async def test_outside_a_request_it_is_a_plain_await():
    assert await unchanged_wait(asyncio.sleep(0, "slept")) == "slept"
