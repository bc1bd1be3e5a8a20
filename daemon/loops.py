"""The event loop the daemon runs on: uvloop (the default) or asyncio's own.

Every small request is a handful of event loop iterations (gRPC's completion callbacks, the
handler's steps, the answer's write), so the loop's own cost per iteration is part of every
call. uvloop runs the same asyncio programs on libuv with the loop written in C: in ``kvtier
bench rpc --event-loop asyncio|uvloop`` the daemon spent 25-70 us less CPU per single-block
call on it (Put least, Get most), which moved the p50 of a Put, Get and Lookup 3-8% closer to
a bare gRPC ping (README, "Running the daemon").
``server.event_loop: asyncio`` runs on the standard library's loop instead (for a Python where
uvloop does not install, or to rule the loop out while debugging); nothing else differs.

A loop that is configured but cannot be imported stops the daemon before it allocates anything
(``daemon/preflight.py``): no silent fallback to the other one.

Work too long for one step of the loop (every other client's calls wait for a step) is done a
slice a turn by ``in_turns``: the pins of leases that end together, the expiry heap's rebuild.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOPS = ("uvloop", "asyncio")


def problem(kind: str) -> str | None:
    """Why ``kind`` cannot run in this Python, or None when it can."""
    if kind != "uvloop":
        return None
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return (
            "uvloop is not installed in this Python (pip install uvloop), or set "
            "server.event_loop: asyncio"
        )
    return None


def describe(kind: str) -> str:
    """``kind`` with its version where it has one of its own, e.g. 'uvloop 0.23.0'."""
    if kind == "uvloop":
        import uvloop

        return f"uvloop {uvloop.__version__}"
    return kind


def run(main: Coroutine[Any, Any, T], kind: str) -> T:
    """Run ``main`` to its end on a new event loop of ``kind`` (one of ``EVENT_LOOPS``)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.run(main)
    if kind == "asyncio":
        return asyncio.run(main)
    main.close()
    raise ValueError(f"event loop {kind!r}: expected one of {', '.join(EVENT_LOOPS)}")


def in_turns(step: Callable[[], bool]) -> None:
    """Call ``step`` until it answers False (nothing left to do): now, then once a turn of the
    running event loop, so that other callbacks run between its calls (work too long for one
    step of the loop, done a slice a call); without a running loop (offline use), again at
    once."""
    while step():
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            continue
        loop.call_soon(in_turns, step)
        return


def running() -> str:
    """The kind of the running event loop ('uvloop' or 'asyncio')."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.partition(".")[0] == "uvloop" else "asyncio"
