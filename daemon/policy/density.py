"""The ``density`` policy: evict the block with the lowest expected hits per unit of
space-time (hit density, in the family of LHD, Beckmann et al., NSDI'18), with classes from
KV-cache signals and statistics learned online.

Lives. Every access of a block (a hit, a store, or a miss this tier did not keep) ends the
block's previous *life* and starts a new one. A life ends with a *reuse* at some age (time
since its access) or is *censored*: its ghost expired (``ghost_factor`` tier-fulls of
evictions after it left the tier), or its id was forgotten. A life still open is censored at
its current age, never counted as "not reused".

Classes. A life's class combines signals known at its start: the block's access count
(1, 2, 3-4, 5-8, 9-16, 17+) and, from its second access on, the gap since the previous one
(four buckets), its depth in the prefix chain (0, 1-7, 8+: shared system prompts sit at the
root), and its *turn*: how many times the chain grew past an already reused block (0, 1, 2-4,
5+; a conversation's later turns are more likely to continue). Depth and turn are fixed when
the block is first seen, from its parent.

Statistics. Per class and age bucket (log-spaced, ``quantum_s`` then doubling every two
buckets): reuses, and lives ended. Every ``period`` accesses (a tier-full by default: at two
tier-fulls, large tiers' tables lagged the traffic; sooner while the policy is young, and only
once the tier evicted or declined something since: a tier that is not full needs no order)
the counts are aged by ``decay``, the open lives are counted at their current age (censored),
and a table of densities is rebuilt: per class, the reuse hazard of each bucket (Kaplan-Meier,
smoothed towards all classes' pooled hazard by ``prior`` lives), the survival curve, and for
each age ``a`` the best ratio over horizons ``T > a`` of the chance of a reuse in ``(a, T]``
to the expected time held until the reuse or ``T``. That maximum is the block's hit density: the
most hits per block-second keeping it can still earn. A one-off document's block has little
at every age; a shared prompt's root has much; a conversation's blocks fall off after the
usual think time.

The block's own heat. A class's density is what its blocks earn on average; blocks of one
class differ (one of a popular prompt's blocks read ten times in the last minute, another
read ten times an hour ago). Each block keeps its *heat*, its access count decayed with a
half-life of ``own_half_life_s`` (``heat = heat * 2^(-gap/half-life) + 1`` at every access,
the decay taken at the middle of the gap's age bucket, so that scalar and array code agree
bit for bit), and its density is its class's times ``sqrt(heat)``: a block read often of
late is kept longer than its class alone would keep it, and a new block (heat 1) ranks as
its class. Measured on the shared Mooncake trace and on generated mixes, this raised the hit
ratio at small tiers (the class statistics are coarsest there) and changed little at large
ones. The heat itself as the weight (not its square root) lost hit ratio at 5-10% tiers;
decaying the weight with the block's age, normalising it per class, or classing lives by
heat instead of the access count did worse on the mixes.

A tier that hits rarely weighs the heat itself. While fewer than ``full_heat_below`` of the
tier's accesses are hits (hits and accesses counted per table and decayed by ``decay``, as the
statistics are), the weight is the heat, not its square root: nearly every block it holds
leaves unread, the class averages tell its few reused ones apart least, and the block's own
recent reads most. Chosen at each table (the buffer is rebuilt with every table), so the order
stays a function of the state. On the Mooncake trace at 1% (a hit ratio near 5%) the heat
itself raised the hit ratio from 4.59 to 5.06; at 5-20% (17% and more) it lowered it, which
is why the square root stays above the threshold. The generated mixes' tiers hit more often
than that (the documents mix comes nearest), and the rule left their sums within 0.01.

Ranking. A block's key is ``(density at its age, last access, -depth, insertion number)``
(never the id: the daemon's ids are reused rows, whose order means nothing, so ties broken by
id made it decide otherwise than the replayer, whose ids are first-seen order). Ages are
taken at ``now`` rounded down to ``quantum_s``, so every decision is a function of the policy's state
and that quantum, and the order changes only when the quantum or the table changes.
``victims`` takes the lowest keys under the chain rule: a block is a candidate only once its
resident children are (each releases its parent at the child's key, so a parent ranks at
least as its last child; a child the caller's mask keeps releases it as well, so a masked
leaf does not pin its chain). Atomic: exactly ``n`` or None, nothing changed.

Admission (``admits``): a block missing from the tier is declined when its density at age 0
is below the would-be victim's. ``admits_many`` asks for a batch in order, a block whose
parent is earlier in the batch taking the lineage that parent will have. ``note_miss``
records an access of a block the tier did not keep, so declined blocks still teach the
statistics.

Cost. A sorted buffer holds the keys of every leaf with density at or below ``bound`` for the
current quantum and table; entries go stale when their block changes and are checked on read;
a block that changes at or below the bound is inserted at its place; a parent that becomes a
leaf likewise. The buffer is rebuilt (vectorised) when the quantum or table changes or it runs
out. Per access: O(1) Python steps plus a log-time insert for low-density blocks.

Memory: 42 bytes per id of per-block arrays (50 once hints are given), the buffer (a
fraction of the leaves), and the statistics (classes x buckets, fixed). Ghost lives are per-id
entries too: no separate table. Counts kept per id are 32-bit (see ``_STAMPS``,
``_INS_LIMIT``, ``seq_keep``).

Id reuse: links are followed only while the parent is resident and was inserted before the
child. History (count, depth, turn, the open life) outlives residency on purpose; the store
must call ``forget`` when it frees an id, which censors the open life and starts the id cold.
A history the store keeps for a dropped block's key (``remember``) keeps its open life open
at the memento slot, counted by the tables as a row's, until it returns or expires.

Thread-safety: none; the owner serialises calls.
"""

from __future__ import annotations

import bisect
import heapq
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.daemon.policy.base import DECLINED, NO_VICTIM, EvictableFn, InsertEach, OwesNoWork
from kvtier.daemon.policy.hints import Hinted
from kvtier.daemon.policy.memento import SEQ_MOD, Kept, renumbered, seq_ages

# Block states (``_state``): no open life, resident, open life but not resident (a ghost).
_CLOSED = 0
_RESIDENT = 1
_GHOST = 2

# Class signals and their buckets. Frequency: the access count (1, 2, 3-4, 5-8, 9-16, 17+)
# and, from the second access on, the gap since the previous access (< 4, < 32, < 256, more
# quanta): 1 + 5 * 4 classes. Depth: 0, 1-7, 8+. Turn: 0, 1, 2-4, 5+.
_COUNT_BUCKET = (0, 0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5)  # by count 0..17+
_GAP_BUCKET = (0,) * 5 + (1,) * 6 + (2,) * 6 + (3,) * 11  # by the gap's age bucket
_DEPTH_BUCKET = (0, 1, 1, 1, 1, 1, 1, 1, 2)  # by depth 0..8+
_TURN_BUCKET = (0, 1, 2, 2, 2, 3)  # by turn 0..5+
_N_FREQ, _N_DEPTH, _N_TURN = 21, 3, 4
CLASSES = _N_FREQ * _N_DEPTH * _N_TURN
assert CLASSES <= 256, "a block's class is kept in a uint8 (_ARRAYS)"
AGE_BUCKETS = 28  # quantum, then doubling every two buckets: 2**13 quanta at the last edge

# Coarser groups a class's statistics are smoothed towards, coarsest first: its access count
# bucket, then its count and gap (see ``ReuseModel.hazard``).
_FREQ_OF = np.arange(CLASSES) // (_N_DEPTH * _N_TURN)


def _onehot(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group x class 0/1 matrix, group of each class): group sums as one product."""
    return (groups[None, :] == np.arange(groups.max() + 1)[:, None]).astype(np.float64), groups


_LEVELS = (
    _onehot(np.where(_FREQ_OF == 0, 0, 1 + (_FREQ_OF - 1) // 4)),
    _onehot(_FREQ_OF),
)
_FINEST = _LEVELS[-1][1]  # each class's finest group
_FIRST_OF_FINEST = np.searchsorted(_FINEST, np.arange(_N_FREQ))  # classes run by group
# Per level: the (group x class) matrix, and each finest group's group at that level.
_GROUPS = tuple((onehot, groups[_FIRST_OF_FINEST]) for onehot, groups in _LEVELS)
_MAX_COUNT = 65535
# Density rows computed at once: more made temporaries large enough that allocating them (the
# allocator hands their pages back each time) cost more than the arithmetic.
_DENSITY_ROWS = 32
_ONE = np.zeros(1, dtype=np.int64)
# touch_many: below this many blocks the scalar loop is as fast.
_VECTOR_MIN = 16
_MIN_BUFFER = 64
_EXHAUSTED = None
# Stamps (``_stamp``, and the buffer entries and memos that carry one) count modulo 2**32:
# they are only compared for equality, with entries and memos that a new quantum or table
# replaces (tables come every ``period`` accesses once the tier decides anything), long
# before the count comes round.
_STAMPS = 1 << 32
# ``_ins`` is a uint32: before the insertion count passes it, the resident blocks' numbers are
# renumbered densely in their order (only residents' are compared: ``_renumber_inserts``).
_INS_LIMIT = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class BlockSignals:
    count: int  # accesses known (this tier's view; reset by forget)
    depth: int
    turn: int
    cls: int  # class of the current (or last) life
    last: float  # time of the last access
    heat: float  # decayed access count as of the last access (1 without own_weight)
    resident: bool
    open_life: bool  # its last access has not been followed by a reuse or a censoring


@dataclass(frozen=True, slots=True)
class DensityStats:
    capacity_blocks: int
    resident: int
    ghosts: int
    tables: int
    buffer_rebuilds: int
    buffer_entries: int


SIGNALS = ("count", "gap", "depth", "turn")
# The gap since the previous access predicts the next reuse on its own, but as a class signal
# it split the statistics too thin and lost hit ratio on the mixes it was tried on.
DEFAULT_SIGNALS = ("count", "depth", "turn")


class Classifier:
    """Maps a life's signals to its class; a signal left out maps every value to bucket 0
    (its classes then pool). The class is a sum of one term per signal, looked up in
    ``count``, ``gap``, ``depth`` and ``turn`` (indexed by the clamped value: count up to 17,
    gap bucket, depth up to 8, turn up to 6)."""

    __slots__ = ("count", "depth", "gap", "turn")

    def __init__(self, signals: Sequence[str] = SIGNALS) -> None:
        unknown = set(signals) - set(SIGNALS)
        if unknown:
            raise ValueError(f"unknown signal {sorted(unknown)[0]!r}; from {', '.join(SIGNALS)}")
        per_freq = _N_DEPTH * _N_TURN
        counts = (*_COUNT_BUCKET, 5) if "count" in signals else (0,) * 19
        # Frequency class: 0 for a first access, else 1 + 4 * (count bucket - 1) + gap.
        self.count = [0 if cb == 0 else (1 + 4 * (cb - 1)) * per_freq for cb in counts]
        gaps = _GAP_BUCKET if "gap" in signals and "count" in signals else (0,) * AGE_BUCKETS
        self.gap = [g * per_freq for g in gaps]
        depths = _DEPTH_BUCKET if "depth" in signals else (0,) * len(_DEPTH_BUCKET)
        self.depth = [d * _N_TURN for d in depths]
        self.turn = list((*_TURN_BUCKET, 3)) if "turn" in signals else [0] * 7

    def __call__(self, count: int, gap_bucket: int, depth: int, turn: int) -> int:
        """The class index of a life: the access count (this access included), the age
        bucket of the gap since the previous access (0 for a first access), depth and
        turn."""
        return (
            self.count[count if count < 18 else 17]
            + (self.gap[gap_bucket] if count > 1 else 0)
            + self.depth[depth if depth < 8 else 8]
            + self.turn[turn if turn < 6 else 6]
        )


def age_bucket(age_quanta: float) -> int:
    """The bucket of an age in quanta: [0, 1) is 0, then two buckets per doubling."""
    if age_quanta < 1.0:
        return 0
    x = 1 + int(2.0 * math.log2(age_quanta))
    return x if x < AGE_BUCKETS else AGE_BUCKETS - 1


def age_buckets(age_quanta: np.ndarray) -> np.ndarray:
    a = np.maximum(age_quanta, 1.0)
    x = 1 + np.floor(2.0 * np.log2(a)).astype(np.int64)
    x[age_quanta < 1.0] = 0
    return np.minimum(x, AGE_BUCKETS - 1)


def heat_decays(halvings_per_quantum: float) -> np.ndarray:
    """The factor a block's heat decays by over a gap, per age bucket of the gap: ``2 **
    -(age * halvings_per_quantum)`` at the bucket's middle (geometric; half a quantum for
    bucket 0). By bucket rather than exact age so that scalar and array code compute the same
    heat, bit for bit (``math`` and numpy may round ``2 ** x`` differently)."""
    middle = np.concatenate(([0.5], 2.0 ** (np.arange(AGE_BUCKETS - 1) / 2.0 + 0.25)))
    return np.asarray(2.0 ** (-middle * halvings_per_quantum), dtype=np.float64)


def bucket_widths() -> np.ndarray:
    """Width of each age bucket in quanta (the last, open-ended, counts as wide as its start)."""
    starts = np.concatenate(([0.0], 2.0 ** (np.arange(AGE_BUCKETS - 1) / 2.0)))
    ends = np.concatenate((starts[1:], [2 * starts[-1]]))
    return ends - starts


class ReuseModel:
    """Reuse statistics per class and age bucket, and the density table they give.

    Events since the last table are counted in ``hits`` and ``ends``, flat lists of integers
    (class-major), so the per-access increments are plain Python and exact in any order;
    ``table`` folds them into the decayed history (``past_hits``, ``past_ends``) and turns
    the sum into densities with numpy.
    """

    def __init__(self, prior: float, decay: float, smooth: int = 1, min_horizon: int = 1) -> None:
        if prior < 0 or not 0 <= decay <= 1 or smooth < 0 or min_horizon < 1:
            raise ValueError(
                "prior and smooth must be >= 0, min_horizon >= 1 and decay within [0, 1]"
            )
        self.prior = prior
        self.decay = decay
        self.smooth = smooth
        self.hits = _counters()
        self.ends = _counters()
        self.past_hits = np.zeros((CLASSES, AGE_BUCKETS))
        self.past_ends = np.zeros((CLASSES, AGE_BUCKETS))
        self._widths = bucket_widths()
        # Horizons of at least ``min_horizon`` buckets (the last bucket always qualifies):
        # the (age, horizon end) pairs by age, where each age's run starts, and the ages
        # some horizon is too near for.
        upper = np.triu(np.ones((AGE_BUCKETS, AGE_BUCKETS), dtype=bool), k=min_horizon - 1)
        upper[:, -1] = True
        age, horizon = np.nonzero(upper)
        self._pairs = (age, horizon + 1)
        self._first_pair = np.searchsorted(age, np.arange(AGE_BUCKETS))
        self._near = ~upper.all(axis=1)

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        """Reuses and ended lives per class and age bucket: the decayed history plus the
        events since."""
        shape = (CLASSES, AGE_BUCKETS)
        return (
            self.past_hits + np.frombuffer(self.hits, dtype=np.int64).reshape(shape),
            self.past_ends + np.frombuffer(self.ends, dtype=np.int64).reshape(shape),
        )

    def table(self, open_lives: np.ndarray) -> np.ndarray:
        """Densities (hits per block-quantum), shape (CLASSES, AGE_BUCKETS), given the open
        lives per class and bucket; then the counts fold into the history, aged by
        ``decay``."""
        return self.table_rows(open_lives)[0]

    def table_rows(self, open_lives: np.ndarray) -> tuple[np.ndarray, list[list[float]]]:
        """``table``, and the same densities as a list of rows (``table.tolist()``, a class
        without lives of its own sharing its group's row object)."""
        hits, ends = self.totals()
        # A class without lives of its own has its finest group's hazard: compute each
        # group's row once, and the rows of the classes with lives.
        seen = np.flatnonzero((ends + open_lives).any(axis=1))
        hazard, group = self._hazards(hits, ends, open_lives, seen)
        densities = self._densities(np.concatenate((group, hazard)))
        row_of = _FINEST.copy()
        row_of[seen] = np.arange(_N_FREQ, _N_FREQ + len(seen))
        distinct = densities.tolist()
        rows = [distinct[r] for r in row_of.tolist()]
        self.past_hits = hits * self.decay
        self.past_ends = ends * self.decay
        self.hits = _counters()
        self.ends = _counters()
        return densities[row_of], rows

    def hazard(self, hits: np.ndarray, ends: np.ndarray, open_lives: np.ndarray) -> np.ndarray:
        """Reuse hazard per class and age bucket: reuses over lives at risk, each class
        smoothed towards its coarser groups' hazard (all lives, then its access count, then
        its count and gap) by ``prior`` lives of evidence."""
        return self._hazards(hits, ends, open_lives, np.arange(CLASSES))[0]

    def _hazards(
        self, hits: np.ndarray, ends: np.ndarray, open_lives: np.ndarray, classes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The hazards of ``classes``, and each finest group's (one row per group)."""
        # At risk in bucket x: every life that reached x (ended at x or later, or still open
        # at an age of x or more).
        risk = np.cumsum((ends + open_lives)[:, ::-1], axis=1)[:, ::-1]
        if self.smooth:
            # A class without events stays 0 when smoothed: only the others are.
            some = np.flatnonzero(hits.any(axis=1) | risk.any(axis=1))
            some_hits, some_risk = hits[some], risk[some]
            for _ in range(self.smooth):
                some_hits, some_risk = _smoothed(some_hits), _smoothed(some_risk)
            hits, risk = np.zeros(hits.shape), np.zeros(risk.shape)
            hits[some], risk[some] = some_hits, some_risk
        k = self.prior
        # Every class of a group has the group's hazard, so each level is computed once per
        # finest group (row), and spread over the classes at the end.
        h = np.broadcast_to(_ratio(hits.sum(0), risk.sum(0) + k, 0.0), (_N_FREQ, AGE_BUCKETS))
        for onehot, of_finest in _GROUPS:
            h = _ratio((onehot @ hits)[of_finest] + k * h, (onehot @ risk)[of_finest] + k, h)
        group = np.clip(h, 0.0, 1.0)
        h = h[_FINEST[classes]]
        h = _ratio(hits[classes] + k * h, risk[classes] + k, h)
        return np.clip(h, 0.0, 1.0), group

    def _densities(self, hazard: np.ndarray) -> np.ndarray:
        """Per row of reuse hazards by age bucket: for each age, the best ratio over horizons
        of the chance of a reuse before the horizon to the expected time held."""
        if len(hazard) > _DENSITY_ROWS:
            return np.concatenate(
                [
                    self._densities(hazard[i : i + _DENSITY_ROWS])
                    for i in range(0, len(hazard), _DENSITY_ROWS)
                ]
            )
        rows = len(hazard)
        # survival[:, x]: alive at the start of bucket x
        survival = np.concatenate((np.ones((rows, 1)), np.cumprod(1.0 - hazard, axis=1)), axis=1)
        held = survival[:, :-1] * self._widths * (1.0 - hazard / 2.0)
        occupancy = np.concatenate((np.zeros((rows, 1)), np.cumsum(held, axis=1)), axis=1)
        # density[c, i] = max over horizons j of (S_i - S_{j+1}) / (Occ_{j+1} - Occ_i), 0 where
        # the time held is 0; ages with a horizon too near count 0 as well. Only the (i, j)
        # pairs of horizons are computed.
        age, end = self._pairs
        num = survival[:, age]
        num -= survival[:, end]
        den = occupancy[:, end]
        den -= occupancy[:, age]
        ratio = np.zeros_like(num)
        np.divide(num, den, out=ratio, where=den > 0)
        best = np.maximum.reduceat(ratio, self._first_pair, axis=1)
        np.maximum(best, 0.0, out=best, where=self._near)
        return best


def _counters() -> array[int]:
    """Zeroed event counters, one per class and age bucket (int64; numpy reads them in
    place)."""
    return array("q", bytes(8 * CLASSES * AGE_BUCKETS))


def _ratio(num: np.ndarray, den: np.ndarray, fallback: np.ndarray | float) -> np.ndarray:
    """``num / den``, and ``fallback`` where nothing is at risk (``den`` is 0)."""
    out = np.array(np.broadcast_to(fallback, np.broadcast(num, den).shape), dtype=np.float64)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _smoothed(a: np.ndarray) -> np.ndarray:
    """``a`` averaged along the age axis with its neighbours (weights 1/4, 1/2, 1/4; the
    ends reflect), so that a few events in one bucket do not make a spike."""
    padded = np.concatenate((a[:, :1], a, a[:, -1:]), axis=1)
    out = 0.25 * padded[:, :-2]
    out += 0.5 * padded[:, 1:-1]
    out += 0.25 * padded[:, 2:]
    return out


class DensityPolicy(InsertEach, OwesNoWork, Hinted):
    """Parameters (all optional; unknown ones are ignored):

    capacity_blocks: the tier's size; sizes the ghost window and the statistics period.
        None uses the most blocks ever resident at once.
    quantum_s: the age unit and the ranking's time step (1 s).
    ghost_factor: an evicted block's life stays open (its reuse is still learned from) for
        this many tier-fulls of evictions (4).
    period: accesses between statistics tables (default: the capacity, at least
        2,048).
    decay: weight of the previous statistics at each table (0.9: about ten periods).
    prior: lives of pooled evidence a class's hazard starts from (8).
    admission: decline a block whose density is below the victim's (True).
    own_weight: rank by the class's density times the square root of the block's own heat
        (True; False ranks by the class's density alone).
    own_half_life_s: half-life of that heat, the block's decayed access count (100 s).
    full_heat_below: below this fraction of hits per access the weight is the heat itself
        (0.085; 0 never).
    initial_ids: initial size of the per-id arrays (they grow by doubling).
    """

    default_admission = "always"

    _state: np.ndarray
    _last: np.ndarray
    _cls: np.ndarray
    _cnt: np.ndarray
    _depth: np.ndarray
    _turn: np.ndarray
    _parent: np.ndarray
    _kids: np.ndarray
    _ins: np.ndarray
    _evseq: np.ndarray
    _stamp: np.ndarray
    _until: np.ndarray
    _heat: np.ndarray
    # Memoryviews of the arrays above, for scalar access (typed Any: memoryview's stubs
    # assume byte-sized integer items).
    _state_v: Any
    _last_v: Any
    _cls_v: Any
    _cnt_v: Any
    _depth_v: Any
    _turn_v: Any
    _parent_v: Any
    _kids_v: Any
    _ins_v: Any
    _evseq_v: Any
    _stamp_v: Any
    _until_v: Any
    _heat_v: Any

    def __init__(
        self,
        capacity_blocks: int | None = None,
        quantum_s: float = 1.0,
        ghost_factor: float = 4.0,
        period: int | None = None,
        decay: float = 0.9,
        prior: float = 8.0,
        admission: bool = True,
        signals: Sequence[str] | str = DEFAULT_SIGNALS,
        smooth: int = 3,
        min_horizon: int = 1,
        own_weight: bool = True,
        own_half_life_s: float = 100.0,
        full_heat_below: float = 0.085,
        initial_ids: int = 1024,
        **_: object,
    ) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        if not quantum_s > 0 or ghost_factor < 0 or (period is not None and period < 1):
            raise ValueError("quantum_s must be > 0, ghost_factor >= 0 and period >= 1")
        if not own_half_life_s > 0:
            raise ValueError("own_half_life_s must be > 0")
        self._fixed_capacity = capacity_blocks
        self._quantum = float(quantum_s)
        # The heat's decay over a gap, by the gap's age bucket (``heat_decays``); without
        # ``own_weight`` every factor is 0, so every heat is 1 and every weight 1.0.
        self._decay_arr = (
            heat_decays(self._quantum / own_half_life_s) if own_weight else np.zeros(AGE_BUCKETS)
        )
        # A float32 slot: rounds a heat as ``_heat`` stores it.
        self._f32: Any = memoryview(np.zeros(1, dtype=np.float32))  # type: ignore[arg-type]
        self._decay = self._decay_arr.tolist()
        self._ghost_factor = ghost_factor
        self._full_heat_below = full_heat_below
        # The heat's weight: its square root, or the heat itself while the tier hits rarely
        # (chosen at each table, see ``_new_table``; ``float`` and ``np.asarray``: the heat
        # as it is, by builtins as cheap to call as the square roots).
        self._weigh: Any = math.sqrt
        self._weigh_all: Any = np.sqrt
        self._hits = 0  # accesses of resident blocks
        self._hits_at_table = 0
        self._accesses_at_table = 0
        self._recent_hits = 0.0  # hits and accesses, decayed as the statistics are
        self._recent_accesses = 0.0
        self._period = period
        self._admission = admission
        self._classify = Classifier(signals.split(",") if isinstance(signals, str) else signals)
        self.model = ReuseModel(prior, decay, smooth, min_horizon)
        self._table = np.zeros((CLASSES, AGE_BUCKETS))
        self._rows: list[list[float]] = self._table.tolist()
        self._version = 0
        self._resident = 0
        self._high_water = 0
        self._seq = 0  # the last stamp given (modulo ``_STAMPS``)
        self._inserts = 0  # the last insertion number given (``_ins``)
        self._evictions = 0
        self._accesses = 0
        self._warming = True
        self._next_table = self._period_now()
        # Evictions and misses so far, and at the last table: a table falls due only once
        # the tier has decided something since (a tier that is not full needs no order).
        self._decided = 0
        self._decided_at_table = 0
        self._now = -math.inf
        self._tables = 0
        # The candidate buffer (see the module docstring).
        self._buf: list[tuple[float, float, int, int, int, int]] = []
        self._cur = 0
        self._bound = -math.inf
        self._complete = False
        self._buf_q = math.nan
        self._buf_version = -1
        self._target = _MIN_BUFFER
        # Memo of ``_select`` (see there).
        self._memo_mask: EvictableFn | None = None
        self._memo_tag: tuple[float, float, int] = (math.nan, math.nan, -1)
        self._memo_allowed: dict[int, tuple[int, bool]] = {}
        self._memo_keys: dict[int, tuple[int, tuple[float, float, int, int]]] = {}
        self._taken = 0  # victims proposed since the last rebuild (sizes the next buffer)
        self._rebuilds = 0
        # Buffer entries of hinted blocks met at its head, taken out until their deadline
        # (``_select``), as ``(until, entry)``; put back in order when it passes, unless the
        # buffer was rebuilt meanwhile (a rebuild places every block itself).
        self._parked: list[tuple[float, tuple[float, float, int, int, int, int]]] = []
        # The last single victim proposed and its density, for ``admits``.
        self._pick = (-1, -1, -1.0)
        # Hints: the latest deadline ever given (none is live past it).
        self._hinted_until = -math.inf
        self._hinted = False  # ``_until`` is its own array (see ``_alloc``)
        self._q_now = math.nan
        self._q = math.nan
        self._size = 0
        self._used = 0  # see ``_use``
        self._alloc(max(1, initial_ids))
        # Histories of dropped blocks by memento slot (``remember``), and their hints (the
        # few with one).
        self._kept = Kept(_KEPT)
        self._kept_until: dict[int, float] = {}
        # Per capped kept field (``_KEPT_CAPPED``), the values at or past its cap by slot.
        self._kept_big: dict[str, dict[int, int]] = {name: {} for name in _KEPT_CAPPED}

    # ------------------------------------------------------------------ protocol

    @property
    def capacity(self) -> int:
        return self._fixed_capacity or max(self._high_water, 1)

    def insert(self, bid: int, now: float, parent: int = -1) -> None:
        if bid >= self._used:
            self._use(bid)
        state_v = self._state_v
        if state_v[bid] == _RESIDENT:
            self.touch(bid, now)
            return
        cls = self._access(bid, now, parent)
        state_v[bid] = _RESIDENT
        self._resident += 1
        if self._resident > self._high_water:
            self._high_water = self._resident
        self._seq = seq = (self._seq + 1) % _STAMPS
        self._stamp_v[bid] = seq
        if self._inserts >= _INS_LIMIT:
            self._renumber_inserts()
        self._inserts += 1
        self._ins_v[bid] = self._inserts
        self._kids_v[bid] = 0
        if 0 <= parent < self._size and parent != bid and state_v[parent] == _RESIDENT:
            self._parent_v[bid] = parent
            self._kids_v[parent] += 1
        else:
            self._parent_v[bid] = -1
        if self._buf_version == self._version:
            # Inline ``_note`` for a new leaf (the per-access path).
            q = self._q if now == self._q_now else self._quantise(now)
            if q != self._buf_q:
                self._buf_version = -1
            else:
                dens = self._rows[cls][0] * self._weigh(self._heat_v[bid])
                if dens <= self._bound and self._until_v[bid] < q + self._quantum:
                    bisect.insort(
                        self._buf,
                        (dens, now, -self._depth_v[bid], self._inserts, bid, seq),
                        lo=self._cur,
                    )
        if self._accesses >= self._next_table and self._table_may_fall_due():
            self._new_table(now)

    def touch(self, bid: int, now: float) -> None:
        if not 0 <= bid < self._size or self._state_v[bid] != _RESIDENT:
            raise KeyError(bid)
        cls = self._access(bid, now, -1)
        self._hits += 1
        self._seq = (self._seq + 1) % _STAMPS
        self._stamp_v[bid] = self._seq
        if self._buf_version == self._version:
            self._note(bid, cls, now)
        if self._accesses >= self._next_table and self._table_may_fall_due():
            self._new_table(now)

    def touch_many(self, bids: np.ndarray, now: float) -> None:
        ids = np.asarray(bids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return
        ok = (ids >= 0) & (ids < self._size)
        ok[ok] = self._state[ids[ok]] == _RESIDENT
        if not ok.all():
            raise KeyError(int(ids[np.argmin(ok)]))  # before any change: all or nothing
        if len(ids) < _VECTOR_MIN or len(np.unique(ids)) < len(ids):
            touch = self.touch
            for bid in ids.tolist():
                touch(bid, now)
            return
        # Distinct ids: the loop's state, vectorised; split where the loop would build a
        # new table, so each part sees the table the loop would.
        while len(ids):
            if not self._table_may_fall_due():
                self._touch_distinct(ids, now)  # no table can fall due (see ``_new_table``)
                return
            room = max(self._next_table - self._accesses, 1)
            part, ids = ids[:room], ids[room:]
            self._touch_distinct(part, now)
            if self._accesses >= self._next_table:
                self._new_table(now)

    def _touch_distinct(self, ids: np.ndarray, now: float) -> None:
        """``touch`` of each of ``ids`` (distinct, resident), as array operations."""
        if now > self._now:
            self._now = now
        n = len(ids)
        self._accesses += n
        self._hits += n
        age = (now - self._last[ids]) / self._quantum
        gap = age_buckets(age)
        heat = self._heat[ids] * self._decay_arr[gap]  # in float64, as ``_access`` computes
        heat += 1.0
        self._heat[ids] = heat
        closing = self._cls[ids].astype(np.int64) * AGE_BUCKETS + gap
        where, times = np.unique(closing, return_counts=True)
        hits, ends = self.model.hits, self.model.ends
        for i, k in zip(where.tolist(), times.tolist(), strict=True):
            hits[i] += k
            ends[i] += k
        count = self._cnt[ids].astype(np.int64)
        count = np.minimum(count + 1, _MAX_COUNT)
        self._cnt[ids] = count
        c = self._classify
        cls = (
            np.take(c.count, np.minimum(count, 17))
            + np.where(count > 1, np.take(c.gap, gap), 0)
            + np.take(c.depth, np.minimum(self._depth[ids], 8))
            + np.take(c.turn, np.minimum(self._turn[ids], 6))
        )
        self._cls[ids] = cls
        self._last[ids] = now
        self._stamp[ids] = np.arange(self._seq + 1, self._seq + n + 1) % _STAMPS
        self._seq = (self._seq + n) % _STAMPS
        if self._buf_version != self._version:
            return
        q = self._quantise(now)
        if q != self._buf_q:
            self._buf_version = -1
            return
        # A heat is at least 1, so a block whose class alone ranks above the bound does too:
        # the weights are computed only for the others.
        dens = self._table[cls, 0]
        low = (
            (dens <= self._bound) & (self._kids[ids] == 0) & (self._until[ids] < q + self._quantum)
        )
        if not low.any():
            return
        ids = ids[low]
        dens = dens[low] * self._weigh_all(self._heat[ids].astype(np.float64))
        low = dens <= self._bound
        ids, dens = ids[low], dens[low]
        new = list(
            zip(
                dens.tolist(),
                [now] * len(ids),
                (-self._depth[ids].astype(np.int64)).tolist(),
                self._ins[ids].tolist(),
                ids.tolist(),
                self._stamp[ids].tolist(),
                strict=True,
            )
        )
        # Merged rather than inserted one by one: the buffer stays sorted from the cursor.
        tail = self._buf[self._cur :]
        tail.extend(new)
        tail.sort()
        self._buf = tail
        self._cur = 0

    def remove(self, bid: int) -> None:
        state_v = self._state_v
        if not 0 <= bid < self._size or state_v[bid] != _RESIDENT:
            raise KeyError(bid)
        state_v[bid] = _GHOST
        self._resident -= 1
        self._evictions += 1
        self._decided += 1
        self._evseq_v[bid] = self._evictions % SEQ_MOD + 1  # seq_keep, inline
        parent = self._parent_v[bid]
        if parent >= 0 and state_v[parent] == _RESIDENT and self._ins_v[parent] < self._ins_v[bid]:
            kids_v = self._kids_v
            kids_v[parent] -= 1
            if kids_v[parent] == 0 and self._buf_version == self._version:
                # A new leaf: the buffer must hold it if it ranks at or below the bound.
                q = self._buf_q
                if self._until_v[parent] < q + self._quantum:
                    last = self._last_v[parent]
                    age = (q - last) / self._quantum
                    if age < 1.0:
                        x = 0
                    else:
                        x = 1 + int(2.0 * math.log2(age))
                        if x >= AGE_BUCKETS:
                            x = AGE_BUCKETS - 1
                    dens = self._rows[self._cls_v[parent]][x] * self._weigh(self._heat_v[parent])
                    if dens <= self._bound:
                        entry = (
                            dens,
                            last,
                            -self._depth_v[parent],
                            self._ins_v[parent],
                            parent,
                            self._stamp_v[parent],
                        )
                        bisect.insort(self._buf, entry, lo=self._cur)

    def remember(self, bid: int, slot: int) -> None:
        """Keep the history of ``bid`` (not resident; ``forget`` follows) at memento
        ``slot`` (see ``kvtier.daemon.policy.memento``): its signals, heat, hint and open
        life. The open life stays open there (``_new_table`` counts it and closes it when
        its ghost expires) until the block returns or ``expire`` censors it."""
        kept = self._kept
        kept.fit(slot)
        self._kept_until.pop(slot, None)
        for big in self._kept_big.values():
            big.pop(slot, None)
        if not 0 <= bid < self._size or self._state_v[bid] == _RESIDENT:
            # Never known here (a forgotten row's values), or still resident, which the
            # store does not do (``forget`` leaves a resident block alone too).
            kept.clear(slot)
            return
        views = kept.views
        for name in _KEPT_SAME:
            views[name][slot] = getattr(self, name + "_v")[bid]
        # The life is open (a ghost) where the eviction count is kept, never 0 (``seq_keep``).
        views["_evseq"][slot] = self._evseq_v[bid] if self._state_v[bid] == _GHOST else 0
        for name, cap in _KEPT_CAPPED.items():
            if (value := getattr(self, name + "_v")[bid]) >= cap:
                self._kept_big[name][slot] = value
                value = cap
            views[name][slot] = value
        if (until := self._until_v[bid]) > -math.inf:
            self._kept_until[slot] = until
        self._state_v[bid] = _CLOSED  # its life moved to the slot: ``forget`` censors none

    def revive(self, slot: int, bid: int) -> None:
        """The history kept at ``slot`` becomes that of ``bid`` (a new row, forgotten)."""
        if bid >= self._used:
            self._use(bid)
        views = self._kept.views
        for name in self._kept.fields:
            getattr(self, name + "_v")[bid] = views[name][slot]
        for name, cap in _KEPT_CAPPED.items():
            if views[name][slot] == cap:
                getattr(self, name + "_v")[bid] = self._kept_big[name].pop(slot)
        self._state_v[bid] = _GHOST if views["_evseq"][slot] else _CLOSED
        views["_evseq"][slot] = 0  # the slot's life is closed (it is freed, left a hole)
        if (until := self._kept_until.pop(slot, None)) is not None:
            self._until_v[bid] = until  # kept only where hints were given: its own array

    def expire(self, slot: int) -> None:
        """The history kept at ``slot`` is forgotten: ``forget``'s censoring of an open
        life, at the slot."""
        views = self._kept.views
        self._kept_until.pop(slot, None)
        for big in self._kept_big.values():
            big.pop(slot, None)
        if slot < len(self._kept) and views["_evseq"][slot]:  # a ghost's open life
            age = max(0.0, self._now - views["_last"][slot]) / self._quantum
            self.model.ends[views["_cls"][slot] * AGE_BUCKETS + age_bucket(age)] += 1
            views["_evseq"][slot] = 0

    def renumber(self, order: np.ndarray) -> None:
        """The table renumbered its memento slots (new slot ``i``: old ``order[i]``)."""
        self._kept.renumber(order)
        self._kept_until = renumbered(self._kept_until, order)
        self._kept_big = {name: renumbered(big, order) for name, big in self._kept_big.items()}

    def forget(self, bid: int) -> None:
        if not 0 <= bid < self._size or self._state_v[bid] == _RESIDENT:
            return
        if self._state_v[bid] == _GHOST:
            self._censor(bid, self._now)
        self._state_v[bid] = _CLOSED
        self._cnt_v[bid] = 0
        self._depth_v[bid] = 0
        self._turn_v[bid] = 0
        self._heat_v[bid] = 0.0
        self._parent_v[bid] = -1
        if self._hinted:
            self._until_v[bid] = -math.inf

    def hint(self, bids: np.ndarray, until: float, now: float) -> None:
        if math.isnan(until):
            raise ValueError("a hint's deadline must be a number")
        ids = np.asarray(bids, dtype=np.int64).reshape(-1)
        if len(ids) == 0 or until < now:
            return
        if ids.min() < 0:
            raise KeyError(int(ids[np.argmin(ids)]))
        if ids.max() >= self._size:
            self._grow(int(ids.max()) + 1)
        if not self._hinted:
            # ``_until`` becomes an array of its own (see ``_alloc``).
            self._hinted = True
            self._until = np.full(self._size, -math.inf)
            self._until_v = memoryview(self._until)  # type: ignore[arg-type]
        self._until[ids] = np.maximum(self._until[ids], until)
        self._hinted_until = max(self._hinted_until, until)
        if self._buf_version == self._version and until >= self._buf_q + self._quantum:
            # Protected for the rest of the buffer's quantum: out of the buffer (new stamps).
            held = ids[self._state[ids] == _RESIDENT]
            if len(held):
                stamps = np.arange(self._seq + 1, self._seq + 1 + len(held)) % _STAMPS
                self._stamp[held] = stamps
                self._seq = (self._seq + len(held)) % _STAMPS

    def unhinted(self, evictable: EvictableFn, now: float) -> EvictableFn:
        """``Hinted.unhinted`` over this policy's own deadlines (``_until``)."""
        if self._hinted_until < now:
            return evictable

        def mask(bids: np.ndarray) -> np.ndarray:
            ids = np.asarray(bids, dtype=np.int64)
            ok = np.ones(len(ids), dtype=bool)
            known = ids < len(self._until)
            ok[known] = self._until[ids[known]] < now
            if ok.any():
                ok &= evictable(ids)
            return ok

        return mask

    def victims(
        self,
        n: int,
        now: float,
        evictable: EvictableFn | None,
        incoming: Sequence[int] = (),
    ) -> np.ndarray | None:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if n > self._resident:
            return None
        q = self._current_buffer(now)
        if n == 1 and evictable is None:
            # The replayer's path: the lowest key, every block evictable (the lowest no hint
            # protects where one is live).
            b = self._first_in_buffer() if self._hinted_until < now else self._first_unhinted(now)
            if b >= 0:
                out = _ONE.copy()  # cheaper than building an array from a list
                out[0] = b
                return out
        chosen = self._select(n, now, evictable)
        if chosen is None:
            self._target = min(max(self._resident, _MIN_BUFFER), 4 * self._target)
            self._rebuild(q, complete=True)
            chosen = self._select(n, now, evictable)
        if chosen is None or len(chosen) < n:
            return None
        return np.asarray(chosen, dtype=np.int64)

    def victim(self, now: float, incoming: int = -1) -> int:
        """``victims(1, now, None, (incoming,))`` as a block id, -1 for None: the replayer
        asks once per miss, and an array per answer was a tenth of its cost."""
        if self._resident == 0:
            return -1
        self._current_buffer(now)
        b = self._first_in_buffer() if self._hinted_until < now else self._first_unhinted(now)
        if b >= 0:
            return b
        found = self.victims(1, now, None, (incoming,) if incoming >= 0 else ())
        return -1 if found is None else int(found[0])

    def replace(self, bid: int, parent: int, now: float) -> int:
        """A miss of a full tier in one call (the replayer's per-miss step, see the module
        ``kvtier.daemon.policy.base``): as ``victim(now, bid)``, then ``admits`` and
        ``remove`` plus ``insert``, or ``note_miss``, would answer and leave the policy.

        The common case (the victim is in the buffer) is those steps written out in one
        frame, as they set the replayer's speed: the incoming block's class is computed
        once, for its admission and its new life. Without a live hint the victim is the
        buffer's first live leaf and its density is its entry's; with one, the first leaf no
        hint protects (``_first_unhinted``: the hinted ones met before it parked), its
        density ``_victim_density``'s and a hinted incoming block always admitted, as the
        steps decide. A victim the buffer does not hold takes ``_replace_by_steps``."""
        if bid >= self._used:
            self._use(bid)
        state_v = self._state_v
        if not self._resident or state_v[bid] == _RESIDENT:
            return self._replace_by_steps(bid, parent, now)
        q = self._q if now == self._q_now else self._quantise(now)
        if q != self._buf_q or self._buf_version != self._version:
            self._rebuild(q, complete=False)
        elif self._parked and self._parked[0][0] < now:
            self._unpark(now)
        buf = self._buf
        stamp_v, kids_v, until_v = self._stamp_v, self._kids_v, self._until_v
        i, end = self._cur, len(buf)
        hinted = self._hinted_until >= now
        if hinted:
            # The victim: ``_first_unhinted``.
            parked = self._parked
            while i < end:
                e = buf[i]
                out = e[4]
                if state_v[out] == _RESIDENT and stamp_v[out] == e[5] and kids_v[out] == 0:
                    if until_v[out] < now:
                        break
                    heapq.heappush(parked, (float(until_v[out]), e))
                i += 1
        else:
            # The victim: ``_first_in_buffer``.
            while i < end:
                e = buf[i]
                out = e[4]
                if state_v[out] == _RESIDENT and stamp_v[out] == e[5] and kids_v[out] == 0:
                    break
                i += 1
        self._cur = i
        if i == end:
            return self._replace_by_steps(bid, parent, now)
        self._taken += 1
        if hinted:
            # ``_victim_density`` (``_first_unhinted`` leaves ``_pick`` alone).
            pick, stamp, theirs = self._pick
            if pick != out or stamp != stamp_v[out]:
                last = self._last_v[out]  # ``_key``
                age = (q - last) / self._quantum
                theirs = self._rows[self._cls_v[out]][
                    age_bucket(age) if age >= 1.0 else 0
                ] * self._weigh(self._heat_v[out])
            admit_all = until_v[bid] >= now  # ``_incoming_density``: infinite
        else:
            self._pick = (out, e[5], e[0])
            theirs, admit_all = e[0], False
        # The class of the life the access starts (``_access``), which admission weighs (no
        # hint is live, so the incoming block's density is its class's at age 0).
        cnt_v, depth_v, turn_v = self._cnt_v, self._depth_v, self._turn_v
        classify = self._classify
        count = cnt_v[bid]
        if count:
            age = (now - self._last_v[bid]) / self._quantum
            if age < 1.0:
                gap = 0
            else:
                gap = 1 + int(2.0 * math.log2(age))
                if gap >= AGE_BUCKETS:
                    gap = AGE_BUCKETS - 1
            depth, turn = depth_v[bid], turn_v[bid]
            heat = self._heat_v[bid] * self._decay[gap] + 1.0
            new_count = count + 1 if count < _MAX_COUNT else count
            cls = (
                classify.count[new_count if new_count < 18 else 17]
                + classify.gap[gap]
                + classify.depth[depth if depth < 8 else 8]
            )
        else:
            depth = turn = 0
            if 0 <= parent < self._size:  # ``_lineage``
                parent_count = cnt_v[parent]
                if parent_count > 0:
                    depth = min(depth_v[parent] + 1, 1 << 30)
                    turn = min(turn_v[parent] + (1 if parent_count >= 2 else 0), 255)
            cls = classify.count[1] + classify.depth[depth if depth < 8 else 8]
            heat = 1.0
        cls += classify.turn[turn if turn < 6 else 6]
        heat_v = self._heat_v
        heat_v[bid] = heat  # stored as float32: the density is the stored heat's
        dens = self._rows[cls][0] * self._weigh(heat_v[bid])
        # The access (``_access``), kept or not.
        if now > self._now:
            self._now = now
        self._accesses += 1
        if count:
            if state_v[bid] != _CLOSED:
                k = self._cls_v[bid] * AGE_BUCKETS + gap
                self.model.hits[k] += 1
                self.model.ends[k] += 1
            if new_count != count:
                cnt_v[bid] = new_count
        else:
            depth_v[bid] = depth
            turn_v[bid] = turn
            cnt_v[bid] = 1
        self._cls_v[bid] = cls
        self._last_v[bid] = now
        self._decided += 1
        if self._admission and not admit_all and dens < theirs:
            # Declined: ``note_miss``.
            state_v[bid] = _GHOST
            self._evseq_v[bid] = self._evictions % SEQ_MOD + 1
            if self._accesses >= self._next_table and self._table_may_fall_due():
                self._new_table(now)
            return DECLINED
        # ``remove(out)``.
        quantum = self._quantum
        state_v[out] = _GHOST
        self._evictions += 1
        self._evseq_v[out] = self._evictions % SEQ_MOD + 1
        p = self._parent_v[out]
        ins_v = self._ins_v
        if p >= 0 and state_v[p] == _RESIDENT and ins_v[p] < ins_v[out]:
            kids_v[p] -= 1
            if kids_v[p] == 0 and until_v[p] < q + quantum:
                # A new leaf (the buffer is current): held if it ranks at or below the bound.
                last = self._last_v[p]
                age = (q - last) / quantum
                if age < 1.0:
                    x = 0
                else:
                    x = 1 + int(2.0 * math.log2(age))
                    if x >= AGE_BUCKETS:
                        x = AGE_BUCKETS - 1
                pdens = self._rows[self._cls_v[p]][x] * self._weigh(heat_v[p])
                if pdens <= self._bound:
                    bisect.insort(buf, (pdens, last, -depth_v[p], ins_v[p], p, stamp_v[p]), lo=i)
        # ``insert(bid, now, parent)``, with the class above.
        state_v[bid] = _RESIDENT
        self._seq = seq = (self._seq + 1) % _STAMPS
        stamp_v[bid] = seq
        if self._inserts >= _INS_LIMIT:
            self._renumber_inserts()
        self._inserts += 1
        ins_v[bid] = self._inserts
        kids_v[bid] = 0
        if 0 <= parent < self._size and parent != bid and state_v[parent] == _RESIDENT:
            self._parent_v[bid] = parent
            kids_v[parent] += 1
        else:
            self._parent_v[bid] = -1
        if dens <= self._bound and until_v[bid] < q + quantum:
            bisect.insort(buf, (dens, now, -depth, self._inserts, bid, seq), lo=i)
        if self._accesses >= self._next_table and self._table_may_fall_due():
            self._new_table(now)
        return int(out)

    def _replace_by_steps(self, bid: int, parent: int, now: float) -> int:
        """``replace`` as the calls it stands for."""
        out = -1
        if self._resident and self._hinted_until < now:
            self._current_buffer(now)
            out = self._first_in_buffer()
        if out < 0:
            out = self.victim(now, bid)
            if out < 0:
                self.note_miss(bid, parent, now)
                return NO_VICTIM
        if self._admission and self._incoming_density(bid, parent, now) < self._victim_density(
            out, now
        ):
            self.note_miss(bid, parent, now)
            return DECLINED
        self.remove(out)
        self.insert(bid, now, parent)
        return out

    def _current_buffer(self, now: float) -> float:
        """The quantum of ``now``, the victim buffer rebuilt (partly) if it is of another
        quantum or the density table changed since, else with the parked entries whose hint
        passed put back (``_unpark``)."""
        q = self._q if now == self._q_now else self._quantise(now)
        if q != self._buf_q or self._buf_version != self._version:
            self._rebuild(q, complete=False)
        elif self._parked and self._parked[0][0] < now:
            self._unpark(now)
        return q

    def _first_in_buffer(self) -> int:
        """The buffer's first live leaf from the cursor on (the lowest key when nothing is
        masked or hinted), taken as the pick; -1 when the buffer ran out."""
        buf, i = self._buf, self._cur
        state_v, stamp_v, kids_v = self._state_v, self._stamp_v, self._kids_v
        while i < len(buf):
            e = buf[i]
            b = e[4]
            if state_v[b] == _RESIDENT and stamp_v[b] == e[5] and kids_v[b] == 0:
                self._cur = i
                self._pick = (b, e[5], e[0])
                self._taken += 1
                return int(b)
            i += 1
        self._cur = i
        return -1

    def _first_unhinted(self, now: float) -> int:
        """``_select(1, now, None)`` where a hint is live: the buffer's first live leaf that
        no hint protects, the hinted ones met before it parked; -1 when the buffer ran out
        (``_select`` then rebuilds it). As ``_select``, it leaves ``_pick`` alone."""
        buf, i = self._buf, self._cur
        state_v, stamp_v, kids_v, until_v = (
            self._state_v,
            self._stamp_v,
            self._kids_v,
            self._until_v,
        )
        parked = self._parked
        while i < len(buf):
            e = buf[i]
            b = e[4]
            if state_v[b] == _RESIDENT and stamp_v[b] == e[5] and kids_v[b] == 0:
                if until_v[b] < now:
                    self._cur = i
                    self._taken += 1
                    return int(b)
                heapq.heappush(parked, (float(until_v[b]), e))
            i += 1
        self._cur = i
        return -1

    def __len__(self) -> int:
        return self._resident

    def __contains__(self, bid: object) -> bool:
        if not isinstance(bid, (int, np.integer)) or not 0 <= bid < self._size:
            return False
        return bool(self._state_v[int(bid)] == _RESIDENT)

    # ------------------------------------------------------------------ admission

    def admits(self, bid: int, parent: int, victim: int, now: float) -> bool:
        """Whether ``bid`` (not resident; ``parent`` its chain predecessor or -1) is worth
        more than ``victim``: its density at age 0 is at least the victim's now. A hinted
        block is always worth it. Pure."""
        if not self._admission:
            return True
        return self._incoming_density(bid, parent, now) >= self._victim_density(victim, now)

    def _incoming_density(self, bid: int, parent: int, now: float) -> float:
        """The density ``bid`` (not resident) would start its new life with (infinite for a
        hinted block): what admission weighs against the victim's."""
        size = self._size
        known = 0 <= bid < size
        if known and self._until_v[bid] >= now:
            return math.inf
        classify = self._classify
        cnt_v = self._cnt_v
        if known and cnt_v[bid] > 0:
            count = cnt_v[bid] + 1
            age = (now - self._last_v[bid]) / self._quantum
            depth, turn = self._depth_v[bid], self._turn_v[bid]
            gap = age_bucket(age)
            cls = classify(count, gap, depth, turn)
            f32 = self._f32
            f32[0] = self._heat_v[bid] * self._decay[gap] + 1.0
            return self._rows[cls][0] * self._weigh(f32[0])
        elif 0 <= parent < size and cnt_v[parent] > 0:
            # ``_lineage``, inline: this runs for every miss of a full tier.
            depth = self._depth_v[parent] + 1
            turn = self._turn_v[parent] + (1 if cnt_v[parent] >= 2 else 0)
            cls = (
                classify.count[1]
                + classify.depth[depth if depth < 8 else 8]
                + classify.turn[turn if turn < 6 else 6]
            )
        else:
            cls = classify.count[1] + classify.depth[0] + classify.turn[0]
        return self._rows[cls][0]

    def admits_many(
        self, bids: Sequence[int], parents: Sequence[int], victim: int, now: float
    ) -> list[bool]:
        """``admits`` for each block of a batch, in order, each asked as it would be once
        the blocks before it had been accessed (kept or noted with ``note_miss``): a parent
        earlier in the batch lends the depth and turn it will have, though the policy has
        not seen it yet (the daemon's store asks for a Put's new chain before it inserts any
        of it). Pure."""
        if not self._admission:
            return [True] * len(bids)
        size = self._size
        cnt_v, depth_v, turn_v, until_v = self._cnt_v, self._depth_v, self._turn_v, self._until_v
        classify = self._classify
        # (access count, depth, turn) of the batch's blocks so far, once accessed.
        lineage: dict[int, tuple[int, int, int]] = {}
        out: list[bool] = []
        for bid, parent in zip(bids, parents, strict=True):
            known = 0 <= bid < size and cnt_v[bid] > 0
            pending = lineage.get(parent)
            if known or pending is None:
                out.append(self.admits(bid, parent, victim, now))
                if known:
                    lineage[bid] = (cnt_v[bid] + 1, depth_v[bid], turn_v[bid])
                else:
                    lineage[bid] = (1, *self._lineage(parent))
                continue
            count, depth, turn = pending
            depth, turn = min(depth + 1, 1 << 30), min(turn + (1 if count >= 2 else 0), 255)
            lineage[bid] = (1, depth, turn)
            if 0 <= bid < size and until_v[bid] >= now:
                out.append(True)  # hinted
                continue
            mine = self._rows[classify(1, 0, depth, turn)][0]
            out.append(bool(mine >= self._victim_density(victim, now)))
        return out

    def _victim_density(self, victim: int, now: float) -> float:
        """``victim``'s density now: the one ``victims`` just picked, else computed."""
        b, stamp, theirs = self._pick
        if b != victim or stamp != self._stamp_v[victim]:
            theirs = self._key(victim, self._quantise(now))[0]
        return theirs

    def note_miss(self, bid: int, parent: int, now: float) -> None:
        """``bid`` was read or stored but this tier does not keep it (declined, or no room):
        the access still ends its previous life and starts a new one."""
        if bid >= self._used:
            self._use(bid)
        if self._state_v[bid] == _RESIDENT:
            self.touch(bid, now)
            return
        self._access(bid, now, parent)
        self._state_v[bid] = _GHOST
        self._evseq_v[bid] = self._evictions % SEQ_MOD + 1
        self._decided += 1
        if self._accesses >= self._next_table and self._table_may_fall_due():
            self._new_table(now)

    # ---------------------------------------------------------------- inspection

    def stats(self) -> DensityStats:
        ghosts = int(np.count_nonzero(self._state[: self._size] == _GHOST))
        ghosts += int(np.count_nonzero(self._kept["_evseq"]))
        return DensityStats(
            self.capacity, self._resident, ghosts, self._tables, self._rebuilds, len(self._buf)
        )

    def density(self, bid: int, now: float) -> float:
        """The block's density (hits per block-quantum) at ``now``."""
        if bid not in self:
            raise KeyError(bid)
        return self._key(bid, self._quantise(now))[0]

    def describe(self, bid: int) -> BlockSignals:
        """What the policy knows of a block (KeyError if nothing)."""
        if not 0 <= bid < self._size or self._cnt_v[bid] == 0:
            raise KeyError(bid)
        return BlockSignals(
            count=int(self._cnt_v[bid]),
            depth=int(self._depth_v[bid]),
            turn=int(self._turn_v[bid]),
            cls=int(self._cls_v[bid]),
            last=float(self._last_v[bid]),
            heat=float(self._heat_v[bid]),
            resident=self._state_v[bid] == _RESIDENT,
            open_life=self._state_v[bid] != _CLOSED,
        )

    @property
    def table(self) -> np.ndarray:
        """The current densities, shape (CLASSES, AGE_BUCKETS) (a copy)."""
        return self._table.copy()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of per-id arrays (``_until`` counts once a hint gave it an array)."""
        return sum(a.itemsize for a in self._arrays() if a.flags.writeable)

    # ------------------------------------------------------------------- helpers

    def _period_now(self) -> int:
        """When the next table is due: every ``period`` accesses, and sooner while the
        policy is young (after 256 accesses, then doubling), so a new tier learns fast."""
        regular = self._period or max(2048, self.capacity)
        period = min(regular, max(256, self._accesses))
        self._warming = period < regular
        return self._accesses + period

    def _table_may_fall_due(self) -> bool:
        """Past the young policy's tables, one falls due only once the tier evicted or
        declined something since the last (a tier that is not full needs no order)."""
        return self._warming or self._decided != self._decided_at_table

    def _quantise(self, now: float) -> float:
        if now != self._q_now:
            self._q_now = now
            self._q = math.floor(now / self._quantum) * self._quantum
        return self._q

    def _lineage(self, parent: int) -> tuple[int, int]:
        """Depth and turn of a block first seen under ``parent``: one deeper, and a turn
        later if the parent was read again before the chain grew."""
        if 0 <= parent < self._size:
            count = self._cnt_v[parent]
            if count > 0:
                grew = 1 if count >= 2 else 0
                return min(self._depth_v[parent] + 1, 1 << 30), min(
                    self._turn_v[parent] + grew, 255
                )
        return 0, 0

    def _access(self, bid: int, now: float, parent: int) -> int:
        """End the block's open life (a reuse) and start a new one at ``now``; returns its
        class. The per-access path: locals and memoryviews keep it short."""
        if now > self._now:
            self._now = now
        self._accesses += 1
        cnt_v = self._cnt_v
        count = cnt_v[bid]
        classify = self._classify
        if count == 0:
            depth, turn = self._lineage(parent)
            self._depth_v[bid] = depth
            self._turn_v[bid] = turn
            cnt_v[bid] = 1
            self._heat_v[bid] = 1.0
            cls = classify.count[1] + classify.depth[depth if depth < 8 else 8]
        else:
            age = (now - self._last_v[bid]) / self._quantum
            if age < 1.0:
                gap = 0
            else:
                gap = 1 + int(2.0 * math.log2(age))
                if gap >= AGE_BUCKETS:
                    gap = AGE_BUCKETS - 1
            self._heat_v[bid] = self._heat_v[bid] * self._decay[gap] + 1.0
            if self._state_v[bid] != _CLOSED:
                i = self._cls_v[bid] * AGE_BUCKETS + gap
                self.model.hits[i] += 1
                self.model.ends[i] += 1
            depth, turn = self._depth_v[bid], self._turn_v[bid]
            if count < _MAX_COUNT:
                count += 1
                cnt_v[bid] = count
            cls = (
                classify.count[count if count < 18 else 17]
                + classify.gap[gap]
                + classify.depth[depth if depth < 8 else 8]
            )
        cls += classify.turn[turn if turn < 6 else 6]
        self._cls_v[bid] = cls
        self._last_v[bid] = now
        return cls

    def _censor(self, bid: int, now: float) -> None:
        age = max(0.0, now - self._last_v[bid]) / self._quantum
        self.model.ends[self._cls_v[bid] * AGE_BUCKETS + age_bucket(age)] += 1

    def _key(self, bid: int, q: float) -> tuple[float, float, int, int]:
        last = self._last_v[bid]
        age = (q - last) / self._quantum
        return (
            self._rows[self._cls_v[bid]][age_bucket(age) if age >= 1.0 else 0]
            * self._weigh(self._heat_v[bid]),
            last,
            -self._depth_v[bid],
            self._ins_v[bid],
        )

    def _note(self, bid: int, cls: int, now: float) -> None:
        """``bid`` (resident) just started a life: the current buffer must hold it if it is a
        leaf ranking at or below the bound; a buffer of another quantum is dropped."""
        q = self._quantise(now)
        if q != self._buf_q:
            self._buf_version = -1
            return
        if self._kids_v[bid] == 0 and self._until_v[bid] < q + self._quantum:
            dens = self._rows[cls][0] * self._weigh(self._heat_v[bid])
            if dens <= self._bound:
                self._insort((dens, now, -self._depth_v[bid], self._ins_v[bid]), bid)

    def _insort(self, key: tuple[float, float, int, int], bid: int) -> None:
        entry = (*key, bid, self._stamp_v[bid])
        bisect.insort(self._buf, entry, lo=self._cur)

    def _new_table(self, now: float) -> None:
        """Close expired ghosts, count the open lives, and rebuild the density table. The
        lives kept for dropped blocks (``remember``) count as the rows' do."""
        size = self._used
        open_lives = np.zeros(CLASSES * AGE_BUCKETS, dtype=np.float64)
        kept = self._kept
        window = self._ghost_factor * self.capacity
        for state, cls, last, evseq in (
            (self._state[:size], self._cls, self._last, self._evseq),
            (None, kept["_cls"], kept["_last"], kept["_evseq"]),
        ):
            # A kept life is open (a ghost) where its eviction count is kept (``_KEPT``).
            ghosts = np.flatnonzero(evseq) if state is None else np.flatnonzero(state == _GHOST)
            going = seq_ages(evseq[ghosts], self._evictions) >= window
            expired = ghosts[going]
            if len(expired):
                idx = cls[expired].astype(np.int64) * AGE_BUCKETS + age_buckets(
                    (now - last[expired]) / self._quantum
                )
                np.add.at(np.frombuffer(self.model.ends, dtype=np.int64), idx, 1)
                if state is None:
                    evseq[expired] = 0
                else:
                    state[expired] = _CLOSED
            live = ghosts[~going] if state is None else np.flatnonzero(state != _CLOSED)
            idx = cls[live].astype(np.int64) * AGE_BUCKETS + age_buckets(
                (now - last[live]) / self._quantum
            )
            open_lives += np.bincount(idx, minlength=CLASSES * AGE_BUCKETS)
        self._table, self._rows = self.model.table_rows(open_lives.reshape(CLASSES, AGE_BUCKETS))
        decay = self.model.decay
        self._recent_accesses = decay * self._recent_accesses + (
            self._accesses - self._accesses_at_table
        )
        self._recent_hits = decay * self._recent_hits + (self._hits - self._hits_at_table)
        full = self._recent_hits < self._full_heat_below * self._recent_accesses
        self._weigh, self._weigh_all = (float, np.asarray) if full else (math.sqrt, np.sqrt)
        self._hits_at_table, self._accesses_at_table = self._hits, self._accesses
        self._version += 1
        self._tables += 1
        self._next_table = self._period_now()
        self._decided_at_table = self._decided

    def _rebuild(self, q: float, complete: bool) -> None:
        """The buffer for quantum ``q``: the lowest-keyed leaves (all with ``complete``),
        leaving out blocks hinted past the quantum."""
        self._rebuilds += 1
        self._parked.clear()
        size = self._used
        live = (self._state[:size] == _RESIDENT) & (self._kids[:size] == 0)
        if self._hinted_until >= q + self._quantum:
            live &= self._until[:size] < q + self._quantum
        ids = np.flatnonzero(live)
        last = self._last[ids]
        dens = self._table[self._cls[ids], age_buckets((q - last) / self._quantum)]
        dens *= self._weigh_all(self._heat[ids].astype(np.float64))
        k = max(_MIN_BUFFER, self._target, 2 * self._taken)
        self._taken = 0
        if complete or k >= len(ids):
            self._bound = math.inf
            self._complete = True
        else:
            self._bound = float(np.partition(dens, k - 1)[k - 1])
            keep = dens <= self._bound
            ids, last, dens = ids[keep], last[keep], dens[keep]
            self._complete = False
        depth = -self._depth[ids].astype(np.int64)
        ins = self._ins[ids]
        order = np.lexsort((ins, depth, last, dens))
        ids = ids[order]
        self._buf = list(
            zip(
                dens[order].tolist(),
                last[order].tolist(),
                depth[order].tolist(),
                ins[order].tolist(),
                ids.tolist(),
                self._stamp[ids].tolist(),
                strict=True,
            )
        )
        self._cur = 0
        self._buf_q = q
        self._buf_version = self._version

    def _select(self, n: int, now: float, evictable: EvictableFn | None) -> list[int] | None:
        """Up to ``n`` victims from the buffer under the chain rule, or None when the buffer
        ran out before the choice was certain. Changes nothing but the buffer's cursor past
        entries that can never be chosen as they are."""
        buf = self._buf
        state_v, stamp_v, kids_v = self._state_v, self._stamp_v, self._kids_v
        parent_v, ins_v, until_v = self._parent_v, self._ins_v, self._until_v
        hints_live = self._hinted_until >= now
        i = self._cur
        advance = True
        from_head = False
        revived: list[tuple[tuple[float, float, int, int], int]] = []
        released: dict[int, int] = {}
        seen: set[int] = set()
        chosen: list[int] = []
        # What the mask said and the keys of released parents, kept across calls with the
        # same mask object, time, quantum and table (a replay evicts for each block of a
        # request at one time): entries carry the block's stamp, so a block touched or
        # re-inserted since is asked again. A mask only grows while time stands still
        # (protection starts at an access, which changes the stamp).
        tag = (now, self._buf_q, self._version)
        if self._memo_mask is not evictable or self._memo_tag != tag:
            self._memo_mask, self._memo_tag = evictable, tag
            self._memo_allowed = {}
            self._memo_keys = {}
        allowed, keys = self._memo_allowed, self._memo_keys
        while len(chosen) < n:
            while i < len(buf):
                e = buf[i]
                b = e[4]
                if state_v[b] != _RESIDENT or stamp_v[b] != e[5] or kids_v[b] > 0:
                    i += 1  # stale, or not a leaf (re-entered when it becomes one)
                    if advance:
                        self._cur = i
                    continue
                if b in seen:
                    i += 1
                    continue
                break
            head = buf[i] if i < len(buf) else None
            if revived and (head is None or revived[0] < (head[:4], head[4])):
                if head is None and revived[0][0][0] > self._bound and not self._complete:
                    return None
                key, b = heapq.heappop(revived)
                from_head = False
            elif head is not None:
                key, b = head[:4], head[4]
                i += 1
                from_head, advance = advance, False
            elif self._complete:
                return chosen
            else:
                return None
            if b in seen:
                continue
            seen.add(b)
            if hints_live and until_v[b] >= now:
                # Hinted: the engine reads its chain soon, ancestors included. At the
                # buffer's head (nothing before it left) its entry is parked, so that the
                # next calls do not walk it again (a queue window's blocks sit at the cold
                # end for its whole length).
                if from_head:
                    heapq.heappush(self._parked, (float(until_v[b]), buf[i - 1]))
                    self._cur = i
                    advance = True
                continue
            if evictable is None:
                chosen.append(b)
            else:
                memo = allowed.get(b)
                if memo is None or memo[0] != stamp_v[b]:
                    self._ask_mask(b, buf, i, evictable, allowed)
                    memo = allowed[b]
                if memo[1]:
                    chosen.append(b)
            p = parent_v[b]
            if p >= 0 and state_v[p] == _RESIDENT and ins_v[p] < ins_v[b]:
                left = released.get(p, kids_v[p]) - 1
                released[p] = left
                if left == 0 and p not in seen:
                    known = keys.get(p)
                    if known is None or known[0] != stamp_v[p]:
                        known = (stamp_v[p], self._key(p, self._buf_q))
                        keys[p] = known
                    heapq.heappush(revived, (max(known[1], key), p))
        self._taken += len(chosen)
        return chosen

    def _unpark(self, now: float) -> None:
        """Put the parked entries whose hint passed by ``now`` back in the buffer, in order,
        where their block is still as the entry says (a block hinted again meanwhile waits
        for its new deadline)."""
        parked, until_v = self._parked, self._until_v
        state_v, stamp_v = self._state_v, self._stamp_v
        while parked and parked[0][0] < now:
            _, entry = heapq.heappop(parked)
            b = entry[4]
            if state_v[b] != _RESIDENT or stamp_v[b] != entry[5]:
                continue
            if until_v[b] >= now:
                heapq.heappush(parked, (float(until_v[b]), entry))
                continue
            bisect.insort(self._buf, entry, lo=self._cur)

    def _ask_mask(
        self,
        b: int,
        buf: list[tuple[float, float, int, int, int, int]],
        i: int,
        evictable: EvictableFn,
        memo: dict[int, tuple[int, bool]],
    ) -> None:
        """Ask the mask about ``b`` together with the next buffer entries and ``b``'s
        ancestors (a masked leaf releases its parent, which is asked next): one call per
        batch rather than per block. Answers go to ``memo`` with each block's stamp."""
        stamp_v, parent_v, state_v, ins_v = (
            self._stamp_v,
            self._parent_v,
            self._state_v,
            self._ins_v,
        )

        def fresh(x: int) -> bool:
            m = memo.get(x)
            return m is None or m[0] != stamp_v[x]

        batch = [b]
        batch += [e[4] for e in buf[i : i + 31] if fresh(e[4])]
        x = b
        for _ in range(32):
            p = parent_v[x]
            if p < 0 or state_v[p] != _RESIDENT or ins_v[p] >= ins_v[x]:
                break
            if fresh(p):
                batch.append(p)
            x = p
        ids = np.asarray(batch, dtype=np.int64)
        for x, ok in zip(batch, evictable(ids).tolist(), strict=True):
            memo[x] = (stamp_v[x], bool(ok))

    # -------------------------------------------------------------- per-id arrays

    def _arrays(self) -> list[np.ndarray]:
        return [getattr(self, name) for name, _, _ in _ARRAYS]

    def _alloc(self, size: int) -> None:
        old = self._size
        for name, dtype, fill in _ARRAYS:
            if name == "_until" and not self._hinted:
                # No hint yet: every deadline -inf, one value seen at every index (read-only;
                # ``hint`` gives it an array of its own).
                arr = np.broadcast_to(np.array(fill, dtype=dtype), (size,))
            else:
                arr = np.full(size, fill, dtype=dtype)
                if old:
                    arr[:old] = getattr(self, name)[:old]
            setattr(self, name, arr)
            setattr(self, name + "_v", memoryview(arr))  # type: ignore[arg-type]
        self._size = size

    def _renumber_inserts(self) -> None:
        """Number the resident blocks 1.. in their insertion order, and go on from there:
        only residents' numbers are compared (a link whose parent left is dead whatever the
        numbers say), and a block inserted later is numbered above all of them."""
        resident = np.flatnonzero(self._state[: self._size] == _RESIDENT)
        ranked = resident[np.argsort(self._ins[resident], kind="stable")]
        self._ins[:] = 0
        self._ins[ranked] = np.arange(1, len(ranked) + 1)
        self._inserts = len(ranked)
        # The buffer's entries and the memo's keys carry the old numbers: both are rebuilt.
        self._buf_version = -1
        self._memo_tag = (math.nan, math.nan, -1)

    def _grow(self, needed: int) -> None:
        self._alloc(max(needed, 2 * self._size))

    def _use(self, bid: int) -> None:
        """``bid`` is given a life: the ids below ``_used`` hold every block with a life,
        where the scans of ``_rebuild`` and ``_new_table`` stop (a replay's ids are dense
        and come in order)."""
        if bid >= self._size:
            self._grow(bid + 1)
        self._used = bid + 1


# Per-id arrays: name, dtype, value of an unknown id.
_ARRAYS: list[tuple[str, Any, float]] = [
    ("_state", np.uint8, _CLOSED),
    ("_last", np.float64, -math.inf),
    ("_cls", np.uint8, 0),  # below CLASSES (asserted where CLASSES is set)
    ("_cnt", np.uint16, 0),
    ("_depth", np.int32, 0),
    ("_turn", np.uint8, 0),
    ("_parent", np.int32, -1),
    ("_kids", np.int32, 0),
    ("_ins", np.uint32, 0),  # insertion number: tells a parent from a reused id
    ("_evseq", np.uint32, 0),  # eviction count when it became a ghost (``seq_keep``)
    ("_stamp", np.uint32, 0),  # changes at every access (modulo ``_STAMPS``)
    ("_until", np.float64, -math.inf),
    ("_heat", np.float32, 0.0),
]

# A dropped block's history (``remember``): the per-id arrays above that make it up, kept as
# the rows keep them (the eviction count read only while a ghost, which ``_new_table``
# closes within its window, so its age stays far below ``SEQ_MOD``), with 4 bytes per
# remembered block less: no state (the life is open, a ghost, where the eviction count is
# kept, 0 where closed: ``seq_keep`` never gives 0), and the depth and the access count in
# narrower arrays (``_KEPT_CAPPED``): a value at or past the cap (chains 65535 deep, blocks
# read 255 times, both rare) is kept as the cap there and in full in a dict by slot.
_KEPT_SAME = ("_last", "_cls", "_turn", "_heat")
_KEPT_CAPPED = {"_depth": (1 << 16) - 1, "_cnt": (1 << 8) - 1}
_KEPT = [
    *(a for a in _ARRAYS if a[0] in _KEPT_SAME),
    ("_evseq", np.uint32, 0),
    ("_depth", np.uint16, 0),
    ("_cnt", np.uint8, 0),
]
