"""A frozen copy of ``kvtier.daemon.policy.heat`` as it was before owed raises (commit
746bff7), for tests only: the reference whose decisions the policy must keep.

It raises every ancestor at once when a key rises (``_propagate`` walks up the chain), which
costs O(n^2) for a chain of n blocks touched root first, but is simple enough to trust. Only
the registration is taken out and the class renamed, and equal keys go to the block inserted
first, as in the policy since 8db06db (they went to the lower id, which in the daemon is a
reused row); keep the rest as it was. Its own module docstring follows.

The ``heat`` policy (the daemon's default): decayed heat, prefix chains, and an adaptive
split between blocks seen once and blocks seen again.

Ranking. Each block's heat is its decayed access count (``kvtier.daemon.heat.HeatTable``).
Blocks are ordered by the time-invariant key ``log2(heat) + last_access / half_life_s``, so
the order never needs re-sorting as time passes; a key only grows, when its block is accessed.

Chain rule. KV blocks form prefix chains and a child is useless without its parent, so a
parent must never rank colder than a child: each block's *effective* key is the maximum of
its own key and its resident descendants' (propagated up when a key grows; a parent whose
child left keeps the higher key, which errs on the safe side), and a block's segment is never
below its child's (protecting a block protects its ancestors). Equal effective keys rank the
deeper block colder, so a chain is eaten from its leaf.

Two segments (the ARC idea, with heat inside). A block enters *probation*, unless a previous
access of it lies within the last ``memory_factor`` cache-fulls of accesses or it returns
from a shadow, in which case it enters *protected*; a probation block accessed again moves to
protected. Most first-time blocks of KV traffic are never read again (one-off prompts, the
last turn of a conversation), while blocks read twice usually are, which is what the split
buys. A target size ``p`` of probation adapts as in ARC: a block evicted from probation that
returns while still in that segment's *shadow* (its last ``shadow_fraction`` * capacity
evictions) means probation was too small, and ``p`` grows by ``probation_gain``; one
returning from protected's shadow shrinks ``p``. ``victims`` takes probation's coldest block
while probation is above ``p``, else protected's, with two exceptions that keep heat and the
chain rule in charge: a protected block whose heat has fallen ``protection_halvings``
halvings below probation's coldest goes first (its protection has run out), and a protected
block with a child in probation waits for that child.

Atomicity and cost. ``victims`` never changes what the policy decides later. Each segment
keeps a sorted *candidate buffer* of its coldest blocks (those with effective key at or below
the buffer's ``bound``); entries go stale when a block's key changes or it leaves, and are
checked on read. A block whose key becomes at most ``bound`` is inserted into the buffer at
its place, so every resident block colder than ``bound`` is in the buffer. An exhausted
buffer is rebuilt by one ``argpartition`` over the segment. A victim thus costs O(1) Python
steps amortised plus a vectorised rebuild per buffer's worth of evictions; no per-eviction O(n)
loop. ``touch_many`` (a Lookup's blocks) leaves exactly the state of a loop of ``touch`` but
does the common steps (a protected block's key rising, a block leaving probation under a
parent that ranks higher) as array operations, and only the rare ones (a key at or below a
buffer's bound, a parent to raise or protect) one by one.

Id reuse. Links and histories are per block id, and the daemon reuses ids. A parent link is
followed only while the parent is resident and was inserted before the child (a parent
removed and re-inserted, or a freed id reused, is newer than its old children). Heat history
and the "seen" record outlive residency on purpose (that is how a returning block is
recognised); the store must call ``forget`` when it frees an id so the next block on that row
starts cold.

Thread-safety: none; the owner serialises calls.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.daemon.heat import HeatTable
from kvtier.daemon.policy.base import EvictableFn

# Segments, also the values of the per-block ``_seg`` array (0: not resident).
_OUT = 0
_PROBATION = 1
_PROTECTED = 2

_NEVER_SEEN = -(1 << 62)
_MIN_BUFFER = 64
# Candidates are checked against the evictable mask in batches of at least this many.
_MASK_BATCH = 32

# touch_many: below this many blocks the scalar loop is as fast; when more than one step in
# _DENSE_ODD must run singly, so is it; and a batch is planned at most _MAX_PLANS times.
_VECTOR_MIN = 8
_DENSE_ODD = 8
_MAX_PLANS = 4

DEFAULT_HALF_LIFE_S = 30.0


@dataclass(frozen=True, slots=True)
class HeatStats:
    capacity_blocks: int
    target_probation: float
    probation: int
    protected: int
    buffer_rebuilds: int


@dataclass(slots=True)
class _Buffer:
    """Coldest-first ``(effective key, -depth, insertion number, bid)`` entries of one
    segment from ``cur`` on.

    Invariant: every block of the segment whose effective key is at most ``bound`` has a
    current entry here (``bound`` is +inf when the buffer covers the whole segment).
    """

    entries: list[tuple[float, int, int, int]] = field(default_factory=list)
    cur: int = 0
    bound: float = -math.inf
    complete: bool = False


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the steps of a ``touch_many`` batch from some position on would do, per step
    (see ``HeatPolicy._settle``). ``bulk``: the step's effect is known in advance; ``acts``:
    a bulk step that writes ``new_eff``; ``leaves``: one that moves its block from probation
    to protected; ``drops``: one that, doing so, takes one off its ``parent``'s
    probation-children count; ``unlinks``: one that finds its parent link dead and clears it
    (None where no step would).
    """

    bulk: np.ndarray
    acts: np.ndarray
    leaves: np.ndarray
    unlinks: np.ndarray | None  # None: none
    drops: np.ndarray | None  # None: no step leaves probation
    bids: np.ndarray
    parent: np.ndarray
    new_eff: np.ndarray


class EagerHeatPolicy:
    """Parameters (all optional; unknown ones are ignored):

    half_life_s: heat half-life (30 s). How much past accesses count against recency. Heat
        only orders blocks within a segment (the split already separates once-seen from
        seen-again blocks), so the half-life is short: a minute-old access still counts a
        quarter, and a finished conversation's blocks cool within minutes instead of
        outliving fresher ones. Replays are insensitive to it between 1 and 60 s; at 300 s
        and more, old frequency starts to crowd out recency and the hit ratio drops.
    capacity_blocks: the tier's size. Bounds ``p`` and sizes the shadows and the memory
        window; None (the store today) uses the most blocks ever resident at once, which is
        the capacity once the tier has filled.
    probation_gain: step of ``p`` per shadow hit (1, ARC's step).
    shadow_fraction: shadow length of each segment as a fraction of the capacity (0.5: both
        shadows together remember one capacity of ids, as ARC's ghost lists do).
    memory_factor: how far back, in cache-fulls of accesses, a previous access makes a block
        "seen" (5: TinyLFU's sketch, sampled over 10 cache-fulls and halved every 5, forgets
        a single access within that horizon).
    protection_halvings: how far a protected block's heat may fall below probation's
        coldest before its protection runs out (3: an eighth, i.e. three half-lives idle).
    initial_ids: initial size of the per-id arrays (they grow by doubling).
    """

    default_admission = "always"

    # Per-id arrays (see _alloc) and their memoryviews (typed Any: memoryview's stubs
    # assume byte-sized integer items).
    _eff: np.ndarray  # effective key: own heat key raised by resident descendants'
    _seg: np.ndarray  # segment, or _OUT
    _ghost: np.ndarray  # segment the block was last evicted from, while not resident
    _depth: np.ndarray  # position in its resident chain (0: no resident parent)
    _parent: np.ndarray  # parent id, -1 once the link is known dead
    _ins: np.ndarray  # insertion sequence number: tells a parent from a reused id
    _seen: np.ndarray  # access sequence number of the last access
    _gseq: np.ndarray  # the segment's eviction count when the block was evicted
    _kids: np.ndarray  # resident children in probation (linked)
    _eff_v: Any
    _seg_v: Any
    _ghost_v: Any
    _depth_v: Any
    _parent_v: Any
    _ins_v: Any
    _seen_v: Any
    _gseq_v: Any
    _kids_v: Any

    def __init__(
        self,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        capacity_blocks: int | None = None,
        probation_gain: float = 1.0,
        shadow_fraction: float = 0.5,
        memory_factor: float = 5.0,
        initial_ids: int = 1024,
        protection_halvings: float = 3.0,
        **_: object,
    ) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        if probation_gain < 0 or shadow_fraction < 0 or memory_factor < 0:
            raise ValueError("probation_gain, shadow_fraction and memory_factor must be >= 0")
        self.heat = HeatTable(half_life_s, initial_ids)
        self._fixed_capacity = capacity_blocks
        self._gain = probation_gain
        self._halvings = protection_halvings
        self._shadow_fraction = shadow_fraction
        self._memory_factor = memory_factor
        self._high_water = 0
        self._p = 0.0
        self._count = [0, 0, 0]
        self._evictions = [0, 0, 0]
        self._accesses = 0
        self._inserts = 0
        self._rebuilds = 0
        self._bufs = [_Buffer(), _Buffer(), _Buffer()]
        self._size = 0
        self._alloc(len(self.heat))

    # ------------------------------------------------------------------ protocol

    @property
    def capacity(self) -> int:
        return self._fixed_capacity or max(self._high_water, 1)

    def insert(self, bid: int, now: float, parent: int = -1) -> None:
        if bid >= self._size:
            self._grow(bid + 1)
        seg_v = self._seg_v
        if seg_v[bid] != _OUT:
            self.touch(bid, now)
            return
        # Per-access path: locals and memoryviews keep it to a few microseconds.
        cap = self._fixed_capacity or max(self._high_water, 1)
        self._accesses += 1
        ghost_v = self._ghost_v
        ghost = ghost_v[bid]
        returning = False
        if ghost != _OUT:
            returning = self._in_shadow(bid, ghost, cap)
            if returning:
                if ghost == _PROBATION:
                    self._p = min(float(cap), self._p + self._gain)
                else:
                    self._p = max(0.0, self._p - self._gain)
            ghost_v[bid] = _OUT
        seen_v = self._seen_v
        linked = 0 <= parent < self._size and seg_v[parent] != _OUT
        if returning or self._accesses - seen_v[bid] <= self._memory_factor * cap:
            seg = _PROTECTED
        else:
            seg = _PROBATION
        seen_v[bid] = self._accesses
        key = self.heat.record_one(bid, now)
        self._inserts += 1
        self._ins_v[bid] = self._inserts
        depth = 0
        self._kids_v[bid] = 0
        if linked:
            depth = min(self._depth_v[parent] + 1, 1 << 30)
            self._parent_v[bid] = parent
            if seg == _PROBATION:
                self._kids_v[parent] += 1
        else:
            self._parent_v[bid] = -1
        self._depth_v[bid] = depth
        seg_v[bid] = seg
        count = self._count
        count[seg] += 1
        if count[1] + count[2] > self._high_water:
            self._high_water = count[1] + count[2]
        self._eff_v[bid] = key
        if key <= self._bufs[seg].bound:
            self._note_key(bid, seg, key, depth)
        if linked and (
            self._eff_v[parent] < key or (seg == _PROTECTED and seg_v[parent] == _PROBATION)
        ):
            self._propagate(bid, key, seg == _PROTECTED)

    def touch(self, bid: int, now: float) -> None:
        seg = self._seg_v[bid] if 0 <= bid < self._size else _OUT
        if seg == _OUT:
            raise KeyError(bid)
        self._accesses += 1
        self._seen_v[bid] = self._accesses
        self._rekey(bid, self.heat.record_one(bid, now))

    def touch_many(self, bids: np.ndarray, now: float) -> None:
        """``touch`` each block of ``bids`` in order, vectorised: the state afterwards is
        exactly the loop's (see ``_settle``). Raises KeyError for the first id (in order)
        that is not resident, before changing anything. Small batches and batches with
        repeats (which see each other's heat) run the loop itself."""
        ids = np.asarray(bids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            return
        if ids.min() < 0 or ids.max() >= self._size or not self._seg[ids].all():  # 0: _OUT
            ok = (ids >= 0) & (ids < self._size)
            ok[ok] = self._seg[ids[ok]] != _OUT
            raise KeyError(int(ids[np.argmin(ok)]))
        locate = self._locator(ids) if n >= _VECTOR_MIN else None
        if locate is None:
            for bid in ids.tolist():
                self.touch(bid, now)
            return
        self._seen[ids] = np.arange(self._accesses + 1, self._accesses + n + 1)
        self._accesses += n
        self._settle(ids, self.heat.record_distinct(ids, now), locate)

    def remove(self, bid: int) -> None:
        seg = self._seg_v[bid] if 0 <= bid < self._size else _OUT
        if seg == _OUT:
            raise KeyError(bid)
        if seg == _PROBATION:
            self._drop_kid(bid)
        self._seg_v[bid] = _OUT
        self._count[seg] -= 1
        self._evictions[seg] += 1
        self._ghost_v[bid] = seg
        self._gseq_v[bid] = self._evictions[seg]

    def forget(self, bid: int) -> None:
        if not 0 <= bid < self._size or self._seg_v[bid] != _OUT:
            return
        self._ghost_v[bid] = _OUT
        self._seen_v[bid] = _NEVER_SEEN
        self.heat.reset(bid)

    def victims(
        self,
        n: int,
        now: float,
        evictable: EvictableFn | None,
        incoming: Sequence[int] = (),
    ) -> np.ndarray | None:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        n1, n2 = self._count[_PROBATION], self._count[_PROTECTED]
        if n > n1 + n2:
            return None
        if n == 1 and evictable is None:
            # The replayer's path: one victim, every block evictable.
            p, from_protected = self._p, False
            b = incoming[0] if len(incoming) == 1 else -1
            if b < 0 or (b < self._size and self._ghost_v[b] != _OUT):
                p, from_protected = self._adapted_target(incoming)
            _, bid = self._pick(n1, p, from_protected, self._coldest)
            return np.array([bid], dtype=np.int64) if bid >= 0 else None
        p, from_protected = self._adapted_target(incoming)
        scans = {
            _PROBATION: self._candidates(_PROBATION, evictable),
            _PROTECTED: self._candidates(_PROTECTED, evictable),
        }
        heads = {_PROBATION: -2, _PROTECTED: -2}  # -2: not looked at yet

        def head(seg: int) -> int:
            if heads[seg] == -2:
                heads[seg] = next(scans[seg], -1)
            return heads[seg]

        out: list[int] = []
        while len(out) < n:
            seg, bid = self._pick(n1, p, from_protected, head)
            if bid < 0:
                return None
            heads[seg] = -2
            if seg == _PROBATION:
                n1 -= 1
            else:
                n2 -= 1
            from_protected = False  # ARC's tie rule concerns the first choice only
            out.append(bid)
        return np.asarray(out, dtype=np.int64)

    def __len__(self) -> int:
        return self._count[_PROBATION] + self._count[_PROTECTED]

    def __contains__(self, bid: object) -> bool:
        if not isinstance(bid, (int, np.integer)) or not 0 <= bid < self._size:
            return False
        return bool(self._seg_v[int(bid)] != _OUT)

    # ---------------------------------------------------------------- inspection

    def stats(self) -> HeatStats:
        return HeatStats(
            self.capacity,
            self._p,
            self._count[_PROBATION],
            self._count[_PROTECTED],
            self._rebuilds,
        )

    def effective_key(self, bid: int) -> float:
        """The block's rank key (its own heat key raised by its descendants')."""
        if bid not in self:
            raise KeyError(bid)
        return float(self._eff_v[bid])

    def order(self) -> np.ndarray:
        """All resident ids, coldest first within each segment, probation first. O(n log n);
        for tests and debugging."""
        parts = []
        for seg in (_PROBATION, _PROTECTED):
            ids = np.flatnonzero(self._seg[: self._size] == seg)
            parts.append(ids[np.lexsort((self._ins[ids], -self._depth[ids], self._eff[ids]))])
        return np.concatenate(parts)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of per-id state: the heat table plus this policy's own arrays."""
        own = sum(a.itemsize for a in self._arrays())
        return self.heat.bytes_per_block + own

    # ------------------------------------------------------------------- helpers

    def _pick(
        self, n1: int, p: float, from_protected: bool, head: Callable[[int], int]
    ) -> tuple[int, int]:
        """The segment and block of the next victim, given each segment's coldest candidate
        (``head``, -1 if none) and probation's size ``n1``; (-1, -1) if there is none.

        ARC's rule picks the segment; two exceptions keep heat and the chain rule in charge:
        a protected block whose heat has decayed far below probation's coldest goes first,
        and a protected block whose child is in probation waits for that child.
        """
        seg = _PROBATION if n1 >= 1 and (n1 > p or (from_protected and n1 == p)) else _PROTECTED
        bid = head(seg)
        if bid >= 0:
            if seg == _PROBATION:
                other = head(_PROTECTED)
                if other >= 0 and self._stale(other, bid):
                    return _PROTECTED, other
            elif self._kids_v[bid] > 0:
                other = head(_PROBATION)
                if other >= 0:
                    return _PROBATION, other
            return seg, bid
        seg = 3 - seg
        bid = head(seg)
        return (seg, bid) if bid >= 0 else (-1, -1)

    def _drop_kid(self, bid: int) -> None:
        """``bid`` leaves probation: its parent has one child fewer there."""
        parent = self._parent_v[bid]
        if parent >= 0 and self._seg_v[parent] != _OUT and self._ins_v[parent] < self._ins_v[bid]:
            self._kids_v[parent] -= 1

    def _leave_probation(self, bid: int) -> None:
        """Move ``bid`` from probation to protected."""
        self._drop_kid(bid)
        self._seg_v[bid] = _PROTECTED
        self._count[_PROBATION] -= 1
        self._count[_PROTECTED] += 1

    def _stale(self, protected: int, probation: int) -> bool:
        """Has the protected block's heat decayed below the probation block's by more than
        ``protection_halvings`` halvings? Then it no longer earns its protection."""
        return bool(self._eff_v[protected] < self._eff_v[probation] - self._halvings)

    def _returning_from(self, bid: int) -> int:
        """The segment whose shadow still holds ``bid``, or _OUT."""
        if not 0 <= bid < self._size or self._seg_v[bid] != _OUT:
            return _OUT
        ghost = self._ghost_v[bid]
        if ghost == _OUT or not self._in_shadow(bid, ghost, self.capacity):
            return _OUT
        return int(ghost)

    def _in_shadow(self, bid: int, ghost: int, cap: int) -> bool:
        return self._evictions[ghost] - self._gseq_v[bid] < self._shadow_fraction * cap

    def _adapted_target(self, incoming: Sequence[int]) -> tuple[float, bool]:
        """``p`` as it will be once ``incoming`` are inserted, and whether the first of them
        returns from protected's shadow; nothing is stored."""
        p, cap = self._p, float(self.capacity)
        from_protected = False
        if len(incoming) == 1 and not 0 <= incoming[0] < self._size:
            return p, False
        for i, bid in enumerate(incoming):
            ghost = self._returning_from(bid)
            if ghost == _PROBATION:
                p = min(cap, p + self._gain)
            elif ghost == _PROTECTED:
                p = max(0.0, p - self._gain)
                from_protected = from_protected or i == 0
        return p, from_protected

    def _locator(self, ids: np.ndarray) -> Callable[[np.ndarray], np.ndarray] | None:
        """A function giving the positions in ``ids`` of some resident ids (-1 where absent),
        or None if ``ids`` has repeats."""
        ins = self._ins[ids]
        if (ins[1:] > ins[:-1]).all():
            # Insertion order, as a chain root first always is: distinct, and sorted by ins.
            def by_ins(find: np.ndarray) -> np.ndarray:
                j = np.minimum(np.searchsorted(ins, self._ins[find]), len(ids) - 1)
                return np.where(ids[j] == find, j, -1)

            return by_ins
        order = np.argsort(ids)
        ranked = ids[order]
        if (ranked[1:] == ranked[:-1]).any():
            return None

        def by_id(find: np.ndarray) -> np.ndarray:
            j = np.minimum(np.searchsorted(ranked, find), len(ids) - 1)
            return np.where(ranked[j] == find, order[j], -1)

        return by_id

    def _settle(
        self, ids: np.ndarray, keys: np.ndarray, locate: Callable[[np.ndarray], np.ndarray]
    ) -> None:
        """``_rekey(ids[i], keys[i])`` for each i in order, mostly vectorised: the batch half
        of ``touch_many``. ``ids`` are distinct and resident; ``locate`` finds ids in it.

        Exactness. ``_plan`` marks the steps whose whole effect it can tell in advance
        ("bulk"): a protected block whose key does not rise (no effect), or a block whose new
        effective key lies above the protected buffer's bound (no ``_note_key``) and whose
        parent is absent, dead (the step unlinks it) or protected with an effective key at
        least as high (``_propagate`` stops there). Such a step writes its own block's
        entries and never another's, except a parent's probation-children count, which only
        ``victims`` reads. It reads its parent as the scalar loop would find it: as at the
        start, or as left by the parent's own step earlier in the batch. Every other step is
        run by ``_rekey`` itself, after the bulk steps before it are applied, so it sees the
        state the loop would. Only such a step's ``_propagate`` may change blocks that later
        steps read (their own or their parents' keys and segments); when it changed any, the
        rest of the batch is planned again from the state as it then is. The buffers'
        ``bound`` only falls during a batch (a full complete buffer is dropped), so a bulk
        step stays above it.
        """
        n = len(ids)
        start = 0
        for _ in range(_MAX_PLANS):
            plan = self._plan(ids, keys, start, locate)
            odd = np.flatnonzero(~plan.bulk)
            if len(odd) * _DENSE_ODD > n - start:
                break  # mostly scalar steps: applying the bulk runs between them costs more
            done = 0
            for r, bid, key in zip(
                odd.tolist(), ids[start + odd].tolist(), keys[start + odd].tolist(), strict=True
            ):
                self._apply(plan, done, r)
                done = r + 1
                if self._rekey(bid, key):
                    break
            else:
                self._apply(plan, done, n - start)
                return
            start += done
            if start == n:
                return
        for bid, key in zip(ids[start:].tolist(), keys[start:].tolist(), strict=True):
            self._rekey(bid, key)

    def _plan(
        self,
        ids: np.ndarray,
        keys: np.ndarray,
        start: int,
        locate: Callable[[np.ndarray], np.ndarray],
    ) -> _Plan:
        """Which steps of ``ids[start:]`` are bulk and what they write, judged on the state
        now (the steps before ``start`` are done); see ``_settle``."""
        bids, key = ids[start:], keys[start:]
        seg, eff = self._seg[bids], self._eff[bids]
        new_eff = np.maximum(eff, key)
        parent = self._parent[bids]
        has = parent >= 0
        pid = np.where(has, parent, 0)
        pseg, pins, ins = self._seg[pid], self._ins[pid], self._ins[bids]
        dead = has & ((pseg == _OUT) | (pins > ins))
        linked = has & ~dead
        # The parent as the step finds it: touched earlier in the batch, it is protected
        # and its effective key is at least its own new one. Mostly it is the block of the
        # step just before (a chain, root first).
        peff = self._eff[pid]
        earlier = np.zeros(len(bids), dtype=bool)
        earlier[1:] = linked[1:] & (pid[1:] == bids[:-1])
        peff[1:] = np.where(earlier[1:], new_eff[:-1], peff[1:])
        rest = np.flatnonzero(linked & ~earlier)
        if len(rest):
            # (A parent stepped before ``start`` is in the state already; max is a no-op.)
            at = locate(pid[rest])
            hit = (at >= 0) & (at < start + rest)
            if hit.any():
                steps = rest[hit]
                earlier[steps] = True
                peff[steps] = np.maximum(peff[steps], keys[at[hit]])
        stops = ~linked | ((earlier | (pseg == _PROTECTED)) & (peff >= new_eff))
        still = (seg == _PROTECTED) & (key <= eff)
        acts = ~still & (new_eff > self._bufs[_PROTECTED].bound) & stops
        leaves = acts & (seg == _PROBATION)
        return _Plan(
            bulk=still | acts,
            acts=acts,
            leaves=leaves,
            unlinks=acts & dead if dead.any() else None,
            drops=leaves & has & (pseg != _OUT) & (pins < ins) if leaves.any() else None,
            bids=bids,
            parent=pid,
            new_eff=new_eff,
        )

    def _apply(self, plan: _Plan, lo: int, hi: int) -> None:
        """Apply the bulk steps ``lo:hi`` of ``plan`` (all bulk); see ``_settle``."""
        if hi <= lo:
            return
        part = slice(lo, hi)
        acts = plan.acts[part]
        if not acts.any():
            return
        bids = plan.bids[part]
        self._eff[bids[acts]] = plan.new_eff[part][acts]
        if plan.drops is not None:  # some leave probation
            leaves = plan.leaves[part]
            moved = int(np.count_nonzero(leaves))
            self._seg[bids[leaves]] = _PROTECTED
            self._count[_PROBATION] -= moved
            self._count[_PROTECTED] += moved
            # _drop_kid: siblings may share a parent, hence subtract.at.
            np.subtract.at(self._kids, plan.parent[part][plan.drops[part]], 1)
        if plan.unlinks is not None:
            self._parent[bids[plan.unlinks[part]]] = -1

    def _rekey(self, bid: int, key: float) -> int:
        """The part of ``touch`` after the heat table gave the resident ``bid`` its new
        ``key``; returns how many of its ancestors ``_propagate`` changed."""
        seg = self._seg_v[bid]
        eff = self._eff_v[bid]
        if key > eff:
            eff = key
            self._eff_v[bid] = eff
        elif seg == _PROTECTED:
            return 0  # nothing moved
        if seg == _PROBATION:
            self._leave_probation(bid)
        if eff <= self._bufs[_PROTECTED].bound:
            self._note_key(bid, _PROTECTED, eff, self._depth_v[bid])
        if self._parent_v[bid] >= 0:
            return self._propagate(bid, eff, True)
        return 0

    def _propagate(self, bid: int, key: float, protect: bool) -> int:
        """Raise the effective keys up the chain from ``bid`` to at least ``key`` and, when
        ``protect``, move ancestors still in probation to protected: a parent ranks at least
        as high as its child. Returns how many ancestors it raised or moved."""
        parent_v, seg_v, ins_v, eff_v = self._parent_v, self._seg_v, self._ins_v, self._eff_v
        child = bid
        changed = 0
        while True:
            parent = parent_v[child]
            if parent < 0:
                return changed
            seg = seg_v[parent]
            if seg == _OUT or ins_v[parent] > ins_v[child]:
                parent_v[child] = -1  # the link died: the parent left or the id was reused
                return changed
            promote = protect and seg == _PROBATION
            if eff_v[parent] >= key and not promote:
                return changed
            if promote:
                self._leave_probation(parent)
                seg = _PROTECTED
            if eff_v[parent] < key:
                eff_v[parent] = key
            self._note_key(parent, seg, eff_v[parent], self._depth_v[parent])
            changed += 1
            child = parent

    def _note_key(self, bid: int, seg: int, key: float, depth: int) -> None:
        """Keep the buffer invariant after ``bid`` got ``key`` in ``seg``."""
        buf = self._bufs[seg]
        if key <= buf.bound:
            bisect.insort(buf.entries, (key, -depth, self._ins_v[bid], bid), lo=buf.cur)
            if buf.complete and len(buf.entries) - buf.cur > 4 * _MIN_BUFFER:
                buf.bound = -math.inf  # too big to keep whole; the next read rebuilds it
                buf.complete = False
                buf.entries.clear()
                buf.cur = 0

    def _valid(self, seg: int, entry: tuple[float, int, int, int]) -> bool:
        bid = entry[3]
        return (
            self._seg_v[bid] == seg
            and self._eff_v[bid] == entry[0]
            and self._ins_v[bid] == entry[2]
        )

    def _coldest(self, seg: int) -> int:
        """The coldest block of ``seg`` or -1; drops stale entries at the buffer's head."""
        buf = self._bufs[seg]
        seg_v, eff_v, ins_v = self._seg_v, self._eff_v, self._ins_v
        while True:
            entries = buf.entries
            cur = buf.cur
            while cur < len(entries):
                key, _, ins, bid = entries[cur]
                if seg_v[bid] == seg and eff_v[bid] == key and ins_v[bid] == ins:
                    buf.cur = cur
                    return bid
                cur += 1
            buf.cur = cur
            if buf.complete or self._count[seg] == 0:
                return -1
            self._rebuild(seg, _MIN_BUFFER)

    def _candidates(self, seg: int, evictable: EvictableFn | None) -> Iterator[int]:
        """Valid, evictable blocks of ``seg``, coldest first, each once."""
        buf = self._bufs[seg]
        if self._coldest(seg) < 0:
            return
        yielded: set[int] = set()
        pending: list[int] = []
        i = buf.cur
        want = _MASK_BATCH
        while True:
            if i >= len(buf.entries):
                if pending:
                    yield from self._passing(pending, evictable, yielded)
                    pending = []
                if buf.complete:
                    return
                # Rebuilding only re-sorts what the segment holds; the decisions it leads to
                # are the ones a bigger buffer would have given.
                self._rebuild(seg, 4 * max(len(buf.entries) - buf.cur, _MIN_BUFFER))
                i = buf.cur
                continue
            entry = buf.entries[i]
            i += 1
            if entry[3] in yielded or not self._valid(seg, entry):
                continue
            if evictable is None:
                yielded.add(entry[3])
                yield entry[3]
                continue
            pending.append(entry[3])
            if len(pending) >= want:
                yield from self._passing(pending, evictable, yielded)
                pending = []
                want *= 2

    @staticmethod
    def _passing(
        bids: list[int], evictable: EvictableFn | None, yielded: set[int]
    ) -> Iterator[int]:
        arr = np.asarray(bids, dtype=np.int64)
        ok = arr if evictable is None else arr[evictable(arr)]
        for bid in ok.tolist():
            yielded.add(bid)
            yield bid

    def _rebuild(self, seg: int, want: int) -> None:
        """Refill ``seg``'s buffer with its ``want`` coldest blocks (ties included)."""
        self._rebuilds += 1
        buf = self._bufs[seg]
        ids = np.flatnonzero(self._seg[: self._size] == seg)
        keys = self._eff[ids]
        want = max(want, _MIN_BUFFER, len(ids) // 16)
        if len(ids) <= want:
            buf.bound = math.inf
            buf.complete = True
        else:
            kth = float(np.partition(keys, want - 1)[want - 1])
            near = keys <= kth
            ids, keys = ids[near], keys[near]
            buf.bound = kth
            buf.complete = False
        depth = self._depth[ids].astype(np.int64)
        ins = self._ins[ids]
        order = np.lexsort((ins, -depth, keys))
        buf.entries = list(
            zip(
                keys[order].tolist(),
                (-depth[order]).tolist(),
                ins[order].tolist(),
                ids[order].tolist(),
                strict=True,
            )
        )
        buf.cur = 0

    # ------------------------------------------------------------------- storage

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self._eff,
            self._seg,
            self._ghost,
            self._depth,
            self._parent,
            self._ins,
            self._seen,
            self._gseq,
            self._kids,
        )

    def _alloc(self, size: int) -> None:
        old = self._size
        fresh: dict[str, np.ndarray] = {
            "_eff": np.full(size, -math.inf, dtype=np.float64),
            "_seg": np.zeros(size, dtype=np.int8),
            "_ghost": np.zeros(size, dtype=np.int8),
            "_depth": np.zeros(size, dtype=np.int32),
            "_parent": np.full(size, -1, dtype=np.int32),
            "_ins": np.zeros(size, dtype=np.int64),
            "_seen": np.full(size, _NEVER_SEEN, dtype=np.int64),
            "_gseq": np.zeros(size, dtype=np.int64),
            "_kids": np.zeros(size, dtype=np.int32),
        }
        for name, arr in fresh.items():
            if old:
                arr[:old] = getattr(self, name)[:old]
            setattr(self, name, arr)
            # Per-access code reads and writes through memoryviews: Python scalars at a
            # fraction of the cost of numpy's scalar indexing.
            setattr(self, name + "_v", arr.data)
        self._size = size

    def _grow(self, need: int) -> None:
        size = max(need, 2 * self._size)
        self.heat.ensure(size)
        self._alloc(size)
