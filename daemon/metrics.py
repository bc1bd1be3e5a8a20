"""Prometheus metrics: the one module that knows Prometheus.

Every metric kvtierd exports is declared in ``CATALOGUE`` below (name, type, labels, help);
the README's metrics table is checked against it. The daemon's own figures are named
``kvtier_*``; next to them the endpoint serves the process and runtime families that every
Prometheus client exports (``STANDARD``: ``process_*`` and ``python_*``, from
prometheus_client's own collectors, under the names that client gives them, so dashboards and
alerts written for any Python service work unchanged).

Nothing is counted twice: at each scrape a typed snapshot of the daemon is taken on its event
loop (``take_snapshot``: the store's ``usage()``, its labelled counters' ``samples()``, latency
histograms, the prefetch ledger, sessions, pools and leases) and translated here. Store
counters map to metrics by name (``COUNTERS``); one the catalogue does not name yet is still
exported, as ``kvtier_store_events_total{event=...}``, so a new counter is never silently
dropped.

The endpoint is off unless ``metrics.address`` is set; a bare port listens on 127.0.0.1 only.
It also answers the health probes ``/healthz`` and ``/readyz`` (``kvtier.daemon.probes``);
any other path is 404.

Thread-safety: the HTTP server runs on its own thread; it never touches daemon state, it asks
the event loop for a snapshot (``asyncio.run_coroutine_threadsafe``) and waits for it. The
standard collectors read only ``/proc/self`` and the interpreter (``gc.get_stats()``) on that
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import numpy as np
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector, CollectorRegistry

from kvtier import __version__
from kvtier.daemon import loops
from kvtier.daemon.config import http_url, split_host_port
from kvtier.daemon.latency import HistogramSample
from kvtier.daemon.policy.prefetch import PrefetchStats
from kvtier.daemon.probes import PATHS as PROBE_PATHS
from kvtier.daemon.probes import HealthProbe, probe_state, text_answer
from kvtier.daemon.service import TenantUsage
from kvtier.daemon.stats import Sample
from kvtier.daemon.store import BlockStore, TierUsage
from kvtier.tiers.base import Health

if TYPE_CHECKING:
    from kvtier.daemon.server import Daemon

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
# Each connection to the endpoint holds a thread and a descriptor while it is open. Whoever
# reaches the port (every local user; in a pod, the pod's network) must not be able to hold
# them without bound: a connection that sends nothing for this long is closed, and one more
# than this many open at once ends the oldest (a scrape lasts milliseconds, so connections
# held open, trickling bytes, cannot keep a scraper out; closing the newest would let them).
HTTP_IDLE_TIMEOUT_S = 10.0
HTTP_MAX_CONNECTIONS = 16
# Connections the kernel completes and queues before the endpoint's thread accepts them
# (the kernel caps it at net.core.somaxconn). socketserver's 5 let a burst of connections
# fill the queue, and a scrape's SYN was then dropped: its connect waited for the retry, 1 s.
# A queued connection costs the daemon no thread and no descriptor.
HTTP_ACCEPT_BACKLOG = socket.SOMAXCONN
# Scrapes start at least this far apart (a later one waits): each takes a snapshot on the
# event loop and renders it holding the GIL, so back-to-back scrapes from whoever reaches the
# port (eight scrapers: 290/s) slowed every client of the daemon 4-6x. Prometheus scrapes
# every few seconds; a scrape that waits still answers fresh figures.
SCRAPE_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str  # as exposed (counters end in _total)
    kind: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str


def _c(name: str, labels: tuple[str, ...], help: str) -> MetricDef:
    return MetricDef(name, "counter", labels, help)


def _g(name: str, labels: tuple[str, ...], help: str) -> MetricDef:
    return MetricDef(name, "gauge", labels, help)


# Store counter name -> its metric. Label names are the counter's labels.
COUNTERS: dict[str, MetricDef] = {
    "hits": _c(
        "kvtier_hits_total",
        ("tier",),
        "Keys a Lookup found, by the fastest tier holding them (the tier that serves them).",
    ),
    "misses": _c(
        "kvtier_misses_total",
        ("reason",),
        "Keys a Lookup found in no tier, by why: absent (never stored, deleted or forgotten), "
        "evicted (dropped from the last tier holding it), declined (a Put was refused: no "
        "room, or no tier's admission took it), unreachable (L3 could not be asked: down, or "
        "the block's cluster master lost; it may hold the block).",
    ),
    "load_failures": _c(
        "kvtier_load_failures_total",
        ("tier",),
        "Blocks a Get found in a tier but could not read (checksum mismatch, I/O error, "
        "absent from L3, L3 unreachable or timed out): each is a miss, and that tier's copy "
        "is dropped, but for a read L3 did not answer (kept, read once L3 answers again).",
    ),
    "lookup_keys": _c("kvtier_lookup_keys_total", (), "Keys asked for by Lookup requests."),
    "loaded_from": _c(
        "kvtier_loaded_blocks_total",
        ("tier",),
        "Blocks Get loaded into engine pools, by the tier they were read from.",
    ),
    "get_blocks": _c(
        "kvtier_get_blocks_total", ("result",), "Blocks asked for by Get: loaded or missing."
    ),
    "put_blocks": _c(
        "kvtier_put_blocks_total",
        ("result",),
        "Blocks offered by Put: stored, existing (already held) or rejected (no room).",
    ),
    "hinted_blocks": _c(
        "kvtier_hinted_blocks_total",
        (),
        "Blocks a Prefetch with a deadline protected from eviction until it (hints of an "
        "engine's queued requests).",
    ),
    "hints_over_budget_blocks": _c(
        "kvtier_hints_over_budget_blocks_total",
        (),
        "Blocks a Prefetch with a deadline found but did not protect: their owner's hinted "
        "blocks already held policy.hint_max_share of the top tier, or every owner's together "
        "policy.hint_max_total_share.",
    ),
    "bytes_put": _c("kvtier_put_bytes_total", (), "Bytes stored by Put requests."),
    "bytes_get": _c("kvtier_get_bytes_total", (), "Bytes loaded into engine pools by Get."),
    "transferred_blocks": _c(
        "kvtier_moved_blocks_total",
        ("direction",),
        "Blocks moved between tiers (promotion, demotion, write-through, flush) and from lower "
        "tiers straight into pools, by direction (L1->L2, L2->pool, ...).",
    ),
    "transferred_bytes": _c(
        "kvtier_moved_bytes_total", ("direction",), "Bytes moved, by direction (see above)."
    ),
    "evictions": _c("kvtier_evictions_total", ("tier",), "Blocks evicted from a tier."),
    "watermark_evictions": _c(
        "kvtier_watermark_evictions_total",
        ("tier",),
        "Of those, blocks evicted by the background balancer above the high watermark.",
    ),
    "demoted_blocks": _c(
        "kvtier_demoted_blocks_total",
        ("tier",),
        "Blocks written to a lower tier as they were evicted from the one above (label: the "
        "lower tier).",
    ),
    "full_rejections": _c(
        "kvtier_evictions_blocked_total",
        ("tier",),
        "Blocks a tier could not make room for because every resident block was pinned, "
        "protected, hinted or in flight (kvtier_tier_unevictable_blocks says which); of a "
        "put, only those no tier then stored.",
    ),
    "admission": _c(
        "kvtier_admission_decisions_total",
        ("tier", "reason", "admitted"),
        "Admission decisions of lower tiers by their rule, and of the top tier by its policy's "
        "own admission (reason: the policy, density), by reason; admitted=false are vetoes.",
    ),
    "prefetch_expired": _c(
        "kvtier_prefetch_expired_total",
        (),
        "Prefetches dropped because their deadline passed before they could start.",
    ),
    "throttled_ms": _c(
        "kvtier_throttled_seconds_total",
        ("direction",),
        "Time transfers waited for a tier's bandwidth limit.",
    ),
    "transfer_failures": _c(
        "kvtier_transfer_failures_total",
        ("direction",),
        "Transfer batches that failed inside the daemon (logged with a traceback).",
    ),
    "copies_lost": _c(
        "kvtier_copies_lost_total",
        ("tier",),
        "Copies a tier dropped on its own: found by a failed read, or by a lookup's probe of a "
        "key-addressed tier (L3) that no longer holds a block.",
    ),
    "rows_forgotten": _c(
        "kvtier_rows_forgotten_total",
        ("tier", "reason"),
        "Blocks held only in a key-addressed tier (L3) that the node forgot, by why: "
        "unconfirmed (the tier had not confirmed them for twice tiers.l3.known_s; a lookup "
        "asks the tier for them again), unserved (put again while the tier could not serve "
        "them: down, or their cluster master lost; the put stored them here).",
    ),
    "copies_expired": _c(
        "kvtier_copies_expired_total",
        ("tier",),
        "Copies in a key-addressed tier (L3) of blocks also held here that were written there "
        "half of tiers.l3.ttl_s ago (it may have expired them): no longer counted; "
        "the block is written there again at its next access the tier's admission takes.",
    ),
    "recovered_repeats_dropped": _c(
        "kvtier_recovered_repeats_dropped_total",
        ("tier",),
        "Recovered index rows of a key that another row, written later, or a put since the "
        "start, of other bytes, replaces; dropped, slot freed (a free the tier refused is "
        "tried again, counted in frees_retried instead).",
    ),
    "leases_expired": _c(
        "kvtier_leases_expired_total", (), "Leases (pins) that ran out before their release."
    ),
    "deleted_blocks": _c(
        "kvtier_deleted_blocks_total",
        (),
        "Blocks removed by Delete, also by one that failed after removing them (its retry counts none).",
    ),
    "evicted_blocks": _c(
        "kvtier_evicted_blocks_total",
        ("tier",),
        "Blocks taken out of a tier by Evict requests (moved down, or gone).",
    ),
    "quota_evictions": _c(
        "kvtier_quota_evictions_total",
        ("tier", "tenant"),
        "Blocks a tenant at its quota evicted (or demoted) of its own to make room.",
    ),
    "displaced_evictions": _c(
        "kvtier_displaced_evictions_total",
        ("tier", "tenant"),
        "Blocks of a tenant over an equal share of a tier evicted (or demoted) inside their "
        "protection period to make room for another tenant's put with nowhere else to go "
        "(tenant: the one whose blocks went).",
    ),
    "quota_rejections": _c(
        "kvtier_quota_rejections_total",
        ("tier", "tenant"),
        "Blocks a tier refused to a tenant's write (a put's, or a move's into the tier) "
        "because they did not fit its quota there and it had nothing of its own to evict.",
    ),
    "sessions_refused": _c(
        "kvtier_sessions_refused_total",
        ("reason",),
        "Sessions refused: tenant (no tenant for the peer, a bad token), draining.",
    ),
    "requests_malformed": _c(
        "kvtier_requests_malformed_total",
        (),
        "Requests refused because they were not a valid message, or no message (INVALID_ARGUMENT).",
    ),
    "requests_internal_error": _c(
        "kvtier_requests_internal_error_total",
        (),
        "Requests that failed inside the daemon (INTERNAL); each is logged.",
    ),
    "requests_detached": _c(
        "kvtier_requests_detached_total",
        (),
        "Requests whose client cancelled them or whose deadline passed; they ran to their "
        "end and their answers were dropped.",
    ),
    "requests_dropped": _c(
        "kvtier_requests_dropped_total",
        (),
        "Requests whose client cancelled them or whose deadline passed while they waited "
        "where they had changed nothing yet (a Delete waiting for L2's recovery); cancelled "
        "there, as if they had never come.",
    ),
    "requests_unreceived": _c(
        "kvtier_requests_unreceived_total",
        (),
        "Calls ended before their request had arrived in full: too many waiting "
        "(RESOURCE_EXHAUSTED) or waited too long (DEADLINE_EXCEEDED).",
    ),
    "requests_parse_waited": _c(
        "kvtier_requests_parse_waited_total",
        (),
        "Large requests that waited for their turn to be parsed (another large request was "
        "parsed just before); turns go round robin over tenants.",
    ),
    "requests_step_waited": _c(
        "kvtier_requests_step_waited_total",
        (),
        "Requests of 16 KiB or more whose handler waited for its turn to start (another such "
        "request's had just run): the calls that came meanwhile are taken up first; turns go "
        "round robin over tenants.",
    ),
    "requests_parse_refused": _c(
        "kvtier_requests_parse_refused_total",
        (),
        "Large requests not parsed, ended RESOURCE_EXHAUSTED in their turn: while they waited, "
        "those waiting held over 64 times server.max_message_bytes, and their sender the most.",
    ),
    "health_watches_refused": _c(
        "kvtier_health_watches_refused_total",
        (),
        "Health watches refused (RESOURCE_EXHAUSTED): server.max_health_watches open, or "
        "server.max_health_watches_per_peer from the watch's TCP client host.",
    ),
    "pool_faults": _c(
        "kvtier_pool_faults_total",
        (),
        "Pools broken by a copy that faulted in their memory (the client truncated or "
        "unmapped it); every later request on such a pool is refused.",
    ),
    "credential_session_tickets": _c(
        "kvtier_credential_session_tickets_total",
        (),
        "Session tickets the credential socket issued (a peer's uid vouched for).",
    ),
    "credential_pool_tickets": _c(
        "kvtier_credential_pool_tickets_total",
        (),
        "Pool tickets the credential socket issued (a file descriptor handed over).",
    ),
    "credential_refused": _c(
        "kvtier_credential_refused_total",
        (),
        "Requests on the credential socket answered with an error.",
    ),
    "credential_internal_errors": _c(
        "kvtier_credential_internal_errors_total",
        (),
        "Credential socket requests that failed inside the daemon; each is logged.",
    ),
    "memory_trims": _c(
        "kvtier_memory_trims_total",
        (),
        "Times the daemon gave the C allocator's freed memory back to the system.",
    ),
    "memory_trimmed_bytes": _c(
        "kvtier_memory_trimmed_bytes_total",
        (),
        "Resident memory those trims gave back, in bytes.",
    ),
    "background_errors": _c(
        "kvtier_background_errors_total",
        (),
        "Background tasks that failed (balancer, lease reaper, transfers, and work done in "
        "turns of the event loop: the give-back of ended leases' pins, the expiry heap's "
        "rebuild, the policies' owed moves, the hand-on of a large request's turn); each is "
        "logged.",
    ),
}
_SCALE = {"throttled_ms": 1e-3}

OTHER_EVENTS = _c(
    "kvtier_store_events_total",
    ("event", "tier", "direction", "reason", "result"),
    "Store counters without a metric of their own yet, by name (event).",
)

# Store gauges (``BlockStore.gauges()``) -> metric name.
STORE_GAUGES: dict[str, MetricDef] = {
    "blocks_pinned": _g(
        "kvtier_blocks_pinned",
        (),
        "Blocks pinned by at least one lease (an ended lease's pins count until given back).",
    ),
    "blocks_in_flight": _g(
        "kvtier_blocks_in_flight", (), "Blocks with a copy being read or written now."
    ),
    "transfers_queued": _g(
        "kvtier_transfers_queued", (), "Transfer jobs waiting for a transfer thread."
    ),
    "transfers_running": _g("kvtier_transfers_running", (), "Transfer jobs running now."),
    "background_tasks": _g(
        "kvtier_background_tasks", (), "Background transfers (prefetch, write-back) in flight."
    ),
    "blocks_remembered": _g(
        "kvtier_blocks_remembered",
        (),
        "Dropped blocks whose policy history is kept for their keys (policy.history_factor).",
    ),
    "recovering": _g(
        "kvtier_recovering",
        (),
        "1 while the disk tier's blocks from before this start are still being indexed "
        "(lookups find what is indexed so far; durable puts wait), else 0.",
    ),
}

HISTOGRAMS: dict[str, MetricDef] = {
    "rpc_seconds": MetricDef(
        "kvtier_rpc_duration_seconds",
        "histogram",
        ("method", "code"),
        "Time the daemon spent on each RPC, by method and gRPC status code.",
    ),
    "transfer_seconds": MetricDef(
        "kvtier_transfer_duration_seconds",
        "histogram",
        ("direction",),
        "Time of each transfer batch, by direction (pool->L1, L1->L2, L2->pool, ...).",
    ),
}

FIXED: tuple[MetricDef, ...] = (
    _g(
        "kvtier_tier_capacity_bytes",
        ("tier",),
        "Bytes a tier can hold (0 for L3, whose bytes are the store's own).",
    ),
    _g(
        "kvtier_tier_used_bytes",
        ("tier",),
        "Bytes a tier's slots hold now (0 for L3, whose bytes are the store's own).",
    ),
    _g("kvtier_tier_blocks", ("tier",), "Blocks a tier holds now."),
    _g(
        "kvtier_tier_health",
        ("tier", "state"),
        "1 for a tier's current state (ok, degraded_nospace, degraded_io, down), 0 otherwise.",
    ),
    _g(
        "kvtier_tier_unevictable_blocks",
        ("tier", "reason"),
        "Blocks of a tier that may not be evicted now: pinned (by a lease), in_flight (a copy "
        "is moving), protected (read or written within policy.protect_s), hinted (a "
        "Prefetch's deadline not passed).",
    ),
    _c(
        "kvtier_tier_events_total",
        ("tier", "event"),
        "A tier's own counters (blocks_read, checksum_failures, io_errors, ...), by name.",
    ),
    _g(
        "kvtier_tier_gauge",
        ("tier", "gauge"),
        "A tier's own point-in-time values, by name (e.g. L2's io_queued: its I/O jobs "
        "waiting for a thread).",
    ),
    _c(
        "kvtier_prefetch_issued_total",
        (),
        "Prefetches started (Prefetch, pinning Lookup, readahead).",
    ),
    _c(
        "kvtier_prefetch_outcomes_total",
        ("outcome",),
        "How prefetches ended: used (arrived before the read), late (the read came first), "
        "wasted (evicted or cancelled unread).",
    ),
    _g(
        "kvtier_prefetch_outstanding",
        (),
        "Prefetches issued and not settled yet: a prefetched block counts until it is read "
        "or leaves the top tier, so one never read keeps this above 0 after traffic stops.",
    ),
    _c(
        "kvtier_prefetch_duplicates_total",
        (),
        "Prefetches of a block already being prefetched (nothing new started).",
    ),
    _g("kvtier_sessions", (), "Open client sessions."),
    _g(
        "kvtier_connections",
        (),
        "gRPC connections open, Unix socket and TCP together, counted every 5 s "
        "(server.max_connections bounds them).",
    ),
    _g("kvtier_tenant_sessions", ("tenant",), "Open client sessions per tenant."),
    _g(
        "kvtier_tenant_used_bytes",
        ("tenant", "tier"),
        "Bytes a tenant (or shared:NAME namespace) holds in a tier.",
    ),
    _g("kvtier_tenant_blocks", ("tenant", "tier"), "Blocks a tenant holds in a tier."),
    _g(
        "kvtier_tenant_quota_bytes",
        ("tenant", "tier"),
        "A tenant's quota on a tier (tiers with a quota only).",
    ),
    _g("kvtier_draining", (), "1 while the daemon takes no new sessions (kvtier drain)."),
    _g("kvtier_pools", (), "Registered engine pools."),
    _g(
        "kvtier_pools_broken",
        (),
        "Registered pools broken by a faulted copy (every request on them is refused).",
    ),
    _g(
        "kvtier_credential_tickets",
        (),
        "Tickets the credential socket issued that no session or pool has redeemed yet.",
    ),
    _g("kvtier_leases", (), "Live leases (pinning Lookups not yet released or expired)."),
    _g("kvtier_index_blocks", (), "Blocks in the block table."),
    _g("kvtier_index_bytes", (), "Memory of the block table."),
    _g("kvtier_uptime_seconds", (), "Seconds since the daemon started."),
    _g(
        "kvtier_build_info",
        ("version", "event_loop"),
        "Always 1; the labels are the version and the event loop (server.event_loop).",
    ),
)

# What prometheus_client's ProcessCollector, GCCollector and PlatformCollector export, under
# their names (see ``register_standard``). The process_* families come from /proc/self: where
# there is no /proc they are absent, and the rest of the scrape is served as usual.
STANDARD: tuple[MetricDef, ...] = (
    _g("process_resident_memory_bytes", (), "Resident memory (RSS) of the daemon process."),
    _g("process_virtual_memory_bytes", (), "Virtual memory size of the daemon process."),
    _g("process_open_fds", (), "File descriptors the daemon process holds open."),
    _g(
        "process_max_fds",
        (),
        "The daemon process's limit on open file descriptors (RLIMIT_NOFILE, soft).",
    ),
    _c(
        "process_cpu_seconds_total",
        (),
        "CPU time (user and system) the daemon process has used, all threads.",
    ),
    _g("process_start_time_seconds", (), "When the daemon process started, in Unix time."),
    _c(
        "python_gc_objects_collected_total",
        ("generation",),
        "Objects the cyclic garbage collector freed, by generation (0, 1, 2).",
    ),
    _c(
        "python_gc_objects_uncollectable_total",
        ("generation",),
        "Objects the cyclic garbage collector found uncollectable, by generation.",
    ),
    _c(
        "python_gc_collections_total",
        ("generation",),
        "Collections of each generation by the cyclic garbage collector.",
    ),
    _g(
        "python_info",
        ("version", "implementation", "major", "minor", "patchlevel"),
        "Always 1; the Python interpreter running the daemon is in the labels.",
    ),
)

CATALOGUE: tuple[MetricDef, ...] = (
    *FIXED,
    *COUNTERS.values(),
    OTHER_EVENTS,
    *STORE_GAUGES.values(),
    *HISTOGRAMS.values(),
    *STANDARD,
)


# ---------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one scrape shows, copied on the event loop."""

    version: str
    uptime_s: float
    tiers: list[TierUsage]
    counters: list[Sample]
    histograms: list[HistogramSample]
    prefetch: PrefetchStats
    store_gauges: dict[str, float]
    sessions: int
    pools: int
    pools_broken: int
    credential_tickets: int
    leases: int
    index_blocks: int
    index_bytes: int
    unevictable: list[tuple[str, str, int]] = field(default_factory=list)
    tenants: list[TenantUsage] = field(default_factory=list)
    draining: bool = False
    connections: int = -1  # -1: not known
    event_loop: str = ""  # the running loop's kind (daemon/loops.py)


def take_snapshot(daemon: Daemon, now: float | None = None) -> Snapshot:
    """Copy the daemon's figures. Call on the daemon's event loop."""
    store = daemon.store
    index = store.table.stats()
    return Snapshot(
        version=__version__,
        event_loop=loops.running(),
        uptime_s=time.monotonic() - store.started_at,
        tiers=store.usage(),
        counters=[
            *store.counters.samples(),
            # The server's and the pool registry's own counts (malformed requests, pool
            # faults, ...), plain names without labels.
            *(Sample(k, (), v) for k, v in sorted(daemon.service.counters.items())),
            *(Sample(k, (), v) for k, v in sorted(daemon.pools.counters.items())),
        ],
        histograms=list(store.latency.samples()),
        prefetch=store.prefetches.stats(),
        store_gauges=store.gauges(),
        sessions=daemon.sessions.session_count,
        pools=len(daemon.pools),
        pools_broken=daemon.pools.broken_count,
        credential_tickets=len(daemon.service.tickets),
        leases=daemon.sessions.lease_count,
        index_blocks=index.blocks,
        index_bytes=index.nbytes,
        unevictable=unevictable(store, time.monotonic() if now is None else now),
        tenants=daemon.service.tenant_usage(),
        draining=daemon.service.draining,
        connections=daemon.connections.count if daemon.connections is not None else -1,
    )


def unevictable(store: BlockStore, now: float) -> list[tuple[str, str, int]]:
    """(tier, reason, blocks) of resident blocks the guard or a live hint would not let go
    now; a block counts under its first reason of pinned, in_flight, protected, hinted."""
    table = store.table
    out = []
    for level in store.stack:
        if level.keyed:
            continue
        held = table.holders(level.col)
        pinned = table.pins[held] > 0
        moving = (table.inflight[held] > 0) & ~pinned
        recent = table.last_access[held] + level.guard.protect_s > now
        protected = recent & ~pinned & ~moving
        hinted = np.zeros(len(held), dtype=bool)
        if (unhinted := getattr(level.policy, "unhinted", None)) is not None:
            rest = ~(pinned | moving | protected)
            hinted[rest] = ~unhinted(_every_block, now)(held[rest])
        for reason, mask in (
            ("pinned", pinned),
            ("in_flight", moving),
            ("protected", protected),
            ("hinted", hinted),
        ):
            out.append((level.label, reason, int(np.count_nonzero(mask))))
    return out


def _every_block(bids: np.ndarray) -> np.ndarray:
    """An evictable mask that lets every block go, narrowed by a policy's live hints."""
    return np.ones(len(bids), dtype=bool)


# ---------------------------------------------------------------------- families


def _family(d: MetricDef) -> Any:
    """An empty metric family of ``d``."""
    if d.kind == "counter":
        return CounterMetricFamily(d.name, d.help, labels=d.labels)
    if d.kind == "gauge":
        return GaugeMetricFamily(d.name, d.help, labels=d.labels)
    return HistogramMetricFamily(d.name, d.help, labels=d.labels)


def families(snap: Snapshot) -> Iterator[Metric]:
    """The snapshot as Prometheus metric families."""
    fams: dict[str, Any] = {}

    def fam(d: MetricDef) -> Any:
        if d.name not in fams:
            fams[d.name] = _family(d)
        return fams[d.name]

    by_name = {d.name: d for d in FIXED}

    def put(name: str, labels: Iterable[str], value: float) -> None:
        fam(by_name[name]).add_metric(list(labels), value)

    for t in snap.tiers:
        tier = t.kind.label
        put("kvtier_tier_capacity_bytes", [tier], t.capacity_bytes)
        put("kvtier_tier_used_bytes", [tier], t.used_bytes)
        put("kvtier_tier_blocks", [tier], t.blocks)
        for state in Health:
            put("kvtier_tier_health", [tier, state.value], float(t.health.state is state))
        for name, value in sorted(t.counters.items()):
            put("kvtier_tier_events_total", [tier, name], value)
        for gauge_name, level in sorted(t.gauges.items()):
            put("kvtier_tier_gauge", [tier, gauge_name], level)
    for tier, reason, n in snap.unevictable:
        put("kvtier_tier_unevictable_blocks", [tier, reason], n)

    pf = snap.prefetch
    put("kvtier_prefetch_issued_total", [], pf.issued)
    for outcome, n in (("used", pf.used), ("late", pf.late), ("wasted", pf.wasted)):
        put("kvtier_prefetch_outcomes_total", [outcome], n)
    put("kvtier_prefetch_outstanding", [], pf.outstanding)
    put("kvtier_prefetch_duplicates_total", [], pf.duplicates)
    put("kvtier_sessions", [], snap.sessions)
    if snap.connections >= 0:
        put("kvtier_connections", [], snap.connections)
    put("kvtier_draining", [], float(snap.draining))
    for ten in snap.tenants:
        put("kvtier_tenant_sessions", [ten.tenant], ten.sessions)
        for u in ten.tiers:
            put("kvtier_tenant_used_bytes", [ten.tenant, u.kind.label], u.used_bytes)
            put("kvtier_tenant_blocks", [ten.tenant, u.kind.label], u.blocks)
            if u.quota_bytes:
                put("kvtier_tenant_quota_bytes", [ten.tenant, u.kind.label], u.quota_bytes)
    put("kvtier_pools", [], snap.pools)
    put("kvtier_pools_broken", [], snap.pools_broken)
    put("kvtier_credential_tickets", [], snap.credential_tickets)
    put("kvtier_leases", [], snap.leases)
    put("kvtier_index_blocks", [], snap.index_blocks)
    put("kvtier_index_bytes", [], snap.index_bytes)
    put("kvtier_uptime_seconds", [], snap.uptime_s)
    put("kvtier_build_info", [snap.version, snap.event_loop], 1)

    seen: set[str] = set()
    for s in snap.counters:
        labels = dict(s.labels)
        known = COUNTERS.get(s.name)
        if known is None:
            row = [s.name, *(labels.get(k, "") for k in OTHER_EVENTS.labels[1:])]
            fam(OTHER_EVENTS).add_metric(row, s.value)
            continue
        seen.add(s.name)
        row = [labels.get(k, "") for k in known.labels]
        fam(known).add_metric(row, s.value * _SCALE.get(s.name, 1))
    # Unlabelled counters show 0 before their first event, so rates work from the first
    # scrape; labelled ones appear with their first label values.
    for source, d in COUNTERS.items():
        fam(d)
        if not d.labels and source not in seen:
            fam(d).add_metric([], 0)

    for gauge_name, level in snap.store_gauges.items():
        gauge = STORE_GAUGES.get(gauge_name)
        if gauge is not None:
            fam(gauge).add_metric([], level)

    for d in HISTOGRAMS.values():
        fam(d)
    for h in snap.histograms:
        hd = HISTOGRAMS.get(h.name)
        if hd is None:
            continue
        labels = dict(h.labels)
        buckets = [(f"{b:g}", n) for b, n in zip(h.bounds, h.cumulative[:-1], strict=True)] + [
            ("+Inf", h.count)
        ]
        fam(hd).add_metric([labels.get(k, "") for k in hd.labels], buckets, h.sum_s)
    yield from fams.values()


# ------------------------------------------------------------------------ server


class DaemonCollector(Collector):
    """Collects from a running daemon by asking its event loop for a snapshot."""

    def __init__(self, daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
        self.daemon = daemon
        self.loop = loop

    async def _snapshot(self) -> Snapshot:
        return take_snapshot(self.daemon)

    def collect(self) -> Iterable[Metric]:
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop)
        snap = future.result(SNAPSHOT_TIMEOUT_S)
        return list(families(snap))

    def describe(self) -> Iterable[Metric]:
        """The families ``collect`` yields, without samples, from the catalogue: registering
        must not call collect() (the loop may not be running), and a scrape that names the
        series it wants (``?name[]=``) collects only from the collectors that name them."""
        return [_family(d) for d in CATALOGUE if d not in STANDARD]


def register_standard(registry: CollectorRegistry, proc: str = "/proc") -> None:
    """Add prometheus_client's process, garbage collector and platform collectors (the
    ``STANDARD`` families) to ``registry``. ``proc`` is where procfs is mounted; without one
    the process collector yields nothing (it looks once, here), and the scrape goes on."""
    ProcessCollector(proc=proc, registry=registry)
    GCCollector(registry=registry)  # CPython only; elsewhere it registers nothing
    PlatformCollector(registry=registry)


class MetricsServer:
    """The /metrics HTTP endpoint of one daemon, with its health probes. Start on the
    daemon's event loop."""

    def __init__(self, daemon: Daemon, address: str, token: bytes | None = None) -> None:
        self.host, self.port = split_host_port(address)
        self.token = token
        # prometheus_client's own collectors name their series by a collect() at registration.
        self.registry = CollectorRegistry(auto_describe=True)
        loop = asyncio.get_running_loop()
        self.registry.register(DaemonCollector(daemon, loop))
        register_standard(self.registry)
        self.probe = HealthProbe(lambda: probe_state(daemon), loop)
        self.scrape: Callable[..., Iterable[bytes]] | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return http_url(self.host, self.port, "/metrics")

    def start(self) -> None:
        self.scrape = scrape_app(self.registry, self.token)
        self._server, self._thread = serve_http(
            self.host, self.port, ProbeRouter(self.scrape, self.probe)
        )
        if self.port == 0:
            self.port = int(self._server.server_address[1])
        log.info("metrics on %s", self.url)

    def set_token(self, token: bytes) -> bool:
        """Scrapes need ``token`` from now on (metrics.token_file read again); False, changing
        nothing, when the endpoint was started without a token."""
        if not isinstance(self.scrape, BearerApp):
            return False
        self.token = self.scrape.token = token
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


class _Handler(WSGIRequestHandler):
    """Serves one connection; its reads and writes give up after ``HTTP_IDLE_TIMEOUT_S``."""

    timeout = HTTP_IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection; a connection beyond ``HTTP_MAX_CONNECTIONS`` open at once
    ends the oldest (its socket shut down, so its thread's next read or write fails and the
    thread ends at once)."""

    request_queue_size = HTTP_ACCEPT_BACKLOG

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: dict[Any, None] = {}  # the connections being served, oldest first
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            while len(self._open) >= HTTP_MAX_CONNECTIONS:
                oldest = next(iter(self._open))
                del self._open[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._open[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that fails as connections do (it stayed silent past its timeout, its
        peer reset it, or it was ended to make room) ends without a word: socketserver's own
        handler printed a traceback on stderr for each, outside the log's format and as
        often as any peer that reaches the port liked. Anything else is logged."""
        if isinstance(sys.exc_info()[1], OSError):
            return
        log.exception("metrics endpoint: serving a connection from %s failed", client_address[0])

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)


class PacedApp:
    """A WSGI app that starts ``app`` at most once per ``interval_s``: a request that comes
    sooner waits for its turn (see ``SCRAPE_INTERVAL_S``). Thread-safety: any thread; the
    requests are served one at a time."""

    def __init__(
        self,
        app: Callable[..., Iterable[bytes]],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.app = app
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._last = -float("inf")

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self._lock:
            wait = self._last + self.interval_s - self._clock()
            if wait > 0:
                self._sleep(wait)
            self._last = self._clock()
            return list(self.app(environ, start_response))


class BearerApp:
    """A WSGI app that starts ``app`` only for a request carrying ``Authorization: Bearer
    TOKEN`` (compared in constant time), and answers 401 otherwise, before ``app`` (a
    ``PacedApp``) gives it a turn. Thread-safety: any thread; ``token`` may be replaced from
    any thread (a request compares against one or the other, whole)."""

    def __init__(self, app: Callable[..., Iterable[bytes]], token: bytes) -> None:
        self.app = app
        self.token = token

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        scheme, _, given = str(environ.get("HTTP_AUTHORIZATION", "")).partition(" ")
        # WSGI hands header values over as latin-1 strings: every one encodes back.
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("latin-1"), self.token
        ):
            return self.app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="kvtier metrics"'),
            ],
        )
        return [b"this endpoint needs the bearer token of metrics.token_file\n"]


class ProbeRouter:
    """A WSGI app that hands ``probes.PATHS`` to ``probe``, ``/metrics`` to ``app`` (the
    scrape: token-checked and paced, which the probes are not), and answers 404 to every
    other path. prometheus_client's app serves the scrape at any path: a probe set to a path
    slightly off (``/readyz/``) got the scrape's 200 whatever the daemon's state. Every path
    takes GET and HEAD (the GET's answer without its body), any other method is 405."""

    def __init__(
        self, app: Callable[..., Iterable[bytes]], probe: Callable[..., Iterable[bytes]]
    ) -> None:
        self.app = app
        self.probe = probe

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD")
        if method not in ("GET", "HEAD"):
            allow = [("Allow", "GET, HEAD")]
            return text_answer(
                start_response, "405 Method Not Allowed", "GET or HEAD only\n", allow
            )
        if method == "HEAD":
            # Answered as the GET would be (token, pace, headers), without the body;
            # prometheus_client's app answers a HEAD 405, with a body.
            return _head(self._get, {**environ, "REQUEST_METHOD": "GET"}, start_response)
        return self._get(environ, start_response)

    def _get(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in PROBE_PATHS:
            return self.probe(environ, start_response)
        if path == "/metrics":
            return self.app(environ, start_response)
        return text_answer(
            start_response,
            "404 Not Found",
            "not found: this endpoint serves /metrics, /healthz and /readyz\n",
        )


def _head(
    app: Callable[..., Iterable[bytes]], environ: dict[str, Any], start_response: Any
) -> Iterable[bytes]:
    """``app``'s answer to the GET ``environ`` without its body: its status and headers, and a
    Content-Length of the body left out where ``app`` did not give one (wsgiref would send
    ``Content-Length: 0`` for an empty body, which HTTP forbids on a HEAD answer unless the
    GET's body is empty too)."""
    answer: list[Any] = []
    written = 0

    def started(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer[:] = [status, headers, exc_info]

        def write(data: bytes) -> None:
            nonlocal written
            written += len(data)

        return write

    body = app(environ, started)
    try:
        size = sum(len(chunk) for chunk in body) + written  # written by then, if at all
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()
    status, headers, exc_info = answer
    if not any(name.lower() == "content-length" for name, _ in headers):
        headers = [*headers, ("Content-Length", str(size))]
    start_response(status, headers, exc_info)
    return []


def scrape_app(
    registry: CollectorRegistry, token: bytes | None = None
) -> Callable[..., Iterable[bytes]]:
    """The scrape of ``registry``, paced (``PacedApp``); with a ``token``, answered only to
    requests that carry it (a ``BearerApp``, whose token may be replaced later)."""
    prometheus = make_wsgi_app(registry)

    def exposition(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        accept = environ.get("HTTP_ACCEPT")
        if accept:
            environ = {**environ, "HTTP_ACCEPT": comparable_accept(accept)}
        return prometheus(environ, start_response)

    app: Callable[..., Iterable[bytes]] = PacedApp(exposition, SCRAPE_INTERVAL_S)
    return app if token is None else BearerApp(app, token)


def comparable_accept(header: str) -> str:
    """``header`` (an Accept header) without the media ranges whose ``version`` has a part
    that is not a number. prometheus_client compares a version with (1, 0, 0) part by part,
    and such a part raised a TypeError in it: the scrape failed (500) and wsgiref printed the
    traceback on stderr, for any peer that sent such a header. HTTP lets a server disregard
    what it cannot serve: the other ranges choose the format, or none does (the default)."""

    def comparable(media_range: str) -> bool:
        for param in media_range.split(";"):
            name, eq, value = param.strip().partition("=")
            if eq and name == "version":  # the first, as prometheus_client reads it
                if not value:  # no version: prometheus_client takes the range's latest
                    return True
                try:
                    for part in value.split("."):
                        int(part)
                except ValueError:
                    return False
                return True
        return True

    return ",".join(r for r in header.split(",") if comparable(r))


def serve_http(
    host: str, port: int, app: Callable[..., Iterable[bytes]]
) -> tuple[_BoundedServer, threading.Thread]:
    """Serve the WSGI ``app`` at ``http://host:port/`` on a thread of its own, with the
    connection bounds of ``_BoundedServer`` and ``_Handler``."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Server(_BoundedServer):
        address_family = family

    server = make_server(host, port, app, Server, _Handler)
    thread = threading.Thread(target=server.serve_forever, name="kvtier-metrics", daemon=True)
    thread.start()
    return server, thread
