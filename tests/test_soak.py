"""The soak (issue 9, item 10): many clients of two tenants, half of them SIGKILLed midway.

Eight client processes (tests/soak_worker.py), four of tenant alice (uid 1) and four of
tenant bob (uid 65534, with an L1 quota), store, load, get, look up, prefetch and delete the
same keys for ``KVTIER_SOAK_S`` seconds against a daemon whose L1 and L2 together hold less
than the two tenants' working sets, so blocks are demoted, promoted and dropped all the time.
Halfway, two clients of each tenant are killed with SIGKILL. Then: no wrong bytes, no
cross-tenant read, no error of any kind, the killed clients' sessions gone with nothing of
theirs left (pools, leases, pins), the daemon's open files and memory back to what they were
after a warm-up of the same workload (within 5%), and its invariant check clean.

``make test`` runs a short soak (a few seconds); ``make test-soak`` the full one (60 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from peers import NOBODY, NOGROUP, require_root
from test_l2_daemon import l2_args

SOAK_S = float(os.environ.get("KVTIER_SOAK_S", "5"))
WORKER = str(Path(__file__).with_name("soak_worker.py"))
ALICE = (1, 1)
BOB = (NOBODY, NOGROUP)


class Worker:
    """A soak client process and the last counts it printed."""

    def __init__(self, address: str, who: tuple[int, int], tenant: str, seed: int, s: float):
        self.tenant = tenant
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, address, str(who[0]), str(who[1]), tenant, str(seed), str(s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.last: dict[str, Any] = {}
        self.killed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.last = json.loads(line)

    def kill(self) -> None:
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout_s: float) -> dict[str, Any]:
        self.proc.wait(timeout_s)
        self._reader.join(10)
        return self.last


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _settle(admin: Any, sessions: int, timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until only ``sessions`` are open and nothing is held or moving."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = admin.stats().gauges
        idle = (
            g["sessions"] == sessions
            and g["pools"] == 0
            and g["leases"] == 0
            and g["blocks_pinned"] == 0
            and g["blocks_in_flight"] == 0
            and g["background_tasks"] == 0
        )
        if idle or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def _run(address: str, seconds: float, seeds: range, kill_at: float | None) -> list[Worker]:
    workers = [
        Worker(address, *(ALICE, "alice") if i % 2 == 0 else (BOB, "bob"), seed=i, s=seconds)
        for i in seeds
    ]
    if kill_at is not None:
        time.sleep(kill_at)
        for w in workers[:4]:  # two of each tenant
            w.kill()
    for w in workers:
        w.wait(seconds + 120)
    return workers


@pytest.mark.soak
def test_soak_two_tenants_with_clients_killed_midway(daemon_factory, tmp_path):
    require_root()
    os.chmod(daemon_factory._sockdir, 0o711)
    block = 32 * 1024  # soak_worker.LAYOUT
    d = daemon_factory(
        "server.socket_mode=0666",
        "policy.protect_s=0.05",
        "tiers.l1.segment_bytes=1MiB",
        *l2_args(tmp_path / "l2", "tiers.l2.capacity_bytes=12MiB", "tiers.l2.file_bytes=12MiB"),
        f"tenants=[{{name: alice, uids: [{ALICE[0]}]}}, "
        f"{{name: bob, uids: [{BOB[0]}], quotas: {{l1: {64 * block}}}}}, "
        "{name: ops, uids: [0], admin: true}]",
        l1_bytes="4MiB",
    )
    assert d.proc is not None
    pid = d.proc.pid
    with d.client() as admin:
        # Warm-up: the same workload for a quarter of the soak (at least 3 s), so that the
        # baseline has the daemon's bounded caches full (SQLite's page cache, the allocator's
        # arenas: a few MiB that fill in the first minute and then stay); what grows past
        # it is a leak.
        warm = _run(d.address, max(3.0, SOAK_S / 4), range(100, 108), kill_at=None)
        assert all(w.last.get("final") for w in warm)
        _settle(admin, sessions=1)
        fds_before, rss_before = _fds(pid), _rss_bytes(pid)

        started = time.monotonic()
        workers = _run(d.address, SOAK_S, range(8), kill_at=SOAK_S / 2)
        elapsed = time.monotonic() - started
        gauges = _settle(admin, sessions=1)
        check = admin.check(settle_s=10)
        fds_after, rss_after = _fds(pid), _rss_bytes(pid)
        stats = admin.stats()

    totals: Counter[str] = Counter()
    for w in workers:
        totals.update({k: v for k, v in w.last.items() if isinstance(v, int) and k != "final"})
    errors = {k: v for k, v in totals.items() if k.startswith("error_")}
    summary = {
        "seconds": round(elapsed, 1),
        "ops": totals["ops"],
        "ops_per_s": round(totals["ops"] / elapsed, 1),
        "ops_by_kind": {k[3:]: v for k, v in sorted(totals.items()) if k.startswith("op_")},
        "blocks_loaded": totals["blocks_loaded"],
        "errors": errors,
        "wrong_bytes_blocks": totals["wrong_bytes_blocks"],
        "cross_tenant_reads": totals["cross_tenant_reads"],
        "fds": [fds_before, fds_after],
        "rss_mib": [round(rss_before / 2**20, 1), round(rss_after / 2**20, 1)],
        "evictions": stats.counter("evictions"),
        "quota_evictions": stats.counter("quota_evictions"),
        "demoted_blocks": stats.counter("demoted_blocks"),
    }
    print(f"\nsoak: {json.dumps(summary)}")

    survivors = [w for w in workers if not w.killed]
    assert all(w.last.get("final") for w in survivors), [w.last for w in survivors]
    assert all(w.last.get("ops", 0) > 0 for w in workers)
    assert totals["blocks_loaded"] > 0 and summary["evictions"] > 0
    assert totals["wrong_bytes_blocks"] == 0
    assert totals["cross_tenant_reads"] == 0
    assert errors == {}
    assert gauges["sessions"] == 1 and gauges["pools"] == 0 and gauges["leases"] == 0
    assert gauges["blocks_pinned"] == 0 and gauges["blocks_in_flight"] == 0
    assert check.problems == [] and check.strict
    assert abs(fds_after - fds_before) <= 0.05 * fds_before, (fds_before, fds_after)
    assert abs(rss_after - rss_before) <= 0.05 * rss_before, (rss_before, rss_after)
    assert d.running()
    assert "Traceback" not in d.log() and " ERROR " not in d.log()
