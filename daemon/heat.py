"""The heat table: per block a decayed access count and the time of its last access.

``heat = heat * 2**(-dt / half_life_s) + 1`` on every access. Stored as numpy arrays indexed by
block id (the store's ids), so a million blocks cost 12 bytes each here and whole-tier
questions ("which blocks are coldest", "which are still protected") are single vector
operations. Times are whatever clock the caller passes (``now``): the daemon's monotonic
clock, or a trace's clock in the replayer.

Not thread-safe: owned by the store.
"""

from __future__ import annotations

import numpy as np


class HeatTable:
    def __init__(self, half_life_s: float, initial_capacity: int = 1024) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self.half_life_s = half_life_s
        self.heat = np.zeros(initial_capacity, dtype=np.float32)
        self.last_access = np.full(initial_capacity, -np.inf, dtype=np.float64)

    def ensure(self, capacity: int) -> None:
        if capacity <= len(self.heat):
            return
        size = max(capacity, 2 * len(self.heat))
        heat = np.zeros(size, dtype=np.float32)
        heat[: len(self.heat)] = self.heat
        last = np.full(size, -np.inf, dtype=np.float64)
        last[: len(self.last_access)] = self.last_access
        self.heat, self.last_access = heat, last

    def reset(self, bids: np.ndarray | int) -> None:
        """Forget the history of blocks whose ids are being (re)used."""
        self.heat[bids] = 0.0
        self.last_access[bids] = -np.inf

    def record(self, bids: np.ndarray | int, now: float) -> None:
        """One access of each block in ``bids`` at ``now``. Repeated ids count once."""
        bids = np.unique(np.atleast_1d(np.asarray(bids, dtype=np.int64)))
        self.heat[bids] = self.heat_at(bids, now) + 1.0
        self.last_access[bids] = now

    def heat_at(self, bids: np.ndarray | int, now: float) -> np.ndarray:
        """Heat of ``bids`` decayed to ``now`` (blocks never accessed have heat 0)."""
        last = self.last_access[bids]
        dt = np.maximum(now - np.where(np.isfinite(last), last, now), 0.0)
        return self.heat[bids] * np.exp2(-dt / self.half_life_s)
