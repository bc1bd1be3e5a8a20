"""Large requests run their first step in turns, once the calls that came meanwhile are in.

gRPC's aio server takes up new calls one at a time, in the order they came, whichever
client sent them: each one costs a pass or two of the event loop. A handler runs on the loop
up to its first wait (``daemon/eager.py``), and for a request of thousands of keys that step
is milliseconds of Python (a Lookup of 4,096 keys: the keys' words, the table's probe, the
heat, the answer's list). With such a step in every pass, the calls queued in gRPC went in
one a step: beside a tenant's 8 Lookups of 4,096 keys open at once, another tenant's one-key
Lookup waited for the 7 queued before it, 0.6 -> 14 ms, nearly all of it before its handler
began (``kvtier bench fair``). The parse of a large request takes turns already
(``daemon/parseturns.py``), but a Lookup's parse is tens of microseconds; its handler is the
cost. Here:

- a request below ``STEP_TURN_BYTES`` never waits (its handler's step is a few hundred
  microseconds at most). That is a quarter of ``LARGE_REQUEST_BYTES``, the parse turns'
  bound (``daemon/parseturns.py``): a Lookup of 1,800 keys, just under that, parses in
  microseconds but its handler's step takes about half a 4,096-key one's, and with only
  requests of 64 KiB taking turns, another tenant's one-key Lookup beside 8 open Lookups of
  1,800 keys went p50 0.6 -> 9-15 ms (4 runs of 6; 1.7-3.1 ms with them in turns);
- a larger one runs its first step in its turn, one at a time; the next turn is handed once
  ``QUIET_PASSES`` passes in a row and ``QUIET_S`` seconds went by without a new call (at
  most ``MAX_DEFERRED_PASSES`` passes after the last turn ended, so that a stream of small
  calls does not starve large ones): the calls queued behind the last large step are taken
  up first, a pass each and no large step between them, and a small call waits behind
  about one large step, not one per call queued before it;
- turns go round robin over the senders (tenants), oldest first within one: a sender's
  request waits behind at most one of each other sender's, never behind another's queue.

The passes in between are empty but for the calls taken up: the loop spins while large
requests wait, taking the cores from gRPC's poller thread and the clients, and with the
window after every step a tenant's batches alone lost 16-46% of their calls/s here (Lookups
of 4,096 keys, 8 or 32 open, 2 cores at load 7). So a sender alone skips the window's
time: while for ``ALONE_S`` no call was taken up but that sender's requests that take
turns, its next turn is handed after ``QUIET_PASSES`` passes without a new call, however
short. Skipping the passes too left another tenant's first call after such a silence behind
every call queued before it, one large step each: a one-key Lookup every 1.5 s beside 32
open Lookups of 4,096 keys went p50 2.3-2.9 ms (max 10 ms) -> 73-124 ms (max 0.74 s), for
no gain beyond noise in the batches' calls/s. The passes take those calls up first, a pass
each, and the call brings the whole window back for the next ones.

Invariants: at most one turn is held or handed at once, and ``_busy`` says whether one is
(or its hand-on is under way, a pass a turn of the loop by ``loops.InTurns``: a pass that
raises is logged, counted in ``background_errors`` and tried again ``loops.TURN_RETRY_S``
later); a turn handed to a call whose client left before it took it up passes
on; a sender is queued only while it has a request waiting; ``_mixed_at`` is the last time a
call was taken up that was not one of ``_sender``'s requests that take turns.

Thread-safety: the event loop only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable

from kvtier.daemon import loops
from kvtier.daemon.stats import Counters

# A request of this many bytes or more takes turns: some 480 keys of 32 bytes, a handler's
# step of a few hundred microseconds, a few times the quiet window that the turn may cost it.
STEP_TURN_BYTES = 16 << 10
# gRPC takes up a queued call in one or two passes, or in the time its poller thread takes
# to pass the "call came" event on (tens of microseconds on idle cores; a pass of an idle
# loop takes a few): this many passes in a row and this long without one means its queue
# is empty. Here (2 busy cores) 3 passes were too few: a one-key Lookup beside 32 open
# Lookups of 4,096 keys stayed at 58-64 ms; 8 took it to 0.8-2.4 ms.
QUIET_PASSES = 8
QUIET_S = 100e-6
# The most passes a large step waits after the last: each pass costs microseconds when it
# takes up no call, and one that takes a call up is that call's work, not a wait.
MAX_DEFERRED_PASSES = 64
# A sender alone skips the window's time (not its passes): while for this long no call was
# taken up but that one sender's requests that take turns, gRPC's queue holds no one else's
# call but one that came after the silence, which the passes take up. An engine's scheduler
# calls at every step, tens of milliseconds apart: far less than this.
ALONE_S = 1.0


class StepTurns:
    def __init__(
        self,
        counters: Counter[str],
        clock: Callable[[], float] = time.perf_counter,
        errors: Counters | None = None,
    ) -> None:
        """``errors``: where a hand-on that failed is counted (the store's counters)."""
        self._counters = counters
        self._errors = Counters() if errors is None else errors
        self._clock = clock
        # Senders with requests waiting, in the order their turns come (a dict keeps it).
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        # A turn is held, or handed on and not taken up yet, or its hand-on is scheduled.
        self._busy = False
        # Calls taken up since the start and when the last was; the count ``_hand_on`` saw
        # last, its passes in a row without one, and its passes since the last turn ended.
        self._arrivals = 0
        self._arrived_at = 0.0
        self._seen = 0
        self._quiet = 0
        self._deferred = 0
        # The sender of the last request that took a turn, and when a call was last taken up
        # that was not one of its (a small call, or another sender's that takes turns).
        self._sender: str | None = None
        self._mixed_at = -math.inf
        # A pass of the hand-on a turn of the loop while it waits for gRPC's queue to empty.
        self._hand_ons = loops.InTurns(
            self._hand_on, "handing on a large request's turn", self._errors
        )

    async def begin(self, sender: str) -> None:
        """Wait for ``sender``'s turn (none if no turn is held or waited for); ``end`` once
        the step is done, whatever it raised."""
        if sender != self._sender:
            if self._sender is not None:
                self._mixed_at = self._clock()
            self._sender = sender
        if not self._busy:
            self._busy = True
            return
        # Nothing that may raise comes between the queueing of its future and the wait:
        # queued with no call awaiting it, it would be handed the turn, held for good.
        self._counters["requests_step_waited"] += 1
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(sender, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.cancelled():  # its client left while it waited: its place goes
                self._drop(sender, turn)
            else:
                self.end()  # handed to this call as its client left: pass it on
            raise

    def arrived(self) -> None:
        """A call was taken up (any call: gRPC hands them over in the order they came)."""
        self._arrivals += 1
        self._arrived_at = self._clock()

    def took_small(self) -> None:
        """A call that takes no turn was taken up: its sender may have more in gRPC's queue."""
        self._mixed_at = self._clock()

    def end(self) -> None:
        """The turn is over; the next is handed once the loop has taken up the calls that
        came meanwhile."""
        self._quiet = 0
        self._deferred = 0
        self._seen = self._arrivals
        self._hand_ons.begin_soon()

    def _hand_on(self) -> bool:
        """A pass of the hand-on: the next turn handed, or none held; whether it waits a
        pass more (``loops.InTurns``, which also tries a pass that raised again: a turn it
        took off stays taken, the retry redoes its pass or hands the next)."""
        if self._waiting:
            alone = self._clock() - self._mixed_at >= ALONE_S
            if self._arrivals != self._seen:
                self._seen = self._arrivals
                self._quiet = 0
            else:
                self._quiet += 1
            self._deferred += 1
            quiet = self._quiet >= QUIET_PASSES and (
                alone or self._clock() - self._arrived_at >= QUIET_S
            )
            if not quiet and self._deferred < MAX_DEFERRED_PASSES:
                return True
        while self._waiting:
            sender = next(iter(self._waiting))
            queue = self._waiting.pop(sender)
            turn = queue.popleft()
            if queue:
                self._waiting[sender] = queue  # to the back of the round
            if not turn.done():
                turn.set_result(None)
                return False
        self._busy = False
        return False

    def _drop(self, sender: str, turn: asyncio.Future[None]) -> None:
        queue = self._waiting.get(sender)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self._waiting[sender]
