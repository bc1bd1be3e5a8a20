"""How much of the top tier one owner's hints and pins may protect.

A hint (``Prefetch`` with a deadline) protects the blocks it names from eviction in every tier
until the deadline, capped at ``policy.hint_max_s`` and renewable. Unbounded, a tenant that
hinted every block it held, again before each deadline, kept them all and left the other
tenants no room to put in. The budget bounds the bytes of the blocks an owner's hints (and
pins, below) protect at once to ``policy.hint_max_share`` of the top tier's capacity (each
block counted as the slot it takes in the top tier, the capacity's unit: counted in its own
bytes, blocks smaller than their slots protected more than the share) where
tenants are configured, and not at all where they are not (the store keeps no budget then): one tenant has nobody to wall off, and a cap would only
cost it hits (replaying the public trace with a 30 s queue window and every hinted block
charged, a cap at half of L1 took heat at 1% of the unique blocks from 14.7% to 6.7% hits, at
0.9 of it to 7.9; the replayer models a node without tenants); nor is the top tier's size a
limit then, since a hint's blocks held only in lower tiers are charged too and the top tier
may be the GPU's. Blocks are charged to their owner (the tenant that stored them, whoever
names them in a hint), each once however often it is hinted, until its latest deadline has
passed (``now > until``, as a policy's hint protects a block while ``now <= until``).

Every owner's charges together are bounded too, to ``policy.hint_max_total_share`` of the top
tier (``total_limit_bytes``): with one owner's share alone, two tenants at half each (or more
at smaller shares) could still protect the whole tier between them, and a tier wholly
protected refuses every put until the deadlines pass. Whatever the owners hint, that much of
the tier stays open to eviction. The total is first come, first served: an owner under its
own share gets no protection once the others have taken the total (its hints still promote);
within one hint it goes to the blocks in the order named, whoever owns them.

A hint past the budget protects the blocks that fit, in the order named (an engine names a
prompt's chain root first, and a chain's head is what a later request reuses most), and the
rest not; they are still promoted. A block already protected stays so, its deadline moved
to the later one at no new cost.

Pins (``Lookup(pin=true)``: a lease's blocks, until it is released, expires or its session
ends) take their room in the same budget: each pinned block is charged to its owner once,
however many leases pin it and whether a hint protects it too, until the last pin is gone and
its hint's deadline has passed. Leases were bounded only by the memory of their records, so
one tenant that pinned every block it held, again before each lease expired, left every other
tenant's put REJECTED_FULL; and with budgets of their own, a tenant pinning half the tier and
hinting the other half held all of it. A pin is all or nothing (``pin``): a lease whose new
blocks do not fit is refused, which the service answers RESOURCE_EXHAUSTED, rather than one
that pins only some of what the lookup found.

Bookkeeping: one deadline, pin count, charged size and owner per block id, and a heap with one entry per
charged block (an entry whose block's deadline moved on since is pushed again with the new
one when it comes up, so renewals do not grow the heap). A block the store drops while it is
charged (``forget``, before its id is reused) leaves its charge with its owner until the
deadline (at most ``policy.hint_max_s``), detached from the id: the block that takes the id
next is new here, charged to its own owner when hinted. The budget is conservative, never
more generous.
"""

from __future__ import annotations

import heapq
import math

import numpy as np


class HintBudget:
    """Protected bytes per owner, against a limit. Thread-safety: none; the event loop's."""

    __slots__ = (
        "_bytes",
        "_detached",
        "_heap",
        "_owner",
        "_pins",
        "_until",
        "limit_bytes",
        "total_limit_bytes",
        "used",
    )

    def __init__(self, limit_bytes: int, total_limit_bytes: int | None = None) -> None:
        """``limit_bytes``: what one owner's hints may protect; ``total_limit_bytes``: what
        every owner's together may (None: ``limit_bytes`` times the owners, no bound)."""
        self.limit_bytes = limit_bytes
        self.total_limit_bytes = total_limit_bytes
        self._until = np.full(0, -math.inf)
        self._bytes = np.zeros(0, dtype=np.int64)
        self._owner = np.zeros(0, dtype=np.int64)
        self._pins = np.zeros(0, dtype=np.int64)
        self._heap: list[tuple[float, int]] = []
        # Charges of dropped blocks, until their deadlines: (until, owner, bytes).
        self._detached: list[tuple[float, int, int]] = []
        # Bytes charged per owner index (grown as owners appear).
        self.used = np.zeros(0, dtype=np.int64)

    def admit(
        self, bids: np.ndarray, owners: np.ndarray, nbytes: np.ndarray, until: float, now: float
    ) -> np.ndarray:
        """The mask of ``bids`` a hint until ``until`` may protect: those already protected
        (their deadline moves to ``until`` if later) and, in order, the new ones that fit
        their owner's budget and the total (charged from now). A block named twice counts
        once."""
        self._expire(now)
        bids = np.asarray(bids, dtype=np.int64)
        if len(bids) == 0:
            return np.zeros(0, dtype=bool)
        _, first = np.unique(bids, return_index=True)
        first.sort()
        u, u_owner = bids[first], np.asarray(owners, dtype=np.int64)[first]
        u_bytes = np.asarray(nbytes, dtype=np.int64)[first]
        self._fit(int(u.max()) + 1, int(u_owner.max()) + 1)
        hinted = self._until[u] >= now  # protected up to its deadline, as policies' hints
        live = hinted | (self._pins[u] > 0)
        # A block charged by its pins alone needs a heap entry for its deadline now.
        for bid in u[live & ~hinted].tolist():
            heapq.heappush(self._heap, (until, bid))
        self._until[u[live]] = np.maximum(self._until[u[live]], until)
        new = ~live
        admit = live.copy()
        for owner in np.unique(u_owner[new]).tolist():
            mine = np.flatnonzero(new & (u_owner == owner))
            room = self.limit_bytes - int(self.used[owner])
            fits = mine[np.cumsum(u_bytes[mine]) <= room]  # a prefix: sizes are positive
            admit[fits] = True
        if self.total_limit_bytes is not None:
            # What every owner's share admits, cut to the total in the order named (``u`` is
            # in first-named order): a chain's head before its descendants, whoever owns them.
            left = self.total_limit_bytes - int(self.used.sum())
            cand = np.flatnonzero(admit & new)
            admit[cand[np.cumsum(u_bytes[cand]) > left]] = False
        took = admit & new
        np.add.at(self.used, u_owner[took], u_bytes[took])
        charged = u[took]
        self._until[charged] = until
        self._bytes[charged] = u_bytes[took]
        self._owner[charged] = u_owner[took]
        for bid in charged.tolist():
            heapq.heappush(self._heap, (until, bid))
        return admit if len(u) == len(bids) else np.isin(bids, u[admit])

    def pin(self, bids: np.ndarray, owners: np.ndarray, nbytes: np.ndarray, now: float) -> bool:
        """Pin ``bids`` (distinct ids) if their owners' budgets and the total take the blocks
        not yet charged; False, changing nothing, if not."""
        self._expire(now)
        bids = np.asarray(bids, dtype=np.int64)
        if len(bids) == 0:
            return True
        owners = np.asarray(owners, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        top = int(owners.max())
        self._fit(int(bids.max()) + 1, top + 1)
        new = (self._until[bids] < now) & (self._pins[bids] == 0)
        if new.any():
            new_owners, new_bytes = owners[new], nbytes[new]
            if top == int(owners.min()):  # one owner (a lookup names one namespace)
                need_total = int(new_bytes.sum())
                if int(self.used[top]) + need_total > self.limit_bytes:
                    return False
            else:
                need = np.zeros(len(self.used), dtype=np.int64)
                np.add.at(need, new_owners, new_bytes)
                if ((need > 0) & (self.used + need > self.limit_bytes)).any():
                    return False
                need_total = int(need.sum())
            total = self.total_limit_bytes
            if total is not None and need_total + int(self.used.sum()) > total:
                return False
            if top == int(owners.min()):
                self.used[top] += need_total
            else:
                np.add.at(self.used, new_owners, new_bytes)
            charged = bids[new]
            self._bytes[charged] = new_bytes
            self._owner[charged] = new_owners
        self._pins[bids] += 1
        return True

    def unpin(self, bids: np.ndarray, now: float, counts: np.ndarray | int = 1) -> None:
        """Take ``counts`` pins (one each, or one count per id) off each of ``bids`` (distinct
        ids, pinned); a block left with neither a pin nor a live hint gives its charge
        back."""
        bids = np.asarray(bids, dtype=np.int64)
        if len(bids) and int(bids.max()) >= len(self._pins):
            kept = bids < len(self._pins)
            bids = bids[kept]
            counts = counts if isinstance(counts, int) else counts[kept]
        pins = self._pins[bids] - counts
        self._pins[bids] = pins
        free = bids[(pins == 0) & (self._until[bids] < now)]
        if len(free):
            owners = self._owner[free]
            if (first := int(owners[0])) == int(owners.max()) == int(owners.min()):
                self.used[first] -= int(self._bytes[free].sum())
            else:
                np.subtract.at(self.used, owners, self._bytes[free])
            self._until[free] = -math.inf
            self._bytes[free] = 0

    def pins(self, rows: int) -> np.ndarray:
        """The pin count of the first ``rows`` ids, for the store's invariant check."""
        out = np.zeros(rows, dtype=np.int64)
        n = min(rows, len(self._pins))
        out[:n] = self._pins[:n]
        return out

    def charged(self, owner: int, now: float) -> int:
        """Bytes ``owner``'s protected blocks hold against the budget now."""
        self._expire(now)
        return int(self.used[owner]) if owner < len(self.used) else 0

    def charged_total(self, now: float) -> int:
        """Bytes every owner's protected blocks hold together now."""
        self._expire(now)
        return int(self.used.sum())

    def forget(self, bid: int) -> None:
        """The store dropped block ``bid`` (its id may now be reused for another block): a
        charge it holds stays with its owner until its deadline, no longer with the id.
        Before, the block that took the id next was "already protected" when hinted, at no
        charge to its own owner, and kept the first owner charged for as long as it was
        hinted again."""
        if bid < len(self._bytes) and self._bytes[bid]:
            heapq.heappush(
                self._detached,
                (float(self._until[bid]), int(self._owner[bid]), int(self._bytes[bid])),
            )
            self._until[bid] = -math.inf
            self._bytes[bid] = 0  # its heap entry, when it comes up, releases nothing
        if bid < len(self._pins):
            self._pins[bid] = 0  # pins keep their blocks, so none should be left

    def _expire(self, now: float) -> None:
        detached = self._detached
        while detached and detached[0][0] < now:
            _, owner, nbytes = heapq.heappop(detached)
            self.used[owner] -= nbytes
        heap, until = self._heap, self._until
        while heap and heap[0][0] < now:
            _, bid = heapq.heappop(heap)
            if until[bid] >= now:  # renewed since: its entry goes back with the new deadline
                heapq.heappush(heap, (float(until[bid]), bid))
                continue
            if self._pins[bid] > 0:  # pinned still: charged until the last unpin
                until[bid] = -math.inf
                continue
            self.used[self._owner[bid]] -= self._bytes[bid]
            until[bid] = -math.inf
            self._bytes[bid] = 0

    def _fit(self, rows: int, owners: int) -> None:
        if rows > len(self._until):
            n = max(rows, 2 * len(self._until), 1024)
            self._until = np.concatenate([self._until, np.full(n - len(self._until), -math.inf)])
            self._bytes = np.concatenate([self._bytes, np.zeros(n - len(self._bytes), np.int64)])
            self._owner = np.concatenate([self._owner, np.zeros(n - len(self._owner), np.int64)])
            self._pins = np.concatenate([self._pins, np.zeros(n - len(self._pins), np.int64)])
        if owners > len(self.used):
            self.used = np.concatenate([self.used, np.zeros(owners - len(self.used), np.int64)])
