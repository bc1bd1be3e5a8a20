"""Waits at which a request has changed nothing yet, where its client's leaving drops it.

A request whose client cancels it (or whose deadline passes) runs to its end
(``server._rpc``), so that no step of it is left half done. One that is still waiting where it
has changed nothing (a Delete waiting for L2's recovery) has nothing to finish, and would hold
its request, for as long as that wait lasts, for an answer no one reads: any client could pile
up such requests by the thousand. ``_rpc`` gives each request a ``Request`` mark; the code that
waits at such a point awaits through ``unchanged_wait``, and ``_rpc`` cancels a request whose
client left while it waits there (``requests_dropped``) instead of letting it run.

Invariant: ``unchanged_wait`` is awaited only where neither the request nor anything it
started has changed any state yet, and nothing of it undoes anything as it unwinds: a cancel
there leaves the daemon as if the request had never come. Thread-safety: the event loop only.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class Request:
    """The mark of one request: the task it waits in at an ``unchanged_wait``, if it does.

    That task is the request's own (``work``, its future in ``_rpc``), or, where the wait
    came before the request's first suspension, the task that started the request
    (``owner``: ``eager_future`` runs a coroutine on its caller's stack until then, and
    ``_rpc`` itself may run on the stack of the task that took up the call). A task the
    request started, which runs in a copy of its context, is neither: its waits drop
    nothing."""

    __slots__ = ("_owner", "_waiting_in")

    def __init__(self, owner: asyncio.Task[Any] | None) -> None:
        self._owner = owner
        self._waiting_in: asyncio.Task[Any] | None = None

    def droppable(self, work: asyncio.Future[Any]) -> bool:
        """Whether the request, whose future is ``work``, waits where it has changed nothing
        (asked by ``_rpc`` as its client leaves)."""
        waiting = self._waiting_in
        return waiting is not None and (waiting is work or waiting is self._owner)

    def ended(self) -> None:
        """The request was answered or left to its end: a task it started that keeps the
        mark (in its copy of the context) keeps no finished task with it."""
        self._owner = None


_REQUEST: contextvars.ContextVar[Request | None] = contextvars.ContextVar(
    "kvtier_request", default=None
)


def mark_request() -> tuple[Request, contextvars.Token[Request | None]]:
    """A new mark for the request about to start in the current task, and the token for
    ``unmark_request`` once the request runs in a copy of the context (``eager_future``)."""
    request = Request(asyncio.current_task())
    return request, _REQUEST.set(request)


def unmark_request(token: contextvars.Token[Request | None]) -> None:
    _REQUEST.reset(token)


async def unchanged_wait(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` at a point where the request running has changed nothing (see the
    module invariant): should its client leave meanwhile, the request is dropped there. Outside
    a request (a test's direct call, a background task) a plain await."""
    request = _REQUEST.get()
    task = asyncio.current_task()
    if request is None or request._waiting_in not in (None, task):
        return await awaitable
    before, request._waiting_in = request._waiting_in, task
    try:
        return await awaitable
    finally:
        request._waiting_in = before
