"""A client killed with SIGKILL at any point leaves nothing behind (issue 9, item 8).

Once the daemon sees its session end: no pool, lease, pinned or in-flight block, no mapping
or descriptor of its memory in the daemon, and no /dev/shm object (its pools are memfds,
which have no name).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CLIENT = textwrap.dedent(
    """
    import sys, time
    from kvtier.client import Client, PoolLayout, SharedMemoryPool
    address, phase = sys.argv[1], sys.argv[2]
    layout = PoolLayout.staging(
        num_layers=2, num_pages=16, block_tokens=16, chunk_bytes=1 << 19, kv_count=1
    )
    client = Client(address)
    shm = SharedMemoryPool.for_layout(layout)
    pool = client.register_pool(shm, layout)
    keys = [i.to_bytes(4, "little") * 8 for i in range(8)]
    if phase != "registered":
        client.put(pool.pool_id, keys, range(8))
    if phase == "leased":
        print("lease", client.lookup(keys, pin=True, lease_ms=600000).lease_id)
    print("ready", shm.name, flush=True)
    n = 8
    while phase in ("putting", "getting"):
        if phase == "putting":
            fresh = [(n + i).to_bytes(4, "little") * 8 for i in range(8)]
            client.put(pool.pool_id, fresh, range(8, 16))
            client.delete(fresh)
            n += 8
        else:
            client.get(pool.pool_id, keys, range(8, 16))
    time.sleep(600)
    """
)


def _daemon_holds(daemon_pid: int, label: str) -> list[str]:
    """Mappings and descriptors of the daemon that name ``label``."""
    found = []
    with open(f"/proc/{daemon_pid}/maps") as f:
        found += [line.strip() for line in f if label in line]
    for fd in os.listdir(f"/proc/{daemon_pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon_pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if label in target:
            found.append(f"fd {fd} -> {target}")
    return found


@pytest.mark.parametrize("phase", ["registered", "putting", "getting", "leased"])
def test_a_client_killed_at_any_point_leaves_nothing_behind(shared_daemon, phase):
    daemon = shared_daemon
    assert daemon.proc is not None
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, daemon.address, phase],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().split() if proc.stdout else []
        if phase == "leased":
            assert line[0] == "lease" and int(line[1]) > 0
            line = proc.stdout.readline().split() if proc.stdout else []
        assert line[:1] == ["ready"], line
        label = line[1]
        with daemon.client() as client:
            held = client.stats().gauges
            assert held["pools"] == 1 and held["sessions"] == 2
            assert _daemon_holds(daemon.proc.pid, label), "the daemon should map the pool"
            if phase in ("putting", "getting"):
                time.sleep(0.3)  # in the middle of its copies
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                g = client.stats().gauges
                # The pool leaves the gauges when it is unregistered; its memory is unmapped
                # just after, on a worker thread (daemon/pools.py).
                if (
                    g["sessions"] == 1
                    and g["pools"] == 0
                    and g["blocks_in_flight"] == 0
                    and not _daemon_holds(daemon.proc.pid, label)
                ):
                    break
                time.sleep(0.05)
            g = client.stats().gauges
            assert g["sessions"] == 1, "the killed client's session is still open"
            assert g["pools"] == 0 and g["leases"] == 0
            assert g["blocks_pinned"] == 0 and g["blocks_in_flight"] == 0
            assert g["credential_tickets"] == 0
        assert _daemon_holds(daemon.proc.pid, label) == []
        assert [n for n in os.listdir("/dev/shm") if f"kvtier-{proc.pid}-" in n] == []
    finally:
        proc.kill()
        proc.wait()
    assert daemon.running()
