"""eager_future: a coroutine runs at once, and goes on in a task only if it suspends."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from kvtier.daemon.eager import eager_future

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="")


def test_a_coroutine_that_never_waits_is_done_before_the_call_returns():
    ran: list[str] = []

    async def work() -> int:
        ran.append("ran")
        return 7

    async def main() -> None:
        tasks_before = len(asyncio.all_tasks())
        fut = eager_future(work())
        assert ran == ["ran"] and fut.done() and fut.result() == 7
        assert not isinstance(fut, asyncio.Task)
        assert len(asyncio.all_tasks()) == tasks_before
        assert await asyncio.shield(fut) == 7

    asyncio.run(main())


def test_an_error_before_the_first_wait_is_the_futures_exception():
    async def work() -> None:
        raise ValueError("bad request")

    async def main() -> None:
        fut = eager_future(work())
        assert fut.done()
        with pytest.raises(ValueError, match="bad request"):
            await fut

    asyncio.run(main())


def test_a_cancel_raised_before_the_first_wait_cancels_the_future():
    async def work() -> None:
        raise asyncio.CancelledError

    async def main() -> None:
        fut = eager_future(work())
        assert fut.cancelled()

    asyncio.run(main())


def test_a_coroutine_that_waits_goes_on_in_a_task_from_where_it_stopped():
    steps: list[str] = []

    async def work(gate: asyncio.Future[str]) -> str:
        steps.append("before")
        got = await gate
        steps.append(f"after {got}")
        await asyncio.sleep(0)  # a bare yield
        steps.append(f"var={VAR.get()}")
        return got.upper()

    async def main() -> None:
        VAR.set("request-1")
        gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        fut = eager_future(work(gate))
        assert steps == ["before"] and isinstance(fut, asyncio.Task) and not fut.done()
        asyncio.get_running_loop().call_later(0.01, gate.set_result, "x")
        assert await fut == "X"
        assert steps == ["before", "after x", "var=request-1"]

    asyncio.run(main())


def test_the_waited_futures_exception_is_raised_inside_the_coroutine():
    async def work(gate: asyncio.Future[None]) -> str:
        try:
            await gate
        except KeyError:
            return "handled"
        return "not raised"

    async def main() -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut = eager_future(work(gate))
        gate.set_exception(KeyError("gone"))
        assert await fut == "handled"

    asyncio.run(main())


def test_a_shielded_eager_task_runs_to_its_end_when_its_caller_is_cancelled():
    async def main() -> None:
        done = asyncio.Event()
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def work() -> None:
            await gate
            done.set()

        async def caller() -> None:
            await asyncio.shield(eager_future(work()))

        call = asyncio.ensure_future(caller())
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gate.set_result(None)
        await asyncio.wait_for(done.wait(), 5)

    asyncio.run(main())


def test_cancelling_the_task_reaches_the_coroutine_where_it_waits():
    async def main() -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seen: list[str] = []

        async def work() -> None:
            try:
                await gate
            except asyncio.CancelledError:
                seen.append("cancelled at its wait")
                raise

        task = eager_future(work())
        task.cancel()  # before the task's first step
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled at its wait"]

        gate2: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def work2() -> None:
            await gate2

        task2 = eager_future(work2())
        await asyncio.sleep(0)  # the task now waits on gate2
        task2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task2
        assert gate2.cancelled()

    asyncio.run(main())


def test_a_context_variable_set_before_the_first_wait_is_the_coroutines_own():
    """As with a task: the coroutine runs in a copy of the caller's context from its first
    step, so a value it sets (and resets after a wait) never reaches the caller."""

    async def work(gate: asyncio.Future[None]) -> str:
        token = VAR.set("inside")
        await gate
        seen = VAR.get()
        VAR.reset(token)  # a token of the context the coroutine started in
        return seen

    async def main() -> None:
        VAR.set("caller")
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut = eager_future(work(gate))
        assert VAR.get() == "caller"
        gate.set_result(None)
        assert await fut == "inside"
        assert VAR.get() == "caller"

    asyncio.run(main())


def test_a_resumed_task_is_shown_by_its_coroutines_name_and_frame():
    async def request_handler(gate: asyncio.Future[None]) -> None:
        await gate

    async def main() -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = eager_future(request_handler(gate))
        assert "request_handler" in repr(task)
        assert [f.f_code.co_name for f in task.get_stack()] == ["request_handler"]
        gate.set_result(None)
        await task

    asyncio.run(main())
