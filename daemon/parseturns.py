"""Large requests are parsed in turns, round robin over their senders.

The event loop parses each request (protobuf) as it takes its call up, in the order gRPC hands
the calls over. A request of a few MB costs the loop milliseconds to tens of them (most of it
copying and faulting in the pages of its repeated fields), so a client that kept many large
requests open held every other client's calls, however small, behind all of them: beside 128
open Puts of 3.8 MB naming no session, another client's one-key Lookup went from 0.6 ms to
2-7 s (of 370 KB: to 0.2 s). Here:

- a request below ``LARGE_REQUEST_BYTES`` is parsed at once, as before;
- a larger one is parsed in its turn, one at a time, and the next turn begins no sooner than
  ``PAUSE_PER_PARSE`` times the last parse's own time after it ended: the parses of large
  requests take at most a quarter of the loop's time, and the calls ready meanwhile (small
  ones are never queued) run in between. A large request that comes alone waits for
  nothing; one that follows another within that pause waits at most the pause (the largest
  legitimate request, of ``server.max_batch_blocks`` keys, parses in tens of microseconds);
- turns go round robin over the senders: a sender's request waits behind at most one request
  of each other sender with requests waiting, never behind another's whole queue. A sender is
  the tenant (``Session.limit_key``) of the open session that the request names; requests
  that name none (or name one not open) share one sender;
- the requests waiting for their turn, every sender's together, hold at most
  ``max_waiting_bytes`` (``WAITING_MESSAGES`` times ``server.max_message_bytes``): each holds
  its bytes while it waits, and a client's large requests arrive far faster than their
  turns come (one connection's 256 open Puts of 3.5 MB grew the daemon by 1.1 GB). One more
  ends the newest requests of the sender with the most bytes waiting until it fits
  (``TurnRefused``, RESOURCE_EXHAUSTED to their clients): the flood's, not another sender's.

Invariants: at most one turn is held or handed on at once; a turn handed to a call whose
client left before it could parse passes on at once; a sender is queued only while it has a
request waiting; ``_bytes`` and ``_bytes_of`` are the bytes of the requests queued, in all
and per sender (one whose client left leaves its queue as its call ends).

Thread-safety: the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
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


class TurnRefused(Exception):
    """A large request ended before its turn: the requests waiting held all the bytes they
    may, and its sender had the most of them."""


def session_id_of(data: bytes) -> str:
    """The session id that serialized request ``data`` names first, or "" where it does not
    start with one (a sender that writes its fields in another order shares the turn of
    requests naming no session)."""
    if not data.startswith(_SESSION_ID_PREFIX) or len(data) < _SESSION_ID_END:
        return ""
    return data[len(_SESSION_ID_PREFIX) : _SESSION_ID_END].decode("ascii", "replace")


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
        # Senders with requests waiting (their turns and sizes), in the order their turns
        # come (a dict keeps it).
        self._waiting: dict[str, deque[tuple[asyncio.Future[None], int]]] = {}
        self._bytes = 0
        self._bytes_of: Counter[str] = Counter()
        # A turn is held, handed on and not yet taken up, or in the pause after one.
        self._busy = False

    async def parse(self, data: bytes, parse: Callable[[bytes], Any]) -> Any:
        """``parse(data)`` in ``data``'s sender's turn (at once if no turn is taken); raises
        TurnRefused where it is ended before its turn."""
        if self._busy:
            sender, size = self._sender_of(data), len(data)
            if self._bytes + size > self._max_waiting_bytes:
                self._make_room(sender, size)
            turn = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(sender, deque()).append((turn, size))
            self._bytes += size
            self._bytes_of[sender] += size
            self._counters["requests_parse_waited"] += 1
            try:
                await turn
            except asyncio.CancelledError:
                if turn.cancelled():  # its client left while it waited: its place goes
                    self._drop(sender, turn, size)
                elif turn.exception() is None:
                    self._next()  # handed to this call as its client left: pass it on
                raise
        self._busy = True
        start = self._clock()
        try:
            return parse(data)
        finally:
            # The pause holds whatever arrives meanwhile too: a parse is one step of the loop,
            # so no other request can have come to wait during it.
            pause_s = PAUSE_PER_PARSE * (self._clock() - start)
            asyncio.get_running_loop().call_later(pause_s, self._next)

    def _make_room(self, sender: str, size: int) -> None:
        """Make room for a request of ``size`` bytes of ``sender``: refuse the newest request
        of the sender with the most bytes waiting until it fits, or this one (raise) where
        ``sender``, with it, would have the most."""
        why = (
            f"the large requests waiting for their turn to be parsed held "
            f"{self._max_waiting_bytes >> 20} MiB; this one's sender had the most of them"
        )
        while self._bytes + size > self._max_waiting_bytes:
            self._counters["requests_parse_refused"] += 1
            most = max(self._waiting, key=self._bytes_of.__getitem__)
            if self._bytes_of[sender] + size >= self._bytes_of[most]:
                raise TurnRefused(why)
            refused, refused_size = self._waiting[most].pop()
            self._uncount(most, refused_size)
            if not refused.cancelled():
                refused.set_exception(TurnRefused(why))

    def _drop(self, sender: str, turn: asyncio.Future[None], size: int) -> None:
        """Take ``turn``, cancelled, out of ``sender``'s queue, unless it left it already."""
        queue = self._waiting.get(sender)
        if queue is None or (turn, size) not in queue:
            return
        queue.remove((turn, size))
        self._uncount(sender, size)

    def _uncount(self, sender: str, size: int) -> None:
        """A request of ``size`` bytes left ``sender``'s queue."""
        self._bytes -= size
        self._bytes_of[sender] -= size
        if not self._waiting[sender]:
            del self._waiting[sender]
            del self._bytes_of[sender]

    def _next(self) -> None:
        """Hand the turn to the oldest request of the next sender in turn, if any waits."""
        self._busy = False
        while self._waiting:
            sender = next(iter(self._waiting))
            queue = self._waiting.pop(sender)
            turn, size = queue.popleft()
            self._waiting[sender] = queue  # to the back of the round
            self._uncount(sender, size)
            if not turn.cancelled():  # its client left while it waited
                turn.set_result(None)
                self._busy = True
                return
