"""Waits at which a request has changed nothing yet, where its client's leaving drops it.

A request whose client cancels it (or whose deadline passes) runs to its end
(``server._rpc``), so that no step of it is left half done. One that is still waiting where it
has changed nothing (a Delete waiting for L2's recovery) has nothing to finish, and would hold
its request, for as long as that wait lasts, for an answer no one reads: any client could pile
up such requests by the thousand. The code that waits at such a point awaits through
``unchanged_wait``, which records its own frame while it waits; as a client leaves, ``_rpc``
asks ``droppable`` whether the request's handler awaits, down its chain of awaited coroutines
(``cr_await``), an ``unchanged_wait`` now, and cancels the request there if so
(``requests_dropped``) instead of letting it run.

The chain is the request's own, whichever task drives it: its own task, or, before its first
suspension, the task that started it (``eager_future`` runs a coroutine on its caller's stack
until then). A task the request started, eagerly or not, is not in it: its waits drop
nothing. Nothing is done for a request that never comes to such a wait, nor for one whose
client stays: a mark made for every request (an object and a context variable set in
``_rpc``) cost every call some 6,000 instructions, 1-2% of a one-key Put's, Get's or
Lookup's in the daemon.

Invariant: ``unchanged_wait`` is awaited only where neither the request nor anything it
started has changed any state yet, and nothing of it undoes anything as it unwinds: a cancel
there leaves the daemon as if the request had never come. ``_WAITING`` holds exactly the
frames of the ``unchanged_wait`` calls waiting now. Thread-safety: the event loop only.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

# The frames of the ``unchanged_wait`` calls waiting now.
_WAITING: set[FrameType] = set()


def droppable(handler: Coroutine[Any, Any, Any]) -> bool:
    """Whether the request whose handler is the coroutine ``handler`` waits, down its chain of
    awaited coroutines, in an ``unchanged_wait`` (asked by ``_rpc`` as its client leaves)."""
    if not _WAITING:
        return False  # the common case: no request waits where it changed nothing
    awaited: Any = handler
    while (frame := getattr(awaited, "cr_frame", None)) is not None:
        if frame in _WAITING:
            return True
        awaited = awaited.cr_await
    return False


async def unchanged_wait(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` at a point where the request running has changed nothing (see the
    module invariant): should its client leave meanwhile, the request is dropped there. Outside
    a request (a test's direct call, a background task) a plain await."""
    frame = inspect.currentframe()
    assert frame is not None
    _WAITING.add(frame)
    try:
        return await awaitable
    finally:
        _WAITING.discard(frame)
        del frame
