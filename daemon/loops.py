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
slice a turn by ``InTurns``: the pins of leases that end together, the expiry heap's rebuild,
the policies' owed moves. A slice that raises is logged and counted (``background_errors``)
and the work stays owed: its slice is tried again ``TURN_RETRY_S`` later (not at the next
turn: a slice that fails every time would log at the loop's rate). A slice must therefore leave
its owner's state whole when it raises: what it took off its queue before the failure is lost
to the retry. Raised to the loop's handler instead, as before, a failure left the work owed
with no turn to come (pins held for good, a rebuild that never ended).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kvtier.daemon.stats import Counters

log = logging.getLogger(__name__)

T = TypeVar("T")

EVENT_LOOPS = ("uvloop", "asyncio")

# How long after a slice of ``InTurns`` work that raised it is tried again.
TURN_RETRY_S = 1.0


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


def turn_failed(what: str, counters: Counters) -> None:
    """The exception being handled ended a turn of ``what``, which is tried again
    ``TURN_RETRY_S`` later: logged, and counted in ``counters``' ``background_errors``."""
    log.exception("%s failed; tried again in %.3g s", what, TURN_RETRY_S)
    counters.inc("background_errors")


class InTurns:
    """Work owed in slices: ``step`` does one and answers whether some is left. ``begin`` (or
    ``begin_soon``) is called whenever some becomes owed, and calls ``step`` until it answers
    False, once a turn of the running event loop, so that other callbacks run between its
    calls. A ``step`` that raises is logged as ``what`` failing, counted in ``counters``'
    ``background_errors``, and called again ``TURN_RETRY_S`` later; without a running loop
    (offline use) the work stays owed until the next ``begin``.

    Thread-safety: none; owned by the event loop."""

    __slots__ = ("_counters", "_due", "_step", "_what")

    def __init__(self, step: Callable[[], bool], what: str, counters: Counters) -> None:
        self._step = step
        self._what = what
        self._counters = counters
        # From a ``begin`` until ``step`` answers False: a call of ``step`` is scheduled or
        # running (a ``begin`` meanwhile does nothing: the step's answer says what is left).
        self._due = False

    @property
    def due(self) -> bool:
        """Whether the work is under way (a call of ``step`` scheduled or running)."""
        return self._due

    def begin(self) -> None:
        """Some work is owed: its first slice now, in the caller's step, unless under way;
        without a running loop every slice now."""
        if not self._due:
            self._turn()

    def begin_soon(self) -> None:
        """``begin``, its first slice at the next turn of the running loop (for a caller in
        the middle of what ``step`` changes); without a running loop, none."""
        if not self._due:
            self._due = self._schedule(0.0)

    def _turn(self) -> None:
        self._due = True
        while True:
            try:
                more = self._step()
            except Exception:
                turn_failed(self._what, self._counters)
                self._due = self._schedule(TURN_RETRY_S)
                return
            if not more:
                self._due = False
                return
            if self._schedule(0.0):
                return

    def _schedule(self, delay_s: float) -> bool:
        """Call ``_turn`` at a later turn of the running loop (``delay_s`` later); whether
        there is one to call it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if delay_s > 0:
            loop.call_later(delay_s, self._turn)
        else:
            loop.call_soon(self._turn)
        return True


def running() -> str:
    """The kind of the running event loop ('uvloop' or 'asyncio')."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.partition(".")[0] == "uvloop" else "asyncio"
