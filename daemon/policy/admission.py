"""Admission: may a tier take a block, and if not, why.

A decision is pure: ``decide`` reads what was recorded and answers with an
``AdmissionDecision`` whose ``reason`` is a short constant string, fit for a metric label. What
happened is recorded separately, by ``record``, once per block access, whether or not the
block is then offered to a tier; so asking twice gives the same answer.

Keys are *stable* block identities (``BlockTable.identities`` in the daemon, the
trace's hash id in the replayer), not the store's block ids, which are reused: a frequency
that outlives the block's residency must not pass to whichever block takes its row next.

Rules, by name (``make_admission(name, **params)``; unknown params are ignored):

- ``always``: admit everything.
- ``second_hit``: admit only blocks seen at least twice recently (the current access counts),
  even when there is room: meant for tiers whose writes cost endurance (NVMe).
- ``tinylfu``: with room, admit; otherwise admit only if the candidate's estimated recent
  frequency beats the would-be victim's (Einziger & Friedman, TinyLFU).
- ``belady``: the replayer's offline bypass for ``opt`` (needs ``next_use``).

Thread-safety: none; each tier's owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

T = TypeVar("T")

_M64 = (1 << 64) - 1
# Odd multipliers of a multiply-shift hash, one per sketch row.
_ROW_SEEDS = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xD6E8FEB86659FD93,
)
_COUNTER_MAX = 15  # 4-bit counters, as in TinyLFU: frequencies beyond this add nothing


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    admit: bool
    reason: str


ADMIT_ALWAYS = AdmissionDecision(True, "always")
ADMIT_ROOM = AdmissionDecision(True, "room")


class Admission(Protocol):
    def record(self, key: int, now: float) -> None:
        """One access of the block ``key`` (hit or miss)."""

    def decide(self, candidate: int, victim: int | None, now: float) -> AdmissionDecision:
        """May ``candidate`` enter, replacing ``victim`` (None: there is a free slot)?"""


_ADMISSIONS: dict[str, Callable[..., Admission]] = {}


def register_admission(name: str) -> Callable[[T], T]:
    def decorate(cls: T) -> T:
        if name in _ADMISSIONS:
            raise ValueError(f"admission {name!r} is registered twice")
        _ADMISSIONS[name] = cls  # type: ignore[assignment]
        return cls

    return decorate


def admission_names() -> list[str]:
    return sorted(_ADMISSIONS)


def make_admission(name: str, **params: Any) -> Admission:
    try:
        factory = _ADMISSIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown admission {name!r}; one of {', '.join(sorted(_ADMISSIONS))}"
        ) from None
    return factory(**params)


class FrequencySketch:
    """Count-min sketch of recent access frequency with TinyLFU's aging.

    Four rows of 4-bit counters (stored one per byte); a key's estimate is the minimum of its
    counters, so it never underestimates what was recorded since the last aging. After
    ``sample_factor * capacity_blocks`` records every counter is halved, so the sketch
    describes roughly the last ten cache-fulls of traffic, as TinyLFU prescribes.

    Memory: ``4 * width`` bytes, width the power of two at or above ``capacity_blocks``.
    """

    def __init__(self, capacity_blocks: int, sample_factor: int = 10) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        width = 1 << max(4, (capacity_blocks - 1).bit_length())
        self._shift = 64 - width.bit_length() + 1
        # bytearray rows: scalar access from Python is several times faster than numpy's,
        # and np.frombuffer still halves a row in one vector operation.
        self._rows = [bytearray(width) for _ in _ROW_SEEDS]
        self.sample_size = max(16, sample_factor * capacity_blocks)
        self._additions = 0

    @property
    def nbytes(self) -> int:
        return sum(len(r) for r in self._rows)

    def increment(self, key: int) -> None:
        h = _mix(key)
        shift = self._shift
        for row, seed in zip(self._rows, _ROW_SEEDS, strict=True):
            i = ((h * seed) & _M64) >> shift
            if row[i] < _COUNTER_MAX:
                row[i] += 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self._age()

    def estimate(self, key: int) -> int:
        h = _mix(key)
        shift = self._shift
        return min(
            row[((h * seed) & _M64) >> shift]
            for row, seed in zip(self._rows, _ROW_SEEDS, strict=True)
        )

    def _age(self) -> None:
        for row in self._rows:
            view = np.frombuffer(row, dtype=np.uint8)
            view >>= 1
            del view  # a live export would stop the bytearray from being written
        self._additions //= 2


def _mix(key: int) -> int:
    h = (key * 0xBF58476D1CE4E5B9) & _M64
    return h ^ (h >> 31)


@register_admission("always")
class AlwaysAdmit:
    def __init__(self, **_: object) -> None:
        pass

    def record(self, key: int, now: float) -> None:
        pass

    def decide(self, candidate: int, victim: int | None, now: float) -> AdmissionDecision:
        return ADMIT_ALWAYS


@register_admission("second_hit")
class SecondHitAdmission:
    """Admit blocks seen at least twice within the sketch's memory.

    Parameters: ``capacity_blocks`` (sizes the sketch; default 4096), ``sample_factor``.
    """

    SEEN_TWICE = AdmissionDecision(True, "seen_twice")
    FIRST_SEEN = AdmissionDecision(False, "first_seen")

    def __init__(
        self, capacity_blocks: int | None = None, sample_factor: int = 10, **_: object
    ) -> None:
        self.sketch = FrequencySketch(capacity_blocks or 4096, sample_factor)

    def record(self, key: int, now: float) -> None:
        self.sketch.increment(key)

    def decide(self, candidate: int, victim: int | None, now: float) -> AdmissionDecision:
        return self.SEEN_TWICE if self.sketch.estimate(candidate) >= 2 else self.FIRST_SEEN


@register_admission("tinylfu")
class TinyLFUAdmission:
    """Admit a candidate over a victim only if it was accessed more often recently.

    Ties go to the victim, as in TinyLFU: replacing a block by one no more popular only costs
    a write. Parameters: ``capacity_blocks`` (default 4096), ``sample_factor``.
    """

    MORE_FREQUENT = AdmissionDecision(True, "more_frequent")
    LESS_FREQUENT = AdmissionDecision(False, "less_frequent")

    def __init__(
        self, capacity_blocks: int | None = None, sample_factor: int = 10, **_: object
    ) -> None:
        self.sketch = FrequencySketch(capacity_blocks or 4096, sample_factor)

    def record(self, key: int, now: float) -> None:
        self.sketch.increment(key)

    def decide(self, candidate: int, victim: int | None, now: float) -> AdmissionDecision:
        if victim is None:
            return ADMIT_ROOM
        if self.sketch.estimate(candidate) > self.sketch.estimate(victim):
            return self.MORE_FREQUENT
        return self.LESS_FREQUENT


@register_admission("belady")
class BeladyAdmission:
    """Offline bypass: admit only if the candidate is needed no later than the victim.

    Parameters: ``next_use`` (see ``kvtier.daemon.policy.opt``). Required.
    """

    SOONER = AdmissionDecision(True, "sooner")
    LATER = AdmissionDecision(False, "later")

    def __init__(self, next_use: Callable[[int], float] | None = None, **_: object) -> None:
        if next_use is None:
            raise ValueError("admission 'belady' needs the trace's future (next_use)")
        self._next_use = next_use

    def record(self, key: int, now: float) -> None:
        pass

    def decide(self, candidate: int, victim: int | None, now: float) -> AdmissionDecision:
        if victim is None:
            return ADMIT_ROOM
        if self._next_use(candidate) <= self._next_use(victim):
            return self.SOONER
        return self.LATER
