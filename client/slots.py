"""Call slots: how many calls a client keeps open on one channel (``max_calls_open``).

The daemon's gRPC server takes up a connection's new calls one per loop pass, in the order
they came, whoever sent them, and refuses a connection's calls past its stream bound (256)
unrun. A client that kept hundreds of calls open held every other tenant's call behind them,
and had its own refused and sent again after a pause. So each client queues its calls past
``max_calls_open`` itself, in the order they came, and sends each as an earlier one ends.

Invariants:
- ``free + held == limit``. A slot freed while callers queue goes to the first of them
  directly (never back to ``free``): a later caller cannot overtake one that waits.
- A caller that stops waiting (its time ran out, an interrupt) either is still queued, and
  leaves holding nothing, or was handed a slot meanwhile, which it keeps (its time) or hands
  on (an interrupt): no slot is lost either way.
- A queued callback (``take_or_queue``) is called on the thread that frees its slot, never
  inside another callback of the same slots: callbacks whose calls end at once and free
  their slot again run one after another, not nested. Another thread's release never adds
  to them: a caller's thread sends no more parts than its own releases handed slots to.
- A callback handed a slot is called: those an interrupt kept from running on the thread
  that freed their slots run on a thread of their own (they hold those slots).
- A task cancelled while it waits (``AsyncCallSlots``) holds no slot and sends nothing, even
  when the slot was handed to it in the loop pass the cancel came in: that slot goes on to
  the next task queued.
- Slots given up (``AsyncCallSlots.give_up``: an exception a signal's handler raised may
  have left their count wrong; ``CallSlots.give_up``: with their channel, whose calls may
  never end) count nothing more: their queued callers are handed back, holding none (a
  task to queue on its owner's new slots in the order they came, a thread to send its call
  again, a callback called to find its channel given up); their releases (of the calls
  still open on them) change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable

from kvtier.client.errors import DeadlineExceededError, InvalidArgumentError
from kvtier.client.types import checked_int, shown

# The daemon's gRPC server keeps at most 256 calls open on one connection (its
# MAX_STREAMS_PER_CONNECTION); the client's session stream takes one of them.
MAX_CALLS_OPEN_LIMIT = 255
# Beside another tenant's 256 one-key Lookups made through one AsyncClient, a one-key Lookup
# waited p50 88-194 ms with all 256 open, 0.8-26 ms with 32 (64: 0.6-32 ms, p99 no better),
# the 256's calls/s alone unchanged (README, Security: Limits).
DEFAULT_MAX_CALLS_OPEN = 32

_LockType = type(threading.Lock())


def checked_max_calls_open(value: object) -> int:
    """A client's ``max_calls_open``, checked at construction."""
    limit = checked_int(value, "max_calls_open", minimum=1)
    if limit > MAX_CALLS_OPEN_LIMIT:
        raise InvalidArgumentError(
            f"max_calls_open: must be at most {MAX_CALLS_OPEN_LIMIT} (got {shown(limit)}): the "
            "daemon keeps 256 calls open per connection, one of them the session's, and "
            "refuses the rest"
        )
    return limit


def slot_wait_error(limit: int, timeout_s: float) -> DeadlineExceededError:
    """The error of a call whose time ran out while it waited for a slot: it was not sent."""
    return DeadlineExceededError(
        f"no call slot came free within {timeout_s}s: this client keeps {limit} calls open "
        "at once (max_calls_open), and the call was not sent"
    )


class CallSlots:
    """The blocking client's slots of one channel: threads wait for one (``acquire``), a
    transfer job's parts queue a callback (``take_or_queue``) that sends the part once a slot
    is theirs, so that no gRPC callback thread ever waits.

    Thread-safety: thread-safe."""

    __slots__ = ("_free", "_given_up", "_granting", "_lock", "_waiting", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = limit
        self._given_up = False
        self._lock = threading.Lock()
        # In the order they came: a waiting thread's lock, or a callback to hand a slot to.
        self._waiting: deque[threading.Lock | Callable[[], None]] = deque()
        # Per thread: the callbacks its releases handed a slot to, while it calls them.
        self._granting = threading.local()

    @property
    def held(self) -> int:
        """Slots taken (by calls open, or about to be sent)."""
        with self._lock:
            return self.limit - self._free

    @property
    def waiting(self) -> int:
        """Callers queued for a slot."""
        with self._lock:
            return len(self._waiting)

    def acquire(self, timeout_s: float | None) -> bool | None:
        """Take a slot, waiting up to ``timeout_s`` (None: for ever) behind the callers queued
        before; False when the time ran out first, None when the slots were given up (before,
        or meanwhile: the caller holds none, and their channel sends nothing more)."""
        with self._lock:
            if self._given_up:
                return None
            if self._free:
                self._free -= 1
                return True
            waiter = threading.Lock()
            waiter.acquire()
            self._waiting.append(waiter)
        try:
            got = waiter.acquire(timeout=-1 if timeout_s is None else max(timeout_s, 0.0))
        except BaseException:  # an interrupt: the slot handed over meanwhile goes on
            if not self._unqueue(waiter):
                self.release()
            raise
        if not got and self._unqueue(waiter):
            return False
        return None if self._given_up else True

    def take_or_queue(self, grant: Callable[[], None]) -> bool:
        """Take a slot now (True), or queue ``grant``, to be called holding a slot once one is
        free (False). ``grant`` must not wait, nor raise but to end the caller's thread.
        Given up, True: a slot that counts nothing (the caller finds its channel given up)."""
        with self._lock:
            if self._given_up:
                return True
            if self._free:
                self._free -= 1
                return True
            self._waiting.append(grant)
            return False

    def release(self) -> None:
        """Free a slot: it goes to the first caller queued, if any."""
        with self._lock:
            if self._given_up:
                return
            if not self._waiting:
                if self._free >= self.limit:
                    raise RuntimeError("a call slot freed more often than taken")
                self._free += 1
                return
            waiter = self._waiting.popleft()
            if isinstance(waiter, _LockType):
                waiter.release()
                return
        self._grant([waiter])  # type: ignore[list-item]

    def give_up(self) -> None:
        """Count nothing more (see the module): their channel was given up
        (``Client.interrupted``), and the calls open on it, which hold its slots, may never
        end (gRPC's lock left held). The threads queued end their wait holding none (None),
        and the callbacks queued are called (a job's part finds its channel given up:
        ``TransferJob._granted``); else they waited for those calls: a thread its whole time,
        a job's part for good."""
        with self._lock:
            self._given_up = True
            waiting, self._waiting = self._waiting, deque()
        callbacks = []
        for waiter in waiting:
            if isinstance(waiter, _LockType):
                waiter.release()
            else:
                callbacks.append(waiter)
        self._grant(callbacks)

    def _grant(self, callbacks: list[Callable[[], None]]) -> None:
        """Call ``callbacks`` on this thread, after those it is calling if any (see the
        module)."""
        granted: deque[Callable[[], None]] | None = getattr(self._granting, "queue", None)
        if granted is not None:  # inside a callback this thread calls
            granted.extend(callbacks)
        elif callbacks:
            self._call_granted(deque(callbacks))

    def _call_granted(self, granted: deque[Callable[[], None]]) -> None:
        """Call the callbacks ``granted`` and those that the slots they free on this thread
        are handed to, one after another."""
        self._granting.queue = granted
        try:
            while granted:
                granted.popleft()()
        except BaseException:
            if granted:  # they hold slots: called on a thread of their own
                threading.Thread(
                    target=self._call_granted, args=(granted,), name="kvtier-slots", daemon=True
                ).start()
            raise
        finally:
            self._granting.queue = None

    def _unqueue(self, waiter: threading.Lock) -> bool:
        """Take a thread that stopped waiting off the queue; False when it was not on it any
        more: a slot was handed to it meanwhile."""
        with self._lock:
            try:
                self._waiting.remove(waiter)
            except ValueError:
                return False
            return True


class AsyncCallSlots:
    """The asyncio client's slots (see ``CallSlots``): ``take`` one that is free, else
    ``wait`` for one in the order the tasks came.

    Not ``asyncio.wait_for`` around a semaphore's acquire: on Python 3.11 it returned the slot
    that its inner task had taken in the loop pass in which the caller was cancelled, the
    cancel dropped, and the cancelled caller sent its call (and on 3.10 the semaphore let a
    newcomer take a slot before a waiter it had woken).

    Thread-safety: none; the tasks of one event loop (the client's)."""

    __slots__ = ("_free", "_given_up", "_waiting", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = limit
        self._given_up = False
        # In the order they came; a waiter is here while it is not done, and one done (its
        # task cancelled, not back yet) is skipped.
        self._waiting: deque[asyncio.Future[bool | None]] = deque()

    @property
    def held(self) -> int:
        """Slots taken (by calls open, or about to be sent)."""
        return self.limit - self._free

    @property
    def waiting(self) -> int:
        """Tasks queued for a slot."""
        return sum(not waiter.done() for waiter in self._waiting)

    def take(self) -> bool:
        """Take a free slot, if one is (none is while tasks queue); never waits."""
        if self._free:
            self._free -= 1
            return True
        return False

    async def wait(self, timeout_s: float | None) -> bool | None:
        """Take the slot freed once the tasks queued before have theirs, waiting up to
        ``timeout_s`` (None: for ever); False when the time ran out first, None when the
        slots were given up meanwhile (the task holds none: it asks the new ones). Cancelled,
        the task leaves holding nothing: a slot handed to it meanwhile goes on."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool | None] = loop.create_future()
        timer = None
        try:  # from its queueing on: the interpreter checks for signals at every call
            self._waiting.append(waiter)
            if timeout_s is not None:
                timer = loop.call_later(max(timeout_s, 0.0), self._expire, waiter)
            try:
                return await waiter
            finally:  # a call, where the interpreter checks for signals: inside the handler
                if timer is not None:
                    timer.cancel()
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.release()
            else:
                with contextlib.suppress(ValueError):  # skipped by a release meanwhile
                    self._waiting.remove(waiter)
            raise

    def release(self) -> None:
        """Free a slot: it goes to the first task still waiting, if any."""
        if self._given_up:
            return
        waiting = self._waiting
        while waiting:
            # Answered before it leaves the queue: an interrupt between the two, taken off
            # first, left it off the queue unanswered, out of ``give_up``'s reach.
            waiter = waiting[0]
            if not waiter.done():
                waiter.set_result(True)
                waiting.popleft()
                return
            waiting.popleft()
        if self._free >= self.limit:
            raise RuntimeError("a call slot freed more often than taken")
        self._free += 1

    def give_up(self) -> None:
        """Count nothing more (see the module): an exception a signal's handler raised as a
        call ended (at the entry of ``release``, or inside it) left a slot taken for good.
        Every task queued ends its wait holding no slot (None), in the order they came, to
        queue on the owner's new slots: handed a slot here, they were all sent at once, past
        ``limit`` (a job's hundreds of parts, past the daemon's calls per connection)."""
        self._given_up = True
        waiting, self._waiting = self._waiting, deque()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def _expire(self, waiter: asyncio.Future[bool | None]) -> None:
        if not waiter.done():
            # Answered before it leaves the queue (as in ``release``). Off the queue already
            # where an interrupt ended the wait as its timer was set, before the wait had the
            # timer to cancel.
            waiter.set_result(False)
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiter)
