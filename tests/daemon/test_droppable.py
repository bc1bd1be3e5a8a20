"""unchanged_wait: a request waiting where it has changed nothing is droppable there only."""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from kvtier.daemon.droppable import droppable, unchanged_wait
from kvtier.daemon.eager import eager_future
from kvtier.daemon.server import KVTierServicer
from kvtier.daemon.store import DeleteResult
from kvtier.proto import kvtier_pb2 as pb


def _start(
    handler: Callable[[], Coroutine[Any, Any, Any]],
) -> tuple[Coroutine[Any, Any, Any], asyncio.Future]:
    """Start ``handler`` as ``server._rpc`` starts a request: eagerly."""
    coro = handler()
    return coro, eager_future(coro)


async def _passes(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_request_is_droppable_only_while_it_waits_where_it_changed_nothing():
    gate, changed, later = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler() -> str:
        await unchanged_wait(gate.wait())  # before its first suspension: on the caller's stack
        changed.set()
        await later.wait()  # a wait after a change: the request runs to its end
        return "done"

    coro, work = _start(handler)
    assert droppable(coro)
    gate.set()
    await changed.wait()
    assert not droppable(coro)
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

    coro, work = _start(handler)
    assert not droppable(coro)
    await waiting.wait()
    assert droppable(coro)
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    assert work.cancelled() and steps == []
    assert not droppable(coro)


async def test_a_request_started_on_the_stack_of_another_eager_start_is_droppable():
    """``_rpc`` itself starts eagerly for a request of 16 KiB or more (its turn's step): the
    wait before the first suspension runs in the task that took up the call, and the cancel
    reaches ``_rpc`` in a task of its own."""
    gate = asyncio.Event()
    asked: list[bool] = []
    started: list[asyncio.Future] = []

    async def rpc() -> None:
        coro, work = _start(lambda: unchanged_wait(gate.wait()))
        started.append(work)
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            asked.append(droppable(coro))
            work.cancel()
            raise

    outer = eager_future(rpc())
    assert isinstance(outer, asyncio.Task)
    outer.cancel()  # at once: the wait is the request's from its start
    await asyncio.gather(outer, return_exceptions=True)
    assert asked == [True]
    await asyncio.gather(*started, return_exceptions=True)
    assert started[0].cancelled()


async def test_a_wait_in_a_task_the_request_started_does_not_make_it_droppable():
    gate, own = asyncio.Event(), asyncio.Event()
    spawned: list[asyncio.Future] = []

    async def handler() -> None:
        # Each runs in a copy of the request's context; the eager one on its stack at first.
        spawned.append(asyncio.ensure_future(unchanged_wait(gate.wait())))
        spawned.append(eager_future(unchanged_wait(gate.wait())))
        await own.wait()

    coro, work = _start(handler)
    await _passes()  # the spawned tasks wait now
    assert not any(task.done() for task in spawned)
    assert not droppable(coro)
    gate.set()
    own.set()
    await asyncio.gather(work, *spawned)


async def test_a_wait_that_does_not_suspend_leaves_the_request_as_it_was():
    """A Delete once recovery has ended: no suspension, nothing left recorded."""
    done = asyncio.Event()
    done.set()
    coro, work = _start(lambda: unchanged_wait(done.wait()))
    assert work.done() and work.result() is True and not droppable(coro)


async def test_outside_a_request_it_is_a_plain_await():
    assert await unchanged_wait(asyncio.sleep(0, "slept")) == "slept"


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        raise grpc.aio.AbortError()


def test_regression_a_wait_in_a_task_a_request_started_eagerly_dropped_the_request():
    """A request that started a task eagerly (``eager_future``, as ``store.delete`` starts its
    removal from the shared tiers) was dropped for that task's ``unchanged_wait``: the wait
    ran on the request's stack, was recorded as the request's own, and the request, which had
    changed state meanwhile, was cancelled halfway as its client left. It runs to its end."""
    gate, later = asyncio.Event(), asyncio.Event()
    steps: list[str] = []

    class Service:
        def __init__(self) -> None:
            self.counters: Counter[str] = Counter()

        async def delete(self, *args: object) -> DeleteResult:
            spawned = eager_future(unchanged_wait(gate.wait()))
            steps.append("changed")
            await later.wait()
            steps.append("ended")
            await spawned
            return DeleteResult(deleted=1, missing=0, busy=0)

    service = Service()
    servicer = KVTierServicer(service, 10)  # type: ignore[arg-type]

    async def run() -> None:
        call = asyncio.ensure_future(servicer.Delete(pb.DeleteRequest(), _Context()))
        await _passes()
        assert steps == ["changed"]
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert service.counters["requests_dropped"] == 0
        assert service.counters["requests_detached"] == 1
        later.set()
        gate.set()
        await asyncio.wait_for(asyncio.gather(*servicer.detached), 5)
        assert steps == ["changed", "ended"]

    asyncio.run(run())


def test_regression_every_request_set_a_context_variable_only_a_delete_in_recovery_used():
    """Every request made a mark object and set a context variable for it (``_rpc``), some
    6,000 instructions a call, 1-2% of a one-key Lookup's in the daemon, for the few Deletes
    that wait for L2's recovery. A request's handler runs in its caller's context unchanged."""
    seen: list[contextvars.Context] = []

    class Service:
        counters: Counter[str] = Counter()

        async def delete(self, *args: object) -> DeleteResult:
            seen.append(contextvars.copy_context())
            return DeleteResult(deleted=0, missing=1, busy=0)

    servicer = KVTierServicer(Service(), 10)  # type: ignore[arg-type]

    async def run() -> None:
        caller = contextvars.copy_context()
        await servicer.Delete(pb.DeleteRequest(), _Context())
        assert dict(seen[0]) == dict(caller)

    asyncio.run(run())
