"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), a baseline.

Four LRU lists: ``T1`` (resident, seen once since entering), ``T2`` (resident, seen again),
and the ghost lists ``B1``/``B2`` of ids recently evicted from each. A miss that hits a ghost
list moves the target size ``p`` of ``T1`` towards the list that would have kept the block.

The paper's single ``REQUEST(x)`` step is split across this package's protocol, and the split
is exact when the caller follows the store's order (``victims`` -> ``remove`` -> ``insert``):

- ``victims(n, now, evictable, incoming=(x,))`` runs ``REPLACE``: it adapts ``p`` as the ghost
  hit on ``x`` would, without storing it, and picks the LRU end of ``T1`` or ``T2``.
- ``remove(v)`` moves ``v`` from ``T1``/``T2`` to the MRU end of ``B1``/``B2``.
- ``insert(x)`` applies the adaptation for real (ghost hit: into ``T2``) or, for a new block,
  trims the ghost lists as the paper's case IV does, then puts ``x`` into ``T1``.

Invariants: a block id is in at most one of the four lists; ``|T1| + |T2| <= c`` is the
caller's business (it evicts before inserting); ``|B1| + |B2| <= c`` always. With the
``evictable`` mask, ``REPLACE`` skips blocks that may not go and takes the next LRU block of
the same list, then of the other list.

Ghost lists remember blocks by a token each, mapped to the block's id (``_ghost_of``). The
daemon reuses the ids of forgotten blocks, so the store must call ``forget`` when it frees an
index row, or a new block on that row would count as a ghost hit. The replayer's ids are
stable. A dropped block the store remembers for its key (``remember``, see
``kvtier.daemon.policy.memento``) keeps its ghost entry, in place, under its memento slot
until the key returns (``revive``) or the store forgets it (``expire``).

Thread-safety: none; the owner serialises calls.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.daemon.policy.base import EvictableFn, InsertEach, OwesNoWork
from kvtier.daemon.policy.hints import Hinted, HintTable
from kvtier.daemon.policy.memento import renumbered

log = logging.getLogger(__name__)

# Candidates are checked against the evictable mask in batches of this many.
_SCAN_BATCH = 256


@dataclass(frozen=True, slots=True)
class ARCStats:
    capacity_blocks: int
    target_t1: float
    t1: int
    t2: int
    b1: int
    b2: int


class ARCPolicy(InsertEach, OwesNoWork, Hinted):
    """ARC over block ids.

    Parameters:
        capacity_blocks: the tier's size ``c`` in blocks. Bounds ``p`` and the ghost lists.
            None (the store does not pass it yet) uses the largest number of blocks ever
            resident at once, which equals ``c`` once the tier has filled.
    """

    default_admission = "always"

    def __init__(self, capacity_blocks: int | None = None, **_: object) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        self._fixed_capacity = capacity_blocks
        self._high_water = 0
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        # Ghost lists: token -> its block's id, or ``-1 - slot`` for a memento slot's.
        self._b1: OrderedDict[int, int] = OrderedDict()
        self._b2: OrderedDict[int, int] = OrderedDict()
        self._ghost_of: dict[int, int] = {}  # id -> token, for the ids in a ghost list
        self._kept_ghost: dict[int, int] = {}  # memento slot -> token
        self._tokens = 0
        self._p = 0.0
        # Blocks moved into B1/B2 by remove() since the last insert.
        self._ghosted = [0, 0]
        self._hints = HintTable()

    @property
    def capacity(self) -> int:
        return self._fixed_capacity or max(self._high_water, 1)

    # ------------------------------------------------------------------ protocol

    def insert(self, bid: int, now: float, parent: int = -1) -> None:
        if bid in self._t1 or bid in self._t2:
            self.touch(bid, now)
            return
        c = self.capacity
        b1, b2 = self._b1, self._b2
        # The paper adapts p with the ghost sizes of before its REPLACE, which here already
        # ran as victims + remove: discount what those removes added.
        n1 = len(b1) - self._ghosted[0]
        n2 = len(b2) - self._ghosted[1]
        self._ghosted = [0, 0]
        tok = self._ghost_of.pop(bid, None)
        if tok is not None and tok in b1:
            self._p = min(float(c), self._p + max(n2 / max(n1, 1), 1.0))
            del b1[tok]
            self._t2[bid] = None
        elif tok is not None:
            self._p = max(0.0, self._p - max(n1 / max(n2, 1), 1.0))
            del b2[tok]
            self._t2[bid] = None
        else:
            # Case IV of the paper. Its REPLACE already ran (victims + remove), which leaves
            # |T1|+|B1| and the total unchanged, so the paper's tests still apply here.
            # When |T1| was c, REPLACE moved T1's LRU block into an empty B1 and it is
            # dropped again here, as the paper drops it without a ghost.
            if len(self._t1) + len(b1) >= c:
                if b1:
                    self._drop_oldest(b1)
            elif len(self._t1) + len(self._t2) + len(b1) + len(b2) >= 2 * c and b2:
                self._drop_oldest(b2)
            self._t1[bid] = None
        self._high_water = max(self._high_water, len(self._t1) + len(self._t2))
        self._bound_ghosts(self.capacity)

    def touch(self, bid: int, now: float) -> None:
        if bid in self._t1:
            del self._t1[bid]
            self._t2[bid] = None
        else:
            self._t2.move_to_end(bid)

    def touch_many(self, bids: np.ndarray, now: float) -> None:
        ids = np.asarray(bids, dtype=np.int64).reshape(-1).tolist()
        t1, t2 = self._t1, self._t2
        for bid in ids:
            if bid not in t1 and bid not in t2:
                raise KeyError(bid)  # before any move: all or nothing
        for bid in ids:
            self.touch(bid, now)

    def remove(self, bid: int) -> None:
        if bid in self._t1:
            del self._t1[bid]
            ghosts = self._b1
            self._ghosted[0] += 1
        elif bid in self._t2:
            del self._t2[bid]
            ghosts = self._b2
            self._ghosted[1] += 1
        else:
            raise KeyError(bid)
        self._tokens += 1
        ghosts[self._tokens] = bid
        self._ghost_of[bid] = self._tokens
        # One over the bound is the paper's transient state between REPLACE and the trim in
        # the following insert; trimming it here would drop a different ghost than the paper.
        self._bound_ghosts(self.capacity + 1)

    def forget(self, bid: int) -> None:
        self._hints.forget(bid)
        if (tok := self._ghost_of.pop(bid, None)) is not None:
            self._b1.pop(tok, None)
            self._b2.pop(tok, None)

    def remember(self, bid: int, slot: int) -> None:
        """Keep the ghost entry of ``bid`` (dropped; ``forget`` follows) for memento
        ``slot``, at its place in its list, and its hint."""
        self._hints.remember(bid, slot)
        self._kept_ghost.pop(slot, None)
        if (tok := self._ghost_of.pop(bid, None)) is not None:
            (self._b1 if tok in self._b1 else self._b2)[tok] = -1 - slot
            self._kept_ghost[slot] = tok

    def revive(self, slot: int, bid: int) -> None:
        """The ghost entry and hint kept for ``slot`` become those of ``bid`` (a new row)."""
        self._hints.revive(slot, bid)
        if (tok := self._kept_ghost.pop(slot, None)) is not None:
            (self._b1 if tok in self._b1 else self._b2)[tok] = bid
            self._ghost_of[bid] = tok

    def expire(self, slot: int) -> None:
        """The ghost entry and hint kept for ``slot`` go."""
        self._hints.expire(slot)
        if (tok := self._kept_ghost.pop(slot, None)) is not None:
            self._b1.pop(tok, None)
            self._b2.pop(tok, None)

    def renumber(self, order: np.ndarray) -> None:
        """The table renumbered its memento slots (new slot ``i``: old ``order[i]``): the
        kept ghost entries name their new slots, in place in their lists."""
        self._hints.renumber(order)
        self._kept_ghost = renumbered(self._kept_ghost, order)
        for slot, tok in self._kept_ghost.items():
            (self._b1 if tok in self._b1 else self._b2)[tok] = -1 - slot

    def victims(
        self,
        n: int,
        now: float,
        evictable: EvictableFn | None,
        incoming: Sequence[int] = (),
    ) -> np.ndarray | None:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if n > len(self._t1) + len(self._t2):
            return None
        evictable = self._hints.mask(evictable, now)
        p, from_b2 = self._adapted_target(incoming)
        n1, n2 = len(self._t1), len(self._t2)
        scan1 = _scan(self._t1, evictable)
        scan2 = _scan(self._t2, evictable)
        out: list[int] = []
        while len(out) < n:
            take_t1 = n1 >= 1 and (n1 > p or (from_b2 and n1 == p))
            first, second = (scan1, scan2) if take_t1 else (scan2, scan1)
            bid = next(first, None)
            if bid is None:
                bid = next(second, None)
                if bid is None:
                    return None
                take_t1 = not take_t1
            if take_t1:
                n1 -= 1
            else:
                n2 -= 1
            from_b2 = False  # the paper's tie rule concerns the first REPLACE only
            out.append(bid)
        return np.asarray(out, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, bid: object) -> bool:
        return bid in self._t1 or bid in self._t2

    def stats(self) -> ARCStats:
        return ARCStats(
            self.capacity, self._p, len(self._t1), len(self._t2), len(self._b1), len(self._b2)
        )

    # ------------------------------------------------------------------- helpers

    def _adapted_target(self, incoming: Sequence[int]) -> tuple[float, bool]:
        """``p`` as it will be once ``incoming`` are inserted, and whether the first of them
        is a ``B2`` ghost hit. Exact for one incoming block; for several, the adaptations are
        applied in order against the current ghost sizes (an approximation)."""
        p, c = self._p, float(self.capacity)
        b1, b2 = self._b1, self._b2
        from_b2 = False
        for i, bid in enumerate(incoming):
            tok = self._ghost_of.get(bid)
            if tok is None:
                continue
            if tok in b1:
                p = min(c, p + max(len(b2) / len(b1), 1.0))
            elif tok in b2:
                p = max(0.0, p - max(len(b1) / len(b2), 1.0))
                from_b2 = from_b2 or i == 0
        return p, from_b2

    def _bound_ghosts(self, limit: int) -> None:
        # The paper keeps |B1|+|B2| <= c while the cache is full; removals by the caller
        # (deletes) can break that, so bound the memory here as well.
        while len(self._b1) + len(self._b2) > limit:
            self._drop_oldest(self._b1 if len(self._b1) >= len(self._b2) else self._b2)

    def _drop_oldest(self, ghosts: OrderedDict[int, int]) -> None:
        _, owner = ghosts.popitem(last=False)
        if owner >= 0:
            del self._ghost_of[owner]
        else:
            del self._kept_ghost[-1 - owner]


def _scan(order: OrderedDict[int, None], evictable: EvictableFn | None) -> Iterator[int]:
    """The ids of ``order`` from its LRU end that may be evicted, checked in batches."""
    if evictable is None:
        yield from order
        return
    it = iter(order)
    while True:
        batch = np.fromiter(
            (b for _, b in zip(range(_SCAN_BATCH), it, strict=False)), dtype=np.int64
        )
        if len(batch) == 0:
            return
        yield from batch[evictable(batch)].tolist()
