"""The simulation engine: a trace replayed through the daemon's tier stack and policies, on
the trace's clock. No bytes move; only which tier holds a copy of which block.

The tier stack it models is the daemon's (one or two tiers, L1 above L2):

- **Inclusive tiers.** A block may have a copy in L1 and in L2 at once. Every stored block is
  offered to L1 first. A block leaving L1 (evicted at a full tier, or above the high
  watermark) is written to L2 when it has no L2 copy and L2's admission admits it
  (``write_back``, the default; ``selective`` does the same); above the high watermark, a
  pass after each request takes as many victims as bring L1 down to the low watermark, as
  the daemon's balancer does: a block L2 admits but has no room for (every candidate
  protected) stays in L1, the pass going on with the others, and passes over it for
  ``BALANCE_RETRY_S`` of trace time (none of its victims gone: L1 is left alone that long),
  while one L2's admission declines leaves, L2 full or not (admission is asked first, as the
  daemon's demotion does). ``write_through``
  writes every new block to L2 at once as well, without asking L2's admission (the daemon's
  store does not). ``selective`` writes a block to L2 as soon as L2's admission admits it, on an access.
  Evicting from L2 drops only the L2 copy. A block L1 declines (its admission, or every
  block protected) is written to L2 as if it had left L1 at once.
- **Arrival.** At a request's arrival every block with a copy in any tier is a hit, counted
  for the fastest tier holding it and touched, in request order, in every tier holding it.
  An L2-only hit is then promoted to L1, keeping its L2 copy (L1's room and admission as for
  any block; one L1 cannot take is still a hit, read from L2). Then every missing block is
  computed and stored, in request order, its parent being the request's previous block.
  The prefix hits are the leading run of hits.
- **Protection.** A block read or written within ``protect_s`` (trace clock) is not
  evictable; a tier whose every candidate is protected rejects the block (counted as
  ``protected``). A block leaves a tier only as a victim its policy proposed.
- **Queue hints** (``queue_window_s`` S > 0): an engine's waiting queue of S seconds. The
  blocks of a request arriving at ``t`` are hinted at ``t - S`` with deadline ``t``: every
  policy protects them until then (``EvictionPolicy.hint``), and those only on L2 are
  promoted to L1 at once (a prefetch, counted). Hints are processed in time order between
  requests, each on its own time.
- **Admission.** Every access is recorded with each tier's admission rule before any
  decision of its request; a rule decides for a block with its would-be victim. An L1
  policy with an ``admits`` method (hit density) is also asked, after the rule, and told of
  the accesses it did not keep (``note_miss``).
- **Ids.** The trace's hash ids are renumbered densely and stay stable for the whole replay;
  a policy keeps what it knows of a block across its stays. The daemon frees a dropped
  block's row at once but keeps its history (a memento) only until ``history_factor`` times
  the blocks it holds were dropped after it (``BlockTable``, History); ``forget_dropped=True``
  models that by calling ``forget`` then (``tests/daemon/test_history.py`` checks that both
  decide alike).

**A cluster** (``ClusterConfig``, ``kvtier.sim.cluster``): N nodes, each the stack above with
its own policy objects, and one L3 they share. A routing rule gives each request to a node;
each node replays its own requests (its own clock, queue hints and, for ``opt``, its own
future), interleaved in trace order through the shared L3:

- **L3 hits.** At arrival, a block with no copy on the node is an L3 hit when the store
  holds it (a ``GET``: most recently used there), and is promoted to the node's L1 as an
  L2-only hit is (from there it moves on as any L1 block: demoted to L2, evicted).
- **L3 writes** (the daemon's ``selective`` write-behind): after the request, each of its
  blocks with a copy on the node, that the node does not know to be in L3, is offered to the
  node's L3 admission (``tiers.l3.admission``, default ``second_hit``: a block this node saw
  twice) and written when admitted. A node knows a block is in L3 once it wrote or read it,
  and forgets it when a read finds it gone (its table's L3 column), so it does not write a
  block again that it keeps reading from L1. Writes land before the next request (the
  daemon's are asynchronous, milliseconds behind). L1 evictions never write to L3.
- **Queue hints** also promote blocks the node knows to be in L3 (the daemon's prefetch
  consults its table, not the store); the nodes' hints are processed in time order.
- The daemon probes L3 only from the first local miss on, for the run present there; the
  replay counts every block L3 holds as an L3 hit, as it counts L1 and L2 hits past a gap.

``--policy opt`` is Belady's optimum with bypass (``kvtier.daemon.policy.opt``), given the
trace's future; with two tiers it runs Belady in each tier, which bounds nothing.

Exactness: with one tier, admission ``always``, no protection, no hints and the ``all``
semantics of ``kvtier.sim.trace`` this is the replayer published before the tier stack, step
for step (its hit ratios are pinned by the tests). One node without L3 is that replay
(``ClusterConfig()``, the default); N nodes without L3 are N independent replays.

Thread-safety: none needed; a replay is a single-threaded batch job.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.daemon.policy.admission import Admission, AlwaysAdmit, make_admission
from kvtier.daemon.policy.base import NO_VICTIM, EvictableFn, EvictionPolicy
from kvtier.daemon.policy.guard import EvictionGuard
from kvtier.daemon.policy.registry import default_admission, make_policy
from kvtier.daemon.space import BALANCE_RETRY_S
from kvtier.daemon.table import MIN_HISTORY_BASE
from kvtier.sim.cluster import ClusterConfig, L3Stats, SharedStore, route_requests
from kvtier.sim.trace import Trace, next_uses

WRITE_POLICIES = ("write_back", "write_through", "selective")
TIER_LABELS = ("l1", "l2", "l3")
_L1, _L2 = 1, 2  # bits of a block's copies (L3 is shared: a node knows, ``_L3Level.known``)
_L3_LABEL = TIER_LABELS[2]


@dataclass(frozen=True, slots=True)
class StackConfig:
    """How the simulated daemon behaves around its policies.

    ``l1_watermarks``: (high, low) fractions of L1's capacity; above high, L1 is emptied down
    to low after each request (the daemon's balancer). None: only a full tier evicts.
    """

    write_policy: str = "write_back"
    protect_s: float = 0.0
    queue_window_s: float = 0.0
    l1_watermarks: tuple[float, float] | None = None
    forget_dropped: bool = False
    history_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"unknown write policy {self.write_policy!r}; one of {', '.join(WRITE_POLICIES)}"
            )
        if not self.protect_s >= 0 or not math.isfinite(self.protect_s):
            raise ValueError("protect_s must be a finite number >= 0")
        if not self.queue_window_s >= 0 or not math.isfinite(self.queue_window_s):
            raise ValueError("queue_window_s must be a finite number >= 0")
        if self.l1_watermarks is not None:
            high, low = self.l1_watermarks
            EvictionGuard(high_watermark=high, low_watermark=low)  # validates


@dataclass(frozen=True, slots=True)
class NodeResult:
    """One node's share of a replay: its requests, and the hits of its own tiers (``l3``:
    blocks it read from the shared L3)."""

    requests: int
    accesses: int
    hits: int
    prefix_hits: int
    tier_hits: dict[str, int]
    evictions: dict[str, int]
    promotions: int
    l3_writes: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "accesses": self.accesses,
            "hits": self.hits,
            "hit_ratio": self.hit_ratio,
            "prefix_hits": self.prefix_hits,
            "tier_hits": dict(self.tier_hits),
            "evictions": dict(self.evictions),
            "promotions": self.promotions,
            "l3_writes": self.l3_writes,
        }


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """A replay's totals (over every node of a cluster; ``l1_blocks`` and ``l2_blocks`` are
    each node's). ``promotions``: blocks copied up into L1 on a hit, from L2 or L3."""

    policy: str
    l1_blocks: int
    l2_blocks: int
    accesses: int
    hits: int
    prefix_hits: int
    tier_hits: dict[str, int]
    declined: dict[str, int]
    evictions: dict[str, int]
    promotions: int
    elapsed_s: float
    hits_per_request: np.ndarray = field(repr=False)
    prefetches: int = 0
    demotions: int = 0
    l2_writes: int = 0
    hinted: int = 0
    semantics: str = "full"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    per_node: tuple[NodeResult, ...] = ()
    l3: L3Stats | None = None

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hits / self.accesses if self.accesses else 0.0

    @property
    def accesses_per_s(self) -> float:
        return self.accesses / self.elapsed_s if self.elapsed_s > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "semantics": self.semantics,
            "l1_blocks": self.l1_blocks,
            "l2_blocks": self.l2_blocks,
            "accesses": self.accesses,
            "hits": self.hits,
            "hit_ratio": self.hit_ratio,
            "prefix_hit_ratio": self.prefix_hit_ratio,
            "tier_hits": dict(self.tier_hits),
            "accesses_per_s": round(self.accesses_per_s),
            "declined": dict(self.declined),
            "evictions": dict(self.evictions),
            "promotions": self.promotions,
            "prefetches": self.prefetches,
            "demotions": self.demotions,
            "l2_writes": self.l2_writes,
            "hinted": self.hinted,
            "misses": self.misses,
            **self.cluster.as_dict(),
            "l3": self.l3.as_dict() if self.l3 is not None else None,
            "per_node": [n.as_dict() for n in self.per_node],
        }


@dataclass(slots=True)
class _Tier:
    bit: int
    label: str
    capacity: int
    policy: EvictionPolicy
    admission: Admission
    admits_all: bool
    admits: Callable[[int, int, int, float], bool] | None  # the policy's own admission
    note_miss: Callable[[int, int, float], None] | None  # an access the tier did not keep
    count: int = 0
    hits: int = 0
    evictions: int = 0
    declined: Counter[str] = field(default_factory=Counter)
    # Bumped whenever the tier's policy may answer ``victims`` differently at the same time
    # (an insert, a remove, touches, hints); ``full_at`` is (now, epoch) of the last time it
    # had no victim, so a request whose blocks all find every block protected asks once.
    epoch: int = 0
    full_at: tuple[float, int] = (math.nan, -1)


@dataclass(slots=True)
class _L3Level:
    """A node's side of the shared L3: its admission rule, and the blocks it knows to be in
    the store (``known``: it wrote or read them, and no read found them gone since)."""

    store: SharedStore
    admission: Admission
    admits_all: bool
    known: bytearray
    hits: int = 0
    writes: int = 0
    declined: Counter[str] = field(default_factory=Counter)


def replay(
    trace: Trace,
    policy: str,
    l1_blocks: int,
    l2_blocks: int = 0,
    *,
    admission: str | None = None,
    l2_admission: str | None = None,
    policy_params: Mapping[str, Any] | None = None,
    semantics: str = "full",
    stack: StackConfig | None = None,
    cluster: ClusterConfig | None = None,
) -> ReplayResult:
    """Replay ``trace`` through ``policy``; see the module docstring for the semantics.

    ``semantics`` picks which blocks are cacheable (``kvtier.sim.trace``). ``admission`` /
    ``l2_admission`` default to the policy's own (``default_admission``). ``policy_params``
    are passed to every tier's policy and admission, after ``capacity_blocks``. ``cluster``:
    how many nodes (each with ``l1_blocks`` and ``l2_blocks``) and the L3 they share; by
    default one node without L3.
    """
    if l1_blocks < 1:
        raise ValueError("l1_blocks must be at least 1")
    if l2_blocks < 0:
        raise ValueError("l2_blocks must not be negative")
    stack = stack or StackConfig()
    cluster = cluster or ClusterConfig()
    trace = trace.cacheable(semantics)
    store = SharedStore(cluster.l3_blocks, cluster.l3_ttl_s) if cluster.l3_blocks else None

    def node(requests: Trace) -> _Engine:
        future: list[float] = [math.inf] * requests.unique_blocks
        needs_future = policy == "opt" or "belady" in (admission, l2_admission)
        per_access_next = next_uses(requests.blocks).tolist() if needs_future else []
        shared: dict[str, Any] = {"next_use": future.__getitem__} if needs_future else {}

        def tier(bit: int, capacity: int, adm_name: str | None) -> _Tier:
            params = {**shared, "capacity_blocks": capacity, **(policy_params or {})}
            pol = make_policy(policy, **params)
            adm = make_admission(adm_name or default_admission(policy), policy=pol, **params)
            return _Tier(
                bit,
                TIER_LABELS[bit - 1],
                capacity,
                pol,
                adm,
                isinstance(adm, AlwaysAdmit),
                # A policy's own admission decides where blocks are stored (L1); a lower tier
                # admits by its admission rule alone (measured: density's own admission on L2
                # declined demoted blocks that were hit later).
                getattr(pol, "admits", None) if bit == _L1 else None,
                getattr(pol, "note_miss", None) if bit == _L1 else None,
            )

        tiers = [tier(_L1, l1_blocks, admission)]
        if l2_blocks:
            tiers.append(tier(_L2, l2_blocks, l2_admission))
        l3 = None
        if store is not None:
            # As the daemon builds its L3 level: the rule with its default parameters.
            adm3 = make_admission(cluster.l3_admission)
            l3 = _L3Level(
                store, adm3, isinstance(adm3, AlwaysAdmit), bytearray(trace.unique_blocks)
            )
        return _Engine(requests, tiers, stack, future, per_access_next, l3)

    node_of = route_requests(trace, cluster)
    members = [np.flatnonzero(node_of == k) for k in range(cluster.nodes)]
    engines = [node(trace if cluster.nodes == 1 else trace.select(m)) for m in members]
    start = time.perf_counter()
    if store is None:
        for engine in engines:  # nothing shared: independent replays
            engine.run()
    else:
        _run_cluster(engines, node_of, trace.timestamps_s)
    elapsed = time.perf_counter() - start

    tier_hits: Counter[str] = Counter()
    evictions: Counter[str] = Counter()
    declined: Counter[str] = Counter()
    for engine in engines:
        for t in engine.tiers:
            tier_hits[t.label] += t.hits
            evictions[t.label] += t.evictions
            for reason, count in t.declined.items():
                declined[f"{t.label}:{reason}"] += count
        if engine.l3 is not None:
            tier_hits[_L3_LABEL] += engine.l3.hits
            for reason, count in engine.l3.declined.items():
                declined[f"{_L3_LABEL}:{reason}"] += count
    if cluster.nodes == 1:
        hits_per_request = engines[0].hits_per_request
    else:
        hits_per_request = np.zeros(trace.requests, dtype=np.int32)
        for engine, m in zip(engines, members, strict=True):
            hits_per_request[m] = engine.hits_per_request
    return ReplayResult(
        policy=policy,
        l1_blocks=l1_blocks,
        l2_blocks=l2_blocks,
        accesses=trace.accesses,
        hits=sum(tier_hits.values()),
        prefix_hits=sum(e.prefix_hits for e in engines),
        tier_hits=dict(tier_hits),
        declined=dict(declined),
        evictions=dict(evictions),
        promotions=sum(e.promotions for e in engines),
        elapsed_s=elapsed,
        hits_per_request=hits_per_request,
        prefetches=sum(e.prefetches for e in engines),
        demotions=sum(e.demotions for e in engines),
        l2_writes=sum(e.l2_writes for e in engines),
        hinted=sum(e.hinted for e in engines),
        semantics=semantics,
        cluster=cluster,
        per_node=tuple(e.result() for e in engines),
        l3=store.stats() if store is not None else None,
    )


def _run_cluster(engines: list[_Engine], node_of: np.ndarray, stamps: np.ndarray) -> None:
    """Interleave the nodes' replays in trace order: request ``r`` is one step of node
    ``node_of[r]``, after every node's hints due by then, in time order."""
    steps = [engine.steps() for engine in engines]
    hints = sorted((at, k) for k, engine in enumerate(engines) for at, _ in engine.hints)
    h = 0
    clock = -math.inf
    for k, ts in zip(node_of.tolist(), stamps.tolist(), strict=True):
        clock = max(clock, ts)
        while h < len(hints) and hints[h][0] <= clock:
            at, j = hints[h]
            h += 1
            engines[j].hints_until(at)
        next(steps[k])
    for rest in steps:
        for _ in rest:
            pass


class _Engine:
    """One node's replay: its mutable state. ``copies[b]`` holds the bits of the tiers with a
    copy of block ``b``; ``parent[b]`` the parent it was stored with (for its later
    placements); ``last[b]`` its last read or write (protection). ``l3``: the node's side of
    the shared L3, if any."""

    def __init__(
        self,
        trace: Trace,
        tiers: list[_Tier],
        stack: StackConfig,
        future: list[float],
        per_access_next: list[float],
        l3: _L3Level | None = None,
    ) -> None:
        self.trace = trace
        self.tiers = tiers
        self.l1 = tiers[0]
        self.l2 = tiers[1] if len(tiers) > 1 else None
        self.l3 = l3
        self.stack = stack
        self.future = future
        self.per_access_next = per_access_next
        self.blocks: list[int] = trace.blocks.tolist()
        self.offsets: list[int] = trace.offsets.tolist()
        self.stamps: list[float] = trace.timestamps_s.tolist()
        self.copies = bytearray(trace.unique_blocks)
        # With ``forget_dropped``: blocks with a copy, and the dropped blocks whose history
        # the daemon would still keep, oldest drop first (``_dropped``).
        self.live = 0
        self.history: OrderedDict[int, None] = OrderedDict()
        self.parent = [-1] * trace.unique_blocks
        self.last = np.full(trace.unique_blocks, -math.inf)
        self.now = -math.inf
        self.prefix_hits = 0
        self.promotions = 0
        self.prefetches = 0
        self.demotions = 0
        self.l2_writes = 0
        self.hinted = 0
        # The balancer's victims that stayed, each passed over until its time; no pass
        # before ``balance_after`` (``_balance``).
        self.kept: dict[int, float] = {}
        self.balance_after = -math.inf
        self.hits_per_request = np.zeros(trace.requests, dtype=np.int32)
        self.mask: EvictableFn | None = None
        # Queue hints: (time, request), in time order; those before ``next_hint`` are done.
        self.hints = self._hint_events()
        self.next_hint = 0
        # Whether blocks may be kept from eviction (protection or hints): a tier with no
        # victim then declines as "protected".
        self.protecting = stack.protect_s > 0 or stack.queue_window_s > 0
        if stack.protect_s > 0:
            last, protect = self.last, stack.protect_s

            def unprotected(bids: np.ndarray) -> np.ndarray:
                return last[bids] + protect <= self.now

            self.mask = unprotected

    def run(self) -> None:
        simple = (
            self.l2 is None
            and self.l3 is None
            and self.l1.admits_all
            and self.mask is None
            and self.stack.l1_watermarks is None
            and not self.stack.forget_dropped
        )
        if simple:
            self._run_one_tier()
        else:
            for _ in self.steps():
                pass

    def result(self) -> NodeResult:
        hits = {t.label: t.hits for t in self.tiers}
        if self.l3 is not None:
            hits[_L3_LABEL] = self.l3.hits
        return NodeResult(
            requests=self.trace.requests,
            accesses=self.trace.accesses,
            hits=sum(hits.values()),
            prefix_hits=self.prefix_hits,
            tier_hits=hits,
            evictions={t.label: t.evictions for t in self.tiers},
            promotions=self.promotions,
            l3_writes=self.l3.writes if self.l3 is not None else 0,
        )

    # ------------------------------------------------------------ one plain tier

    def _run_one_tier(self) -> None:
        """One tier without an admission rule, nothing protected but by queue hints: the
        replayer's common case, spelled out, since it runs once per access and sets the
        replayer's speed. The same steps as ``steps``, its declines included: with hints, a
        tier with no victim declines as ``protected``, and (as ``_refusal``'s ``full_at``)
        is not asked again within the request until something changed in it."""
        blocks = self.blocks
        offsets = self.offsets
        stamps = self.stamps
        copies = self.copies
        l1 = self.l1
        touch = l1.policy.touch
        future, per_access_next = self.future, self.per_access_next
        hits_per_request = self.hits_per_request
        prefix_hits = hits = 0
        now = self.now
        count, capacity, evictions = l1.count, l1.capacity, 0
        victim, remove, insert = _one_victim(l1.policy), l1.policy.remove, l1.policy.insert
        admits, note_miss = l1.admits, l1.note_miss
        replace = getattr(l1.policy, "replace", None)
        declined = l1.declined
        parents = self.parent
        hinting = bool(self.hints)
        no_victim = "protected" if hinting else "no_victim"
        for r, ts in enumerate(stamps):
            if ts > now:
                now = ts
            if hinting:
                self.hints_until(now)
                self.now = now
            lo, hi = offsets[r], offsets[r + 1]
            req = blocks[lo:hi]
            if per_access_next:
                for k in range(lo, hi):
                    future[blocks[k]] = per_access_next[k]
            leading = True
            missing: list[int] = []
            for i, b in enumerate(req):
                if copies[b]:
                    hits += 1
                    touch(b, now)
                    if leading:
                        prefix_hits += 1
                else:
                    leading = False
                    missing.append(i)
            hits_per_request[r] = hi - lo - len(missing)
            stuck = False  # no victim, and nothing changed in the tier since
            for i in missing:
                b = req[i]
                if copies[b]:
                    continue  # a repeat within the request, already placed
                if stuck:
                    declined["protected"] += 1
                    continue
                parent = req[i - 1] if i else -1
                if count >= capacity and replace is not None:
                    out = replace(b, parent, now)
                    if out < 0:
                        if out == NO_VICTIM:
                            declined[no_victim] += 1
                            stuck = hinting and note_miss is None
                        else:
                            declined["density"] += 1
                        continue
                    copies[out] = 0
                    evictions += 1
                    copies[b] = _L1
                    parents[b] = parent
                    continue
                if count >= capacity:
                    out = victim(now, b)
                    if out < 0:
                        declined[no_victim] += 1
                        if note_miss is not None:
                            note_miss(b, parent, now)
                        else:
                            stuck = hinting
                        continue
                    if admits is not None and not admits(b, parent, out, now):
                        declined["density"] += 1
                        if note_miss is not None:
                            note_miss(b, parent, now)
                        continue
                    remove(out)
                    copies[out] = 0
                    evictions += 1
                else:
                    count += 1
                insert(b, now, parent)
                copies[b] = _L1
                parents[b] = parent
        self.now = now
        l1.count, l1.evictions, l1.hits = count, l1.evictions + evictions, hits
        self.prefix_hits = prefix_hits

    # ----------------------------------------------------------- the tier stack

    def steps(self) -> Iterator[None]:
        """Serve the node's requests in order, yielding after each (a cluster interleaves its
        nodes' steps in trace order)."""
        blocks, offsets, stamps = self.blocks, self.offsets, self.stamps
        copies, last = self.copies, self.last
        l1, l2, l3 = self.l1, self.l2, self.l3
        touch1 = l1.policy.touch
        touch2 = l2.policy.touch if l2 else None
        recorders = [t.admission.record for t in self.tiers if not t.admits_all]
        if l3 is not None and not l3.admits_all:
            recorders.append(l3.admission.record)
        future, per_access_next = self.future, self.per_access_next
        hits_per_request = self.hits_per_request
        protecting = self.mask is not None
        selective = l2 is not None and self.stack.write_policy == "selective"
        hinting = bool(self.hints)
        watermarks = self.stack.l1_watermarks
        high = low = 0
        if watermarks is not None:
            high = math.floor(watermarks[0] * l1.capacity)
            low = math.floor(watermarks[1] * l1.capacity)
        prefix_hits = hits1 = hits2 = 0
        now = self.now
        for r, ts in enumerate(stamps):
            if ts > now:
                now = ts
            if hinting:
                self.hints_until(now)
                if self.now > now:  # hints a cluster ran ahead of this node's clock
                    now = self.now
            self.now = now
            lo, hi = offsets[r], offsets[r + 1]
            req = blocks[lo:hi]
            if per_access_next:
                for k in range(lo, hi):
                    future[blocks[k]] = per_access_next[k]
            for record in recorders:
                for b in req:
                    record(b, now)
            leading = True
            missing: list[int] = []
            promote: list[int] = []
            for i, b in enumerate(req):
                c = copies[b]
                if c & _L1:
                    hits1 += 1
                    touch1(b, now)
                    if c & _L2:
                        touch2(b, now)  # type: ignore[misc]
                elif c:
                    hits2 += 1
                    touch2(b, now)  # type: ignore[misc]
                    promote.append(b)
                elif l3 is not None and self._read_l3(l3, b):
                    promote.append(b)
                else:
                    if l3 is not None and l3.known[b]:
                        self._lost_from_l3(l3, b)
                    leading = False
                    missing.append(i)
                    continue
                if protecting:
                    last[b] = now
                if leading:
                    prefix_hits += 1
            hits_per_request[r] = hi - lo - len(missing)
            for t in self.tiers:
                t.epoch += 1  # touched
            for b in promote:
                c = copies[b]
                if c & _L1 or not (
                    c or (l3 is not None and l3.known[b] and l3.store.holds(b, now))
                ):
                    continue  # promoted already, or its copy went meanwhile
                if self._offer(l1, b, self.parent[b]):
                    self.promotions += 1
            for i in missing:
                b = req[i]
                if copies[b]:
                    continue  # a repeat within the request, already placed
                if protecting:
                    last[b] = now
                self._store(b, req[i - 1] if i else -1)
            if selective:
                for b in req:
                    if copies[b] == _L1:
                        self._offer(l2, b, self.parent[b])  # type: ignore[arg-type]
            if l3 is not None:
                self._write_behind(l3, req)
            if watermarks is not None and l1.count > high and now >= self.balance_after:
                self._balance(l1.count - low)
            yield
        l1.hits += hits1
        if l2 is not None:
            l2.hits += hits2
        self.prefix_hits = prefix_hits

    def _write_behind(self, l3: _L3Level, req: list[int]) -> None:
        """Write to L3 the request's blocks the node holds, does not know to be there, and
        its L3 admission admits (the daemon's ``selective`` write policy for L3)."""
        copies, known, now = self.copies, l3.known, self.now
        for b in req:
            if not copies[b] or known[b]:
                continue
            if not l3.admits_all:
                decision = l3.admission.decide(b, None, now)
                if not decision.admit:
                    l3.declined[decision.reason] += 1
                    continue
            l3.store.write(b, now)
            l3.writes += 1
            known[b] = 1

    def _read_l3(self, l3: _L3Level, b: int) -> bool:
        """Whether L3 serves ``b`` to this node now (an L3 hit, counted)."""
        if not l3.store.read(b, self.now):
            return False
        l3.hits += 1
        l3.known[b] = 1
        return True

    def _lost_from_l3(self, l3: _L3Level, b: int) -> None:
        """A read found a block gone from L3 that the node thought was there."""
        l3.known[b] = 0
        if self.stack.forget_dropped and not self.copies[b]:
            self._dropped(b)

    def _hint_events(self) -> list[tuple[float, int]]:
        window = self.stack.queue_window_s
        if window <= 0:
            return []
        return sorted(((t - window, q) for q, t in enumerate(self.stamps)), key=lambda e: e[0])

    def hints_until(self, t: float) -> None:
        """Hint the queued requests announced by ``t``, each at its own time."""
        hints, offsets = self.hints, self.offsets
        while self.next_hint < len(hints) and hints[self.next_hint][0] <= t:
            at, q = hints[self.next_hint]
            self.next_hint += 1
            self.now = max(self.now, at)
            self._hint(self.blocks[offsets[q] : offsets[q + 1]], self.stamps[q])

    def _hint(self, req: list[int], deadline: float) -> None:
        if not req:
            return
        ids = np.asarray(req, dtype=np.int64)
        self.hinted += len(req)
        for t in self.tiers:
            t.policy.hint(ids, deadline, self.now)
            t.epoch += 1
        l3 = self.l3
        if self.l2 is None and l3 is None:
            return
        copies = self.copies
        for b in req:
            c = copies[b]
            if c == _L2:
                if self._offer(self.l1, b, self.parent[b], access=False):
                    self.prefetches += 1
            elif not c and l3 is not None and l3.known[b]:
                # The daemon prefetches what its table says L3 holds.
                if not l3.store.holds(b, self.now):
                    self._lost_from_l3(l3, b)
                elif self._offer(self.l1, b, self.parent[b], access=False):
                    l3.store.read(b, self.now)
                    self.prefetches += 1

    def _store(self, b: int, parent: int) -> None:
        """A block just computed: offered to L1, and to L2 as the write policy says."""
        self.parent[b] = parent
        stored = self._offer(self.l1, b, parent)
        l2 = self.l2
        if l2 is not None:
            if self.stack.write_policy == "write_through":
                self._offer(l2, b, parent, ask_admission=False)
            elif not stored:
                self._offer(l2, b, parent)
        l3 = self.l3
        if (
            self.stack.forget_dropped
            and not self.copies[b]
            and not (l3 is not None and l3.known[b])
        ):
            # Stored nowhere: the daemon's put added a row for it and abandoned it, so its
            # key is remembered (and later forgotten) as a dropped block's is.
            self.live += 1
            self.history.pop(b, None)
            self._dropped(b)

    def _offer(
        self, tier: _Tier, b: int, parent: int, ask_admission: bool = True, access: bool = True
    ) -> bool:
        """Place ``b`` in ``tier`` if there is room (after evicting the policy's victim) and
        the tier admits it; returns whether it did. Declines are counted; an L1 policy that
        learns from accesses hears of a declined one (``access``: ``b`` is being read or
        stored, not demoted)."""
        reason = self._refusal(tier, b, parent, ask_admission)
        if isinstance(reason, str):
            tier.declined[reason] += 1
            if access and tier.note_miss is not None and tier.bit == _L1:
                tier.note_miss(b, parent, self.now)
                tier.epoch += 1
            return False
        victim = reason
        now = self.now
        if victim >= 0:
            self._evict(tier, victim)
        tier.policy.insert(b, now, parent)
        tier.epoch += 1
        tier.count += 1
        if (
            self.stack.forget_dropped
            and not self.copies[b]
            and not (self.l3 is not None and self.l3.known[b])
        ):
            self.live += 1
            self.history.pop(b, None)  # held again: its history is its own again
        self.copies[b] |= tier.bit
        if tier.bit == _L2:
            self.l2_writes += 1
        return True

    def _balance(self, n: int) -> None:
        """The daemon's balancer pass over L1 (``SpaceManager.balance``): its ``n`` coldest
        evictable blocks, less the victims a pass kept within ``BALANCE_RETRY_S``, each leave
        or stay (``_balance_out``). The pass goes on past a victim that stays, as the
        daemon's takes every victim it asked its policy for (this one ended at the first, so
        the daemon dropped blocks past it that the replay kept); each that stayed is
        passed over until ``BALANCE_RETRY_S`` after the pass that kept it, and a pass that
        moved none leaves L1 alone until then."""
        now = self.now
        kept = {b: until for b, until in self.kept.items() if until > now}
        self.kept = kept
        passed_over = list(kept)
        waiting = len(passed_over)
        moved = False
        for _ in range(n):
            found = self.l1.policy.victims(1, now, _less(self.mask, passed_over))
            if found is None:
                break
            victim = int(found[0])
            if self._balance_out(victim):
                moved = True
            else:
                kept[victim] = now + BALANCE_RETRY_S
                passed_over.append(victim)
        if not moved and len(passed_over) > waiting:
            self.balance_after = now + BALANCE_RETRY_S

    def _balance_out(self, victim: int) -> bool:
        """The balancer's eviction of ``victim`` from L1 (the daemon's ``balance``): a block
        whose only copy is in L1 that L2 admits but has no room for stays (L1 has room for
        it; a pass ``BALANCE_RETRY_S`` later tries again); otherwise ``_evict``. Whether it
        left. L2's admission is asked first, as the daemon's demotion does: a block it
        declines leaves whether or not L2 has room."""
        l2 = self.l2
        if (
            l2 is not None
            and not self.copies[victim] & _L2
            and isinstance(self._room(l2, victim), str)
        ):
            if self.stack.write_policy == "write_through" or l2.admits_all:
                return False
            decision = l2.admission.decide(victim, None, self.now)
            if decision.admit:
                return False
            l2.declined[decision.reason] += 1
            self._evict(self.l1, victim, demote=False)
            return True
        self._evict(self.l1, victim)
        return True

    def _room(self, tier: _Tier, b: int) -> str | int:
        """The victim that makes room for ``b`` in ``tier`` (-1: none needed), or why there
        is none."""
        now = self.now
        if tier.count < tier.capacity:
            return -1
        if tier.full_at == (now, tier.epoch):
            return "protected"
        found = tier.policy.victims(1, now, self.mask, (b,))
        if found is None:
            tier.full_at = (now, tier.epoch)
            return "protected" if self.protecting else "no_victim"
        return int(found.item(0))

    def _refusal(self, tier: _Tier, b: int, parent: int, ask_admission: bool) -> str | int:
        """Why ``tier`` does not take ``b`` now, or the victim that makes room (-1: none)."""
        now = self.now
        victim = self._room(tier, b)
        if isinstance(victim, str):
            return victim
        if ask_admission:
            if not tier.admits_all:
                decision = tier.admission.decide(b, victim if victim >= 0 else None, now)
                if not decision.admit:
                    return decision.reason
            if victim >= 0 and tier.admits is not None and not tier.admits(b, parent, victim, now):
                return "density"
        return victim

    def _evict(self, tier: _Tier, victim: int, demote: bool = True) -> None:
        """Take ``victim`` out of ``tier``; one leaving L1 with no L2 copy is offered to L2
        unless ``demote`` is False (L2's admission declined it already)."""
        tier.policy.remove(victim)
        tier.epoch += 1
        tier.count -= 1
        tier.evictions += 1
        self.copies[victim] &= ~tier.bit
        l2 = self.l2
        if demote and tier.bit == _L1 and l2 is not None and not self.copies[victim] & _L2:
            through = self.stack.write_policy == "write_through"
            if self._offer(
                l2, victim, self.parent[victim], ask_admission=not through, access=False
            ):
                self.demotions += 1
        l3 = self.l3
        if (
            self.stack.forget_dropped
            and not self.copies[victim]
            and not (l3 is not None and l3.known[victim])
        ):
            # The daemon's table keeps a block while any tier, L3 included, holds it.
            self._dropped(victim)

    def _dropped(self, b: int) -> None:
        """``b`` has no copy left. The daemon keeps its history for its key until
        ``history_factor`` times the blocks held were dropped after it (``BlockTable``,
        History); its policies forget it then, or at once with a factor of 0."""
        self.live -= 1
        factor = self.stack.history_factor
        if factor <= 0:
            for t in self.tiers:
                t.policy.forget(b)
            return
        history = self.history
        history[b] = None
        limit = int(factor * max(self.live, MIN_HISTORY_BASE))
        while len(history) > limit:
            oldest, _ = history.popitem(last=False)
            for t in self.tiers:
                t.policy.forget(oldest)


def _less(mask: EvictableFn | None, bids: list[int]) -> EvictableFn | None:
    """``mask`` (None: every block), less ``bids``."""
    if not bids:
        return mask
    out = np.asarray(bids, dtype=np.int64)
    if mask is None:
        return lambda cand: ~np.isin(cand, out)
    return lambda cand: mask(cand) & ~np.isin(cand, out)


def _one_victim(policy: Any) -> Callable[[float, int], int]:
    """The policy's ``victim(now, incoming)`` (one unmasked victim as an id, -1 for none),
    or the same answer from ``victims`` for policies without it."""
    own = getattr(policy, "victim", None)
    if own is not None:
        return own  # type: ignore[no-any-return]
    victims = policy.victims

    def victim(now: float, incoming: int) -> int:
        found = victims(1, now, None, (incoming,))
        return -1 if found is None else int(found[0])

    return victim


def sweep_capacities(unique_blocks: int, percents: Sequence[float]) -> list[int]:
    """Capacities in blocks at ``percents`` of the unique blocks, rounded half to even."""
    return [max(1, round(unique_blocks * p / 100)) for p in percents]
