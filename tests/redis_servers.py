"""Fixtures with real ``redis-server`` processes (see ``kvtier.bench.redis_proc``): a single
node shared by a test module, a fresh node per test for tests that kill or restart it, and a
3-master Redis Cluster made with ``redis-cli --cluster create`` (and one with a replica per
master). Every process is stopped at
teardown (and dies with the test process if that crashes). Registered as a plugin by
``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from kvtier.bench.redis_proc import RedisClusterProcs, RedisServer
from kvtier.tiers.base import BlockRef, HostBuffers
from kvtier.tiers.remote.tier import RemoteTier

OP_TIMEOUT_S = 0.5
# What "fails fast" allows beyond the op timeout on a loaded machine: scheduling, not waiting.
SLACK_S = 1.5


def ref(i: int, ns: int = 1) -> BlockRef:
    return BlockRef(ns, hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest())


def data(i: int, nbytes: int) -> bytes:
    return np.random.default_rng(i).bytes(nbytes)


def host(blocks: list[bytes] | list[bytearray]) -> HostBuffers:
    return HostBuffers([memoryview(b) for b in blocks])


def empty(n: int, nbytes: int) -> list[bytearray]:
    return [bytearray(nbytes) for _ in range(n)]


def raw_client(server: RedisServer) -> redis.Redis:
    """A plain synchronous redis-py client, to look at or damage what the tier stored."""
    return redis.Redis(host="127.0.0.1", port=server.port, password=server.password)


async def wait_for(what: str, ok: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def counted_failed(cluster: RedisClusterProcs, node: RedisServer) -> bool:
    """Whether every running node counts ``node`` failed and reports the cluster ok."""
    node_id = cluster.node_id(node)
    for other in cluster.nodes:
        if not other.running:
            continue
        if "cluster_state:ok" not in other.cli("CLUSTER", "INFO", check=False):
            return False
        line = [f for f in other.cli("CLUSTER", "NODES").splitlines() if f.startswith(node_id)]
        if not line or "fail" not in line[0].split()[2].split(","):
            return False
    return True


class ServerLookups:
    """Counts the keys ``tier`` looks up the server of (``keys``), through its own
    ``_servers_of``, from now until ``monkeypatch`` undoes it."""

    def __init__(self, tier: RemoteTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys = 0
        servers_of = tier._servers_of

        def counting(keys: list[bytes]) -> list[str]:
            self.keys += len(keys)
            return servers_of(keys)

        monkeypatch.setattr(tier, "_servers_of", counting)


def partial_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """Three masters, no replicas, that go on serving the slots they have while one is lost
    (``cluster-require-full-coverage no``), stopped at teardown: the ``redis_cluster_partial``
    fixtures of the cluster test modules, one for a module, one a test's own."""
    cluster = RedisClusterProcs(
        tmp_path_factory.mktemp("redis-cluster-partial"),
        masters=3,
        extra_config="cluster-require-full-coverage no",
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for a whole module; tests keep apart by key prefix (``l3_prefix``)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server of the test's own, to kill, pause or restart."""
    server = RedisServer(tmp_path_factory.mktemp("redis-own"))
    server.start()
    yield server
    server.resume()  # a paused server would not stop on SIGTERM
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """Three masters, no replicas, node timeout 1 s. Tests that kill or reshard restore it."""
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster"), masters=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def redis_cluster_replicated(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterProcs]:
    """Three masters with a replica each, node timeout 1 s. Tests that kill, fail over or
    restart nodes leave every node running and the cluster ok (which node is a master may
    have changed: ``primaries``)."""
    cluster = RedisClusterProcs(
        tmp_path_factory.mktemp("redis-cluster-replicated"), masters=3, replicas=1
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def l3_prefix() -> str:
    """A key prefix of the test's own."""
    return f"t{uuid.uuid4().hex[:12]}:"
