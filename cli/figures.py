"""Figures derived from the daemon's Stats: hit ratios, rates, latency quantiles.

The Stats RPC carries raw, ever-growing counters (``hits{tier="L1"}``, ``misses{reason=...}``,
``transferred_bytes{direction=...}``, the latency histograms ``rpc_seconds_bucket{...}``).
``derive(now, before)`` turns one snapshot into what an operator reads: ratios over the
daemon's lifetime, and, given an earlier snapshot, ratios, rates and latency quantiles over
the interval between the two (without one, rates are averages since the start). An earlier
snapshot of a daemon that has restarted since (its uptime or its ever-growing counters went
back) is not subtracted: the figures then cover the new daemon's life (``restarted``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kvtier.client import Stats
from kvtier.client.types import split_counter
from kvtier.daemon.latency import quantile

HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum_us")
# A gauge every Stats carries that shows the daemon-wide figures (an admin's, or any
# session's without tenants): without it they were withheld (``Figures.withheld``).
DAEMON_WIDE_GAUGE = "sessions"
WITHHELD = "daemon-wide figures, which a daemon with tenants shows admins only"
# The size of a tier that reports no capacity: a key-addressed one (L3), whose bytes are the
# store's own (Stats carries 0 for both); "0 B / 0 B" read as empty while it held blocks.
NOT_TRACKED = "bytes not tracked (the store's own)"


@dataclass(frozen=True)
class TierFigures:
    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    state: str
    hits: int  # lookup keys this tier served over the window
    hit_ratio: float  # of all keys looked up over the window


@dataclass(frozen=True)
class LatencyFigures:
    method: str
    calls: int  # over the window
    errors: int
    calls_per_s: float
    mean_s: float
    p50_s: float
    p99_s: float


@dataclass(frozen=True)
class Figures:
    version: str
    uptime_s: float
    window_s: float  # what rates and window ratios cover (uptime when there is no "before")
    tiers: list[TierFigures]
    lookups: int  # keys over the window
    hit_ratio: float  # over the window; NaN with no lookups
    lifetime_hit_ratio: float
    misses: dict[str, int]  # reason -> keys over the window
    put_bytes_per_s: float
    get_bytes_per_s: float
    lookups_per_s: float
    moved_bytes_per_s: dict[str, float]  # direction -> bytes/s
    latency: list[LatencyFigures]
    gauges: dict[str, float] = field(default_factory=dict)
    # The earlier snapshot was of a daemon that has restarted since: the window is the new
    # one's uptime.
    restarted: bool = False
    # The daemon-wide figures were not sent: a daemon with tenants shows a non-admin session
    # its own tenant's usage only, and its lookups, rates and latency would read as zeros.
    withheld: bool = False


def tier_ok(state: str) -> bool:
    """Whether a tier's state (Stats' ``ok``, ``ok: NOTE``, ``degraded_io: ...``) is ok: a
    tier that serves and takes writes may carry a note (blocks lost at the start with a
    damaged data file, an index moved aside), which tells what happened, not that it is
    degraded now; ``/readyz`` and ``kvtier_tier_health`` count it ok too."""
    return state.partition(":")[0] == "ok"


def is_histogram(key: str) -> bool:
    base, _ = split_counter(key)
    return base.startswith(("rpc_seconds", "transfer_seconds")) and base.endswith(
        HISTOGRAM_SUFFIXES
    )


def _sum(counters: dict[str, int], name: str, **labels: str) -> int:
    total = 0
    for key, value in counters.items():
        base, found = split_counter(key)
        if base == name and all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


def _by_label(counters: dict[str, int], name: str, label: str) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for key, value in counters.items():
        base, found = split_counter(key)
        if base == name and label in found:
            out[found[label]] += value
    return dict(out)


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


# How much less a daemon's uptime may grow between two snapshots than the time between their
# answers (their ways back differ) before the two are taken for two runs of the daemon.
UPTIME_SLACK_S = 1.0
# Counters every daemon has and never lowers: one that went back means a restart.
_EVER_GROWING = ("lookup_keys", "bytes_put", "bytes_get", "rpc_seconds_count")


def restarted_between(before: Stats, now: Stats, elapsed_s: float | None = None) -> bool:
    """Whether ``now`` is of a daemon that started after ``before`` was taken (a restart at
    the same address): its uptime grew less than ``elapsed_s`` (the time between the two
    answers, when known), or went back, or so did a counter that only grows."""
    grown = now.uptime_s - before.uptime_s
    if grown < 0 or (elapsed_s is not None and grown < elapsed_s - UPTIME_SLACK_S):
        return True
    return any(_sum(now.counters, name) < _sum(before.counters, name) for name in _EVER_GROWING)


def derive(now: Stats, before: Stats | None = None, elapsed_s: float | None = None) -> Figures:
    """The figures of ``now``, over the interval since ``before`` (taken ``elapsed_s``
    before ``now``, when known) or, without it or across a restart, since the start."""
    restarted = before is not None and restarted_between(before, now, elapsed_s)
    if restarted:
        before = None
    c1 = now.counters
    c0 = before.counters if before is not None else {}
    window = now.uptime_s - before.uptime_s if before is not None else now.uptime_s
    window = max(window, 1e-9)

    def delta(name: str, **labels: str) -> int:
        return _sum(c1, name, **labels) - _sum(c0, name, **labels)

    def delta_by(name: str, label: str) -> dict[str, int]:
        b0 = _by_label(c0, name, label)
        return {k: v - b0.get(k, 0) for k, v in _by_label(c1, name, label).items()}

    lookups = delta("lookup_keys")
    hits = delta_by("hits", "tier")
    tiers = [
        TierFigures(
            t.tier.label,
            t.used_bytes,
            t.capacity_bytes,
            t.blocks,
            t.state,
            hits.get(t.tier.label, 0),
            _ratio(hits.get(t.tier.label, 0), lookups),
        )
        for t in now.tiers
    ]
    return Figures(
        version=now.version,
        uptime_s=now.uptime_s,
        window_s=window,
        tiers=tiers,
        lookups=lookups,
        hit_ratio=_ratio(sum(hits.values()), lookups),
        lifetime_hit_ratio=_ratio(_sum(c1, "hits"), _sum(c1, "lookup_keys")),
        misses=delta_by("misses", "reason"),
        put_bytes_per_s=delta("bytes_put") / window,
        get_bytes_per_s=delta("bytes_get") / window,
        lookups_per_s=lookups / window,
        moved_bytes_per_s={
            d: n / window for d, n in sorted(delta_by("transferred_bytes", "direction").items())
        },
        latency=_latency(c1, c0, window),
        gauges=dict(now.gauges),
        restarted=restarted,
        withheld=DAEMON_WIDE_GAUGE not in now.gauges,
    )


def _latency(c1: dict[str, int], c0: dict[str, int], window: float) -> list[LatencyFigures]:
    """Per method, over the window: calls, errors, and quantiles from the bucket deltas."""
    buckets: dict[str, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    counts: dict[str, int] = defaultdict(int)
    errors: dict[str, int] = defaultdict(int)
    sums: dict[str, int] = defaultdict(int)
    for counters, sign in ((c1, 1), (c0, -1)):
        for key, value in counters.items():
            base, labels = split_counter(key)
            method = labels.get("method")
            if method is None or not base.startswith("rpc_seconds"):
                continue
            if base == "rpc_seconds_bucket":
                le = labels["le"]
                buckets[method][float("inf") if le == "+Inf" else float(le)] += sign * value
            elif base == "rpc_seconds_count":
                counts[method] += sign * value
                if labels.get("code") != "OK":
                    errors[method] += sign * value
            elif base == "rpc_seconds_sum_us":
                sums[method] += sign * value
    out = []
    for method in sorted(counts):
        n = counts[method]
        if n <= 0:
            continue
        bounds = sorted(b for b in buckets[method] if b != float("inf"))
        cumulative = [buckets[method][b] for b in bounds] + [buckets[method][float("inf")]]
        out.append(
            LatencyFigures(
                method,
                n,
                errors[method],
                n / window,
                sums[method] / 1e6 / n,
                quantile(tuple(bounds), cumulative, 0.5),
                quantile(tuple(bounds), cumulative, 0.99),
            )
        )
    return out


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    if s != s:  # NaN
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def percent(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"
