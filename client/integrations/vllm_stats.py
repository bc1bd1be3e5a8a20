"""The vLLM connector's counters, reported through vLLM's KV-connector stats.

vLLM 0.32 asks each side of a connector for its stats after every step
(``get_kv_connector_stats``: the workers' ride in the step's output to the scheduler, which
adds its own), sends their ``data`` to its front end, and there rebuilds them
(``build_kv_connector_stats``), adds up the steps of a logging interval and logs them in
its periodic stats line (``KV Transfer metrics: ...``), and records each step's in
Prometheus (``build_prom_metrics``) as ``vllm:kvtier_<name>``.

Invariants:
- A side reports what changed since its last report (``Deltas``), so every increment of a
  counter is reported once; steps and workers add up (a worker's counter is the sum over
  the workers, i.e. over tensor- and pipeline-parallel ranks).
- A gauge (``GAUGES``) is reported at every step it is not 0, and at the step it falls to
  0; added up, it keeps the largest value: over the workers of a step, and over the steps
  of a logging interval. Prometheus holds the last step's (with several API servers, the
  latest any of them recorded: one series, not one per process).
- ``data`` is a flat ``{name: number}`` of names in ``COUNTERS`` or ``GAUGES``: it crosses
  processes as is.

This module does not import vLLM (the sides use it without it in tests); the classes vLLM
calls are in ``vllm`` (``KVTierConnectorStats``, ``KVTierPromMetrics``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COUNTERS: dict[str, str] = {
    # scheduler side
    "lookups": "Lookups of a request's blocks in kvtier (one per vLLM ask that could hit)",
    "lookup_errors": "Lookups that failed (the request ran as a miss)",
    "hit_blocks": "Blocks vLLM was offered from kvtier and allocated for loading",
    "pin_errors": "Pins of a hit that failed (its blocks loaded unpinned)",
    "pin_refused": "Pins of a hit the daemon refused at a lease limit",
    "pin_shortfall_blocks": "Blocks of a hit gone by the time they were pinned",
    "save_blocks_planned": "Blocks the scheduler side planned to store",
    "finish_save_requests": "Finished requests with blocks left to store at the finish",
    "hints": "Prefetch hints for requests left waiting",
    "hint_blocks": "Blocks named in prefetch hints",
    "hint_errors": "Prefetch hints that failed",
    "failed_load_requests": "Requests a worker reported a failed load of",
    # worker side, summed over the workers
    "load_blocks": "Blocks the workers were asked to load",
    "load_blocks_failed": "Blocks that did not load (vLLM recomputed them)",
    "save_blocks": "Blocks handed to the daemon to store",
    "save_blocks_dropped": "Computed blocks not stored (no staging page, kvtier paused, "
    "max_save_jobs reached, or after such a gap in their request's chain)",
    "save_blocks_withheld": "Blocks not stored because computed over a failed load",
    "save_blocks_not_durable": "Blocks stored with save_durable that the daemon's disk tier "
    "did not write (held in memory only)",
    "save_jobs_failed": "Save jobs that ended in an error",
    "saves_over_limit": "Saves dropped because max_save_jobs jobs were in flight",
    "staging_retired": "Staging pools retired after a transfer ended uncleanly",
}
"""Every counter of either side's ``stats``, with its meaning."""

GAUGES: dict[str, str] = {
    "save_jobs_behind": (
        "Save jobs still in flight that were in flight at the step before: a backlog, 0 while "
        "the daemon keeps up (the most on any worker, at a step's end)"
    ),
}

PROM_PREFIX = "vllm:kvtier_"


class Deltas:
    """What a side reports of its stats at a step: each counter's increment since the last
    ``take``, each gauge not 0 or that fell to 0 (thread-safety: none; each side calls it
    from vLLM's thread)."""

    def __init__(self) -> None:
        self._reported: dict[str, int] = {}

    def take(self, counters: Mapping[str, int], gauges: Mapping[str, int]) -> dict[str, int]:
        # One read of each: what is reported and what is remembered as reported agree.
        counters, gauges = dict(counters), dict(gauges)
        out = {k: v - self._reported.get(k, 0) for k, v in counters.items()}
        out = {k: v for k, v in out.items() if v}
        out.update({k: v for k, v in gauges.items() if v or self._reported.get(k, 0)})
        self._reported.update(counters)
        self._reported.update(gauges)
        return out


def add_up(data: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Add ``other``'s counters to ``data``'s; a gauge keeps the larger value."""
    for name, value in other.items():
        if name in GAUGES:
            data[name] = max(data.get(name, 0), value)
        else:
            data[name] = data.get(name, 0) + value
