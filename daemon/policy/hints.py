"""Hints: blocks the engine will read soon, protected from eviction until a deadline.

An engine's scheduler knows the requests waiting in its queue. It names their blocks with a
deadline (when it expects to start them); until then no policy proposes those blocks as
victims. ``HintTable`` is the one implementation every policy embeds, so the rule is the same
everywhere:

- ``add(bids, until, now)``: protect each id while ``now <= until`` (the deadline itself
  included: the request starting at ``until`` still finds its blocks). A block hinted again
  keeps the later deadline, since another queued request may need it longer. Ids need not be
  resident: a hint covers a block that becomes resident before its deadline (the trace
  replayer hints blocks before an earlier request stores them).
- ``mask(evictable, now)``: the caller's ``evictable`` mask narrowed by the live hints; the
  mask itself when no hint is live, so a policy pays nothing without hints.
- ``forget(bid)``: the id names another block now; its hint is dropped.
- ``remember(bid, slot)``, ``revive(slot, bid)``, ``expire(slot)``: a dropped block's hint is
  kept by its memento slot while the store remembers its key (``BlockTable``, History), and
  given to the key's new row when it returns: a hint names a block, not a row.

Deadlines are kept in an array indexed by block id (8 bytes per id up to the largest id
ever hinted), so the mask is one vector operation per batch of candidates.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvtier.daemon.policy.base import EvictableFn
from kvtier.daemon.policy.memento import renumbered


class HintTable:
    """Deadlines by block id (see the module docstring)."""

    __slots__ = ("_kept", "_until", "_until_v", "latest")

    def __init__(self) -> None:
        self._until = np.full(0, -math.inf)
        # ``until`` reads one deadline per victim scanned: through a memoryview, a Python
        # float without a NumPy scalar in between.
        self._until_v = self._until.data
        # Deadlines of dropped blocks by memento slot (``remember``): the few with a hint.
        self._kept: dict[int, float] = {}
        # The latest deadline of any hint (-inf: none); read on per-victim paths, where
        # ``live``'s call costs more than the comparison.
        self.latest = -math.inf

    def add(self, bids: np.ndarray, until: float, now: float) -> None:
        if math.isnan(until):
            raise ValueError("a hint's deadline must be a number")
        ids = np.asarray(bids, dtype=np.int64).reshape(-1)
        if len(ids) == 0 or until < now:
            return
        if ids.min() < 0:
            raise KeyError(int(ids[np.argmin(ids)]))
        top = int(ids.max())
        if top >= len(self._until):
            grown = np.full(max(top + 1, 2 * len(self._until), 1024), -math.inf)
            grown[: len(self._until)] = self._until
            self._until = grown
            self._until_v = grown.data
        np.maximum.at(self._until, ids, until)
        if until > self.latest:
            self.latest = until

    def __deepcopy__(self, memo: dict[int, Any]) -> HintTable:
        """A copy with its own deadlines (a memoryview does not copy): policies are cloned
        whole to compare their decisions."""
        other = HintTable()
        other._until = self._until.copy()
        other._until_v = other._until.data
        other._kept = dict(self._kept)
        other.latest = self.latest
        return other

    def forget(self, bid: int) -> None:
        if 0 <= bid < len(self._until):
            self._until[bid] = -math.inf

    def remember(self, bid: int, slot: int) -> None:
        """Keep the deadline of ``bid`` (dropped; ``forget`` follows) for memento ``slot``."""
        self._kept.pop(slot, None)
        if (until := self.until(bid)) > -math.inf:
            self._kept[slot] = until

    def revive(self, slot: int, bid: int) -> None:
        """The deadline kept for ``slot`` becomes that of ``bid`` (a new row)."""
        if (until := self._kept.pop(slot, None)) is not None:
            self.add(np.array([bid]), until, -math.inf)

    def expire(self, slot: int) -> None:
        self._kept.pop(slot, None)

    def renumber(self, order: np.ndarray) -> None:
        """The table renumbered its memento slots (new slot ``i``: old ``order[i]``)."""
        self._kept = renumbered(self._kept, order)

    def live(self, now: float) -> bool:
        """Whether any hint may still protect a block at ``now``."""
        return self.latest >= now

    def until(self, bid: int) -> float:
        """The block's deadline (-inf without a hint)."""
        until_v = self._until_v
        return until_v[bid] if 0 <= bid < len(until_v) else -math.inf  # type: ignore[no-any-return]

    def deadlines(self, bids: np.ndarray) -> np.ndarray:
        """Each id's deadline (-inf without a hint), vectorised."""
        ids = np.asarray(bids, dtype=np.int64)
        out = np.full(len(ids), -math.inf)
        known = ids < len(self._until)
        out[known] = self._until[ids[known]]
        return out

    def mask(self, evictable: EvictableFn | None, now: float) -> EvictableFn | None:
        if not self.live(now):
            return evictable

        def unhinted(bids: np.ndarray) -> np.ndarray:
            ids = np.asarray(bids, dtype=np.int64)
            ok = self.deadlines(ids) < now
            if evictable is not None and ok.any():
                ok &= evictable(ids)
            return ok

        return unhinted

    def __len__(self) -> int:
        """Ids with a deadline (live or past) on record."""
        return int(np.count_nonzero(self._until > -math.inf))


class Hinted:
    """Mixin giving a policy the protocol's ``hint`` verb over its ``self._hints`` table; the
    policy creates the table, narrows ``victims``' mask with ``self._hints.mask`` and calls
    ``self._hints.forget`` from its ``forget``. Its ``remember``/``revive``/``expire`` keep
    the hints of dropped blocks (a policy with more history to keep calls the table's)."""

    _hints: HintTable

    def hint(self, bids: np.ndarray, until: float, now: float) -> None:
        self._hints.add(bids, until, now)

    def unhinted(self, evictable: EvictableFn, now: float) -> EvictableFn:
        """``evictable`` narrowed to the blocks no live hint protects: the rule ``victims``
        follows, for callers that drop blocks without asking it (a whole segment's)."""
        return self._hints.mask(evictable, now) or evictable

    def remember(self, bid: int, slot: int) -> None:
        self._hints.remember(bid, slot)

    def revive(self, slot: int, bid: int) -> None:
        self._hints.revive(slot, bid)

    def expire(self, slot: int) -> None:
        self._hints.expire(slot)

    def renumber(self, order: np.ndarray) -> None:
        self._hints.renumber(order)
