"""Sweeps over capacities and policies, their tables, and plots (matplotlib, optional).

Capacities of a sweep are percentages of the trace's unique block ids (as its README counts
them), whatever the semantics: the semantics change what is counted and stored, not the size
of the cache, so the tables of both semantics compare the same caches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.engine import ReplayResult, StackConfig, replay, sweep_capacities
from kvtier.sim.trace import Trace

SWEEP_PERCENTS: tuple[float, ...] = (1, 2, 5, 10, 20)
SWEEP_POLICIES = ("density", "heat", "lru", "arc", "opt")


def sweep(
    trace: Trace,
    policies: Sequence[str] = SWEEP_POLICIES,
    percents: Sequence[float] = SWEEP_PERCENTS,
    policy_params: Mapping[str, Any] | None = None,
    *,
    semantics: str = "full",
    stack: StackConfig | None = None,
    cluster: ClusterConfig | None = None,
) -> list[ReplayResult]:
    """One single-tier replay per capacity (``percents`` of the trace's unique ids) and
    policy; with ``cluster``, the capacity of each node's L1."""
    cacheable = trace.cacheable(semantics)
    return [
        replay(
            cacheable,
            name,
            cap,
            policy_params=policy_params,
            semantics=semantics,
            stack=stack,
            cluster=cluster,
        )
        for cap in sweep_capacities(trace.unique_blocks, percents)
        for name in policies
    ]


def describe_cluster(c: ClusterConfig) -> str:
    """One line: the nodes, how requests reach them, the shared L3."""
    nodes = f"{c.nodes} nodes, route {c.route}" if c.nodes > 1 else "1 node"
    if c.nodes > 1 and c.route == "random":
        nodes += f" (seed {c.route_seed})"
    l3 = "no L3"
    if c.l3_blocks:
        ttl = f"ttl {c.l3_ttl_s:g} s" if c.l3_ttl_s else "no ttl"
        l3 = f"shared L3 {c.l3_blocks} blocks ({ttl}, admission {c.l3_admission})"
    return f"cluster: {nodes}; {l3}"


def _tiers(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def format_result(r: ReplayResult) -> str:
    each = " each" if r.cluster.nodes > 1 else ""
    lines = [f"policy {r.policy}: L1 {r.l1_blocks} blocks, L2 {r.l2_blocks} blocks{each}"]
    if not r.cluster.single:
        lines.append(f"  {describe_cluster(r.cluster)}")
    lines += [
        f"  hit ratio {100 * r.hit_ratio:.2f}% ({r.hits} of {r.accesses}), "
        f"prefix hit ratio {100 * r.prefix_hit_ratio:.2f}%",
        f"  hits by tier: {_tiers(r.tier_hits)}; misses {r.misses}; promotions {r.promotions}",
        f"  evictions: {_tiers(r.evictions)}",
    ]
    if r.l2_blocks:
        lines.append(f"  L2 writes {r.l2_writes} (of them demotions {r.demotions})")
    if r.l3 is not None:
        lines.append(
            f"  L3 writes {r.l3.writes}, evictions {r.l3.evictions}, expiries "
            f"{r.l3.expiries}; {r.l3.held} blocks held at the end"
        )
    if r.hinted:
        lines.append(f"  hinted blocks {r.hinted}; prefetched to L1 {r.prefetches}")
    if r.declined:
        lines.append("  declined: " + ", ".join(f"{k} {v}" for k, v in sorted(r.declined.items())))
    if r.cluster.nodes > 1:
        for k, n in enumerate(r.per_node):
            lines.append(
                f"  node {k}: {n.requests} requests, {n.accesses} accesses, hit ratio "
                f"{100 * n.hit_ratio:.2f}% ({_tiers(n.tier_hits)})"
            )
    lines.append(f"  speed: {r.accesses_per_s:,.0f} block accesses/s")
    return "\n".join(lines)


def format_sweep(
    results: Sequence[ReplayResult],
    unique_blocks: int,
    percents: Sequence[float] | None = None,
) -> str:
    """Hit ratios (%), one row per policy, one column per capacity; then each policy's
    slowest run. Columns are labelled with ``percents`` when given (the capacities they
    were made from), else with each capacity's share of ``unique_blocks``."""
    caps = sorted({r.l1_blocks for r in results})
    names = list(dict.fromkeys(r.policy for r in results))
    by = {(r.policy, r.l1_blocks): r for r in results}
    pct = {c: 100 * c / unique_blocks for c in caps}
    if percents is not None and len(percents) == len(caps):
        pct = dict(zip(caps, sorted(percents), strict=True))
    width = max([8, *(len(n) + 2 for n in names)])
    head = "policy".ljust(width) + "".join(f"{_percent(pct[c])}% ({c})".rjust(16) for c in caps)
    rows = [head]
    for name in names:
        cells = "".join(
            f"{100 * by[(name, c)].hit_ratio:16.2f}" if (name, c) in by else " " * 16 for c in caps
        )
        rows.append(name.ljust(width) + cells)
    speeds = ", ".join(
        f"{name} {min(r.accesses_per_s for r in results if r.policy == name):,.0f}"
        for name in names
    )
    rows.append(f"speed, block accesses/s (slowest run): {speeds}")
    return "\n".join(rows)


class PlotUnavailable(RuntimeError):
    pass


def require_plotting(path: str) -> None:
    """Raise now (before a long replay) where a figure could not be saved to ``path``:
    PlotUnavailable without matplotlib, ValueError for a format it does not write (its
    name's suffix; none is PNG)."""
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(f"matplotlib cannot write .{suffix} files; one of {', '.join(formats)}")


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
    unique = trace.unique_blocks
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.policy for r in results):
        rs = sorted((r for r in results if r.policy == name), key=lambda r: r.l1_blocks)
        ax.plot(
            [100 * r.l1_blocks / unique for r in rs],
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
    cacheable = trace.cacheable(result.semantics)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if cacheable.requests:
        window = max(1, cacheable.requests // 100)
        edges = np.arange(0, cacheable.requests, window)
        hits = np.add.reduceat(result.hits_per_request, edges)
        total = np.add.reduceat(np.diff(cacheable.offsets), edges)
        ax.plot(cacheable.timestamps_s[edges] / 60, 100 * hits / np.maximum(total, 1))
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("block hit ratio per window (%)")
    ax.set_title(f"{result.policy}, L1 {result.l1_blocks} blocks: {100 * result.hit_ratio:.2f}%")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _percent(value: float) -> str:
    """A capacity's percentage as a sweep names it: 1, 2.5, 0.25 (not 0.999)."""
    return f"{value:.2f}".rstrip("0").rstrip(".")
