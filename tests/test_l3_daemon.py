"""Two daemons standing for two nodes, sharing a real Redis as L3: a prefix one node computed is
served by the other, corrupt values are misses, and a Redis that dies mid-workload costs the
nodes their shared tier, never a request."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from kvtier.client import DeadlineExceededError, PoolLayout, SharedMemoryPool, Tier

LAYOUT = PoolLayout.staging(num_layers=2, num_pages=64, block_tokens=16, chunk_bytes=8 << 10)


def node(daemon_factory, tmp_path, name: str, url: str, prefix: str, *extra: str):
    return daemon_factory(
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / name / 'l2'}",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=64MiB",
        "tiers.l3.enabled=true",
        f"tiers.l3.urls=[{url}]",
        f"tiers.l3.key_prefix='{prefix}'",
        "tiers.l3.admission=always",
        # Generous, below the clients' 30 s: with 0.5 s a loaded machine's L3 reads timed
        # out and came back as misses. The Redis killed below refuses at once.
        "tiers.l3.op_timeout_s=10",
        "tiers.l3.connect_timeout_s=10",
        *extra,
    )


def keys(n: int, tag: int) -> list[bytes]:
    rng = np.random.default_rng(tag)
    return [rng.bytes(32) for _ in range(n)]


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_prefix_stored_by_one_node_is_served_by_another(
    daemon_factory, tmp_path, redis_server, l3_prefix
):
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix)
    b = node(daemon_factory, tmp_path, "b", redis_server.url, l3_prefix)
    chain = keys(16, 1)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        data = shm.array()
        data[:] = np.random.default_rng(2).integers(0, 256, len(data), dtype=np.uint8)
        want = data.copy()
        pool = ca.register_pool(shm, LAYOUT)
        assert ca.put(pool.pool_id, chain, range(16)).prefix_len == 16
        # Written behind to L3, off the Put's path.
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 16)
    with b.client() as cb, SharedMemoryPool.for_layout(LAYOUT) as shm:
        found = cb.lookup(chain)
        assert found.prefix_len == 16 and found.tiers == [Tier.L3_REMOTE] * 16
        pool = cb.register_pool(shm, LAYOUT)
        assert cb.get(pool.pool_id, chain, range(32, 48)).loaded == [True] * 16
        bb = LAYOUT.block_bytes
        got = shm.array()
        for i in range(16):
            assert np.array_equal(got[(32 + i) * bb : (33 + i) * bb], want[i * bb : (i + 1) * bb])
        assert (
            cb.stats().counter("loaded_from", tier="L3")
            + cb.stats().counter("copies", direction="L3->L1")
            >= 16
        )


def test_a_corrupt_value_in_redis_is_a_miss(daemon_factory, tmp_path, redis_server, l3_prefix):
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix)
    b = node(daemon_factory, tmp_path, "b", redis_server.url, l3_prefix)
    chain = keys(4, 3)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        ca.put(pool.pool_id, chain, range(4))
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 4)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    (victim,) = [k for k in raw.keys(f"{l3_prefix}*") if k.decode().endswith(chain[2].hex())]
    value = bytearray(raw.get(victim))
    value[-1] ^= 0xFF
    raw.set(victim, bytes(value))
    with b.client() as cb, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = cb.register_pool(shm, LAYOUT)
        assert cb.lookup(chain).prefix_len == 4  # present, as far as a probe can tell
        assert cb.get(pool.pool_id, chain, range(4)).loaded == [True, True, False, True]
        assert cb.stats().counters["l3_read_bad_checksum"] >= 1


def test_redis_dying_mid_workload_fails_no_request(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    a = node(daemon_factory, tmp_path, "a", fresh_redis.url, l3_prefix)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        for round_ in range(6):
            if round_ == 3:
                fresh_redis.kill()
            ks = keys(8, 100 + round_)
            assert ca.put(pool.pool_id, ks, range(8)).prefix_len == 8
            assert ca.lookup(ks).prefix_len == 8
            assert ca.get(pool.pool_id, ks, range(8, 16)).prefix_len == 8
            assert ca.lookup(keys(4, 999)).prefix_len == 0  # a miss probes L3: still answered
        (l3,) = [t for t in ca.stats().tiers if t.tier == Tier.L3_REMOTE]
        assert l3.state.startswith("down")


def test_regression_a_get_of_another_layout_left_blocks_found_in_l3_unloadable_at_their_size(
    daemon_factory, tmp_path, redis_server, l3_prefix
):
    """A block a probe finds in L3 takes the size of the first Get that names it (the probe
    cannot tell it). A client of another layout guessed wrong: its read failed, a miss, and
    the block, pinned by its lease, stayed in the table with no copy and that size. A
    lookup of a chain whose earlier key was missing probed L3 again and gave the row its L3
    copy back under the wrong size, so every Get of the block at its real size was
    INVALID_ARGUMENT ("stored with 65536 bytes"), also after the lease ended, until the
    daemon restarted; during the lease, a Get naming it was INVALID_ARGUMENT, not a miss."""
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix)
    b = node(daemon_factory, tmp_path, "b", redis_server.url, l3_prefix)
    chain = keys(4, 4)
    other = PoolLayout.staging(num_layers=4, num_pages=8, block_tokens=16, chunk_bytes=8 << 10)
    assert other.block_bytes != LAYOUT.block_bytes
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        data = shm.array()
        data[:] = np.random.default_rng(5).integers(0, 256, len(data), dtype=np.uint8)
        want = data[: 4 * LAYOUT.block_bytes].copy()
        pool = ca.register_pool(shm, LAYOUT)
        ca.put(pool.pool_id, chain, range(4))
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 4)
    with (
        b.client() as wrong,
        b.client() as cb,
        SharedMemoryPool.for_layout(other) as wrong_shm,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
    ):
        wrong_pool = wrong.register_pool(wrong_shm, other)
        lease = wrong.lookup(chain[1:], pin=True).lease_id
        missed = wrong.get(wrong_pool.pool_id, chain[1:], range(3), lease_id=lease)
        assert missed.loaded == [False] * 3  # the read of another size fails: a miss
        pool = cb.register_pool(shm, LAYOUT)
        # Pinned with no copy left: a miss.
        assert cb.get(pool.pool_id, chain[1:], range(1, 4)).loaded == [False] * 3
        assert cb.lookup(chain).prefix_len == 4  # chain[0] is missing here: L3 is probed
        wrong.release(lease)
        got = cb.get(pool.pool_id, chain, range(4))
        assert got.loaded == [True] * 4
        assert np.array_equal(shm.array()[: 4 * LAYOUT.block_bytes], want)
        assert cb.check().problems == []


def test_regression_a_pinning_lookup_whose_client_gave_up_during_the_l3_probe_kept_its_pins(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A pinning Lookup whose chain is missing locally waits for the L3 probe; a client that
    gave up meanwhile (its timeout, a hung Redis) never learned the lease the Lookup then
    took, and its blocks stayed pinned until the lease expired (30 s by default), counted
    against the session's and tenant's lease limits: a client retrying on its timeout piled
    up a lease a try. Now such a lease is released at once, as a RegisterPool whose client
    left unregisters its pool."""
    a = node(
        daemon_factory, tmp_path, "a", fresh_redis.url, l3_prefix, "tiers.l3.probe_deadline_ms=3000"
    )
    chain = keys(4, 6)
    with a.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        client.put(pool.pool_id, chain[:2], range(2))  # the rest of the chain is probed
        looked_up = client.stats().counters.get("lookup_keys", 0)
        fresh_redis.pause()
        try:
            for _ in range(3):
                with pytest.raises(DeadlineExceededError):
                    client.lookup(chain, pin=True, timeout_s=0.5)
            # The Lookups run on to their end (the probe's deadline) without their client.
            wait_for(lambda: client.stats().counters.get("lookup_keys", 0) == looked_up + 12)
        finally:
            fresh_redis.resume()
        gauges = client.stats().gauges
        assert gauges["leases"] == 0 and gauges["blocks_pinned"] == 0
        assert client.check().problems == []
        assert client.lookup(chain, pin=True).lease_id  # a client that waits gets its lease
