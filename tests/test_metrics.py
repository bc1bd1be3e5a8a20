"""Prometheus /metrics of a real daemon, scraped over HTTP after a scripted workload; every
figure checked is the one the workload implies, and the process figures are the ones /proc
shows for the daemon. Also: the request context in log lines."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from h2_frames import DATA, END_STREAM, RawConnection, frame
from harness import entry_setting
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kvtier.client import NotFoundError, PoolLayout, PutStatus, SharedMemoryPool, Tier
from kvtier.daemon import metrics
from kvtier.daemon.credentials import cred_socket_path
from kvtier.daemon.metrics import CATALOGUE

BLOCK = 64 * 1024
LAYOUT = PoolLayout.staging(
    num_layers=4, num_pages=64, block_tokens=16, chunk_bytes=BLOCK // 8, dtype="uint8"
)
# L1 of 1 MiB holds 16 blocks; nothing is protected, so a full L1 evicts at once.
L1_ONLY = ("tiers.l1.segment_bytes=1MiB", "policy.protect_s=0", "metrics.address=127.0.0.1:0")


def keys(n: int, tag: int) -> list[bytes]:
    rng = np.random.default_rng(tag)
    return [rng.bytes(32) for _ in range(n)]


def metrics_url(daemon) -> str:
    m = re.search(r"metrics on (http://\S+/metrics)", daemon.log())
    assert m, daemon.log()
    return m.group(1)


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return samples(scrape_text(url))


def declared_families(text: str) -> set[str]:
    """The catalogue names of the families in ``text``, each checked against its declaration:
    the type, and labels among the declared ones. A family is the daemon's own (kvtier_) or one
    of the standard process and runtime families; nothing else is served."""
    declared = {d.name: d for d in CATALOGUE}
    standard = {d.name for d in metrics.STANDARD}
    names = set()
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        assert name in declared, name
        assert name.startswith("kvtier_") or name in standard, name
        d = declared[name]
        assert fam.type == d.kind, (name, fam.type)
        for s in fam.samples:
            assert set(s.labels) - {"le"} <= set(d.labels), (name, s.labels)
        names.add(name)
    return names


def value(m: dict, name: str, **labels: str) -> float:
    """One sample, or the sum over samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= ls)


def test_metrics_match_a_scripted_workload(daemon_factory):
    d = daemon_factory(*L1_ONLY, l1_bytes="1MiB")
    url = metrics_url(d)
    assert url.startswith("http://127.0.0.1:")
    hits: Counter[str] = Counter()
    misses: Counter[str] = Counter()
    rpcs: Counter[tuple[str, str]] = Counter()
    a, b, c = keys(12, 1), keys(12, 2), keys(3, 3)

    def lookup(client, ks, **kw):
        rpcs["Lookup", "OK"] += 1
        return client.lookup(ks, **kw)

    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        rpcs["RegisterPool", "OK"] += 1
        before = scrape(url)
        assert value(before, "kvtier_sessions") == 1 and value(before, "kvtier_pools") == 1
        assert value(before, "kvtier_tier_capacity_bytes", tier="L1") == 1 << 20
        assert value(before, "kvtier_tier_health", tier="L1", state="ok") == 1
        assert value(before, "kvtier_lookup_keys_total") == 0  # shown before the first event
        assert ("kvtier_lookup_keys_total", frozenset()) in before

        assert client.put(pool.pool_id, a, range(12)).statuses == [PutStatus.STORED] * 12
        assert client.put(pool.pool_id, a, range(12)).statuses == [PutStatus.EXISTS] * 12
        rpcs["Put", "OK"] += 2
        assert client.get(pool.pool_id, a, range(12)).prefix_len == 12
        rpcs["Get", "OK"] += 1
        assert lookup(client, a).prefix_len == 12
        hits["L1"] += 12
        # B needs 12 slots of the 16: 8 of A's blocks are evicted, and dropped (no L2).
        assert client.put(pool.pool_id, b, range(12, 24)).stored == 12
        rpcs["Put", "OK"] += 1
        found = lookup(client, a).tiers.count(Tier.L1_HOST)
        assert found == 4
        hits["L1"] += 4
        misses["evicted"] += 8

        # Pin everything resident: a put finds no room and is declined.
        lease_b = lookup(client, b, pin=True).lease_id
        lease_a = lookup(client, a, pin=True).lease_id
        hits["L1"] += 12 + 4
        misses["evicted"] += 8
        assert client.put(pool.pool_id, c, range(24, 27)).statuses == [PutStatus.REJECTED_FULL] * 3
        rpcs["Put", "OK"] += 1
        assert lookup(client, c).prefix_len == 0
        misses["declined"] += 3
        pinned = scrape(url)
        assert value(pinned, "kvtier_leases") == 2
        assert value(pinned, "kvtier_blocks_pinned") == 16
        assert value(pinned, "kvtier_tier_unevictable_blocks", tier="L1", reason="pinned") == 16
        assert value(pinned, "kvtier_evictions_blocked_total", tier="L1") == 3

        client.release(lease_a)
        client.release(lease_b)
        rpcs["Release", "OK"] += 2
        assert lookup(client, keys(5, 4)).prefix_len == 0
        misses["absent"] += 5
        assert client.delete(b).deleted == 12
        rpcs["Delete", "OK"] += 1
        assert lookup(client, b).prefix_len == 0
        misses["absent"] += 12  # deleted on purpose: absent, not evicted

        # Refused requests are timed under their status.
        with pytest.raises(NotFoundError):
            client.get(987654321, a[:1], [0])
        rpcs["Get", "NOT_FOUND"] += 1
        with pytest.raises(NotFoundError):
            client.release(12345)
        rpcs["Release", "NOT_FOUND"] += 1

        text = scrape_text(url)
        m = samples(text)
        for tier, n in hits.items():
            assert value(m, "kvtier_hits_total", tier=tier) == n
        for reason in ("absent", "evicted", "declined"):
            assert value(m, "kvtier_misses_total", reason=reason) == misses[reason], reason
        assert value(m, "kvtier_lookup_keys_total") == sum(hits.values()) + sum(misses.values())
        assert value(m, "kvtier_put_blocks_total", result="stored") == 24
        assert value(m, "kvtier_put_blocks_total", result="existing") == 12
        assert value(m, "kvtier_put_blocks_total", result="rejected") == 3
        assert value(m, "kvtier_put_bytes_total") == 24 * BLOCK
        assert value(m, "kvtier_get_blocks_total", result="loaded") == 12
        assert value(m, "kvtier_get_bytes_total") == 12 * BLOCK
        assert value(m, "kvtier_evictions_total", tier="L1") == 8
        assert value(m, "kvtier_deleted_blocks_total") == 12
        assert value(m, "kvtier_tier_blocks", tier="L1") == 4
        assert value(m, "kvtier_tier_used_bytes", tier="L1") == 4 * BLOCK
        assert value(m, "kvtier_leases") == 0
        assert value(m, "kvtier_tier_unevictable_blocks", tier="L1", reason="pinned") == 0
        for (method, code), n in rpcs.items():
            got = value(m, "kvtier_rpc_duration_seconds_count", method=method, code=code)
            assert got == n, (method, code)
        # Both puts that stored blocks copied one batch in; the Get copied one batch out.
        assert value(m, "kvtier_transfer_duration_seconds_count", direction="pool->L1") == 2
        assert value(m, "kvtier_transfer_duration_seconds_count", direction="L1->pool") == 1
        assert value(m, "kvtier_rpc_duration_seconds_sum", method="Put") > 0
    # Every family is declared in the catalogue, with its type and labels.
    assert "kvtier_hits_total" in declared_families(text)


def test_regression_blocks_a_hint_protects_were_missing_from_the_unevictable_gauge(
    daemon_factory,
):
    """A tier full of blocks a Prefetch's deadline protects refuses puts (counted in
    kvtier_evictions_blocked_total, whose help says kvtier_tier_unevictable_blocks tells
    why), but the gauge counted pinned, in-flight and protected blocks only: 0 of 16 here."""
    d = daemon_factory(*L1_ONLY, l1_bytes="1MiB")
    url = metrics_url(d)
    a = keys(16, 5)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, a, range(16)).stored == 16
        assert client.prefetch(a, deadline_ms=600_000).resident == 16
        assert client.put(pool.pool_id, keys(1, 6), [16]).statuses == [PutStatus.REJECTED_FULL]
        m = scrape(url)
        assert value(m, "kvtier_evictions_blocked_total", tier="L1") == 1
        assert value(m, "kvtier_tier_unevictable_blocks", tier="L1", reason="hinted") == 16
        assert value(m, "kvtier_tier_unevictable_blocks", tier="L1") == 16


def test_metrics_count_moves_between_tiers(daemon_factory, tmp_path):
    d = daemon_factory(
        *L1_ONLY,
        # The balancer keeps out of the way: only the put that needs room demotes.
        "tiers.l1.high_watermark=1.0",
        "tiers.l1.low_watermark=1.0",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / 'l2'}",
        "tiers.l2.capacity_bytes=16MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=16MiB",
        "tiers.l2.admission=always",
        l1_bytes="1MiB",
    )
    url = metrics_url(d)
    ks = keys(20, 5)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks[:16], range(16)).stored == 16
        # L1 is full: making room for four more demotes four blocks to L2.
        assert client.put(pool.pool_id, ks[16:], range(16, 20)).stored == 4
        tiers = client.lookup(ks).tiers
        assert tiers.count(Tier.L1_HOST) == 16 and tiers.count(Tier.L2_DISK) == 4
        # L1 holds only blocks without a lower copy: the four on L2 are read straight into
        # the pages.
        assert client.get(pool.pool_id, ks, range(20, 40)).prefix_len == 20
        m = scrape(url)
    assert value(m, "kvtier_moved_blocks_total", direction="L1->L2") == 4
    assert value(m, "kvtier_moved_bytes_total", direction="L1->L2") == 4 * BLOCK
    assert value(m, "kvtier_demoted_blocks_total", tier="L2") == 4
    assert value(m, "kvtier_moved_blocks_total", direction="L2->pool") == 4
    assert value(m, "kvtier_hits_total", tier="L1") == 16
    assert value(m, "kvtier_hits_total", tier="L2") == 4
    assert value(m, "kvtier_tier_blocks", tier="L2") == 4
    assert value(m, "kvtier_tier_health", tier="L2", state="ok") == 1
    assert value(m, "kvtier_tier_events_total", tier="L2", event="checksum_failures") == 0
    assert value(m, "kvtier_transfer_duration_seconds_count", direction="L1->L2") >= 1
    assert value(m, "kvtier_transfer_duration_seconds_count", direction="L2->pool") == 1


def test_metrics_show_usage_quotas_and_sessions_per_tenant(daemon_factory):
    quota = 4 * BLOCK
    d = daemon_factory(
        *L1_ONLY,
        f"tenants=[{{name: ops, uids: [0], quotas: {{l1: {quota}}}}}, {{name: bob, uids: [65534]}}]",
        l1_bytes="1MiB",
    )
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, keys(4, 1), range(4)).stored == 4
        assert client.put(pool.pool_id, keys(2, 2), range(4, 6)).stored == 2
        # A put larger than the quota stores what fits: its own blocks are not evictable yet.
        assert client.put(pool.pool_id, keys(6, 3), range(6)).stored == 4
        # With all its blocks pinned, the tenant at its quota is refused.
        lease = client.lookup(keys(6, 3)[:4], pin=True).lease_id
        assert client.put(pool.pool_id, keys(1, 4), [0]).stored == 0
        client.release(lease)
        m = scrape(metrics_url(d))
        # The quota keeps 4 blocks (L1 alone: the others were dropped).
        assert value(m, "kvtier_tenant_used_bytes", tenant="ops", tier="L1") == quota
        assert value(m, "kvtier_tenant_blocks", tenant="ops", tier="L1") == 4
        assert value(m, "kvtier_tenant_quota_bytes", tenant="ops", tier="L1") == quota
        assert value(m, "kvtier_tenant_used_bytes", tenant="bob", tier="L1") == 0
        assert (
            "kvtier_tenant_quota_bytes",
            frozenset({("tenant", "bob"), ("tier", "L1")}),
        ) not in m
        assert value(m, "kvtier_tenant_sessions", tenant="ops") == 1
        assert value(m, "kvtier_quota_evictions_total", tenant="ops", tier="L1") == 2 + 4
        # Blocks: the 2 of the 6-block put past the quota, then the pinned case's 1.
        assert value(m, "kvtier_quota_rejections_total", tenant="ops", tier="L1") == 2 + 1
        assert value(m, "kvtier_draining") == 0
        client.drain()
        assert value(scrape(metrics_url(d)), "kvtier_draining") == 1
        client.drain(resume=True)


def proc_cpu_s(pid: int) -> float:
    """User and system CPU time of ``pid`` from /proc/PID/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        (line,) = [x for x in f if x.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024  # kB


def test_metrics_show_the_daemon_process_as_proc_reports_it(daemon_factory):
    """process_* describe the daemon process (not whoever scrapes it) as /proc shows it at
    about the same time; python_* describe the interpreter it runs on."""
    started = time.time()
    d = daemon_factory("metrics.address=127.0.0.1:0")
    pid = d.proc.pid
    url = metrics_url(d)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, keys(8, 7), range(8)).stored == 8
        scrape(url)
        fds_before, cpu_before = len(os.listdir(f"/proc/{pid}/fd")), proc_cpu_s(pid)
        text = scrape_text(url)
        fds_after, cpu_after = len(os.listdir(f"/proc/{pid}/fd")), proc_cpu_s(pid)
        rss = proc_rss_bytes(pid)
    m = samples(text)
    assert declared_families(text) >= {d.name for d in metrics.STANDARD}
    # RSS moves between the two reads; it is the daemon's (tens of MiB, with its 128 MiB L1
    # arena mapped but not touched), not 0 and not the scraper's.
    assert 0.5 * rss <= value(m, "process_resident_memory_bytes") <= 1.5 * rss
    assert value(m, "process_virtual_memory_bytes") >= value(m, "process_resident_memory_bytes")
    # While it counts, the daemon also holds the scrape's connection and the listed directory.
    fds = value(m, "process_open_fds")
    assert min(fds_before, fds_after) <= fds <= max(fds_before, fds_after) + 2
    assert value(m, "process_max_fds") == resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
    # The same ticks, summed in another order: equal up to rounding.
    assert cpu_before - 1e-9 <= value(m, "process_cpu_seconds_total") <= cpu_after + 1e-9
    # /proc/stat's boot time is whole seconds: the start time may read up to 1 s early.
    assert started - 2 <= value(m, "process_start_time_seconds") <= time.time()
    gens = {dict(ls)["generation"] for n, ls in m if n == "python_gc_collections_total"}
    assert gens == {"0", "1", "2"}
    assert value(m, "python_gc_collections_total", generation="0") > 0
    for name in ("python_gc_objects_collected_total", "python_gc_objects_uncollectable_total"):
        assert {dict(ls)["generation"] for n, ls in m if n == name} == gens
    # The daemon runs on the interpreter that started it (the test's).
    assert value(m, "python_info", version=platform.python_version()) == 1


def test_a_host_without_proc_serves_the_scrape_without_the_process_families(tmp_path):
    """The process collector reads /proc; where there is none (macOS, a sandbox without it)
    it yields nothing, and the runtime families and the rest of the registry are served."""
    with_proc = CollectorRegistry(auto_describe=False)
    metrics.register_standard(with_proc)
    assert declared_families(generate_latest(with_proc).decode()) == {
        d.name for d in metrics.STANDARD
    }
    without = CollectorRegistry(auto_describe=False)
    metrics.register_standard(without, proc=str(tmp_path / "no-proc"))
    names = declared_families(generate_latest(without).decode())
    assert names == {d.name for d in metrics.STANDARD if not d.name.startswith("process_")}


def test_with_a_token_file_only_scrapes_that_carry_the_token_are_answered(daemon_factory, tmp_path):
    """The figures name every tenant and its usage; a token keeps other local users out."""
    token = tmp_path / "metrics.token"
    token.write_text("t0ken-" * 6 + "\n")
    token.chmod(0o600)
    d = daemon_factory(*L1_ONLY, f"metrics.token_file={token}")
    url = metrics_url(d)
    for header in (None, "Bearer " + "x" * 36, "Basic " + "t0ken-" * 6, "Bearer"):
        request = urllib.request.Request(url)
        if header is not None:
            request.add_header("Authorization", header)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401, header
        assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")
        assert b"kvtier_" not in refused.value.read()
    request = urllib.request.Request(url, headers={"Authorization": "Bearer " + "t0ken-" * 6})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert "kvtier_tier_capacity_bytes" in declared_families(resp.read().decode())


def test_regression_a_scrape_naming_the_series_it_wants_answered_none(daemon_factory):
    """prometheus_client's endpoint serves only the series a scrape names (``?name[]=``),
    collecting from the collectors that name them at registration: the daemon's collector
    named none (its describe() was empty) and the standard ones were not asked, so every
    such scrape was answered 200 with an empty body, whatever it named."""
    d = daemon_factory(*L1_ONLY)
    url = metrics_url(d)
    wanted = [
        "kvtier_sessions",
        "kvtier_prefetch_issued_total",
        "kvtier_pools",
        "kvtier_tier_blocks",  # labelled
        "kvtier_rpc_duration_seconds_count",  # a histogram's series, as the README says
        "process_open_fds",
    ]
    query = urllib.parse.urlencode([("name[]", name) for name in wanted])
    with d.client() as client:
        client.stats()  # a session open
        text = scrape_text(f"{url}?{query}")
    got = {name for (name, _) in samples(text)}
    assert got == set(wanted), text
    assert value(samples(text), "kvtier_sessions") == 1
    assert value(samples(text), "kvtier_rpc_duration_seconds_count", method="Stats") >= 1
    assert declared_families(scrape_text(url)) >= {
        "kvtier_rpc_duration_seconds" if name.endswith("_count") else name for name in wanted
    }  # the whole scrape as before
    # A family's bare name (OpenMetrics' # TYPE line's) matches no sample (README: Metrics).
    om = urllib.request.Request(
        f"{url}?name[]=kvtier_hits", headers={"Accept": "application/openmetrics-text"}
    )
    with urllib.request.urlopen(om, timeout=10) as resp:
        assert resp.read() == b"# EOF\n"


def test_tenants_with_metrics_and_no_token_get_a_warning_at_start(daemon_factory):
    d = daemon_factory(*L1_ONLY, "tenants=[{name: ops, uids: [0]}]")
    # The URL it listens on, not metrics.address as given (it said "reaches 127.0.0.1:0").
    assert f"without metrics.token_file: anyone who reaches {metrics_url(d)} may" in d.log()
    quiet = daemon_factory(*L1_ONLY)
    assert "without metrics.token_file" not in quiet.log()


def test_metrics_are_off_by_default(daemon):
    assert "metrics on" not in daemon.log()


def test_log_lines_a_request_causes_carry_its_ids(daemon_factory):
    d = daemon_factory("logging.format=json", "logging.level=debug")
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        client.put(pool.pool_id, keys(2, 6), range(2))
        session = client.session_id
        pool.unregister()
    d.stop()
    entries = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    registered = [
        e for e in entries if e["logger"] == "kvtier.daemon.pools" and "register" in e["msg"]
    ]
    assert len(registered) == 2  # registered, then unregistered
    for e in registered:
        assert re.fullmatch(r"[0-9a-f]{12}", e["request_id"])
        assert e["session_id"] == session[:8]
    assert registered[0]["request_id"] != registered[1]["request_id"]
    assert registered[1]["pool_id"] == pool.pool_id
    lifecycle = [e for e in entries if "listening on" in e["msg"]]
    assert lifecycle and "request_id" not in lifecycle[0]


def test_regression_debug_logging_was_a_line_of_grpc_s_per_call(daemon_factory):
    """Regression: at logging.level DEBUG, grpc's Python layer logged each call ("Loaded
    running loop", "RPC cancelled ..."): 234 of 236 DEBUG lines of a daemon that served 120
    calls were grpc's, the daemon's own detail lost among them. Its loggers stay at INFO."""
    d = daemon_factory("logging.format=json", "logging.level=debug")
    with d.client() as client:
        for _ in range(20):
            client.stats()
    d.stop()
    entries = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    assert [e for e in entries if e["logger"].startswith("grpc") and e["level"] == "DEBUG"] == []
    assert any("listening on" in e["msg"] for e in entries)


def test_a_clients_x_request_id_names_the_lines_its_request_causes_when_it_is_sane(
    daemon_factory,
):
    """README (Logs): a line a request causes carries the client's ``x-request-id``, where it
    is 1 to 64 letters, digits or ``._:-``; another (a space, 65 characters) gets an id of
    the daemon's own, so a client cannot write what it likes into the log."""
    d = daemon_factory("server.bad_request_log_interval_s=0")
    sent = ["trace-7:a.b_c", "x" * 64, "x" * 65, "two words", ""]
    with grpc.insecure_channel(d.address) as channel:
        put = channel.unary_unary("/kvtier.v1.KVTier/Put")  # bytes in, bytes out
        for request_id in sent:
            with pytest.raises(grpc.RpcError) as refused:
                put(b"\xff", timeout=10, metadata=(("x-request-id", request_id),))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d.stop()
    ids = re.findall(r"Put: refused a request of 1 bytes .*\[req=(\S+)\]", d.log())
    assert ids[:2] == sent[:2]
    assert len(ids) == 5 and all(re.fullmatch(r"[0-9a-f]{12}", i) for i in ids[2:]), ids


def test_a_json_log_is_one_json_object_on_every_line(daemon_factory, tmp_path):
    """With logging.format json, every line kvtierd writes, on stdout and stderr alike (a
    pod's log is both), parses as the log's JSON: the start line, printed at any log level,
    was plain text on stdout, and so was a start the host checks refused."""
    d = daemon_factory("logging.format=json", "metrics.address=127.0.0.1:0")
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        client.put(pool.pool_id, keys(2, 7), range(2))
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "SIGHUP: applied" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.stop() == 0
    lines = d.log().splitlines()
    entries = [json.loads(line) for line in lines]  # each one, or JSONDecodeError
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in entries)
    (start,) = [e for e in entries if e["msg"].startswith("kvtierd 0")]
    assert start["level"] == "INFO" and f"metrics on {metrics_url(d)}" in start["msg"]
    assert any(e["msg"].startswith("SIGHUP: applied") for e in entries)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.daemon",
            *("--set", "logging.format=json", "--set", f"server.socket={tmp_path}/s.sock"),
            *("--set", "tiers.l2.enabled=true", "--set", f"tiers.l2.path={tmp_path}/l2"),
            *("--set", "tiers.l2.capacity_bytes=1000TiB", "--set", "tiers.l2.file_bytes=4TiB"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    (problem,) = [json.loads(line) for line in refused.stderr.splitlines()]
    assert problem["level"] == "ERROR" and "cannot start" in problem["msg"], problem
    assert "cannot hold" in problem["msg"] and refused.stdout == ""


def _daemon_with_l2(sockdir, tmp_path, metrics_address: str) -> list[str]:
    """Overrides of a small daemon with L2, its socket in ``sockdir`` and its metrics on
    ``metrics_address``."""
    return [
        f"server.socket={sockdir}/d.sock",
        "tiers.l1.capacity_bytes=16MiB",
        "tiers.l1.segment_bytes=1MiB",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / 'l2'}",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=16MiB",
        f"metrics.address={metrics_address}",
    ]


def _exit_guard() -> threading.Timer:
    """What ``main`` hands ``_serve`` to bound the exit after a stop (ae12c80), without its
    ``os._exit``: the test's process must not end with the daemon's."""
    guard = threading.Timer(3600, lambda: None)
    guard.daemon = True
    return guard


async def test_regression_a_start_that_failed_once_serving_left_its_sockets(tmp_path):
    """The metrics endpoint starts once the daemon serves (``serve``'s ``on_ready``); its port
    is checked free before the start, but may be taken by then (an L2 recovery can take
    minutes). The start then failed ('cannot start: Address already in use') with the gRPC
    socket and its .cred left behind, the gRPC one still listening until the process ended,
    and the store never stopped. The daemon now stops as at SIGTERM before the error goes
    on, so both sockets go."""
    from kvtier.daemon import main as main_module
    from kvtier.daemon.config import load_config

    sockdir = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    overrides = _daemon_with_l2(sockdir, tmp_path, f"127.0.0.1:{taken.getsockname()[1]}")

    def load():
        return load_config(None, overrides, environ={})

    guard = _exit_guard()
    try:
        none_held = SimpleNamespace(hangup=False, stop=None)  # main's signal holder, empty
        with pytest.raises(OSError, match="Address already in use"):
            await main_module._serve(load(), load, none_held, {}, guard)
        assert sorted(p.name for p in sockdir.iterdir()) == []
    finally:
        guard.cancel()
        taken.close()
        shutil.rmtree(sockdir, ignore_errors=True)


async def test_a_scrape_after_the_store_closed_answers_its_last_figures(tmp_path, monkeypatch):
    """kvtierd stops its metrics endpoint only once the daemon has stopped, so a scrape can
    land after the store closed its tiers: it answers 200 with the figures the store ended
    with (a tier's stats read what it holds in memory, never its closed files or index)."""
    from kvtier.daemon import main as main_module
    from kvtier.daemon import metrics as metrics_module
    from kvtier.daemon import server as server_module
    from kvtier.daemon.config import load_config

    sockdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    overrides = _daemon_with_l2(sockdir, tmp_path, "127.0.0.1:0")

    def load():
        return load_config(None, overrides, environ={})

    daemons, urls, after_close = [], [], []
    started = asyncio.Event()
    start_daemon, start_metrics = server_module.Daemon.start, metrics_module.MetricsServer.start
    stop_daemon = server_module.Daemon.stop

    async def recording_start(self):
        daemons.append(self)
        await start_daemon(self)

    def recording_metrics_start(self):
        start_metrics(self)
        urls.append(self.url)
        started.set()

    async def stop_then_scrape(self):
        await stop_daemon(self)  # the store is closed when this returns
        after_close.append(await asyncio.to_thread(scrape, urls[0]))

    monkeypatch.setattr(server_module.Daemon, "start", recording_start)
    monkeypatch.setattr(server_module.Daemon, "stop", stop_then_scrape)
    monkeypatch.setattr(metrics_module.MetricsServer, "start", recording_metrics_start)
    guard = _exit_guard()
    try:
        none_held = SimpleNamespace(hangup=False, stop=None)  # main's signal holder, empty
        served = asyncio.create_task(main_module._serve(load(), load, none_held, {}, guard))
        await started.wait()
        before = await asyncio.to_thread(scrape, urls[0])
        daemons[0].request_stop()
        await served
    finally:
        guard.cancel()
        shutil.rmtree(sockdir, ignore_errors=True)
    (m,) = after_close
    assert value(m, "kvtier_tier_capacity_bytes", tier="L2") == 64 << 20
    assert value(m, "kvtier_tier_capacity_bytes") == value(before, "kvtier_tier_capacity_bytes")


def test_regression_idle_connections_to_the_metrics_port_held_a_thread_and_a_file_each(
    monkeypatch,
):
    """Any local user (in a pod, anything on the pod's network) may connect to the metrics
    port. Each connection kept a thread and a descriptor for as long as it stayed open,
    sending nothing: 1,010 of them, opened by uid 65534, used up a daemon's 1,024 files, and
    its credential socket then refused every new session. Now an idle connection is closed
    after a while, and one beyond HTTP_MAX_CONNECTIONS at once ends the oldest, so held
    connections can neither use up the daemon's files nor keep a scrape out."""
    monkeypatch.setattr(metrics._Handler, "timeout", 60.0)
    server, thread = metrics.serve_http("127.0.0.1", 0, metrics.scrape_app(CollectorRegistry()))
    address = ("127.0.0.1", server.server_address[1])
    url = f"http://127.0.0.1:{address[1]}/metrics"
    held = [
        socket.create_connection(address, timeout=30) for _ in range(metrics.HTTP_MAX_CONNECTIONS)
    ]
    try:
        for conn in held:  # each is being served (so counted) before the next test step
            conn.sendall(b"G")
        deadline = time.monotonic() + 30
        while len(server._open) < metrics.HTTP_MAX_CONNECTIONS:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with urllib.request.urlopen(url, timeout=30) as answer:  # a scrape still answers
            assert answer.status == 200
        assert held[0].recv(100) == b""  # the oldest connection was ended for it
        assert len(server._open) <= metrics.HTTP_MAX_CONNECTIONS
    finally:
        for conn in held:
            conn.close()
    monkeypatch.setattr(metrics._Handler, "timeout", 0.2)
    silent = socket.create_connection(address, timeout=30)
    assert silent.recv(100) == b""  # closed by the server, having sent nothing
    silent.close()
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_regression_a_flood_of_connections_kept_a_scrape_waiting_to_connect():
    """The metrics port listened with socketserver's backlog of 5: 64 connections opened at
    once (and left idle) filled the kernel's accept queue before the endpoint's thread took
    them, so the kernel dropped a scrape's SYN and its connect waited for the retry, 1 s
    later. The accept queue now holds such a flood: with no connection accepted at all, the
    scrape's connect completes (it never did: each retry found the queue full), and the
    endpoint answers it once it accepts again. No time is measured: the connect either
    completes in the kernel or is never let in."""
    server, thread = metrics.serve_http("127.0.0.1", 0, metrics.scrape_app(CollectorRegistry()))
    server.shutdown()  # the port listens on, and nothing accepts
    thread.join(5)
    address = ("127.0.0.1", server.server_address[1])
    flood = [socket.socket() for _ in range(64)]
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    try:
        for conn in flood:
            conn.setblocking(False)
            conn.connect_ex(address)  # EINPROGRESS: all 64 at once, none waited for
        # Far past the SYN retries at 1, 3 and 7 s, which find a full queue still full.
        scrape = socket.create_connection(address, timeout=10)
        with scrape:
            serving.start()
            scrape.settimeout(30)
            scrape.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            assert scrape.makefile("rb").readline().startswith(b"HTTP/1.0 200 ")
    finally:
        for conn in flood:
            conn.close()
        if serving.is_alive():
            server.shutdown()
            serving.join(5)
        server.server_close()


def test_regression_connections_that_end_badly_printed_a_traceback_each(monkeypatch, capfd):
    """A connection to the metrics port that stayed silent until its timeout, or that one
    beyond HTTP_MAX_CONNECTIONS ended, printed socketserver's 20-line traceback on stderr:
    plain text inside a JSON log, and as many as any peer that reaches the port cared to
    cause. Such connections now end without a word; the endpoint answers as before."""
    monkeypatch.setattr(metrics._Handler, "timeout", 0.2)
    server, thread = metrics.serve_http("127.0.0.1", 0, metrics.scrape_app(CollectorRegistry()))
    address = ("127.0.0.1", server.server_address[1])
    try:
        silent = [socket.create_connection(address, timeout=30) for _ in range(2)]
        half = socket.create_connection(address, timeout=30)
        half.sendall(b"GET /metr")  # a request line never finished
        assert all(conn.recv(100) == b"" for conn in [*silent, half])  # timed out, closed
        held = [
            socket.create_connection(address, timeout=30)
            for _ in range(metrics.HTTP_MAX_CONNECTIONS + 2)
        ]
        for conn in held:
            conn.sendall(b"G")
        assert held[0].recv(100) == b"" and held[1].recv(100) == b""  # ended to make room
        url = f"http://127.0.0.1:{address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert answer.status == 200
        for conn in held:
            conn.close()
        deadline = time.monotonic() + 30
        while server._open and time.monotonic() < deadline:  # every handler thread done
            time.sleep(0.01)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_regression_an_accept_header_naming_a_version_not_made_of_numbers_failed_the_scrape(
    capfd,
):
    """prometheus_client compares the version an Accept header's media range names with
    (1, 0, 0) part by part, and a part that is not a number ("version=abc", "1.x") raised a
    TypeError inside it: any peer that reaches the port got 500, and the daemon's stderr a
    25-line traceback for each such request, outside the log's format and at no bounded rate.
    Such a range is now disregarded, as HTTP lets a server do: the others choose the format,
    or the default text format is served; a range with a version of numbers still counts."""
    server, thread = metrics.serve_http("127.0.0.1", 0, metrics.scrape_app(CollectorRegistry()))
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

    def scrape_as(accept: str) -> tuple[int, str]:
        request = urllib.request.Request(url, headers={"Accept": accept})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, answer.headers["Content-Type"]
        except urllib.error.HTTPError as e:
            return e.code, e.headers["Content-Type"]

    try:
        plain = scrape_as("text/plain; version=abc")
        numbered = scrape_as("application/openmetrics-text; version=1.x, text/plain")
        open_metrics = scrape_as(
            "application/openmetrics-text; version=x, application/openmetrics-text; version=1.0.0"
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert plain[0] == 200 and plain[1].startswith("text/plain; version=0.0.4"), plain
    assert numbered[0] == 200 and numbered[1].startswith("text/plain; version=0.0.4"), numbered
    assert open_metrics[0] == 200, open_metrics
    assert open_metrics[1].startswith("application/openmetrics-text; version=1.0.0"), open_metrics
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


def test_regression_a_scrape_flood_slowed_every_client_of_the_daemon():
    """Anyone who reaches the metrics port may scrape it back to back. Eight local scrapers
    (290 scrapes/s, each a snapshot on the event loop and a render holding the GIL) took
    another client's 1-key lookup from p50 2.1 / p99 4.8 ms to 9.7 / 30 ms. Scrapes now start
    at least SCRAPE_INTERVAL_S apart: each still answers, fresh, after a wait."""
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    calls = []

    def app(environ, start_response):
        calls.append(now[0])
        start_response("200 OK", [])
        return [b"x"]

    paced = metrics.PacedApp(app, 0.5, clock=lambda: now[0], sleep=sleep)
    for _ in range(3):
        assert paced({}, lambda status, headers: None) == [b"x"]
    assert calls == [100.0, 100.5, 101.0]
    assert slept == [0.5, 0.5]
    now[0] += 2.0  # a scrape long after the last waits for nothing
    paced({}, lambda status, headers: None)
    assert slept == [0.5, 0.5]


def test_regression_the_servers_own_counters_were_missing_from_the_metrics(daemon_factory):
    """Malformed requests, calls ended before their request arrived, and pool faults were
    only in ``kvtier stats``: an operator's dashboard could not see a client sending garbage.
    They are counters of the metrics too, 0 before their first; a call that ends its request
    without a message counts as malformed (it was counted nowhere), and the credential
    socket's counts (kept, shown nowhere) join them."""
    d = daemon_factory(*L1_ONLY)
    url = metrics_url(d)
    before = scrape(url)
    for name in ("requests_malformed", "requests_unreceived", "pool_faults", "credential_refused"):
        assert value(before, f"kvtier_{name}_total") == 0
    channel = grpc.insecure_channel(d.address)
    lookup = channel.unary_unary("/kvtier.v1.KVTier/Lookup")
    with pytest.raises(grpc.RpcError) as e:
        lookup(b"\xff\xff\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    conn = RawConnection(d.socket)
    stream = conn.open_call("/kvtier.v1.KVTier/Lookup")
    conn.sock.sendall(frame(DATA, END_STREAM, stream, b""))  # a request without a message
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and stream not in conn.reset:
        conn.pump(0.1)
    conn.close()
    cred = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cred.settimeout(10)
    cred.connect(cred_socket_path(d.socket))
    cred.sendall(b"KVT/1 NONSENSE\n")
    assert cred.recv(1024).startswith(b"ERR ")
    cred.close()
    after = scrape(url)
    assert value(after, "kvtier_credential_refused_total") == 1
    assert value(after, "kvtier_requests_malformed_total") == 2  # not one, and none
    with d.client() as client:
        assert client.stats().counters["requests_malformed"] == 2


def test_stats_count_the_daemons_grpc_connections(daemon_factory):
    """gRPC enforces server.max_connections without telling the daemon; the daemon counts
    its connections from the kernel's socket tables (every CHECK_INTERVAL_S, 0.2 s here
    rather than 5 s: the count is the same, the wait for the next check shorter)."""
    CHECK_INTERVAL_S = 0.2
    daemon = daemon_factory(
        entry=entry_setting({"kvtier.daemon.connections.CHECK_INTERVAL_S": CHECK_INTERVAL_S})
    )
    # Raw connections of our own beside the client's (each kvtier client holds its own).
    raw = [RawConnection(daemon.socket) for _ in range(3)]
    try:
        with daemon.client() as client:
            deadline = time.monotonic() + 10
            while client.stats().gauges["connections"] < 4 and time.monotonic() < deadline:
                time.sleep(CHECK_INTERVAL_S / 4)
            assert client.stats().gauges["connections"] == 4
    finally:
        for conn in raw:
            conn.close()


# Stats gauges (daemon-wide, admin view) -> the metric an operator reads them from; a gauge
# of a tier's own (``l2_io_queued``) is ``kvtier_tier_gauge{tier, gauge}``.
STATS_GAUGE_METRICS = {
    "sessions": "kvtier_sessions",
    "pools": "kvtier_pools",
    "pools_broken": "kvtier_pools_broken",
    "leases": "kvtier_leases",
    "credential_tickets": "kvtier_credential_tickets",
    "connections": "kvtier_connections",
    "blocks": "kvtier_index_blocks",
    "index_bytes": "kvtier_index_bytes",
    "recovering": "kvtier_recovering",
}


def test_regression_stats_gauges_were_missing_from_the_metrics(daemon_factory, tmp_path):
    """``recovering`` (the disk tier's index still being read: lookups answer what is read so
    far), ``pools_broken`` and ``credential_tickets`` were in ``kvtier stats`` only: the
    scrape dropped every store gauge it had no name for, so a node serving without its disk's
    blocks looked to Prometheus like one that had them. Every Stats gauge is a metric with
    Stats' value, read at a quiet point."""
    d = daemon_factory(
        *L1_ONLY,
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / 'l2'}",
        "tiers.l2.capacity_bytes=4MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=4MiB",
        l1_bytes="1MiB",
    )
    d.wait_recovered()
    url = metrics_url(d)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, keys(4, 1), range(4)).stored == 4
        lease = client.lookup(keys(4, 1), pin=True).lease_id
        gauges = client.stats().gauges
        m = scrape(url)
        client.release(lease)
    tiers = {"l1": "L1", "l2": "L2"}
    for name, level in gauges.items():
        prefix, _, rest = name.partition("_")
        if prefix in tiers:
            got = value(m, "kvtier_tier_gauge", tier=tiers[prefix], gauge=rest)
            assert ("kvtier_tier_gauge", frozenset({("tier", tiers[prefix]), ("gauge", rest)})) in m
        else:
            metric = STATS_GAUGE_METRICS.get(name, f"kvtier_{name}")
            assert (metric, frozenset()) in m, name
            got = value(m, metric)
        if name != "connections":  # counted every 5 s, not at the call
            assert got == level, name
    assert value(m, "kvtier_recovering") == 0
    assert value(m, "kvtier_leases") == 1 and value(m, "kvtier_pools") == 1


def test_regression_readme_gave_no_meaning_for_the_names_kvtier_stats_prints():
    # `kvtier stats` prints the daemon's own counter and gauge names (bytes_put,
    # full_rejections, throttled_ms, ...), which README's metrics table, naming only the
    # metrics (kvtier_put_bytes_total, ...), did not mention: an operator reading stats found
    # no meaning nor unit for 30 of them. Each metric's row names what stats prints.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = {
        m.group(1): m.group(0) for m in re.finditer(r"^\| `(kvtier_[a-z_]+)` \|.*\|$", readme, re.M)
    }
    for source, metric in [*metrics.COUNTERS.items(), *metrics.STORE_GAUGES.items()]:
        last = rows[metric.name].rstrip(" |").rsplit("|", 1)[1]
        assert f"`{source}`" in last, (metric.name, source)
