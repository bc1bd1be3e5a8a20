"""Health watches (``grpc.health.v1.Health/Watch``) against a real daemon: a client that opens
them in a loop gets RESOURCE_EXHAUSTED past ``server.max_health_watches_per_peer`` from its TCP
host and past ``server.max_health_watches`` in all, each naming its bound, and the daemon
serves every other call meanwhile; once the watches close, others open again."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2
from harness import tenant_token

WATCH = "/grpc.health.v1.Health/Watch"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _watch(channel: grpc.Channel):
    """One watch: its first answer (the status now), or the RpcError that refused it."""
    call = channel.unary_stream(
        WATCH,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )(health_pb2.HealthCheckRequest(service=""), timeout=120)
    try:
        return call, next(call).status
    except grpc.RpcError as e:
        return call, e


def _flood(channel: grpc.Channel, n: int) -> tuple[list, list[grpc.RpcError]]:
    opened, refused = [], []
    for _ in range(n):
        call, first = _watch(channel)
        if isinstance(first, grpc.RpcError):
            refused.append(first)
        else:
            assert first == SERVING
            opened.append(call)
    return opened, refused


def test_a_client_opening_watches_in_a_loop_meets_the_bounds_and_others_are_served(
    daemon_factory, tmp_path
):
    """A watch needs no session, over TCP no token either (listening on TCP needs a tenant,
    which these watches never name)."""
    total, per_peer = 6, 4
    _, tenants = tenant_token(tmp_path, "t")
    d = daemon_factory(
        tenants,
        "server.tcp_address=127.0.0.1:0",
        f"server.max_health_watches={total}",
        f"server.max_health_watches_per_peer={per_peer}",
    )
    tcp = grpc.insecure_channel(d.tcp_address())
    unix = grpc.insecure_channel(d.address)
    try:
        # Over TCP the peer's host is known: it gets per_peer watches.
        tcp_open, tcp_refused = _flood(tcp, 10)
        assert len(tcp_open) == per_peer and len(tcp_refused) == 10 - per_peer
        for e in tcp_refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"from ipv4:127.0.0.1; at most {per_peer} per client host" in e.details()
            assert "server.max_health_watches_per_peer" in e.details()
        # On the Unix socket peers are not told apart: the total bounds them.
        unix_open, unix_refused = _flood(unix, 10)
        assert len(unix_open) == total - per_peer and len(unix_refused) == 10 - (total - per_peer)
        for e in unix_refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.details() == (
                f"{total} health watches are open; at most {total} (server.max_health_watches)"
            )
        # Every other call is served: a client's session, its calls, the health check.
        with d.client(timeout_s=10) as client:
            assert client.health()
            assert client.lookup([b"k" * 32]).prefix_len == 0
            other = grpc.insecure_channel(d.address)
            _, first = _watch(other)  # another client's watch: the total is taken
            assert isinstance(first, grpc.RpcError)
            assert first.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            refused = 10 - per_peer + 10 - (total - per_peer) + 1
            assert client.stats().counters["health_watches_refused"] == refused
            probe = subprocess.run(
                [sys.executable, "-m", "kvtier.cli", "--address", d.address, "health"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert probe.returncode == 0 and probe.stdout.startswith("ok: "), probe
            # The open watches still watch: a drain reaches each of them.
            client.drain()
            assert all(next(call).status == NOT_SERVING for call in tcp_open + unix_open)
            client.drain(resume=True)
            assert all(next(call).status == SERVING for call in tcp_open + unix_open)
            # The flooding client goes away: its watches end and others open again.
            unix.close()
            deadline = time.monotonic() + 60
            while True:
                call, first = _watch(other)
                if not isinstance(first, grpc.RpcError):
                    break
                assert first.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the closed watches were never counted out"
                time.sleep(0.05)
            assert first == SERVING
            call.cancel()
            other.close()
            assert client.check().ok
    finally:
        tcp.close()
        unix.close()
