"""Start a coroutine at once and make it a task only if it has to wait.

A request handler that runs in a task of its own (so that a client's cancel cannot stop it
halfway, see ``server``) pays for the task even when it never waits: most single-block
requests copy inline and answer without suspending once, yet the task's steps took the event
loop through three more iterations for each (14 for a single-block Put, 11 without it).
``eager_future`` runs the coroutine on the caller's stack up to its first suspension, as
Python 3.12's eager task factory does for every task; only a coroutine that suspends goes on
in a task, which takes it up exactly where it stopped. As with a task, the coroutine runs in
a copy of the caller's context from its first step (a value it sets stays its own, and a token
it takes before a wait resets after it); unlike a task, ``asyncio.current_task()`` is the
caller's until the first wait, so ``asyncio.timeout`` and ``TaskGroup`` belong after it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")
_NOTHING: Any = object()


def eager_future(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """The outcome of ``coro`` as a future: already done when it finished without suspending
    (its result, its exception, or cancelled), else a task running the rest of it."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except StopIteration as stop:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(stop.value)
        return done
    except asyncio.CancelledError:
        done = loop.create_future()
        done.cancel()
        return done
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # Made in another frame: the exception's traceback holds this one, which must not
        # hold the future holding the exception (a cycle only a full collection frees, with
        # the request the handler's frames hold: up to server.max_message_bytes each).
        return _failed(loop, e)
    return loop.create_task(_Resumed(coro, yielded, context))


def _failed(loop: asyncio.AbstractEventLoop, error: BaseException) -> asyncio.Future[Any]:
    done = loop.create_future()
    done.set_exception(error)
    return done


class _Resumed(Coroutine[Any, Any, T]):
    """A coroutine that was started in ``context`` and stopped at ``yielded`` (the future it
    waits on, or None for a bare yield): to the task that drives it, its first step yields
    that again, and every later step goes to the coroutine itself, in that same context (a
    task's own context could only be given on Python 3.11 and later)."""

    __slots__ = ("_context", "_coro", "_pending")

    def __init__(
        self, coro: Coroutine[Any, Any, T], yielded: Any, context: contextvars.Context
    ) -> None:
        self._coro = coro
        self._pending = yielded
        self._context = context

    def send(self, value: Any) -> Any:
        if self._pending is not _NOTHING:
            pending, self._pending = self._pending, _NOTHING
            return pending
        return self._context.run(self._coro.send, value)

    def throw(self, *exc: Any) -> Any:  # type: ignore[override]
        # An exception before the first step (a cancel) reaches the coroutine where it waits.
        self._pending = _NOTHING
        return self._context.run(self._coro.throw, *exc)

    def close(self) -> None:
        self._pending = _NOTHING
        self._context.run(self._coro.close)

    # What asyncio shows of a task (its repr, get_stack) is the coroutine's own.
    @property
    def __name__(self) -> str:
        return self._coro.__qualname__  # type: ignore[attr-defined,no-any-return]

    @property
    def cr_code(self) -> Any:
        return self._coro.cr_code  # type: ignore[attr-defined]

    @property
    def cr_frame(self) -> Any:
        return self._coro.cr_frame  # type: ignore[attr-defined]

    @property
    def cr_running(self) -> bool:
        return bool(self._coro.cr_running)  # type: ignore[attr-defined]

    def __await__(self) -> Generator[Any, None, T]:
        raise TypeError("a resumed coroutine is driven by its task only")
