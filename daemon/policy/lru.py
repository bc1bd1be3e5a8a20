"""Least-recently-used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from kvtier.daemon.policy.base import EvictableFn, InsertEach, OwesNoWork
from kvtier.daemon.policy.hints import Hinted, HintTable

# Candidates are checked against the evictable mask in batches of this many.
_SCAN_BATCH = 256


class LRUPolicy(InsertEach, OwesNoWork, Hinted):
    """Thread-safety: none; the owner serialises calls."""

    def __init__(self, **_: object) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._hints = HintTable()

    def insert(self, bid: int, now: float, parent: int = -1) -> None:
        self._order[bid] = None
        self._order.move_to_end(bid)

    def touch(self, bid: int, now: float) -> None:
        self._order.move_to_end(bid)

    def touch_many(self, bids: np.ndarray, now: float) -> None:
        ids = np.asarray(bids, dtype=np.int64).reshape(-1).tolist()
        order = self._order
        # Check all, then move all (all or nothing); both loops run in C, not bytecode.
        if not all(map(order.__contains__, ids)):
            raise KeyError(next(b for b in ids if b not in order))
        deque(map(order.move_to_end, ids), maxlen=0)

    def remove(self, bid: int) -> None:
        del self._order[bid]

    def forget(self, bid: int) -> None:
        self._hints.forget(bid)  # LRU keeps no other history beyond residency.

    def victims(
        self,
        n: int,
        now: float,
        evictable: EvictableFn | None,
        incoming: Sequence[int] = (),
    ) -> np.ndarray | None:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if n > len(self._order):
            return None
        evictable = self._hints.mask(evictable, now)
        if evictable is None:
            it = iter(self._order)
            return np.fromiter((next(it) for _ in range(n)), dtype=np.int64, count=n)
        chosen: list[np.ndarray] = []
        found = 0
        it = iter(self._order)
        while found < n:
            batch = np.fromiter(
                (b for _, b in zip(range(_SCAN_BATCH), it, strict=False)), dtype=np.int64
            )
            if len(batch) == 0:
                return None
            ok = batch[evictable(batch)]
            chosen.append(ok[: n - found])
            found += len(chosen[-1])
        return np.concatenate(chosen)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, bid: object) -> bool:
        return bid in self._order
