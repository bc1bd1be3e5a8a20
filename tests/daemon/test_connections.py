"""Counting the daemon's connections from the kernel's socket tables (daemon/connections.py)."""

from __future__ import annotations

import logging
import socket

from kvtier.daemon.connections import ConnectionWatch, tcp_connections, unix_connections


def test_a_listeners_accepted_unix_connections_are_counted(tmp_path):
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(16)
    clients = [socket.socket(socket.AF_UNIX) for _ in range(5)]
    accepted = []
    try:
        for c in clients:
            c.connect(path)
        accepted = [server.accept()[0] for _ in range(3)]
        # Accepted ones only: two wait in the backlog, the listener is not a connection.
        assert unix_connections(path) == 3
        assert unix_connections(path + "x") == 0
        accepted.pop().close()
        assert unix_connections(path) == 2
    finally:
        for s in [server, *clients, *accepted]:
            s.close()


def test_established_tcp_connections_on_a_port_are_counted():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    accepted = [server.accept()[0] for _ in range(3)]
    try:
        assert tcp_connections(port) == 3  # the server's side of each (the clients' ports differ)
    finally:
        for s in [server, *clients, *accepted]:
            s.close()


def test_a_table_in_the_kernels_format_is_parsed(tmp_path):
    net = tmp_path / "net"
    net.mkdir()
    (net / "unix").write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 10 /run/kvtier/kvtierd.sock\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 11 /run/kvtier/kvtierd.sock\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 12 /run/kvtier/kvtierd.sock.cred\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 13\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 14 /run/with space.sock\n"
    )
    (net / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0\n"
        "   1: 0100007F:1F90 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000 0\n"
        "   2: 0100007F:D2F0 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 0\n"
    )
    proc = str(tmp_path)
    assert unix_connections("/run/kvtier/kvtierd.sock", proc) == 1
    assert unix_connections("/run/with space.sock", proc) == 1
    assert tcp_connections(8080, proc) == 1  # 0x1F90: the listener (0A) is not counted
    assert ConnectionWatch("/run/kvtier/kvtierd.sock", 8080, 10, proc).check() == 2


def test_the_watch_warns_at_the_bound_once_per_interval_and_knows_when_it_cannot_count(
    tmp_path, caplog
):
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)
    clients = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    for c in clients:
        c.connect(path)
    accepted = [server.accept()[0] for _ in range(2)]
    now = [0.0]
    try:
        watch = ConnectionWatch(path, 0, 2, clock=lambda: now[0])
        with caplog.at_level(logging.WARNING, logger="kvtier.daemon.connections"):
            assert watch.check() == 2
            assert watch.check() == 2  # within the interval: not logged again
            now[0] = 61.0
            assert watch.check() == 2
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and "server.max_connections is 2" in lines[0]
        assert ConnectionWatch(path, 0, 3).check() == 2  # under the bound: quiet
        assert len(caplog.records) == 2
    finally:
        for s in [server, *clients, *accepted]:
            s.close()
    blind = ConnectionWatch(path, 0, 2, proc=str(tmp_path / "no-proc"))
    assert blind.check() == -1 and blind.count == -1


def test_a_daemon_without_sockets_to_count_counts_none(tmp_path):
    assert ConnectionWatch("", 0, 1, proc=str(tmp_path)).check() == 0
