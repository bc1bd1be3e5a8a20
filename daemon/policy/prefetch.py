"""Prefetch accounting: did promoting blocks ahead of use pay off?

The store (or the replayer) drives a ``PrefetchLedger`` with four events per block key and
reads ``stats()``. Every issued prefetch ends in exactly one outcome:

- ``used``: the block arrived, then a demand read found it before it was evicted;
- ``late``: a demand read came before the prefetch completed (the engine waited anyway);
- ``wasted``: the block was evicted, or the prefetch cancelled, before any demand read;
- or it is still ``outstanding``.

So ``issued == used + late + wasted + outstanding`` at all times (a test holds it). A second
prefetch of a key that is outstanding counts as ``duplicate`` and opens nothing new. Pure
bookkeeping: no clock (``now`` is an argument), no I/O.

Thread-safety: none; the owner serialises calls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class _State(enum.IntEnum):
    IN_FLIGHT = 0
    ARRIVED = 1


@dataclass(slots=True)
class _Entry:
    state: _State
    issued_at: float


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    issued: int
    used: int
    late: int
    wasted: int
    outstanding: int
    duplicates: int
    late_wait_s: float
    """Sum over late prefetches of (demand time - issue time): how long each had been in
    flight when the demand read came."""

    @property
    def used_ratio(self) -> float:
        done = self.used + self.late + self.wasted
        return self.used / done if done else 0.0


class PrefetchLedger:
    def __init__(self) -> None:
        self._open: dict[int, _Entry] = {}
        self._issued = self._used = self._late = self._wasted = self._dup = 0
        self._late_wait_s = 0.0

    def issue(self, key: int, now: float) -> bool:
        """A prefetch of ``key`` was started; False (a duplicate) if one is outstanding."""
        if key in self._open:
            self._dup += 1
            return False
        self._open[key] = _Entry(_State.IN_FLIGHT, now)
        self._issued += 1
        return True

    def complete(self, key: int, now: float) -> None:
        """The prefetched block is now resident. Unknown keys (late ones already settled)
        are ignored."""
        entry = self._open.get(key)
        if entry is not None:
            entry.state = _State.ARRIVED

    def demand(self, key: int, now: float) -> None:
        """A request read ``key``. Keys never prefetched are ignored."""
        entry = self._open.pop(key, None)
        if entry is None:
            return
        if entry.state is _State.ARRIVED:
            self._used += 1
        else:
            self._late += 1
            self._late_wait_s += max(0.0, now - entry.issued_at)

    def evict(self, key: int, now: float) -> None:
        """``key`` left the tier (or its prefetch was cancelled) without a demand read."""
        if self._open.pop(key, None) is not None:
            self._wasted += 1

    @property
    def outstanding(self) -> int:
        """Prefetches issued and not settled yet (cheap: callers test it per request)."""
        return len(self._open)

    def stats(self) -> PrefetchStats:
        return PrefetchStats(
            issued=self._issued,
            used=self._used,
            late=self._late,
            wasted=self._wasted,
            outstanding=len(self._open),
            duplicates=self._dup,
            late_wait_s=self._late_wait_s,
        )
