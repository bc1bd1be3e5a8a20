"""The tests' harness (harness.py) reads what a daemon says as the daemon meant it."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from harness import DaemonProcess, tenant_token

from kvtier.client import Client


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_regression_tcp_address_reads_a_socket_path_with_a_space_and_the_last_start(
    tmp_path: Path, log_format: str
) -> None:
    """The start line's Unix socket was read up to the first space (no TCP listener found in
    a folder whose name held one), and the first start's port was taken after a restart had
    taken another."""
    token, tenants = tenant_token(tmp_path, "t")
    # Short, as a socket's path must be (pytest's tmp_path may be too long).
    folder = tempfile.mkdtemp(prefix="kvt with a space ", dir="/tmp")
    overrides = [tenants, "server.tcp_address=127.0.0.1:0", f"logging.format={log_format}"]
    overrides.append("tiers.l1.capacity_bytes=128MiB")
    d = DaemonProcess(tmp_path, f"{folder}/d.sock", [a for o in overrides for a in ("--set", o)])
    try:
        d.start()
        first = d.tcp_address()
        d.stop()
        # Held, the first port is not the one the restarted daemon takes.
        with socket.socket() as held:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("127.0.0.1", int(first.rsplit(":", 1)[1])))
            d.start()
            address = d.tcp_address()
        assert address != first
        with Client(address, token_file=str(token), timeout_s=30) as client:
            assert client.health()
    finally:
        d.kill()
        shutil.rmtree(folder, ignore_errors=True)
