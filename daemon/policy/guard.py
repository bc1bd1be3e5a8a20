"""Which blocks may be evicted now, and how many must be: the rules around any policy.

Two pure decisions, both on the caller's clock (``now``), both vectorised:

- ``EvictionGuard.evictable``: a block may go when it is not pinned by a lease, no copy of it
  is in flight, and its protection period (``protect_s`` after its last write or read) has
  passed. The policy only ranks; this mask says who is allowed to be ranked out.
- ``EvictionGuard.to_free``: the watermark rule. Above ``high_watermark`` of the capacity the
  tier frees down to ``low_watermark``; below it nothing is freed unless the incoming data
  would not fit at all. During ``warmup_s`` after start only that hard limit applies, so a
  cold cache is filled before anything is judged cold.

Units of ``used``/``capacity``/``incoming`` are the caller's (blocks or bytes), the same for
all three.

Thread-safety: immutable; safe to share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.daemon.policy.base import EvictableFn


@dataclass(frozen=True, slots=True)
class EvictionGuard:
    protect_s: float = 2.0
    warmup_s: float = 0.0
    high_watermark: float = 0.95
    low_watermark: float = 0.90

    def __post_init__(self) -> None:
        if self.protect_s < 0 or self.warmup_s < 0:
            raise ValueError("protect_s and warmup_s must not be negative")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 <= low <= high <= 1")

    def in_warmup(self, now: float, started_at: float) -> bool:
        return now - started_at < self.warmup_s

    def evictable(
        self,
        now: float,
        last_access: np.ndarray,
        pins: np.ndarray,
        inflight: np.ndarray,
    ) -> np.ndarray:
        """Element-wise mask over aligned arrays of the candidates' fields."""
        # A never-accessed block (last_access -inf) is unprotected.
        return (
            (np.asarray(pins) == 0)
            & (np.asarray(inflight) == 0)
            & (np.asarray(last_access) + self.protect_s <= now)
        )

    def evictable_fn(
        self,
        now: float,
        last_access: np.ndarray,
        pins: np.ndarray,
        inflight: np.ndarray,
    ) -> EvictableFn:
        """The mask as a policy's ``evictable`` argument: the arrays are indexed by block id
        and read when the policy asks, so they must stay valid for the call."""

        def mask(bids: np.ndarray) -> np.ndarray:
            return self.evictable(now, last_access[bids], pins[bids], inflight[bids])

        return mask

    def to_free(
        self, used: int, capacity: int, now: float, started_at: float, incoming: int = 0
    ) -> int:
        """How much to evict before ``incoming`` more is stored (0 if nothing)."""
        after = used + incoming
        hard = max(0, after - capacity)
        if self.in_warmup(now, started_at):
            return hard
        if after <= math.floor(self.high_watermark * capacity):
            return hard
        return max(hard, after - math.floor(self.low_watermark * capacity))
