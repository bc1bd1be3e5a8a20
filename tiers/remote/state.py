"""The L3 tier's reachability and its write budget, as pure state machines (``now`` is an
argument: deterministic in tests).

``Availability``: UP, or DOWN until a retry time that grows by exponential backoff with jitter
after every failed attempt, or NOSPACE (the store refused writes for lack of memory; reads go
on) until a retry time. Only a success reported by the reconnection probe brings the tier back
UP; a late success of an operation started before the failure does not.

``TokenBucket``: a write budget in bytes/s with a burst of one second's budget (at least one
largest value, so any single block can pass). A write that does not fit is dropped, never
queued.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class Reach(enum.Enum):
    UP = "up"
    DOWN = "down"
    NOSPACE = "nospace"


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of state, to be logged once."""

    before: Reach
    after: Reach
    detail: str
    retry_in_s: float


def backoff_s(initial_s: float, max_s: float, attempts: int, rng: random.Random) -> float:
    """Exponential backoff with jitter after ``attempts`` failed attempts: uniform in
    [d/2, d], d = initial * 2^attempts capped at max, so that many daemons do not retry in
    step."""
    d = min(max_s, initial_s * (2.0 ** min(attempts, 62)))
    return d * rng.uniform(0.5, 1.0)


class Availability:
    """Thread-safety: none; the event loop owns it."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._rng = rng or random.Random()
        self.state = Reach.UP
        self.detail = ""
        self.retry_at = 0.0
        self.attempts = 0  # failed attempts since the last UP
        self.since = 0.0  # when the current state began

    def _delay(self) -> float:
        return backoff_s(self.initial_s, self.max_s, self.attempts, self._rng)

    def serves(self, now: float) -> bool:
        """Whether reads and probes may go to the network."""
        return self.state is not Reach.DOWN

    def takes_writes(self, now: float) -> bool:
        # After NOSPACE's backoff, writes are tried again; a new refusal backs off further.
        return self.state is Reach.UP or (self.state is Reach.NOSPACE and now >= self.retry_at)

    def failed(self, now: float, detail: str) -> Transition | None:
        """The store could not be reached (timeout, connection refused or reset)."""
        if self.state is Reach.DOWN:
            return None  # already down; the reconnection probe owns the backoff
        before = self.state
        self.state, self.detail, self.since = Reach.DOWN, detail, now
        self.attempts = 0
        delay = self._delay()
        self.retry_at = now + delay
        return Transition(before, Reach.DOWN, detail, delay)

    def retry_failed(self, now: float, detail: str) -> float:
        """The reconnection probe failed: the next one waits longer. Returns the delay."""
        self.attempts += 1
        self.detail = detail
        delay = self._delay()
        self.retry_at = now + delay
        return delay

    def no_space(self, now: float, detail: str) -> Transition | None:
        """The store refused a write for lack of memory."""
        if self.state is Reach.DOWN:
            return None
        before = self.state
        if before is Reach.NOSPACE:
            self.attempts += 1
        else:
            self.attempts = 0
            self.since = now
        self.state, self.detail = Reach.NOSPACE, detail
        delay = self._delay()
        self.retry_at = now + delay
        return (
            Transition(before, Reach.NOSPACE, detail, delay)
            if before is not Reach.NOSPACE
            else None
        )

    def recovered(self, now: float) -> Transition | None:
        """The reconnection probe succeeded, or a write went through after NOSPACE."""
        if self.state is Reach.UP:
            return None
        before = self.state
        self.state, self.detail, self.since = Reach.UP, "", now
        self.attempts = 0
        self.retry_at = 0.0
        return Transition(before, Reach.UP, "", 0.0)


class TokenBucket:
    """Thread-safety: none; the event loop owns it. ``rate_bytes_s == 0`` is unlimited."""

    def __init__(self, rate_bytes_s: int, burst_bytes: int, now: float) -> None:
        self.rate = float(rate_bytes_s)
        self.burst = float(max(burst_bytes, rate_bytes_s))
        self.tokens = self.burst
        self.stamp = now

    def set_rate(self, rate_bytes_s: int, burst_bytes: int) -> None:
        """A new rate (a reload); tokens saved so far stay, up to the new burst."""
        self.rate = float(rate_bytes_s)
        self.burst = float(max(burst_bytes, rate_bytes_s))
        self.tokens = min(self.tokens, self.burst) if self.rate > 0 else self.burst

    def take(self, nbytes: int, now: float) -> bool:
        """Spend ``nbytes`` if the budget holds them; otherwise spend nothing."""
        if self.rate <= 0:
            return True
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        if nbytes > self.tokens:
            return False
        self.tokens -= nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        """Return ``nbytes`` taken for writes that were not sent after all (up to the burst)."""
        if self.rate > 0:
            self.tokens = min(self.burst, self.tokens + nbytes)
