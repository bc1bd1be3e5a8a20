"""The heat table: per block a decayed access count and the time of its last access.

``heat = heat * 2**(-dt / half_life_s) + 1`` on every access. Stored as numpy arrays indexed by
block id (the store's ids), so a million blocks cost 12 bytes each here and whole-tier
questions ("which blocks are coldest", "which are still protected") are single vector
operations. Times are whatever clock the caller passes (``now``): the daemon's monotonic
clock, or a trace's clock in the replayer.

Ordering by heat needs no re-sorting as time passes: every block decays by the same factor,
so at any time ``heat_a(now) < heat_b(now)`` exactly when ``log_key(a) < log_key(b)`` with the
time-invariant ``log_key = log2(heat at last access) + last_access / half_life_s``. A key only
grows when its block is accessed.

Not thread-safe: owned by the store (or a policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

NEVER = -math.inf


class HeatTable:
    def __init__(self, half_life_s: float, initial_capacity: int = 1024) -> None:
        if not half_life_s > 0:
            raise ValueError("half_life_s must be positive")
        self.half_life_s = half_life_s
        self.heat = np.zeros(max(1, initial_capacity), dtype=np.float32)
        self.last_access = np.full(len(self.heat), NEVER, dtype=np.float64)
        self._views()

    def __len__(self) -> int:
        return len(self.heat)

    @property
    def bytes_per_block(self) -> int:
        return self.heat.itemsize + self.last_access.itemsize

    def ensure(self, capacity: int) -> None:
        if capacity <= len(self.heat):
            return
        size = max(capacity, 2 * len(self.heat))
        heat = np.zeros(size, dtype=np.float32)
        heat[: len(self.heat)] = self.heat
        last = np.full(size, NEVER, dtype=np.float64)
        last[: len(self.last_access)] = self.last_access
        self.heat, self.last_access = heat, last
        self._views()

    def reset(self, bids: np.ndarray | int) -> None:
        """Forget the history of blocks whose ids are being (re)used."""
        self.heat[bids] = 0.0
        self.last_access[bids] = NEVER

    def record(self, bids: np.ndarray | int, now: float) -> None:
        """One access of each block in ``bids`` at ``now``. Repeated ids count once."""
        bids = np.unique(np.atleast_1d(np.asarray(bids, dtype=np.int64)))
        self.heat[bids] = self.heat_at(bids, now) + 1.0
        self.last_access[bids] = now

    def record_one(self, bid: int, now: float) -> float:
        """One access of one block; returns its new ``log_key``.

        The scalar twin of ``record`` for per-access callers (a policy's touch): it reads
        and writes through memoryviews, which cost a fraction of numpy's scalar indexing.
        """
        last = self._last_mv[bid]
        h = self._heat_mv[bid]
        if h > 0.0 and now > last:
            h *= 2.0 ** ((last - now) / self.half_life_s)
        h += 1.0
        self._heat_mv[bid] = h
        if now > last:
            self._last_mv[bid] = now
        else:
            now = last  # a clock that stepped back must not make the block look older
        return math.log2(h) + now / self.half_life_s

    def record_distinct(self, bids: np.ndarray, now: float) -> np.ndarray:
        """One access of each block in ``bids`` at ``now``; returns the new keys (``log_key``).

        The vector twin of ``record_one``: heat, last access and the returned keys are bit
        for bit what ``record_one`` gives per id, clock-step-back rule included. Precondition:
        the ids are distinct (a repeated id would be recorded once, from its old state);
        callers with repeats loop over ``record_one``.

        Exactness: numpy's ``power`` and ``log2`` may use SIMD code that differs from the C
        library's in the last bit, and ``record_one`` uses the C library (through Python's
        float ``**`` and ``math.log2``). So the two transcendental steps go through Python,
        once per run of equal inputs; blocks of one chain, touched together, mostly share
        their history, so a 1,024-block chain costs a handful of calls instead of 2,048.
        Everything else is float64 arithmetic, which numpy and Python round alike.
        """
        last = self.last_access[bids]
        h = self.heat[bids].astype(np.float64)
        decays = (h > 0.0) & (now > last)
        if decays.all():  # the usual case, without indexing
            h *= _by_runs(_pow2, (last - now) / self.half_life_s)
        elif decays.any():
            at = np.flatnonzero(decays)
            h[at] *= _by_runs(_pow2, (last[at] - now) / self.half_life_s)
        h += 1.0
        self.heat[bids] = h
        when = np.fmax(last, now)  # now if later, else last (which is never NaN)
        self.last_access[bids] = when
        return _by_runs(math.log2, h) + when / self.half_life_s

    def heat_at(self, bids: np.ndarray | int, now: float) -> np.ndarray:
        """Heat of ``bids`` decayed to ``now`` (blocks never accessed have heat 0)."""
        last = self.last_access[bids]
        dt = np.maximum(now - np.where(np.isfinite(last), last, now), 0.0)
        return self.heat[bids] * np.exp2(-dt / self.half_life_s)

    def log_key(self, bids: np.ndarray | int) -> np.ndarray:
        """The time-invariant ordering key (see the module docstring); -inf if never
        accessed."""
        heat = self.heat[bids].astype(np.float64)
        with np.errstate(divide="ignore"):
            key = np.log2(heat) + self.last_access[bids] / self.half_life_s
        return np.where(heat > 0, key, NEVER)

    def _views(self) -> None:
        # Re-taken whenever the arrays are replaced; the old views keep the old arrays
        # alive only until they are dropped here. Typed Any: memoryview's stubs assume
        # byte-sized integer items.
        self._heat_mv: Any = self.heat.data
        self._last_mv: Any = self.last_access.data


# 2.0 ** x as record_one computes it (the builtin pow is float ** float), callable from C.
_pow2: Callable[[float], float] = partial(pow, 2.0)


def _by_runs(fn: Callable[[float], float], x: np.ndarray) -> np.ndarray:
    """``fn`` of each element of the float64 array ``x``, called once per run of equal
    elements (NaN, unequal to itself, gets a call of its own)."""
    n = len(x)
    if n == 0:
        return np.empty(0, dtype=np.float64)
    if x[0] == x[-1] and (x == x[0]).all():
        return np.full(n, fn(float(x[0])))  # one chain's worth of blocks, one history
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(x[1:], x[:-1], out=starts[1:])
    firsts = x[starts]
    values = np.fromiter(map(fn, firsts.tolist()), dtype=np.float64, count=len(firsts))
    if len(values) == n:
        return values
    return values[np.cumsum(starts) - 1]
