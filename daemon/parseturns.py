"""Large requests are parsed in turns, round robin over their senders.

The event loop parses each request (protobuf) as it takes its call up, in the order gRPC hands
the calls over. A request of a few MB costs the loop milliseconds to tens of them (most of it
copying and faulting in the pages of its repeated fields), so a client that kept many large
requests open held every other client's calls, however small, behind all of them: beside 128
open Puts of 3.8 MB naming no session, another client's one-key Lookup went from 0.6 ms to
2-7 s (of 370 KB: to 0.2 s). Here:

- a request below ``LARGE_REQUEST_BYTES`` is parsed at once, as before;
- a larger one is parsed in its turn, one at a time: the next turn of its sender begins no
  sooner than ``PAUSE_PER_PARSE`` times the parse's own time after it ended, any other
  sender's no sooner than one parse time after. The parses of one sender's large requests
  take at most a quarter of the loop's time, every sender's together at most half, and the
  calls ready meanwhile (small ones are never queued) run in between. A large request that
  comes alone waits for nothing; one that follows its sender's last within that pause waits
  at most the pause (the largest legitimate request, of ``server.max_batch_blocks`` keys,
  parses in tens of microseconds), one that follows another sender's at most that parse's
  time: a flood's pause is the flood's own (beside 128 open Puts of 3.8 MB naming no
  session, another tenant's Lookups of 4,096 keys waited for it, p50 2.1 -> 113 ms);
- turns go round robin over the senders, the first whose pauses have passed first: a
  sender's request waits behind at most one request of each other sender with requests
  waiting, never behind another's whole queue. A sender is the tenant
  (``Session.limit_key``) of the open session that the request names; requests that name
  none (or name one not open) share one sender;
- the requests waiting for their turn, every sender's together, hold at most
  ``max_waiting_bytes`` (``WAITING_MESSAGES`` times ``server.max_message_bytes``): each holds
  its bytes while it waits, and a client's large requests arrive far faster than their
  turns come (one connection's 256 open Puts of 3.5 MB grew the daemon by 1.1 GB). Past it
  the newest requests of the sender with the most bytes waiting (the flood's, not another
  sender's) lose their bytes until the rest fit, and end in their turn, which takes the
  sender's last parse time as a parse would (``TurnRefused``, RESOURCE_EXHAUSTED to their
  clients): ended at once, a flood's calls came back at once, and receiving them took the
  loop (a one-key Lookup beside 128 open Puts of 3.8 MB: p99 13 -> 318 ms).

Invariants: at most one turn is handed on at once, and none while one is, or while
anything waits, does a request parse at once; a turn handed to a call whose client left
before it could parse passes on at once; while requests wait and no turn is handed, the
timer is armed for the first whose pauses pass; a sender is queued only while it has a
request waiting; ``_bytes`` and ``_bytes_of`` are the ``size`` of the requests queued, in all
and per sender (one whose client left leaves its queue as its call ends); the bytes of a
request of size 0 are gone.

Thread-safety: the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Below this a request parses in microseconds (a Lookup of 1,900 keys, a Put of some 1,500; the
# one-key calls of an engine's fast path are a hundred bytes): it is not worth a turn.
LARGE_REQUEST_BYTES = 64 << 10
# The pause after a parse, in parse times. A large request costs the loop more than its parse
# (gRPC copies it into Python; it is answered, its memory freed): beside 128 open Puts of
# 370 KB, a pause of one parse time left the loop busy with them, and another client's
# one-key Lookup waited p99 350 ms; at three, 18 ms.
PAUSE_PER_PARSE = 3
# Every session-bound request starts with its session id (field 1, 32 hex digits) when a
# protobuf library wrote it: a tag, a length, the id. Read from the raw bytes, without parsing.
_SESSION_ID_PREFIX = b"\x0a\x20"
_SESSION_ID_END = len(_SESSION_ID_PREFIX) + 32
# The bytes of the requests waiting for their turn, in requests of server.max_message_bytes
# (256 MiB at the default). An engine's large requests are a few hundred KB and wait a
# fraction of a millisecond each: only a flood fills it.
WAITING_MESSAGES = 64
# Senders whose own pauses are kept before those passed are forgotten.
_PAUSES_KEPT = 64


class TurnRefused(Exception):
    """A large request not parsed: while it waited the requests waiting held more bytes than
    they may, and its sender had the most of them (its bytes went then; it ends in its turn)."""


def session_id_of(data: bytes) -> str:
    """The session id that serialized request ``data`` names first, or "" where it does not
    start with one (a sender that writes its fields in another order shares the parse turn
    of requests naming no session; its handler's turn, ``RequestReceiver``, is its own)."""
    if not data.startswith(_SESSION_ID_PREFIX) or len(data) < _SESSION_ID_END:
        return ""
    return data[len(_SESSION_ID_PREFIX) : _SESSION_ID_END].decode("ascii", "replace")


@dataclass(slots=True, eq=False)
class _Waiting:
    """A request waiting for its turn."""

    turn: asyncio.Future[None]
    request: list[bytes]  # its bytes, the only reference to them; emptied if it is refused
    size: int  # the bytes it counts against the bound: 0 once refused


class ParseTurns:
    def __init__(
        self,
        sender_of: Callable[[bytes], str],
        counters: Counter[str],
        max_waiting_bytes: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._sender_of = sender_of
        self._counters = counters
        self._max_waiting_bytes = max_waiting_bytes
        self._clock = clock
        # Senders with requests waiting, in the order their turns come (a dict keeps it).
        self._waiting: dict[str, deque[_Waiting]] = {}
        self._bytes = 0
        self._bytes_of: Counter[str] = Counter()
        # Loop times: the next parse of any sender begins no sooner than ``_free_at``, the
        # next of a sender here no sooner than the first of its ``_paused`` (the later pause);
        # the second is its last parse's time, which a refused request's turn takes as well.
        self._free_at = 0.0
        self._paused: dict[str, tuple[float, float]] = {}
        # A turn is handed to a waiting call that has not taken it up yet.
        self._handed = False
        # Armed for ``_timer_at`` (a Handle: uvloop's call_at of a time passed calls soon).
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0

    async def parse(self, request: list[bytes], parse: Callable[[bytes], Any]) -> Any:
        """``parse`` of the bytes ``request`` holds in their sender's turn (at once if
        nothing waits and no pause holds it). ``request`` is the only reference to them: a
        request refused while it waits frees them at once, and raises TurnRefused in its
        turn (answered then, a flood's refused calls come back no faster than its others)."""
        loop = asyncio.get_running_loop()
        sender = self._sender_of(request[0])
        if (
            self._handed
            or self._waiting
            or loop.time() < max(self._free_at, self._paused.get(sender, (0.0, 0.0))[0])
        ):
            waiting = _Waiting(loop.create_future(), request, len(request[0]))
            self._waiting.setdefault(sender, deque()).append(waiting)
            self._bytes += waiting.size
            self._bytes_of[sender] += waiting.size
            self._counters["requests_parse_waited"] += 1
            if self._bytes > self._max_waiting_bytes:
                self._make_room()
            self._arm()
            try:
                await waiting.turn
            except asyncio.CancelledError:
                if waiting.turn.cancelled():  # its client left while it waited: its place goes
                    self._drop(sender, waiting)
                else:
                    self._handed = False  # handed to this call as its client left: pass it on
                    self._arm()
                raise
            self._handed = False
            if not request:
                self._pause(sender, self._paused.get(sender, (0.0, 0.0))[1])
                raise TurnRefused(
                    f"the large requests waiting for their turn to be parsed held "
                    f"{self._max_waiting_bytes >> 20} MiB; this one's sender had the most of them"
                )
        data = request.pop()
        start = self._clock()
        try:
            return parse(data)
        finally:
            self._pause(sender, self._clock() - start)

    def _pause(self, sender: str, parse_s: float) -> None:
        """Begin the pauses after ``sender``'s turn, of ``parse_s``; hand the next turn."""
        now = asyncio.get_running_loop().time()
        self._free_at = now + parse_s
        self._paused[sender] = (now + PAUSE_PER_PARSE * parse_s, parse_s)
        if len(self._paused) > _PAUSES_KEPT:
            self._paused = {s: p for s, p in self._paused.items() if p[0] > now}
        self._arm()

    def _arm(self) -> None:
        """Hand the turn to the oldest request of the first sender in turn whose pauses have
        passed, or arm the timer for the first to pass (a sender that came since the timer was
        armed may pass first); nothing while a turn is handed."""
        if self._handed or not self._waiting:
            return
        loop = asyncio.get_running_loop()
        paused = self._paused
        # The first sender in turn of those whose own pauses pass first.
        sender = min(self._waiting, key=lambda s: paused.get(s, (0.0, 0.0))[0])
        at = max(self._free_at, paused.get(sender, (0.0, 0.0))[0])
        if at > loop.time():
            if self._timer is None or self._timer_at > at:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer, self._timer_at = loop.call_at(at, self._on_timer), at
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queue = self._waiting.pop(sender)
        waiting = queue.popleft()
        self._waiting[sender] = queue  # to the back of the round
        self._uncount(sender, waiting.size)
        if waiting.turn.cancelled():  # its client left while it waited: the next
            self._arm()
            return
        waiting.turn.set_result(None)
        self._handed = True

    def _on_timer(self) -> None:
        self._timer = None
        self._arm()

    def _make_room(self) -> None:
        """Refuse the newest requests of the sender with the most bytes waiting until those
        waiting fit the bound again: their bytes go, they keep their places."""
        while self._bytes > self._max_waiting_bytes:
            most = max(self._bytes_of, key=self._bytes_of.__getitem__)
            refused = next(w for w in reversed(self._waiting[most]) if w.size)
            refused.request.clear()
            self._bytes -= refused.size
            self._bytes_of[most] -= refused.size
            refused.size = 0
            self._counters["requests_parse_refused"] += 1

    def _drop(self, sender: str, waiting: _Waiting) -> None:
        """Take ``waiting``, cancelled, out of its sender's queue, unless it left it already."""
        queue = self._waiting.get(sender)
        if queue is None or waiting not in queue:
            return
        queue.remove(waiting)
        self._uncount(sender, waiting.size)

    def _uncount(self, sender: str, size: int) -> None:
        """A request of ``size`` bytes left ``sender``'s queue."""
        self._bytes -= size
        self._bytes_of[sender] -= size
        if not self._waiting[sender]:
            del self._waiting[sender]
            del self._bytes_of[sender]
