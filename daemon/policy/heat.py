"""The ``heat`` policy (the daemon's default): decayed heat, prefix chains, and an adaptive
split between blocks seen once and blocks seen again.

Ranking. Each block's heat is its decayed access count (``kvtier.daemon.heat.HeatTable``).
Blocks are ordered by the time-invariant key ``log2(heat) + last_access / half_life_s``, so
the order never needs re-sorting as time passes; a key only grows, when its block is accessed.

Chain rule. KV blocks form prefix chains and a child is useless without its parent, so a
parent must never rank colder than a child: each block's *effective* key is the maximum of
its own key and its resident descendants' (propagated up when a key grows; a parent whose
child left keeps the higher key, which errs on the safe side), and a block's segment is never
below its child's (protecting a block protects its ancestors). Equal effective keys rank the
deeper block colder, so a chain is eaten from its leaf, then the one inserted first (not the
lower id: the daemon reuses rows, so the replayer's ids would order ties otherwise).

Owed raises. Raising the ancestors at once walks to the root whenever a deeper block ranks
above them, which is the common case (a conversation's blocks are stored one by one, each a
little later than its parent, then read root first): O(n^2) for a chain of n. Instead, a key
that rises above its parent's is *owed*: an entry ``c -> k`` in ``_owed_new`` or ``_owed``
says that every live ancestor of ``c`` ranks at least ``k``; one whose stored ``_eff`` is
lower *lags*. Segment moves are owed otherwise (see "Owed moves"). Payments walk hottest
first, each stopping at the first ancestor already at its key, so a payment raises a block at
most once: O(n) for a chain. Lags never reach a decision:

- ``victims`` first pays ``_owed_new`` only up to the first ancestor whose stored key lies
  above its *cutoff* (the protected buffer's bound if the ancestor is protected, the higher
  of both bounds if in probation), and keeps the rest hidden in ``_owed``. Invariant: a block
  lagging behind ``_owed`` ranks above its cutoff, so neither its stored key nor its paid one
  has a valid buffer entry, and ``victims`` (which reads valid entries, segments and counts)
  decides as if all were paid. It holds because going up a chain, stored keys fall only
  across an edge whose lower end is owed at least its own key, cutoffs never rise, stored
  keys only grow, and bounds only fall until a rebuild.
- ``_rebuild`` (whose bound may rise), ``effective_key`` and ``order`` pay everything first.
  ``remove`` of a block that might lag (above its cutoff) pays everything, since raises owed
  below it may pass through it; of any other, hands its own owed raise to its parent. Links
  die only by ``remove``, so payments follow the links the eager walks would have.
- Paid, each effective key is the maximum of the same raises as the eager walks', whatever
  their order. Under eviction, hidden raises wait for the next rebuild (typically a
  buffer's worth of evictions later, at least 64), which pays each chain once.

Owed moves. Protecting a block moves its ancestors in probation to protected. A block leaves
probation once per residency, so those walks cost O(1) amortised, but one walk may be a whole
chain: the first touch of a 200,000-block chain's leaf moved them all in one call, 0.2 s of
the daemon's loop. A walk moves at most ``_MOVE_BUDGET`` ancestors and stops at a moved block
``c``, keeping ``c -> k`` in ``_moving``: the walk ``_propagate(c, k, protect)`` would go on
is owed. ``work`` (which the daemon calls between requests, told by ``on_owed``) goes on with
such walks, a budget at a time; ``victims``, ``remove``, ``effective_key`` and ``order``
first make every move owed, so decisions and keys are the eager walks': a block leaves
probation at most once, each move raises its block to the walk's key whatever the order of
the walks, and no link dies while a walk is owed (only ``remove`` kills one). Between
requests the moves are made piecemeal; a ``victims`` that finds some still owed makes the
rest in one step.

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
loop. Hinted blocks (an engine's waiting queue) are *parked*: a scan that meets one under a
live hint takes its entry out of the buffer into a heap by deadline (a rebuild leaves them out
likewise), and the first ``victims`` call past the deadline puts the entry back at its place
if it is still current. So a waiting queue is walked once, not on every eviction, wherever
its blocks sit in the order. ``touch_many`` (a Lookup's blocks) leaves exactly the state of a loop of ``touch`` but
does the common steps (a protected block's key rising, a block leaving probation under a
protected parent, a raise owed to that parent) as array operations, and only the rare ones
(a key at or below a buffer's bound, a parent to protect) one by one.

Id reuse. Links and histories are per block id, and the daemon reuses ids. A parent link is
followed only while the parent is resident and was inserted before the child (a parent
removed and re-inserted, or a freed id reused, is newer than its old children). Heat history
and the "seen" record outlive residency on purpose (that is how a returning block is
recognised); the store must call ``forget`` when it frees an id so the next block on that row
starts cold, after ``remember`` where it keeps the dropped block's history for its key.

Thread-safety: none; the owner serialises calls.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kvtier.daemon.counts import add_at
from kvtier.daemon.heat import HeatTable
from kvtier.daemon.policy.base import NO_VICTIM, EvictableFn
from kvtier.daemon.policy.hints import Hinted, HintTable
from kvtier.daemon.policy.memento import SEQ_MOD, Kept, seq_ages

# Segments, also the values of the per-block ``_seg`` array (0: not resident).
_OUT = 0
_PROBATION = 1
_PROTECTED = 2

# Per-row sequence numbers (``_seen``, ``_gseq``) are uint32 residues (``seq_keep``, 0: none),
# read only as ages against the count of the day (``seq_ages``), which is exact while the age
# is below ``SEQ_MOD``. Every ``_AGE_OUT_EVERY`` accesses the rows whose age reached
# ``_AGE_OUT`` forget it (never seen, no ghost), so no stored age ever reaches ``SEQ_MOD``
# (evictions are never more than accesses). Decisions compare ages with
# ``memory_factor * capacity`` and ``shadow_fraction * capacity``: an age past ``_AGE_OUT`` is
# beyond both, and forgetting it decides alike, at any capacity below 400 million blocks.
_AGE_OUT = 1 << 31
_AGE_OUT_EVERY = 1 << 30
# ``_ins`` is a uint32: before the insertion count passes it, the resident blocks' numbers are
# renumbered densely in their order (only residents' are compared: ``_renumber_inserts``).
_INS_LIMIT = (1 << 32) - 1
_ONE = np.zeros(1, dtype=np.int64)
_MIN_BUFFER = 64
# A rebuilt buffer holds at least this fraction of its segment (``1 / _BUFFER_SHARE``): each
# entry is a Python tuple of about 180 bytes, so a sixteenth of the segment (the first
# choice) cost 11 bytes per resident block; a thirty-second costs 5.5, for a vectorised
# rebuild every 32nd of the segment's evictions instead of every 16th (a 64th, 3 bytes, made
# the replay sweep a few per cent slower, within the machine's noise).
_BUFFER_SHARE = 32
# Candidates are checked against the evictable mask in batches of at least this many.
_MASK_BATCH = 32

# touch_many: below this many blocks the scalar loop is as fast; when more than one step in
# _DENSE_ODD must run singly, so is it; and a batch is planned at most _MAX_PLANS times.
_VECTOR_MIN = 8
_DENSE_ODD = 8
_MAX_PLANS = 4

# Owed raises (see the module docstring): ``_owed_new`` is sorted out, and ``_owed`` paid,
# once it holds more than this many, so that a policy whose ``victims`` is never called (a
# tier not yet full) or rarely rebuilds stays small, and so does each payment's pause.
_OWED_LIMIT = 4096
# Owed moves (see the module docstring): a walk moves at most this many ancestors to
# protected per call (about 1 us each) and owes the rest.
_MOVE_BUDGET = 1024
# Below this many owed raises, Python's sort beats numpy's fixed cost.
_SORT_IN_NUMPY = 64

DEFAULT_HALF_LIFE_S = 30.0

# A dropped block's history (``remember``): name, dtype, value of a forgotten row.
_KEPT: list[tuple[str, Any, float]] = [
    ("_ghost", np.int8, _OUT),
    ("_gseq", np.uint32, 0),  # ``seq_keep``, as the rows keep them: 0 none
    ("_seen", np.uint32, 0),
    ("heat", np.float32, 0.0),
    ("last_access", np.float64, -math.inf),
]


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
    segment from ``cur`` on. Ties go to the block inserted first, never to the lower id: the
    daemon's ids are reused rows, whose order means nothing (the replayer's are first-seen
    order), so an id tie-break made the two decide differently.

    Invariant: every block of the segment whose effective key is at most ``bound`` has a
    current entry here (``bound`` is +inf when the buffer covers the whole segment).
    """

    entries: list[tuple[float, int, int, int]] = field(default_factory=list)
    cur: int = 0
    bound: float = -math.inf
    complete: bool = False
    # Bumped whenever ``entries`` is replaced: an entry parked before then is not put back
    # (the new entries already account for its block).
    gen: int = 0


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the steps of a ``touch_many`` batch from some position on would do, per step
    (see ``HeatPolicy._settle``). ``bulk``: the step's effect is known in advance; ``acts``:
    a bulk step that writes ``new_eff``; ``leaves``: one that moves its block from probation
    to protected; ``drops``: one that, doing so, takes one off its ``parent``'s
    probation-children count; ``unlinks``: one that finds its parent link dead and clears it;
    ``owes``: one that owes its parent its ``new_eff`` (None where no step would).
    """

    bulk: np.ndarray
    acts: np.ndarray
    leaves: np.ndarray
    unlinks: np.ndarray | None  # None: none
    drops: np.ndarray | None  # None: no step leaves probation
    owes: np.ndarray | None  # None: none
    bids: np.ndarray
    parent: np.ndarray
    new_eff: np.ndarray


class HeatPolicy(Hinted):
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
    _ins: np.ndarray  # insertion number (uint32): tells a parent from a reused id
    _seen: np.ndarray  # access count at the last access (``seq_keep``; 0: never)
    _gseq: np.ndarray  # its segment's eviction count when evicted (``seq_keep``)
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
        self._age_out_at = _AGE_OUT_EVERY  # access count of the next ``_age_out``
        self._rebuilds = 0
        self._bufs = [_Buffer(), _Buffer(), _Buffer()]
        # Owed raises, block -> key its resident ancestors owe (see the module docstring).
        # Each value is at most the block's stored ``_eff``.
        self._owed_new: dict[int, float] = {}  # not yet sorted out by ``_defer_owed``
        self._owed: dict[int, float] = {}  # every ancestor still lacking it is hidden
        # Owed moves, block -> key (see the module docstring): the walk resumes there.
        self._moving: dict[int, float] = {}
        # Called when moves become owed where none were (see "Owed work" in ``base``).
        self.on_owed: Callable[[], None] | None = None
        # Ancestors looked at by the chain walks (``_propagate``, ``_pay``): a cost measure.
        self.chain_steps = 0
        # Buffer entries looked at by victim scans under a mask or hints: a cost measure.
        self.scan_steps = 0
        self._hints = HintTable()
        # Parked entries of hinted blocks: (deadline, bid, segment, buffer gen, entry).
        self._parked: list[tuple[float, int, int, int, tuple[float, int, int, int]]] = []
        self._size = 0
        self._alloc(len(self.heat))
        # Histories of dropped blocks by memento slot (``remember``; their hints are kept
        # by ``_hints``).
        self._kept = Kept(_KEPT)

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
        if self._accesses >= self._age_out_at:
            self._age_out()
        ghost_v = self._ghost_v
        ghost = ghost_v[bid]
        returning = False
        if ghost != _OUT:
            # ``_in_shadow``, inline: most inserts of a full tier are of evicted blocks.
            gseq = self._gseq_v[bid]
            returning = (self._evictions[ghost] - gseq + 1) % SEQ_MOD < self._shadow_fraction * cap
            if returning:
                if ghost == _PROBATION:
                    self._p = min(float(cap), self._p + self._gain)
                else:
                    self._p = max(0.0, self._p - self._gain)
            ghost_v[bid] = _OUT
        seen_v = self._seen_v
        seen = seen_v[bid]
        acc = self._accesses
        linked = 0 <= parent < self._size and seg_v[parent] != _OUT
        if returning or (seen and (acc - seen + 1) % SEQ_MOD <= self._memory_factor * cap):
            seg = _PROTECTED
        else:
            seg = _PROBATION
        seen_v[bid] = acc % SEQ_MOD + 1  # seq_keep, inline
        key = self.heat.record_one(bid, now)
        if self._inserts >= _INS_LIMIT:
            self._renumber_inserts()
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
            if len(self._owed_new) > _OWED_LIMIT:
                self._defer_owed()

    def insert_many(self, bids: np.ndarray, now: float, parents: np.ndarray) -> None:
        """``insert`` each block of ``bids`` in order (``parents[i]`` its parent), leaving
        exactly the loop's state. A batch whose every step is plain (a distinct block not
        resident and without a ghost, whose parent, if linked, needs no raise: the blocks a
        Put stored, a batch demoted) is applied as array operations; any other runs the
        loop."""
        ids = np.asarray(bids, dtype=np.int64).reshape(-1)
        pars = np.asarray(parents, dtype=np.int64).reshape(-1)
        if len(ids) != len(pars):
            raise ValueError(f"{len(ids)} blocks but {len(pars)} parents")
        if len(ids) < _VECTOR_MIN or not self._insert_in_bulk(ids, pars, now):
            for bid, parent in zip(ids.tolist(), pars.tolist(), strict=True):
                self.insert(bid, now, parent)

    def _insert_in_bulk(self, ids: np.ndarray, pars: np.ndarray, now: float) -> bool:
        """``insert_many``'s array path; False, having changed nothing the loop would see,
        when some step is not plain."""
        n = len(ids)
        if ids.min() < 0:
            return False
        if ids.max() >= self._size:
            self._grow(int(ids.max()) + 1)  # as the loop would (sizes do not decide)
        if self._accesses + n >= self._age_out_at:
            self._age_out()  # as the loop would, in advance (it decides nothing)
        if (self._seg[ids] != _OUT).any() or (self._ghost[ids] != _OUT).any():
            return False
        order = np.argsort(ids, kind="stable")
        ranked = ids[order]
        if (ranked[1:] == ranked[:-1]).any():
            return False  # a repeat is a touch within the batch
        step = np.arange(n)
        # Each parent's place in the batch (-1: outside it); a parent is linked at a step if
        # it came earlier in the batch, or is resident now (and outside it).
        j = np.minimum(np.searchsorted(ranked, pars), n - 1)
        ppos = np.where((pars >= 0) & (ranked[j] == pars), order[j], -1)
        inside = (ppos >= 0) & (ppos < step)
        safe = np.clip(pars, 0, self._size - 1)
        outside = (ppos < 0) & (pars >= 0) & (pars < self._size) & (self._seg[safe] != _OUT)
        linked = inside | outside
        # The segment of each step, as ``insert`` decides it with the counts of that step.
        acc = self._accesses + step + 1
        if self._fixed_capacity:
            cap = np.full(n, float(self._fixed_capacity))
        else:
            c0 = self._count[_PROBATION] + self._count[_PROTECTED]
            cap = np.maximum(np.maximum(self._high_water, c0 + step), 1).astype(np.float64)
        seen = self._seen[ids]
        protected = (seen != 0) & (
            (acc - seen.astype(np.int64) + 1) % SEQ_MOD <= self._memory_factor * cap
        )
        seg = np.where(protected, _PROTECTED, _PROBATION).astype(self._seg.dtype)
        saved = self.heat.heat[ids].copy(), self.heat.last_access[ids].copy()
        keys = self.heat.record_distinct(ids, now)
        # A step that would raise its parent (``_propagate``) is not plain.
        pp = np.maximum(ppos, 0)
        parent_key = np.where(inside, keys[pp], self._eff[safe])
        parent_seg = np.where(inside, seg[pp], self._seg[safe])
        raises = linked & ((parent_key < keys) | ((seg == _PROTECTED) & (parent_seg == _PROBATION)))
        if raises.any():
            self.heat.heat[ids], self.heat.last_access[ids] = saved
            return False
        self._accesses += n
        self._seen[ids] = acc % SEQ_MOD + 1
        if self._inserts + n >= _INS_LIMIT:
            self._renumber_inserts()
        self._ins[ids] = self._inserts + step + 1
        self._inserts += n
        self._kids[ids] = 0
        kids_of = pars[linked & (seg == _PROBATION)]
        if len(kids_of):
            add_at(self._kids, kids_of, 1)
        depth = np.zeros(n, dtype=np.int64)
        out_depth = np.minimum(self._depth[safe].astype(np.int64) + 1, 1 << 30)
        depth[outside] = out_depth[outside]
        if inside.any():
            # A block whose parent is earlier in the batch is one deeper than it: pointer
            # jumping finds each block's first ancestor outside the batch's chains and the
            # steps to it (log2 of the longest chain rounds; the depth saturates, so adding
            # the steps at the end clamps as stepwise would).
            anc = np.where(inside, ppos, step)
            dist = inside.astype(np.int64)
            while not np.array_equal(up := anc[anc], anc):
                dist += dist[anc]
                anc = up
            depth = np.minimum(depth[anc] + dist, 1 << 30)
        self._parent[ids] = np.where(linked, pars, -1)
        self._depth[ids] = depth
        self._seg[ids] = seg
        n_protected = int(np.count_nonzero(protected))
        self._count[_PROTECTED] += n_protected
        self._count[_PROBATION] += n - n_protected
        total = self._count[_PROBATION] + self._count[_PROTECTED]
        if total > self._high_water:
            self._high_water = total
        self._eff[ids] = keys
        bound = max(self._bufs[_PROBATION].bound, self._bufs[_PROTECTED].bound)
        for i in np.flatnonzero(keys <= bound).tolist():
            self._note_key(int(ids[i]), int(seg[i]), float(keys[i]), int(depth[i]))
        return True

    def touch(self, bid: int, now: float) -> None:
        seg = self._seg_v[bid] if 0 <= bid < self._size else _OUT
        if seg == _OUT:
            raise KeyError(bid)
        self._accesses += 1
        if self._accesses >= self._age_out_at:
            self._age_out()
        self._seen_v[bid] = self._accesses % SEQ_MOD + 1
        self._rekey(bid, self.heat.record_one(bid, now))
        if len(self._owed_new) > _OWED_LIMIT:
            self._defer_owed()

    def touch_many(self, bids: np.ndarray, now: float) -> None:
        """``touch`` each block of ``bids`` in order, vectorised: the state afterwards is
        exactly the loop's (see ``_settle``). Raises KeyError for the first id (in order)
        that is not resident, before changing anything. Small batches and batches with
        repeats (which see each other's heat) run the loop itself."""
        ids = np.asarray(bids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            return
        if n < _VECTOR_MIN:
            # A few ids (a single-block request): checked and touched one by one, which costs
            # a fraction of the array checks below.
            listed = ids.tolist()
            seg_v, size = self._seg_v, self._size
            for bid in listed:
                if not 0 <= bid < size or seg_v[bid] == _OUT:
                    raise KeyError(bid)
            for bid in listed:
                self.touch(bid, now)
            return
        if ids.min() < 0 or ids.max() >= self._size or not self._seg[ids].all():  # 0: _OUT
            ok = (ids >= 0) & (ids < self._size)
            ok[ok] = self._seg[ids[ok]] != _OUT
            raise KeyError(int(ids[np.argmin(ok)]))
        locate = self._locator(ids)
        if locate is None:
            for bid in ids.tolist():
                self.touch(bid, now)
            return
        if self._accesses + n >= self._age_out_at:
            self._age_out()
        self._seen[ids] = np.arange(self._accesses + 1, self._accesses + n + 1) % SEQ_MOD + 1
        self._accesses += n
        self._settle(ids, self.heat.record_distinct(ids, now), locate)
        if len(self._owed_new) > _OWED_LIMIT:
            self._defer_owed()

    def remove(self, bid: int) -> None:
        seg = self._seg_v[bid] if 0 <= bid < self._size else _OUT
        if seg == _OUT:
            raise KeyError(bid)
        if self._moving:
            self._pay_moves()  # the block may lie on a walk owed: it may have moved
            seg = self._seg_v[bid]
        if self._owed_new:
            self._defer_owed()
        if self._owed:
            self._owed_leaving(bid, seg)
        if seg == _PROBATION:
            self._drop_kid(bid)
        self._seg_v[bid] = _OUT
        self._count[seg] -= 1
        self._evictions[seg] += 1
        self._ghost_v[bid] = seg
        self._gseq_v[bid] = self._evictions[seg] % SEQ_MOD + 1  # seq_keep, inline

    def forget(self, bid: int) -> None:
        self._hints.forget(bid)
        if not 0 <= bid < self._size or self._seg_v[bid] != _OUT:
            return
        self._ghost_v[bid] = _OUT
        self._seen_v[bid] = 0
        self.heat.reset(bid)

    def remember(self, bid: int, slot: int) -> None:
        """Keep the history of ``bid`` (not resident; ``forget`` follows) at memento
        ``slot`` (see ``kvtier.daemon.policy.memento``): the segment it left, when, its last
        access's sequence number, its heat and its hint."""
        kept = self._kept
        kept.fit(slot)
        if 0 <= bid < self._size:
            views = kept.views
            views["_ghost"][slot] = ghost = self._ghost_v[bid]
            # Kept as the row keeps them; a ghost's number is read only with the ghost.
            views["_gseq"][slot] = self._gseq_v[bid] if ghost != _OUT else 0
            views["_seen"][slot] = self._seen_v[bid]
            views["heat"][slot] = self.heat._heat_mv[bid]
            views["last_access"][slot] = self.heat._last_mv[bid]
        else:
            kept.clear(slot)  # never known here: a forgotten row's values
        self._hints.remember(bid, slot)

    def revive(self, slot: int, bid: int) -> None:
        """The history kept at ``slot`` becomes that of ``bid`` (a new row, forgotten)."""
        if bid >= self._size:
            self._grow(bid + 1)
        views = self._kept.views
        self._ghost_v[bid] = views["_ghost"][slot]
        self._gseq_v[bid] = views["_gseq"][slot]
        self._seen_v[bid] = views["_seen"][slot]
        self.heat._heat_mv[bid] = views["heat"][slot]
        self.heat._last_mv[bid] = views["last_access"][slot]
        self._hints.revive(slot, bid)

    def expire(self, slot: int) -> None:
        """The history kept at ``slot`` is forgotten (its values are overwritten when the
        slot is next remembered)."""
        self._hints.expire(slot)

    def renumber(self, order: np.ndarray) -> None:
        """The table renumbered its memento slots (new slot ``i``: old ``order[i]``)."""
        self._kept.renumber(order)
        self._hints.renumber(order)

    def victims(
        self,
        n: int,
        now: float,
        evictable: EvictableFn | None,
        incoming: Sequence[int] = (),
    ) -> np.ndarray | None:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if n > self._count[_PROBATION] + self._count[_PROTECTED]:
            return None
        hinted = self._prepare_pick(now)  # the segments' counts are right from here on
        n1, n2 = self._count[_PROBATION], self._count[_PROTECTED]
        if n == 1 and evictable is None:
            bid = self._one(n1, incoming, now if hinted else None)
            if bid < 0:
                return None
            one = _ONE.copy()  # cheaper than building an array from a list
            one[0] = bid
            return one
        p, from_protected = self._adapted_target(incoming)
        scans = {
            seg: self._candidates(seg, evictable, now if hinted else None, min(n, _MASK_BATCH))
            for seg in (_PROBATION, _PROTECTED)
        }
        # Per segment, the batch of candidates being taken and the position of its head.
        ready: list[list[int]] = [[], [], []]
        pos = [0, 0, 0]

        def head(seg: int) -> int:
            got, i = ready[seg], pos[seg]
            while i >= len(got):
                nxt = next(scans[seg], None)
                if nxt is None:
                    return -1
                got, i = nxt, 0
                ready[seg], pos[seg] = got, 0
            return got[i]

        out: list[int] = []
        while len(out) < n:
            seg, bid = self._pick(n1, p, from_protected, head)
            if bid < 0:
                return None
            pos[seg] += 1
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
        self._pay_moves()
        self._pay_owed()
        return float(self._eff_v[bid])

    def order(self) -> np.ndarray:
        """All resident ids, coldest first within each segment, probation first. O(n log n);
        for tests and debugging."""
        self._pay_moves()
        self._pay_owed()
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

    def victim(self, now: float, incoming: int = -1) -> int:
        """``victims(1, now, None, (incoming,))`` (``()`` for -1) as a block id, -1 for None:
        the replayer asks once per miss, and an array per answer was a tenth of its cost."""
        if self._count[_PROBATION] + self._count[_PROTECTED] == 0:
            return -1
        hinted = self._prepare_pick(now)
        return self._one(
            self._count[_PROBATION], (incoming,) if incoming >= 0 else (), now if hinted else None
        )

    def replace(self, bid: int, parent: int, now: float) -> int:
        """A miss of a full tier in one call (the replayer's per-miss step, see
        ``kvtier.daemon.policy.base``): ``victim(now, bid)``, then ``remove`` of the victim
        and ``insert`` of ``bid``; ``NO_VICTIM`` (nothing changed) when there is none.

        The common case (``bid`` not resident) is the victim's choice and its removal
        written out in one frame, as they set the replayer's speed, live hints included
        (the heads are then ``_coldest_unhinted``'s); a resident ``bid`` takes the steps
        themselves."""
        if bid >= self._size:
            self._grow(bid + 1)
        seg_v, count = self._seg_v, self._count
        n1 = count[_PROBATION]
        if seg_v[bid] != _OUT:
            return self._replace_by_steps(bid, parent, now)
        if n1 + count[_PROTECTED] == 0:
            return NO_VICTIM
        # ``_prepare_pick``.
        parked = self._parked
        if parked and parked[0][0] < now:
            self._unpark(now)
        at: Any = None  # the heads' ``now``: None while no hint is live
        coldest: Callable[[int, Any], int] = self._coldest
        if self._hints.latest >= now:
            coldest, at = self._coldest_unhinted, now
        if self._moving:
            self._pay_moves()
            n1 = count[_PROBATION]
        if self._owed_new:
            self._defer_owed()
        # ``_one``: ARC's target as it will be once ``bid`` is in (``_adapted_target``).
        p, from_protected = self._p, False
        ghost = self._ghost_v[bid]
        if ghost != _OUT:
            cap = self._fixed_capacity or max(self._high_water, 1)
            if (self._evictions[ghost] - self._gseq_v[bid] + 1) % SEQ_MOD < (
                self._shadow_fraction * cap
            ):
                if ghost == _PROBATION:
                    p = min(float(cap), p + self._gain)
                else:
                    p, from_protected = max(0.0, p - self._gain), True
        # ``_pick`` with ``coldest`` as the heads.
        eff_v = self._eff_v
        seg = _PROBATION if n1 >= 1 and (n1 > p or (from_protected and n1 == p)) else _PROTECTED
        out = coldest(seg, at)
        if out >= 0:
            if seg == _PROBATION:
                other = coldest(_PROTECTED, at)
                if other >= 0 and eff_v[other] < eff_v[out] - self._halvings:
                    seg, out = _PROTECTED, other
            elif self._kids_v[out] > 0:
                other = coldest(_PROBATION, at)
                if other >= 0:
                    seg, out = _PROBATION, other
        else:
            seg = 3 - seg
            out = coldest(seg, at)
            if out < 0:
                return NO_VICTIM
        # ``remove(out)``.
        if self._owed:
            self._owed_leaving(out, seg)
        if seg == _PROBATION:
            self._drop_kid(out)
        seg_v[out] = _OUT
        count[seg] -= 1
        evictions = self._evictions
        evictions[seg] += 1
        self._ghost_v[out] = seg
        self._gseq_v[out] = evictions[seg] % SEQ_MOD + 1  # seq_keep, inline
        self.insert(bid, now, parent)
        return out

    def _replace_by_steps(self, bid: int, parent: int, now: float) -> int:
        """``replace`` as the calls it stands for."""
        out = self.victim(now, bid)
        if out < 0:
            return NO_VICTIM
        self.remove(out)
        self.insert(bid, now, parent)
        return out

    def _prepare_pick(self, now: float) -> bool:
        """Before choosing victims at ``now``: unpark the blocks whose hints expired and pay
        the raises owed; whether a hint is live (the one-victim path then passes over the
        blocks hints protect, ``_coldest_unhinted``)."""
        if self._parked and self._parked[0][0] < now:
            self._unpark(now)
        hinted = self._hints.latest >= now
        if self._moving:
            self._pay_moves()
        if self._owed_new:
            self._defer_owed()
        return hinted

    def _one(self, n1: int, incoming: Sequence[int], now: float | None = None) -> int:
        """The one victim when nothing is masked, -1 if none (owed raises paid); ``now``:
        hints are live (``_coldest_unhinted`` gives the heads)."""
        p, from_protected = self._p, False
        b = incoming[0] if len(incoming) == 1 else -1
        if b < 0 or (b < self._size and self._ghost_v[b] != _OUT):
            p, from_protected = self._adapted_target(incoming)
        if now is None:
            return self._pick(n1, p, from_protected, self._coldest)[1]
        return self._pick(n1, p, from_protected, partial(self._coldest_unhinted, now=now))[1]

    def _coldest_unhinted(self, seg: int, now: float) -> int:
        """The coldest block of ``seg`` that no hint protects at ``now``, or -1; the hinted
        ones met at the buffer's head are parked on the way, as ``_candidates`` parks those
        it meets (the same victim, without a generator and a batch per call: a replay with
        a queue window asks this once per miss)."""
        hints, parked = self._hints, self._parked
        while True:
            bid = self._coldest(seg, now)
            if bid < 0:
                return -1
            self.scan_steps += 1
            until = hints.until(bid)
            if until < now:
                return bid
            # ``_coldest`` left the buffer's cursor on this block's entry: parked, it is
            # passed over (the consumed head is trimmed later).
            buf = self._bufs[seg]
            heapq.heappush(parked, (until, bid, seg, buf.gen, buf.entries[buf.cur]))
            buf.cur += 1

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
                # Protection runs out once the protected block's heat has decayed more
                # than ``protection_halvings`` halvings below the probation block's.
                if other >= 0 and self._eff_v[other] < self._eff_v[bid] - self._halvings:
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

    def _returning_from(self, bid: int) -> int:
        """The segment whose shadow still holds ``bid``, or _OUT."""
        if not 0 <= bid < self._size or self._seg_v[bid] != _OUT:
            return _OUT
        ghost = self._ghost_v[bid]
        if ghost == _OUT or not self._in_shadow(bid, ghost, self.capacity):
            return _OUT
        return int(ghost)

    def _in_shadow(self, bid: int, ghost: int, cap: int) -> bool:
        age = (self._evictions[ghost] - self._gseq_v[bid] + 1) % SEQ_MOD
        return age < self._shadow_fraction * cap

    def _adapted_target(self, incoming: Sequence[int]) -> tuple[float, bool]:
        """``p`` as it will be once ``incoming`` are inserted, and whether the first of them
        returns from protected's shadow; nothing is stored."""
        p = self._p
        if len(incoming) == 1:
            # One block (the replayer's case, once per miss): the loop below, unrolled.
            ghost = self._returning_from(incoming[0])
            if ghost == _PROBATION:
                return min(float(self.capacity), p + self._gain), False
            if ghost == _PROTECTED:
                return max(0.0, p - self._gain), True
            return p, False
        cap = float(self.capacity)
        from_protected = False
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
        parent is absent, dead (the step unlinks it) or protected (``_propagate`` stops
        there, owing the parent the step's key if it ranks lower). Such a step writes its
        own block's entries and never another's, except a parent's probation-children count
        and the owed raises, which only ``victims`` reads. It reads its parent as the scalar
        loop would find it: as at the start, or as left by the parent's own step earlier in
        the batch. Every other step is run by ``_rekey`` itself, after the bulk steps before
        it are applied, so it sees the state the loop would. Only such a step's
        ``_propagate`` may change blocks that later steps read (their own or their parents'
        keys and segments); when it changed any, the rest of the batch is planned again from
        the state as it then is. The buffers' ``bound`` only falls during a batch (a full
        complete buffer is dropped), so a bulk step stays above it.
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
        guarded = earlier | (pseg == _PROTECTED)  # _propagate ends at such a parent
        still = (seg == _PROTECTED) & (key <= eff)
        acts = ~still & (new_eff > self._bufs[_PROTECTED].bound) & (~linked | guarded)
        leaves = acts & (seg == _PROBATION)
        owes = acts & linked & (peff < new_eff)
        return _Plan(
            bulk=still | acts,
            acts=acts,
            leaves=leaves,
            unlinks=acts & dead if dead.any() else None,
            drops=leaves & has & (pseg != _OUT) & (pins < ins) if leaves.any() else None,
            owes=owes if owes.any() else None,
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
            add_at(self._kids, plan.parent[part][plan.drops[part]], -1)
        if plan.unlinks is not None:
            self._parent[bids[plan.unlinks[part]]] = -1
        if plan.owes is not None:
            # Plain assignment is _owe's max: an owed value never exceeds its block's key.
            owes = plan.owes[part]
            self._owed_new.update(
                zip(bids[owes].tolist(), plan.new_eff[part][owes].tolist(), strict=True)
            )

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

    def _propagate(self, bid: int, key: float, protect: bool, budget: float = -1.0) -> int:
        """Make ``bid``'s ancestors rank at least ``key``: when ``protect``, move the ones in
        probation up to the first protected one to protected, raising each to ``key``; then
        owe ``key`` to the rest (see "Owed raises"). Past ``budget`` moves (-1:
        ``_MOVE_BUDGET``), the rest of the walk is owed instead (see "Owed moves"). Returns
        how many ancestors it moved."""
        parent_v, seg_v, ins_v, eff_v = self._parent_v, self._seg_v, self._ins_v, self._eff_v
        child = bid
        changed = steps = 0
        while True:
            parent = parent_v[child]
            if parent < 0:
                break
            steps += 1
            seg = seg_v[parent]
            if seg == _OUT or ins_v[parent] > ins_v[child]:
                parent_v[child] = -1  # the link died: the parent left or the id was reused
                break
            if not (protect and seg == _PROBATION):
                if eff_v[parent] < key:
                    owed = self._owed_new
                    if owed.get(child, -math.inf) < key:
                        owed[child] = key
                break
            if changed >= (_MOVE_BUDGET if budget < 0 else budget):
                moving = self._moving
                if not moving and self.on_owed is not None:
                    self.on_owed()
                if moving.get(child, -math.inf) < key:
                    moving[child] = key
                break
            # Never owed as raises are: victims reads segments. A block leaves probation
            # once per residency, so these steps cost O(1) amortised.
            self._leave_probation(parent)
            if eff_v[parent] < key:
                eff_v[parent] = key
            self._note_key(parent, _PROTECTED, eff_v[parent], self._depth_v[parent])
            changed += 1
            child = parent
        self.chain_steps += steps
        return changed

    @property
    def owes_work(self) -> bool:
        """Whether moves are owed (see "Owed moves"): ``work`` then has something to do."""
        return bool(self._moving)

    def work(self) -> bool:
        """Make up to about ``_MOVE_BUDGET`` of the moves owed (see "Owed moves"); returns
        whether some remain. The daemon calls it between requests; nothing decides
        differently for calling it or not."""
        budget = _MOVE_BUDGET
        moving = self._moving
        while moving and budget > 0:
            child = next(iter(moving))
            key = moving.pop(child)
            budget -= self._propagate(child, key, True, budget) + 1
        if len(self._owed_new) > _OWED_LIMIT:
            self._defer_owed()
        return bool(moving)

    def _pay_moves(self) -> None:
        """Make every move owed: afterwards each block's segment is the eager walks'."""
        moving = self._moving
        while moving:
            child = next(iter(moving))
            self._propagate(child, moving.pop(child), True, math.inf)

    def _cutoffs(self) -> tuple[float, float, float]:
        """Per segment, the key above which a block may lag (see "Owed raises")."""
        b1, b2 = self._bufs[_PROBATION].bound, self._bufs[_PROTECTED].bound
        return (math.inf, max(b1, b2), b2)

    def _defer_owed(self) -> None:
        """Pay the raises in ``_owed_new`` as far as ``victims`` could see them, and keep the
        rest in ``_owed``; afterwards every block that lags ranks above its cutoff."""
        fresh, self._owed_new = self._owed_new, {}
        # Bounds only fall until the next rebuild, so cutoffs taken now stay safe to keep.
        self._pay(self._hottest_first(fresh), self._cutoffs())
        if len(self._owed) > _OWED_LIMIT:
            self._pay_owed()

    def _pay_owed(self) -> None:
        """Pay every owed raise: afterwards no block lags."""
        if not (self._owed_new or self._owed):
            return
        fresh, self._owed_new = self._owed_new, {}
        owed, self._owed = self._owed, {}
        self._pay(self._hottest_first(fresh, owed), None)

    def _pay(
        self, raises: Iterable[tuple[int, float]], cutoffs: tuple[float, float, float] | None
    ) -> None:
        """For each ``(child, key)``, hottest first, raise ``child``'s ancestors to ``key`` up
        to the first that ranks at least as high; with ``cutoffs``, stop at the first that
        ranks above its cutoff and owe ``key`` to it in ``_owed`` instead. Hottest first, a
        block is raised at most once per call: a later walk stops at it."""
        parent_v, seg_v, ins_v, eff_v = self._parent_v, self._seg_v, self._ins_v, self._eff_v
        bufs, owed = self._bufs, self._owed
        steps = 0
        for child, key in raises:
            while True:
                parent = parent_v[child]
                if parent < 0:
                    break
                steps += 1
                seg = seg_v[parent]
                if seg == _OUT or ins_v[parent] > ins_v[child]:
                    parent_v[child] = -1
                    break
                eff = eff_v[parent]
                if eff >= key:
                    break
                if cutoffs is not None and eff > cutoffs[seg]:
                    if owed.get(child, -math.inf) < key:
                        owed[child] = key
                    break
                eff_v[parent] = key
                if key <= bufs[seg].bound:
                    self._note_key(parent, seg, key, self._depth_v[parent])
                child = parent
        self.chain_steps += steps

    def _owed_leaving(self, bid: int, seg: int) -> None:
        """Keep the owed raises (all in ``_owed``) right as the resident ``bid`` leaves: its
        link is the path of raises owed below it, and of its own."""
        if self._eff_v[bid] > self._cutoffs()[seg]:
            # It may lag, so raises owed below it may pass through it (rare: a victim ranks
            # at or below its buffer's bound).
            self._pay_owed()
            return
        key = self._owed.pop(bid, None)
        if key is None:
            return
        # It does not lag, so only its own raise passes through it: hand it to the parent,
        # which ranks above its cutoff (the raise was kept hidden there), and stays so.
        parent = self._parent_v[bid]
        self.chain_steps += 1
        if parent < 0 or self._seg_v[parent] == _OUT or self._ins_v[parent] > self._ins_v[bid]:
            return
        if self._eff_v[parent] < key:
            self._eff_v[parent] = key
            self._owed[parent] = key

    @staticmethod
    def _hottest_first(*owed: dict[int, float]) -> Iterable[tuple[int, float]]:
        """The owed raises of ``owed`` by descending key (then id, for determinism)."""
        size = sum(len(d) for d in owed)
        if size < _SORT_IN_NUMPY:
            return sorted(
                itertools.chain.from_iterable(d.items() for d in owed),
                key=lambda item: (-item[1], item[0]),
            )
        blocks = np.concatenate([np.fromiter(d, dtype=np.int64, count=len(d)) for d in owed])
        keys = np.concatenate(
            [np.fromiter(d.values(), dtype=np.float64, count=len(d)) for d in owed]
        )
        order = np.lexsort((blocks, -keys))
        return zip(blocks[order].tolist(), keys[order].tolist(), strict=True)

    def _note_key(self, bid: int, seg: int, key: float, depth: int) -> None:
        """Keep the buffer invariant after ``bid`` got ``key`` in ``seg``."""
        buf = self._bufs[seg]
        if key <= buf.bound:
            bisect.insort(buf.entries, (key, -depth, self._ins_v[bid], bid), lo=buf.cur)
            if buf.complete and len(buf.entries) - buf.cur > 4 * _MIN_BUFFER:
                buf.bound = -math.inf  # too big to keep whole; the next read rebuilds it
                buf.complete = False
                buf.entries = []
                buf.cur = 0
                buf.gen += 1

    def _valid(self, seg: int, entry: tuple[float, int, int, int]) -> bool:
        bid = entry[3]
        return (
            self._seg_v[bid] == seg
            and self._eff_v[bid] == entry[0]
            and self._ins_v[bid] == entry[2]
        )

    def _coldest(self, seg: int, now: float | None = None) -> int:
        """The coldest block of ``seg`` or -1 (hinted or not); drops stale entries at the
        buffer's head. ``now``: hints are live (a rebuild parks their blocks)."""
        buf = self._bufs[seg]
        seg_v, eff_v, ins_v = self._seg_v, self._eff_v, self._ins_v
        while True:
            entries = buf.entries
            start = cur = buf.cur
            size = len(entries)
            while cur < size:
                key, _, ins, bid = entries[cur]
                if seg_v[bid] == seg and eff_v[bid] == key and ins_v[bid] == ins:
                    # ``_trimmed``'s test first: mostly the head did not move, or moved
                    # little (one victim per call).
                    if cur != start:
                        trim = cur > _MIN_BUFFER and 2 * cur >= size
                        buf.cur = self._trimmed(buf, cur) if trim else cur
                    return bid
                cur += 1
            buf.cur = self._trimmed(buf, cur)
            if buf.complete or self._count[seg] == 0:
                return -1
            self._rebuild(seg, _MIN_BUFFER, now)

    @staticmethod
    def _trimmed(buf: _Buffer, cur: int) -> int:
        """Drop the consumed head of a buffer once it outweighs the rest; returns the new
        ``cur``. A buffer that covers its whole segment is never rebuilt, so without this its
        head would keep an entry for every block that ever passed through the segment.
        Called only where no scan of the buffer is in progress (``_coldest``)."""
        if cur > _MIN_BUFFER and 2 * cur >= len(buf.entries):
            del buf.entries[:cur]
            return 0
        return cur

    def _candidates(
        self, seg: int, evictable: EvictableFn | None, now: float | None, first: int
    ) -> Iterator[list[int]]:
        """Valid, evictable blocks of ``seg``, coldest first, each once, in the batches they
        were checked in: ``first`` blocks (what the caller needs), then twice as many each
        time (a caller takes from a batch what it needs, one by one, at a list's cost).
        ``now``: hints are live (a hinted block is not evictable while ``now`` is at most its
        deadline; the entries of those met are parked)."""
        buf = self._bufs[seg]
        if self._coldest(seg, now) < 0:
            return
        seen: set[int] = set()
        pending: list[int] = []
        at: list[int] = []  # each pending block's position in the buffer
        seg_v, eff_v, ins_v = self._seg_v, self._eff_v, self._ins_v
        i = buf.cur
        want = first
        steps = 0
        try:
            while True:
                if i >= len(buf.entries):
                    if pending:
                        pending, i = self._park_hinted(seg, pending, at, i, now)
                        yield self._passing(pending, evictable)
                        pending, at = [], []
                    if buf.complete:
                        return
                    # Rebuilding only re-sorts what the segment holds; the decisions it leads
                    # to are the ones a bigger buffer would have given.
                    self._rebuild(seg, 4 * max(len(buf.entries) - buf.cur, _MIN_BUFFER), now)
                    i = buf.cur
                    continue
                entry = buf.entries[i]
                i += 1
                steps += 1
                bid = entry[3]
                # ``_valid``, inline: once per entry scanned.
                if (
                    bid in seen
                    or seg_v[bid] != seg
                    or eff_v[bid] != entry[0]
                    or ins_v[bid] != entry[2]
                ):
                    continue
                # Once per block: passing or not, the call decides the same for any other
                # entry of it.
                seen.add(bid)
                pending.append(bid)
                at.append(i - 1)
                if len(pending) >= want:
                    pending, i = self._park_hinted(seg, pending, at, i, now)
                    yield self._passing(pending, evictable)
                    pending, at = [], []
                    want *= 2
        finally:
            self.scan_steps += steps

    def _park_hinted(
        self, seg: int, bids: list[int], at: list[int], i: int, now: float | None
    ) -> tuple[list[int], int]:
        """Park the entries (at positions ``at``, all before ``i``) of the blocks of ``bids``
        that a hint protects at ``now``; returns the others and where the scan goes on."""
        if now is None:
            return bids, i
        if len(bids) == 1 and self._hints.until(bids[0]) < now:
            return bids, i  # the common batch of a single victim: no arrays
        until = self._hints.deadlines(np.asarray(bids, dtype=np.int64))
        live = until >= now
        if not live.any():
            return bids, i
        buf = self._bufs[seg]
        entries = buf.entries
        lo = at[0]
        parked = np.flatnonzero(live).tolist()
        for j in parked:
            heapq.heappush(self._parked, (float(until[j]), bids[j], seg, buf.gen, entries[at[j]]))
        gone = {at[j] for j in parked}
        entries[lo:i] = [e for k, e in enumerate(entries[lo:i], lo) if k not in gone]
        return [b for b, keep in zip(bids, (~live).tolist(), strict=True) if keep], i - len(gone)

    def _unpark(self, now: float) -> None:
        """Put back the parked entries whose hint has passed by ``now`` and that are still
        current; a block hinted again meanwhile waits for its new deadline."""
        parked = self._parked
        while parked and parked[0][0] < now:
            _, bid, seg, gen, entry = heapq.heappop(parked)
            until = self._hints.until(bid)
            if until >= now:
                heapq.heappush(parked, (until, bid, seg, gen, entry))
                continue
            buf = self._bufs[seg]
            if gen == buf.gen and self._valid(seg, entry):
                self._note_key(bid, seg, entry[0], -entry[1])

    @staticmethod
    def _passing(bids: list[int], evictable: EvictableFn | None) -> list[int]:
        """Those of ``bids`` the caller's mask lets go."""
        if evictable is None or not bids:
            return bids
        arr = np.asarray(bids, dtype=np.int64)
        return arr[evictable(arr)].tolist()  # type: ignore[no-any-return]

    def _rebuild(self, seg: int, want: int, now: float | None = None) -> None:
        """Refill ``seg``'s buffer with its ``want`` coldest blocks (ties included); with
        ``now``, blocks a hint protects then are parked instead (see the module docstring)."""
        # The bound may rise, past keys that lag: pay them first. Raising a lagging block
        # touches no buffer (it ranks above its cutoff), so a scan of the other segment
        # in progress stays valid. (No move is owed: every caller runs under ``victims``,
        # which made them first.)
        self._pay_owed()
        self._rebuilds += 1
        buf = self._bufs[seg]
        buf.gen += 1
        ids = np.flatnonzero(self._seg[: self._size] == seg)
        parked = np.zeros(0, dtype=np.int64)
        if now is not None and self._hints.live(now) and len(ids):
            until = self._hints.deadlines(ids)
            live = until >= now
            if live.any():
                parked, until = ids[live], until[live]
                ids = ids[~live]
        keys = self._eff[ids]
        want = max(want, _MIN_BUFFER, len(ids) // _BUFFER_SHARE)
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
        if len(parked):
            # Only those that would have an entry: a key at most the new bound.
            pkeys = self._eff[parked]
            near = pkeys <= buf.bound
            parked, until, pkeys = parked[near], until[near], pkeys[near]
            pdepth = -self._depth[parked].astype(np.int64)
            pins = self._ins[parked]
            gen = buf.gen
            self._parked = [e for e in self._parked if e[2] != seg or e[3] == gen]
            self._parked.extend(
                (u, b, seg, gen, (k, d, n, b))
                for u, b, k, d, n in zip(
                    until.tolist(),
                    parked.tolist(),
                    pkeys.tolist(),
                    pdepth.tolist(),
                    pins.tolist(),
                    strict=True,
                )
            )
            heapq.heapify(self._parked)

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
            "_ins": np.zeros(size, dtype=np.uint32),
            "_seen": np.zeros(size, dtype=np.uint32),
            "_gseq": np.zeros(size, dtype=np.uint32),
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

    def _age_out(self) -> None:
        """Forget the sequence numbers whose age reached ``_AGE_OUT`` (a block never seen,
        a ghost gone), in the rows and the kept histories, before any can reach
        ``SEQ_MOD``; next due ``_AGE_OUT_EVERY`` accesses on (see ``_AGE_OUT``)."""
        size = self._size
        # The rows, and the histories kept at memento slots: a kept one may wait there any
        # number of accesses (the table expires mementos only as blocks are dropped).
        kept = self._kept
        for seen, ghost, gseq in (
            (self._seen[:size], self._ghost[:size], self._gseq[:size]),
            (kept["_seen"], kept["_ghost"], kept["_gseq"]),
        ):
            old = (seen != 0) & (seq_ages(seen, self._accesses) >= _AGE_OUT)
            seen[old] = 0
            for seg in (_PROBATION, _PROTECTED):
                rows = np.flatnonzero(ghost == seg)
                gone = rows[seq_ages(gseq[rows], self._evictions[seg]) >= _AGE_OUT]
                ghost[gone] = _OUT
                gseq[gone] = 0
        self._age_out_at = self._accesses + _AGE_OUT_EVERY

    def _renumber_inserts(self) -> None:
        """Number the resident blocks 1.. in their insertion order, and go on from there:
        only residents' numbers are compared (a link whose parent left is dead whatever the
        numbers say), and a block inserted later is numbered above all of them."""
        resident = np.flatnonzero(self._seg[: self._size] != _OUT)
        ranked = resident[np.argsort(self._ins[resident], kind="stable")]
        self._ins[:] = 0
        self._ins[ranked] = np.arange(1, len(ranked) + 1)
        self._inserts = len(ranked)
        # Buffered and parked entries carry the old numbers (``_valid`` would drop them all
        # as stale): the next read rebuilds each buffer, and parked entries of an older
        # generation are not put back.
        for buf in self._bufs:
            buf.bound = -math.inf
            buf.complete = False
            buf.entries = []
            buf.cur = 0
            buf.gen += 1

    def _grow(self, need: int) -> None:
        size = max(need, 2 * self._size)
        self.heat.ensure(size)
        self._alloc(size)
