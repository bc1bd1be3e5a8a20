"""``RedisServer`` starts on ports taken between their choice and its bind: another socket
holds them (as any process on the machine may, other tests' servers and connections among
them), and the server chooses afresh; a port it was given stays its own, and is named when
taken."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvtier.bench.redis_proc import (
    START_ATTEMPTS,
    PortInUse,
    RedisProcError,
    RedisServer,
    free_ports,
)


@pytest.fixture
def held() -> Iterator[Callable[[], int]]:
    """Binds a loopback port (not listening, as a connection's local end) until the test
    ends, and gives its number."""
    with ExitStack() as stack:

        def hold() -> int:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

        yield hold


def taken_first(*ports: int) -> Callable[[int], list[int]]:
    """A chooser whose first answer starts with ``ports``, the rest free, and then free."""
    calls = []

    def choose(n: int) -> list[int]:
        calls.append(n)
        if len(calls) > 1:
            return free_ports(n)
        return [*ports, *free_ports(n - len(ports))]

    return choose


def serves(server: RedisServer) -> bool:
    return server.cli("SET", "k", "v").strip() == "OK" and server.cli("GET", "k").strip() == "v"


def test_regression_a_server_whose_chosen_port_was_taken_exited_instead_of_starting(
    tmp_path: Path, held: Callable[[], int]
) -> None:
    """The port was chosen free (bound to 0, read, let go) and bound by another socket
    before redis-server bound it: the server exited with "Address already in use" and the
    start raised, failing a test's setup at random. The start now chooses again."""
    taken = held()
    with RedisServer(tmp_path / "r", choose_ports=taken_first(taken)) as server:
        assert server.port != taken
        assert serves(server)


def test_regression_a_cluster_node_whose_bus_port_was_taken_exited_instead_of_starting(
    tmp_path: Path, held: Callable[[], int]
) -> None:
    """As above for a cluster node's bus port, given explicitly (``cluster-port``): the
    node exited, its ``nodes.conf`` written; it now starts on fresh ports and a clean one."""
    taken = held()
    server = RedisServer(
        tmp_path / "r", cluster=True, choose_ports=taken_first(free_ports(1)[0], taken)
    )
    with server:
        assert server.cluster_port != taken
        assert server.cli("CONFIG", "GET", "cluster-port").split()[1] == str(server.cluster_port)
        assert len(server.cli("CLUSTER", "MYID").strip()) == 40


def test_regression_a_server_whose_port_another_server_held_was_taken_for_started(
    tmp_path: Path,
) -> None:
    """Started on the port of another redis-server, the server was ready once a PING there
    answered PONG: the other one's, while this one exited. Ready is now this server's own
    process answering; the start goes on to fresh ports."""
    with RedisServer(tmp_path / "other") as other:
        server = RedisServer(tmp_path / "r", choose_ports=taken_first(other.port))
        with server:
            assert server.port != other.port and server.running
            assert f"process_id:{server.proc.pid}" in server.cli("INFO", "server").split()
            assert serves(server)


def test_a_port_given_and_taken_is_named_not_replaced(
    tmp_path: Path, held: Callable[[], int]
) -> None:
    """Whoever gave the port may have handed it on (a client's URL): it is not changed."""
    taken = held()
    server = RedisServer(tmp_path / "r", port=taken)
    with pytest.raises(PortInUse, match=f"(?i)port {taken} \\(tcp\\) in use"):
        server.start()
    assert server.port == taken and not server.running


def test_ports_taken_at_every_start_end_it_naming_them(
    tmp_path: Path, held: Callable[[], int]
) -> None:
    ports = [held() for _ in range(2 * START_ATTEMPTS)]
    chosen = iter(ports)
    server = RedisServer(
        tmp_path / "r", cluster=True, choose_ports=lambda n: [next(chosen) for _ in range(n)]
    )
    with pytest.raises(RedisProcError, match=f"on each of {START_ATTEMPTS} starts") as e:
        server.start()
    assert not isinstance(e.value, PortInUse) and not server.running
    # Each start stops at its first port taken: the server's own.
    assert all(f"{p} (tcp)" in str(e.value).lower() for p in ports[::2]), e.value


def test_regression_a_port_taken_by_a_listener_that_never_answers_hung_the_start(
    tmp_path: Path,
) -> None:
    """A port taken by a listening socket that never answers (a hung or paused server, a
    test's silent one): the readiness check's redis-cli waited 30 s for that socket's INFO
    answer, past the start's own timeout, and raised subprocess.TimeoutExpired instead of
    seeing the server exit and choosing fresh ports. It now waits for an answer for a
    moment at a time, watching the server between."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        taken = int(silent.getsockname()[1])
        server = RedisServer(tmp_path / "r", choose_ports=taken_first(taken))
        try:
            server.start(timeout_s=10)
            assert server.port != taken
            assert serves(server)
        finally:
            server.stop()
