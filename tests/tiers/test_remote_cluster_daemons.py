"""Two daemons (two nodes) sharing a real 3-master Redis Cluster as L3: one serves the
other's prefix, and a master killed mid-workload costs neither daemon a failed request; one
master out of memory holds back the daemon's L3 writes to that master only; a master lost
for good makes its blocks held only in L3 lookup misses that a Get makes no room for and a
Put stores here. Run
with ``make test-l3-cluster`` (the cluster suite)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from redis_servers import counted_failed, partial_cluster

from kvtier.bench.redis_proc import RedisClusterProcs, RedisServer
from kvtier.client import Client, KvtierError, PoolLayout, PutStatus, SharedMemoryPool, Tier

pytestmark = pytest.mark.redis_cluster

LAYOUT = PoolLayout.staging(num_layers=2, num_pages=64, block_tokens=16, chunk_bytes=8 << 10)


@pytest.fixture
def redis_cluster_partial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """``partial_cluster``, a test's own: it loses a master for good."""
    yield from partial_cluster(tmp_path_factory)


def node(daemon_factory, tmp_path, name: str, cluster: RedisClusterProcs, prefix: str):
    return daemon_factory(
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / name / 'l2'}",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=64MiB",
        "tiers.l3.enabled=true",
        "tiers.l3.mode=cluster",
        f"tiers.l3.urls=[{', '.join(cluster.urls)}]",
        f"tiers.l3.key_prefix='{prefix}'",
        "tiers.l3.admission=always",
        "tiers.l3.op_timeout_s=1.0",
        "tiers.l3.connect_timeout_s=0.5",
        "tiers.l3.backoff_initial_s=0.05",
        "tiers.l3.backoff_max_s=0.3",
    )


def put_written_to_l3(client: Client, pool_id: int, chain: list[bytes]) -> None:
    """``chain`` put from the pool's first pages, then waited for until the daemon has copied
    every block of it to L3 (its first copies there)."""
    assert client.put(pool_id, chain, range(len(chain))).prefix_len == len(chain)
    deadline = time.monotonic() + 30
    while client.stats().counter("copies", direction="L1->L3") < len(chain):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def keys(n: int, tag: int) -> list[bytes]:
    rng = np.random.default_rng(tag)
    return [rng.bytes(32) for _ in range(n)]


def test_two_daemons_share_a_cluster_and_survive_a_master_killed_mid_workload(
    daemon_factory, tmp_path, redis_cluster, l3_prefix
):
    a = node(daemon_factory, tmp_path, "a", redis_cluster, l3_prefix)
    b = node(daemon_factory, tmp_path, "b", redis_cluster, l3_prefix)
    shared = keys(32, 1)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        data = shm.array()
        data[:] = np.random.default_rng(2).integers(0, 256, len(data), dtype=np.uint8)
        want = data.copy()
        pool = ca.register_pool(shm, LAYOUT)
        put_written_to_l3(ca, pool.pool_id, shared)
    with b.client() as cb, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert cb.lookup(shared).tiers == [Tier.L3_REMOTE] * 32
        pool = cb.register_pool(shm, LAYOUT)
        assert cb.get(pool.pool_id, shared, range(32)).prefix_len == 32
        assert np.array_equal(
            shm.array()[: 32 * LAYOUT.block_bytes], want[: 32 * LAYOUT.block_bytes]
        )

    # Both nodes keep working on their own blocks while a master dies and comes back.
    errors: list[BaseException] = []
    done = threading.Event()

    def workload(daemon, tag: int) -> None:
        try:
            with daemon.client(timeout_s=10) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
                pool = client.register_pool(shm, LAYOUT)
                round_ = 0
                while not done.is_set():
                    ks = keys(8, 1000 * tag + round_)
                    assert client.put(pool.pool_id, ks, range(8)).prefix_len == 8
                    assert client.lookup(ks).prefix_len == 8
                    assert client.get(pool.pool_id, ks, range(8, 16)).prefix_len == 8
                    client.lookup(keys(4, 99_000 + round_))  # misses probe L3: still answered
                    round_ += 1
        except (KvtierError, AssertionError) as e:
            errors.append(e)

    threads = [threading.Thread(target=workload, args=(d, t)) for t, d in ((1, a), (2, b))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    victim = redis_cluster.nodes[1]
    victim.kill()
    redis_cluster.wait_fail()
    time.sleep(1.0)
    victim.start()
    redis_cluster.wait_ok()
    time.sleep(0.5)
    done.set()
    for t in threads:
        t.join(60)
    assert errors == []


def test_a_full_master_holds_back_its_own_blocks_only_not_the_daemon_s_other_l3_writes(
    daemon_factory, redis_cluster, l3_prefix
):
    """One master full (noeviction, OOM): the daemon goes on writing the blocks of the
    other masters' slots to L3 during that master's backoff, and L3's state says
    degraded_nospace. The tier's pause was per master, but any degraded state made the
    daemon offer L3 no write at all, so the other masters got nothing for the backoff."""
    full, others = redis_cluster.nodes[0], redis_cluster.nodes[1:]

    def stored(nodes) -> int:
        return sum(len(n.cli("--scan", "--pattern", f"{l3_prefix}*").split()) for n in nodes)

    d = daemon_factory(
        "tiers.l3.enabled=true",
        "tiers.l3.mode=cluster",
        f"tiers.l3.urls=[{', '.join(redis_cluster.urls)}]",
        f"tiers.l3.key_prefix='{l3_prefix}'",
        "tiers.l3.admission=always",
        "tiers.l3.op_timeout_s=5.0",
        # A backoff the test outlasts none of: the second Put's writes come within it.
        "tiers.l3.backoff_initial_s=60",
        "tiers.l3.backoff_max_s=60",
    )
    full.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    full.cli("CONFIG", "SET", "maxmemory", "1")
    try:
        with d.client() as c, SharedMemoryPool.for_layout(LAYOUT) as shm:
            pool = c.register_pool(shm, LAYOUT)

            def l3_state() -> str:
                (l3,) = [t for t in c.stats().tiers if t.tier == Tier.L3_REMOTE]
                return l3.state

            assert c.put(pool.pool_id, keys(32, 1), range(32)).prefix_len == 32
            deadline = time.monotonic() + 30
            while not l3_state().startswith("degraded_nospace"):
                assert time.monotonic() < deadline, l3_state()
                time.sleep(0.05)
            before = stored(others)
            assert c.put(pool.pool_id, keys(32, 2), range(32, 64)).prefix_len == 32
            deadline = time.monotonic() + 30
            while stored(others) <= before:
                assert time.monotonic() < deadline, "no L3 write reached the other masters"
                time.sleep(0.05)
            state = l3_state()
            assert state.startswith(f"degraded_nospace: master {full.address} out of memory")
            assert state.endswith("the other masters serve and take writes"), state
        assert stored([full]) == 0
    finally:
        full.cli("CONFIG", "SET", "maxmemory", "0")


def wait_counted_failed(cluster: RedisClusterProcs, lost: RedisServer) -> None:
    """Until every running master counts ``lost`` failed and serves its own slots."""
    deadline = time.monotonic() + 30
    while not counted_failed(cluster, lost):
        assert time.monotonic() < deadline, "the masters did not count the lost one failed"
        time.sleep(0.1)


def test_regression_a_lost_master_s_blocks_are_lookup_misses_and_a_get_evicts_nothing_for_them(
    daemon_factory, tmp_path, redis_cluster_partial, l3_prefix
):
    """One master of three lost for good (full coverage off: the others serve). The blocks
    held only in L3 on that master were answered as L3 hits by a Lookup (rows confirmed
    within known_s), though a Get of them can only miss (L3 reads none of a lost master's
    keys), and a Get made room for them in a full L1, evicting blocks for nothing. Now the
    Lookup answers them as misses and the other masters' as L3 hits; the Get evicts none of
    L1's blocks."""
    cluster = redis_cluster_partial
    a = node(daemon_factory, tmp_path, "a", cluster, l3_prefix)
    b = daemon_factory(
        "tiers.l1.capacity_bytes=1MiB",  # 32 blocks
        "tiers.l1.segment_bytes=256KiB",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / 'b' / 'l2'}",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=64MiB",
        "tiers.l2.write_policy=write_through",
        "policy.protect_s=0",  # L1's blocks evictable as soon as L2 holds them
        "tiers.l3.enabled=true",
        "tiers.l3.mode=cluster",
        f"tiers.l3.urls=[{', '.join(cluster.urls)}]",
        f"tiers.l3.key_prefix='{l3_prefix}'",
        "tiers.l3.admission=always",
        "tiers.l3.known_s=3600",  # the rows stay confirmed: no probe asks about them again
        "tiers.l3.op_timeout_s=5.0",
        "tiers.l3.connect_timeout_s=0.5",
        "tiers.l3.backoff_initial_s=0.05",
        "tiers.l3.backoff_max_s=0.3",
    )
    shared = keys(32, 1)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        put_written_to_l3(ca, pool.pool_id, shared)
    victim = cluster.nodes[1]
    on_victim = {
        bytes.fromhex(k.rsplit(":", 1)[1])
        for k in victim.cli("--scan", "--pattern", f"{l3_prefix}*").split()
    }
    lost = [i for i, k in enumerate(shared) if k in on_victim]
    assert lost and len(lost) < 32
    with b.client() as cb, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert cb.lookup(shared).tiers == [Tier.L3_REMOTE] * 32
        pool = cb.register_pool(shm, LAYOUT)
        own = keys(32, 2)  # L1 full of b's own blocks, each with an L2 copy
        assert cb.put(pool.pool_id, own, range(32)).prefix_len == 32

        def l3_state() -> str:
            (l3,) = [t for t in cb.stats().tiers if t.tier == Tier.L3_REMOTE]
            return l3.state

        victim.kill()
        wait_counted_failed(cluster, victim)
        deadline = time.monotonic() + 30
        round_ = 0
        while not l3_state().startswith("degraded_io"):
            assert time.monotonic() < deadline, l3_state()
            cb.lookup(keys(8, 1000 + round_))  # misses: probes that meet the lost master
            round_ += 1
            time.sleep(0.05)
        before = cb.stats()
        tiers = cb.lookup(shared).tiers
        assert [i for i, t in enumerate(tiers) if t == Tier.ABSENT] == lost
        # Counted as misses L3 could not be asked about, not as keys never stored.
        after = cb.stats()
        assert [
            after.counter("misses", reason=r) - before.counter("misses", reason=r)
            for r in ("unreachable", "absent")
        ] == [len(lost), 0]
        assert [i for i, t in enumerate(tiers) if t == Tier.L3_REMOTE] == [
            i for i in range(32) if i not in lost
        ]

        deadline = time.monotonic() + 30
        while cb.stats().counter("copies", direction="L1->L2") < 32:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while (l1_now := cb.lookup(own).tiers) != cb.lookup(own).tiers:  # balanced
            assert time.monotonic() < deadline
            time.sleep(0.1)
        l1_before = [i for i, t in enumerate(l1_now) if t == Tier.L1_HOST]
        assert len(l1_before) >= 16
        evictions = cb.stats().counter("evictions", tier="L1")
        lost_keys = [shared[i] for i in lost]
        for _ in range(3):
            assert cb.get(pool.pool_id, lost_keys, range(32, 32 + len(lost))).prefix_len == 0
        assert [i for i, t in enumerate(cb.lookup(own).tiers) if t == Tier.L1_HOST] == l1_before
        assert cb.stats().counter("evictions", tier="L1") == evictions
        # Computed again by the engine and put: stored here (the put answered EXISTS, their
        # rows standing, and stored nothing).
        put = cb.put(pool.pool_id, lost_keys, range(len(lost)))
        assert put.statuses == [PutStatus.STORED] * len(lost)
        assert Tier.ABSENT not in cb.lookup(lost_keys).tiers
