"""Trace replay: run the daemon's policies on a recorded trace, on the trace's clock.

``kvtier replay TRACE.jsonl --policy NAME --l1-blocks N [--l2-blocks M]`` reads a trace in the
Mooncake format (one JSON object a line: ``timestamp`` in ms, ``hash_ids`` one id per block,
a request's ids being its prefix chain) and replays it through the same policy objects the
daemon runs. No bytes move; only residency is simulated.

Semantics, exactly:
- Requests are taken in file order; ``now`` is the request's timestamp in seconds (held back
  from going backwards, so policies see a monotonic clock).
- At a request's arrival every block resident in any tier is a hit (counted for that tier)
  and is touched, in request order. The prefix hits are the leading run of hits.
- Then, in request order, L2 hits are promoted to L1, and every missing block is offered to
  L1, its parent being the previous block of the request. A full tier asks its policy for one
  victim, and its admission rule for a decision (``decide(block, victim)``): a declined block
  is offered to L2 instead (if any), and is not cached if L2 declines too.
- Tiers are exclusive: a block lives in one tier. A block evicted from L1 is demoted to L2,
  subject to L2's admission; a block evicted from L2 is dropped. Promotion leaves L2 first,
  so the slot it frees can take the block L1 demotes to make room.
- Every access is recorded with each tier's admission rule before any decision of its
  request.
- ``--policy opt`` is Belady's optimum with bypass (``kvtier.daemon.policy.opt``), given the
  trace's future. With two tiers it runs Belady in each tier, which bounds nothing.

Block ids: the trace's hash ids are renumbered densely (stable for the whole replay; the
daemon reuses ids, the replay does not need to).

Thread-safety: none needed; a replay is a single-threaded batch job.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.daemon.policy.admission import Admission, AlwaysAdmit, make_admission
from kvtier.daemon.policy.base import EvictionPolicy
from kvtier.daemon.policy.registry import default_admission, make_policy, policy_names

SWEEP_PERCENTS = (1, 2, 5, 10, 20)
SWEEP_POLICIES = ("heat", "lru", "arc", "opt")
TIER_LABELS = ("l1", "l2")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests as flat arrays: request ``r`` accesses ``blocks[offsets[r]:offsets[r + 1]]``."""

    name: str
    timestamps_s: np.ndarray  # float64, one per request
    offsets: np.ndarray  # int64, requests + 1
    blocks: np.ndarray  # int64 dense block ids, one per access
    unique_blocks: int

    @property
    def requests(self) -> int:
        return len(self.timestamps_s)

    @property
    def accesses(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True, slots=True)
class ReplayResult:
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
        }


# ----------------------------------------------------------------------- trace input


def load_trace(path: str | Path) -> Trace:
    """Read a Mooncake-format JSONL trace. Raises TraceError naming the line at fault."""
    path = Path(path)
    try:
        with path.open("r", encoding="utf-8") as f:
            return _parse(f, str(path))
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror or e}") from None


def trace_from_requests(requests: Iterable[Mapping[str, Any]], name: str = "<memory>") -> Trace:
    """A trace from request objects shaped like the file's lines (for generators, tests)."""
    return _parse((json.dumps(dict(r)) for r in requests), name)


def _parse(lines: Iterable[str], name: str) -> Trace:
    stamps: list[float] = []
    offsets = [0]
    ids: list[int] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise TraceError(f"{where}: 'timestamp' must be a number of milliseconds")
        hashes = obj.get("hash_ids")
        if not isinstance(hashes, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes
        ):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        stamps.append(float(ts) / 1000.0)
        ids.extend(hashes)
        offsets.append(len(ids))
    try:
        raw = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        raise TraceError(f"{name}: a hash id does not fit in 64 bits") from None
    uniq, dense = np.unique(raw, return_inverse=True)
    return Trace(
        name=name,
        timestamps_s=np.asarray(stamps, dtype=np.float64),
        offsets=np.asarray(offsets, dtype=np.int64),
        blocks=dense.astype(np.int64).reshape(-1),
        unique_blocks=len(uniq),
    )


def next_uses(blocks: np.ndarray) -> np.ndarray:
    """For each access, the position of the next access of the same block (inf if none)."""
    order = np.argsort(blocks, kind="stable")  # stable: positions ascend within a block
    nxt = np.full(len(blocks), np.inf)
    if len(blocks) > 1:
        same = blocks[order[1:]] == blocks[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    return nxt


# ----------------------------------------------------------------------------- engine


@dataclass(slots=True)
class _Tier:
    level: int
    label: str
    capacity: int
    policy: EvictionPolicy
    admission: Admission
    admits_all: bool
    count: int = 0
    hits: int = 0
    evictions: int = 0
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
) -> ReplayResult:
    """Replay ``trace`` through ``policy``; see the module docstring for the semantics.

    ``admission``/``l2_admission`` default to the policy's own (``default_admission``).
    ``policy_params`` are passed to every tier's policy, after ``capacity_blocks``.
    """
    if l1_blocks < 1:
        raise ValueError("l1_blocks must be at least 1")
    if l2_blocks < 0:
        raise ValueError("l2_blocks must not be negative")
    future: list[float] = [math.inf] * trace.unique_blocks
    needs_future = policy == "opt" or "belady" in (admission, l2_admission)
    per_access_next = next_uses(trace.blocks).tolist() if needs_future else []
    shared: dict[str, Any] = {"next_use": future.__getitem__} if needs_future else {}

    def tier(level: int, capacity: int, adm_name: str | None) -> _Tier:
        params = {**shared, "capacity_blocks": capacity, **(policy_params or {})}
        adm = make_admission(adm_name or default_admission(policy), **params)
        return _Tier(
            level,
            TIER_LABELS[level - 1],
            capacity,
            make_policy(policy, **params),
            adm,
            isinstance(adm, AlwaysAdmit),
        )

    tiers = [tier(1, l1_blocks, admission)]
    if l2_blocks:
        tiers.append(tier(2, l2_blocks, l2_admission))
    engine = _Engine(trace, tiers, future, per_access_next)
    start = time.perf_counter()
    engine.run()
    elapsed = time.perf_counter() - start
    declined: Counter[str] = Counter()
    for t in tiers:
        for reason, count in t.declined.items():
            declined[f"{t.label}:{reason}"] += count
    return ReplayResult(
        policy=policy,
        l1_blocks=l1_blocks,
        l2_blocks=l2_blocks,
        accesses=trace.accesses,
        hits=sum(t.hits for t in tiers),
        prefix_hits=engine.prefix_hits,
        tier_hits={t.label: t.hits for t in tiers},
        declined=dict(declined),
        evictions={t.label: t.evictions for t in tiers},
        promotions=engine.promotions,
        elapsed_s=elapsed,
        hits_per_request=engine.hits_per_request,
    )


class _Engine:
    """One replay's mutable state. ``where[b]`` is the level of the tier holding block ``b``
    (0: none); ``parent[b]`` the parent it was inserted with, for demotions."""

    def __init__(
        self,
        trace: Trace,
        tiers: list[_Tier],
        future: list[float],
        per_access_next: list[float],
    ) -> None:
        self.trace = trace
        self.tiers = tiers
        self.future = future
        self.per_access_next = per_access_next
        self.where = bytearray(trace.unique_blocks)
        self.parent = [-1] * trace.unique_blocks
        self.now = -math.inf
        self.prefix_hits = 0
        self.promotions = 0
        self.hits_per_request = np.zeros(trace.requests, dtype=np.int32)

    def run(self) -> None:
        blocks = self.trace.blocks.tolist()
        offsets = self.trace.offsets.tolist()
        stamps = self.trace.timestamps_s.tolist()
        where = self.where
        l1 = self.tiers[0]
        l2 = self.tiers[1] if len(self.tiers) > 1 else None
        touch1 = l1.policy.touch
        touch2 = l2.policy.touch if l2 else None
        recorders = [t.admission.record for t in self.tiers if not t.admits_all]
        future, per_access_next = self.future, self.per_access_next
        hits_per_request = self.hits_per_request
        prefix_hits = hits1 = hits2 = 0
        now = self.now
        simple = l2 is None and l1.admits_all
        count, capacity, evictions = l1.count, l1.capacity, 0
        victims, remove, insert = l1.policy.victims, l1.policy.remove, l1.policy.insert
        parents = self.parent
        for r, ts in enumerate(stamps):
            if ts > now:
                now = ts
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
                w = where[b]
                if w == 1:
                    hits1 += 1
                    touch1(b, now)
                elif w == 2:
                    hits2 += 1
                    touch2(b, now)  # type: ignore[misc]
                    promote.append(b)
                else:
                    leading = False
                    missing.append(i)
                    continue
                if leading:
                    prefix_hits += 1
            hits_per_request[r] = hi - lo - len(missing)
            for b in promote:
                if where[b] == 2:
                    self._promote(b)
            if simple:
                # The common case (one tier, no admission) spelled out: it runs once per
                # miss and sets the replayer's speed. Same steps as _place.
                for i in missing:
                    b = req[i]
                    if where[b]:
                        continue  # a repeat within the request, already placed
                    parent = req[i - 1] if i else -1
                    if count >= capacity:
                        found = victims(1, now, None, (b,))
                        if found is None:
                            l1.declined["no_victim"] += 1
                            continue
                        victim = int(found[0])
                        remove(victim)
                        where[victim] = 0
                        evictions += 1
                    else:
                        count += 1
                    insert(b, now, parent)
                    where[b] = 1
                    parents[b] = parent
                continue
            for i in missing:
                b = req[i]
                if where[b]:
                    continue
                parent = req[i - 1] if i else -1
                if not self._place(l1, b, parent) and l2 is not None:
                    self._place(l2, b, parent)
        if simple:
            l1.count, l1.evictions = count, l1.evictions + evictions
        l1.hits += hits1
        if l2 is not None:
            l2.hits += hits2
        self.prefix_hits = prefix_hits

    def _room(self, tier: _Tier, b: int) -> int:
        """The victim to make room for ``b`` in ``tier``: -1 if there is room, -2 if ``b`` is
        not admitted (counted). Changes nothing else."""
        victim = -1
        if tier.count >= tier.capacity:
            found = tier.policy.victims(1, self.now, None, (b,))
            if found is None:
                tier.declined["no_victim"] += 1
                return -2
            victim = int(found[0])
        if not tier.admits_all:
            decision = tier.admission.decide(b, victim if victim >= 0 else None, self.now)
            if not decision.admit:
                tier.declined[decision.reason] += 1
                return -2
        return victim

    def _place(self, tier: _Tier, b: int, parent: int) -> bool:
        victim = self._room(tier, b)
        if victim == -2:
            return False
        if victim >= 0:
            self._evict(tier, victim)
        self._insert(tier, b, parent)
        return True

    def _promote(self, b: int) -> None:
        l1, l2 = self.tiers
        victim = self._room(l1, b)
        if victim == -2:
            return
        l2.policy.remove(b)
        l2.count -= 1
        self.where[b] = 0
        if victim >= 0:
            self._evict(l1, victim)
        self._insert(l1, b, self.parent[b])
        self.promotions += 1

    def _evict(self, tier: _Tier, victim: int) -> None:
        tier.policy.remove(victim)
        tier.count -= 1
        tier.evictions += 1
        self.where[victim] = 0
        if tier.level < len(self.tiers):
            self._place(self.tiers[tier.level], victim, self.parent[victim])

    def _insert(self, tier: _Tier, b: int, parent: int) -> None:
        tier.policy.insert(b, self.now, parent)
        tier.count += 1
        self.where[b] = tier.level
        self.parent[b] = parent


def sweep_capacities(unique_blocks: int, percents: Sequence[int] = SWEEP_PERCENTS) -> list[int]:
    """Capacities in blocks at ``percents`` of the unique blocks, rounded half to even."""
    return [max(1, round(unique_blocks * p / 100)) for p in percents]


def sweep(
    trace: Trace,
    policies: Sequence[str] = SWEEP_POLICIES,
    percents: Sequence[int] = SWEEP_PERCENTS,
    policy_params: Mapping[str, Any] | None = None,
) -> list[ReplayResult]:
    return [
        replay(trace, name, cap, policy_params=policy_params)
        for cap in sweep_capacities(trace.unique_blocks, percents)
        for name in policies
    ]


# --------------------------------------------------------------------------------- CLI


def add_replay_parser(subparsers: Any) -> None:
    """Register ``kvtier replay`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "replay",
        help="replay a Mooncake-format trace through the eviction policies (offline)",
        description=(
            "Replay a trace (JSONL: timestamp ms, hash_ids) through a policy on the trace's "
            "clock and report block hit ratios. No daemon is involved."
        ),
    )
    p.add_argument("trace", help="trace file, one JSON object a line")
    p.add_argument("--policy", default="heat", choices=policy_names())
    p.add_argument("--l1-blocks", type=_count(1), help="L1 capacity in blocks (>= 1)")
    p.add_argument("--l2-blocks", type=_count(0), default=0, help="L2 capacity in blocks")
    p.add_argument("--admission", help="L1 admission rule (default: the policy's own)")
    p.add_argument("--l2-admission", help="L2 admission rule (default: the policy's own)")
    p.add_argument("--half-life", type=_positive_float, help="heat half-life in seconds")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="run heat, lru, arc, opt at 1, 2, 5, 10, 20%% of the unique blocks",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON object line")
    p.add_argument("--plot", metavar="PNG", help="draw the result (needs matplotlib)")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    try:
        return _replay_command(args)
    except (TraceError, ValueError, PlotUnavailable) as e:
        print(f"kvtier replay: error: {e}", file=sys.stderr)
        return 2


def _replay_command(args: argparse.Namespace) -> int:
    if not args.sweep and args.l1_blocks is None:
        raise ValueError("--l1-blocks is required (or use --sweep)")
    params = {"half_life_s": args.half_life} if args.half_life else {}
    trace = load_trace(args.trace)
    print(
        f"{trace.name}: {trace.requests} requests, {trace.accesses} block accesses, "
        f"{trace.unique_blocks} unique blocks"
    )
    if args.sweep:
        results = sweep(trace, policy_params=params)
        print(format_sweep(results, trace.unique_blocks))
        if args.plot:
            plot_sweep(results, trace, args.plot)
        if args.json:
            print(json.dumps({"sweep": [r.as_dict() for r in results]}))
        return 0
    result = replay(
        trace,
        args.policy,
        args.l1_blocks,
        args.l2_blocks,
        admission=args.admission,
        l2_admission=args.l2_admission,
        policy_params=params,
    )
    print(format_result(result))
    if args.plot:
        plot_run(result, trace, args.plot)
    if args.json:
        print(json.dumps(result.as_dict()))
    return 0


def format_result(r: ReplayResult) -> str:
    tiers = ", ".join(f"{k} {v}" for k, v in r.tier_hits.items())
    lines = [
        f"policy {r.policy}: L1 {r.l1_blocks} blocks, L2 {r.l2_blocks} blocks",
        f"  hit ratio {100 * r.hit_ratio:.2f}% ({r.hits} of {r.accesses}), "
        f"prefix hit ratio {100 * r.prefix_hit_ratio:.2f}%",
        f"  hits by tier: {tiers}; promotions {r.promotions}",
        f"  evictions: {', '.join(f'{k} {v}' for k, v in r.evictions.items())}",
    ]
    if r.declined:
        lines.append("  declined: " + ", ".join(f"{k} {v}" for k, v in sorted(r.declined.items())))
    lines.append(f"  speed: {r.accesses_per_s:,.0f} block accesses/s")
    return "\n".join(lines)


def format_sweep(results: Sequence[ReplayResult], unique_blocks: int) -> str:
    caps = sorted({r.l1_blocks for r in results})
    names = list(dict.fromkeys(r.policy for r in results))
    by = {(r.policy, r.l1_blocks): r for r in results}
    pct = {c: 100 * c / unique_blocks for c in caps}
    head = "policy".ljust(8) + "".join(f"{pct[c]:>7.0f}% ({c})".rjust(16) for c in caps)
    rows = [head]
    for name in names:
        cells = "".join(f"{100 * by[(name, c)].hit_ratio:16.2f}" for c in caps)
        rows.append(name.ljust(8) + cells)
    speed = [r.accesses_per_s for r in results if r.policy == "heat"]
    if speed:
        rows.append(f"heat speed: {min(speed):,.0f} block accesses/s (slowest run)")
    return "\n".join(rows)


class PlotUnavailable(RuntimeError):
    pass


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib; install the 'plot' extra: pip install 'kvtier[plot]'"
        ) from None
    return plt


def plot_sweep(results: Sequence[ReplayResult], trace: Trace, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.policy for r in results):
        rs = sorted((r for r in results if r.policy == name), key=lambda r: r.l1_blocks)
        ax.plot(
            [100 * r.l1_blocks / trace.unique_blocks for r in rs],
            [100 * r.hit_ratio for r in rs],
            marker="o",
            label=name,
        )
    ax.set_xscale("log")
    ax.set_xlabel("capacity (% of unique blocks)")
    ax.set_ylabel("block hit ratio (%)")
    ax.set_title(Path(trace.name).name)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_run(result: ReplayResult, trace: Trace, path: str) -> None:
    """Hit ratio over the trace, per window of about 1% of the requests."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if trace.requests:
        window = max(1, trace.requests // 100)
        edges = np.arange(0, trace.requests, window)
        hits = np.add.reduceat(result.hits_per_request, edges)
        total = np.add.reduceat(np.diff(trace.offsets), edges)
        ax.plot(trace.timestamps_s[edges] / 60, 100 * hits / np.maximum(total, 1))
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("block hit ratio per window (%)")
    ax.set_title(f"{result.policy}, L1 {result.l1_blocks} blocks: {100 * result.hit_ratio:.2f}%")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value
