"""Start a private kvtierd for a benchmark: temp socket, temp folders, stopped on exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.client import wait_until_serving


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
def bench_daemon(*overrides: str, start_timeout_s: float = 120.0) -> Iterator[BenchDaemon]:
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-", dir="/tmp")
    sock = os.path.join(workdir, "d.sock")
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
    def alive() -> None:
        if daemon.proc.poll() is not None:
            raise RuntimeError(
                f"kvtierd exited with {daemon.proc.returncode} during start:\n{daemon.log()}"
            )

    try:
        wait_until_serving(daemon.address, timeout_s, check=alive)
    except TimeoutError as e:
        raise TimeoutError(f"{e}:\n{daemon.log()}") from None
