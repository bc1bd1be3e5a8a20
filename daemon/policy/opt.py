"""Belady's offline optimum, the ceiling every replay report shows.

Evicts the resident block whose next use lies farthest in the future. Knowing the future, it
only exists inside the replayer, which passes ``next_use``: a function giving, for a block id,
the position (in the trace's access order) of the block's next access after its current one,
``inf`` if none. Paired with the ``belady`` admission rule it is the optimum *with bypass*: a
missing block whose next use is farther than every resident's is not inserted at all.

Invariants: ``_next[bid]`` holds the next use of each resident block as of its last access;
the heap holds ``(-next_use, bid)`` for every resident block plus stale entries, which are
recognised by not matching ``_next`` and dropped lazily (next uses are positions, unique per
access in a replay; ``victims`` still guards against an entry matching twice).

Thread-safety: none; the replayer owns it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.daemon.policy.base import EvictableFn, InsertEach, OwesNoWork
from kvtier.daemon.policy.hints import Hinted, HintTable

NextUseFn = Callable[[int], float]


class BeladyPolicy(InsertEach, OwesNoWork, Hinted):
    """Parameters:
    next_use: the trace's future, see the module docstring. Required.
    """

    default_admission = "belady"
    needs_future = True

    def __init__(self, next_use: NextUseFn | None = None, **_: object) -> None:
        if next_use is None:
            raise ValueError(
                "policy 'opt' is Belady's offline optimum and needs the trace's future "
                "(next_use); only the replayer can run it"
            )
        self._next_use = next_use
        self._next: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []
        self._hints = HintTable()

    def insert(self, bid: int, now: float, parent: int = -1) -> None:
        self._set(bid)

    def touch(self, bid: int, now: float) -> None:
        if bid not in self._next:
            raise KeyError(bid)
        self._set(bid)

    def touch_many(self, bids: np.ndarray, now: float) -> None:
        ids = np.asarray(bids, dtype=np.int64).reshape(-1).tolist()
        for bid in ids:
            if bid not in self._next:
                raise KeyError(bid)  # before any next use is read: all or nothing
        for bid in ids:
            self._set(bid)

    def remove(self, bid: int) -> None:
        del self._next[bid]

    def forget(self, bid: int) -> None:
        self._hints.forget(bid)  # No other history beyond residency.

    def victims(
        self,
        n: int,
        now: float,
        evictable: EvictableFn | None,
        incoming: Sequence[int] = (),
    ) -> np.ndarray | None:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if n > len(self._next):
            return None
        evictable = self._hints.mask(evictable, now)
        heap, current = self._heap, self._next
        # Dropping stale entries from the top changes no decision, only the heap's size.
        while current.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        if n == 1 and (evictable is None or evictable(np.array([heap[0][1]]))[0]):
            return np.array([heap[0][1]], dtype=np.int64)
        taken: list[tuple[float, int]] = []
        out: list[int] = []
        seen: set[int] = set()  # a block re-inserted with an equal key has two live entries
        try:
            while len(out) < n and heap:
                batch: list[tuple[float, int]] = []
                while heap and len(batch) < max(n - len(out), 16):
                    item = heapq.heappop(heap)
                    taken.append(item)
                    if current.get(item[1]) == -item[0] and item[1] not in seen:
                        seen.add(item[1])
                        batch.append(item)
                ids = np.array([b for _, b in batch], dtype=np.int64)
                ok = ids if evictable is None else ids[evictable(ids)]
                out.extend(ok[: n - len(out)].tolist())
        finally:
            # victims() must leave the order as it found it.
            for item in taken:
                heapq.heappush(heap, item)
        return np.asarray(out, dtype=np.int64) if len(out) == n else None

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, bid: object) -> bool:
        return bid in self._next

    def _set(self, bid: int) -> None:
        nu = float(self._next_use(bid))
        self._next[bid] = nu
        heapq.heappush(self._heap, (-nu, bid))
        if len(self._heap) > 2 * len(self._next) + 64:
            self._heap = [(-v, b) for b, v in self._next.items()]
            heapq.heapify(self._heap)
