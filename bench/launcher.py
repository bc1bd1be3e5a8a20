"""Start a private kvtierd for a benchmark: temp socket, temp folders, stopped on exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtier.client import Client, KvtierError


@dataclass
class BenchDaemon:
    address: str
    workdir: str
    proc: subprocess.Popen[bytes]
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def bench_daemon(
    *overrides: str, start_timeout_s: float = 120.0, socket_path: str | None = None
) -> Iterator[BenchDaemon]:
    """A private daemon; ``socket_path`` fixes its socket (so that a restarted daemon keeps
    its clients' address), otherwise it gets a fresh one."""
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-", dir="/tmp")
    sock = socket_path or os.path.join(workdir, "d.sock")
    log_path = os.path.join(workdir, "kvtierd.log")
    args = [
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
        proc = subprocess.Popen(args, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    daemon = BenchDaemon(f"unix:{sock}", workdir, proc, log_path)
    try:
        _wait_ready(daemon, start_timeout_s)
        yield daemon
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(daemon: BenchDaemon, timeout_s: float) -> None:
    wait_until_serving(daemon.address, daemon.proc, daemon.log, timeout_s)


def wait_until_serving(
    address: str, proc: subprocess.Popen[bytes], log: Callable[[], str], timeout_s: float
) -> None:
    """Wait until the daemon at ``address`` answers SERVING; raise (with its log) if the
    process exits first or the time runs out. Tests' daemons use this too."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtierd exited with {proc.returncode} during start:\n{log()}")
        try:
            with Client(address, timeout_s=2.0) as c:
                if c.health():
                    return
        except KvtierError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"kvtierd not ready after {timeout_s}s:\n{log()}")
