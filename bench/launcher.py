"""Start a private kvtierd for a benchmark: temp socket, temp folder, stopped on exit.

Each start gets a fresh folder (socket and log) in the system temp folder; anything that must
outlive one daemon (an L2 directory across a restart) is passed in through a config override
pointing elsewhere. ``BenchDaemon.start_s`` is the time from spawning the process to its first
SERVING answer to a gRPC health check, polled every ``poll_s``.

The readiness probe speaks the standard gRPC health protocol on a channel of its own, with
reconnect backoff shortened to a few milliseconds and a subchannel pool of its own: gRPC's
default backoff (1 s and growing after a refused connection) would otherwise decide when a
start is noticed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import Client
from kvtier.client.types import unix_socket_path
from kvtier.paths import unix_address

# Unix socket paths are limited to 107 bytes (sun_path).
_MAX_SOCKET_PATH = 107
_PROBE_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 5),
    ("grpc.min_reconnect_backoff_ms", 5),
    ("grpc.max_reconnect_backoff_ms", 20),
]


@dataclass
class BenchDaemon:
    address: str
    workdir: str
    proc: subprocess.Popen[bytes]
    log_path: str
    spawned_at: float = 0.0  # time.perf_counter() when the process was spawned
    start_s: float = 0.0  # from spawning to the first SERVING answer

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, **kwargs: object) -> Client:
        return Client(self.address, **kwargs)  # type: ignore[arg-type]


@contextlib.contextmanager
def bench_daemon(
    *overrides: str,
    start_timeout_s: float = 300.0,
    poll_s: float = 0.05,
    socket_path: str | None = None,
    wait_recovered: bool = True,
    wrapper: Sequence[str] = (),
) -> Iterator[BenchDaemon]:
    """A kvtierd with ``overrides`` (``section.key=value``), SERVING when yielded (and, with
    ``wait_recovered``, done indexing what its disk tier held and faulting in its L1 arena: it
    serves before either is done), stopped with SIGTERM (and waited for) on exit.
    ``socket_path`` fixes its socket (so that a restarted daemon keeps its clients' address);
    otherwise it gets a fresh one. ``wrapper`` comes before the daemon's command line (a tool
    that runs it, such as valgrind, which keeps its process id)."""
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-")
    sock = socket_path or os.path.join(workdir, "d.sock")
    if len(sock.encode()) > _MAX_SOCKET_PATH:
        shutil.rmtree(workdir, ignore_errors=True)
        raise RuntimeError(
            f"the temp folder {os.path.dirname(workdir)} is too deep for a Unix socket path; "
            "set TMPDIR to a shorter one"
        )
    log_path = os.path.join(workdir, "kvtierd.log")
    args = [
        *wrapper,
        sys.executable,
        "-m",
        "kvtier.daemon",
        "--set",
        f"server.socket={sock}",
        "--set",
        "logging.level=WARNING",
    ]
    for o in overrides:
        args += ["--set", o]
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    daemon = BenchDaemon(unix_address(sock), workdir, proc, log_path, spawned_at=t0)
    try:
        wait_until_serving(daemon.address, proc, daemon.log, start_timeout_s, poll_s=poll_s)
        daemon.start_s = time.perf_counter() - t0
        if wait_recovered:
            _wait_recovered(daemon.address, t0 + start_timeout_s)
        yield daemon
    finally:
        stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """SIGTERM, wait (the daemon drains and flushes), SIGKILL only past ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_serving(
    address: str,
    proc: subprocess.Popen[bytes],
    log: Callable[[], str],
    timeout_s: float,
    *,
    poll_s: float = 0.05,
) -> None:
    """Wait until the daemon at ``address`` answers SERVING; raise (with its log) if the
    process exits first or the time runs out. Tests' daemons use this too."""
    deadline = time.monotonic() + timeout_s
    path = unix_socket_path(address)
    with grpc.insecure_channel(address, options=_PROBE_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {proc.returncode} during start:\n{log()}")
            # No connection attempt before the socket exists: nothing to back off from.
            if path is None or os.path.exists(path):
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            time.sleep(poll_s)
    raise TimeoutError(f"kvtierd not ready after {timeout_s}s:\n{log()}")


def _wait_recovered(address: str, deadline: float) -> None:
    """Until the daemon has indexed its disk tier and faulted in its L1 arena: both run in the
    background while it serves, and a figure taken meanwhile measures them (on a small
    machine the pre-fault of a GiB takes seconds and a core), not steady-state serving."""
    with Client(address) as client:
        while (gauges := client.stats().gauges).get("recovering", 0) or gauges.get(
            "l1_prefaulting", 0
        ):
            if time.perf_counter() > deadline:
                raise TimeoutError("kvtierd still indexing its disk tier or faulting in its L1")
            time.sleep(0.02)
