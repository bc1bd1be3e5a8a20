"""Two daemons standing for two nodes, sharing a real Redis as L3: a prefix one node computed is
served by the other, corrupt values are misses, and a Redis that dies mid-workload costs the
nodes their shared tier, never a request."""

from __future__ import annotations

import functools
import re
import sqlite3
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import races
import redis

from kvtier.client import (
    DeadlineExceededError,
    InvalidArgumentError,
    PoolLayout,
    PutStatus,
    ResourceExhaustedError,
    SharedMemoryPool,
    Tier,
)
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

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
        # Lookups wait as long for L3's answers: with the default 50 ms, a loaded machine's
        # probe came back late and the other node's Lookup found none of the blocks there.
        "tiers.l3.probe_deadline_ms=3000",
        *extra,
    )


def token_tenants(tmp_path, *names: str) -> tuple[dict[str, bytes], str]:
    """Tenants by token, one file each: (each tenant's token, the ``tenants=`` setting)."""
    tokens = {}
    for name in names:
        tokens[name] = f"a-long-enough-secret-for-tenant-{name}".encode()
        path = tmp_path / f"{name}.token"
        path.write_bytes(tokens[name])
        path.chmod(0o600)
    listed = ", ".join(f"{{name: {n}, token_file: {tmp_path / f'{n}.token'}}}" for n in tokens)
    return tokens, f"tenants=[{listed}]"


def keys(n: int, tag: int) -> list[bytes]:
    rng = np.random.default_rng(tag)
    return [rng.bytes(32) for _ in range(n)]


# This file's bound before the helper was shared (20 s), kept.
wait_for = functools.partial(races.wait_for, timeout_s=20.0)


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


def test_regression_stats_and_top_showed_l3_as_empty(
    daemon_factory, tmp_path, redis_server, l3_prefix, capsys
):
    # A key-addressed tier tracks no bytes (Stats carries 0 used, 0 capacity): kvtier stats
    # printed "L3_REMOTE  0 B / 0 B (  0.0%)  16 blocks", top "0 B" used of "0 B", as if
    # the tier held nothing while it held 16 blocks.
    from kvtier.cli.main import main

    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix)
    with a.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, keys(16, 60), range(16)).prefix_len == 16
        wait_for(lambda: client.stats().counter("copies", direction="L1->L3") == 16)
    capsys.readouterr()
    assert main(["--address", a.address, "stats"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if re.match(r"\W*L3\s", x)]
    assert "bytes not tracked (the store's own)  16 blocks" in line and "0 B" not in line, line
    assert main(["--address", a.address, "top", "--once", "--interval", "0.1"]) == 0
    (row,) = [x for x in capsys.readouterr().out.splitlines() if re.match(r"\W*L3\s", x)]
    assert "not tracked" in row and "0 B" not in row, row


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


def test_regression_a_get_of_another_layout_broke_blocks_found_in_l3_for_other_clients(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A block a probe found in L3 had no size until the first Get named it, which took its
    pool's block size as a guess. A client of another layout guessed wrong: its read failed,
    and the rows it left (pinned, with no copy, at the wrong size) made every Get of those
    blocks at their real size INVALID_ARGUMENT until a restart, then a Put of them (the
    engine that missed recomputed them) INVALID_ARGUMENT until the lease ended (7307244,
    cba7657). Now the probe sizes each block it finds, so the other layout's Get and Put are
    refused as for any block held here, and nothing they do touches the blocks: another
    client loads them, and stores the rest of their chain, while that client's lease holds
    them."""
    a = node(daemon_factory, tmp_path, "a", fresh_redis.url, l3_prefix)
    b = node(daemon_factory, tmp_path, "b", fresh_redis.url, l3_prefix)
    chain = keys(4, 4)
    other = PoolLayout.staging(num_layers=4, num_pages=8, block_tokens=16, chunk_bytes=8 << 10)
    assert other.block_bytes != LAYOUT.block_bytes
    blocks = np.random.default_rng(5).integers(0, 256, 4 * LAYOUT.block_bytes, dtype=np.uint8)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        shm.array()[: len(blocks)] = blocks
        pool = ca.register_pool(shm, LAYOUT)
        ca.put(pool.pool_id, chain[1:], range(1, 4))
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 3)
    with (
        b.client() as wrong,
        b.client() as cb,
        SharedMemoryPool.for_layout(other) as wrong_shm,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
    ):
        wrong_pool = wrong.register_pool(wrong_shm, other)
        lease = wrong.lookup(chain[1:], pin=True).lease_id
        assert lease
        refused = f"stored with {LAYOUT.block_bytes} bytes"
        with pytest.raises(InvalidArgumentError, match=refused):
            wrong.get(wrong_pool.pool_id, chain[1:], range(3), lease_id=lease)
        with pytest.raises(InvalidArgumentError, match=refused):
            wrong.get(wrong_pool.pool_id, chain[2:3], [0])
        with pytest.raises(InvalidArgumentError, match=refused):
            wrong.put(wrong_pool.pool_id, chain[1:], range(3))
        shm.array()[: len(blocks)] = blocks
        pool = cb.register_pool(shm, LAYOUT)
        put = cb.put(pool.pool_id, chain, range(4))
        assert put.statuses == [PutStatus.STORED] + [PutStatus.EXISTS] * 3
        shm.array()[:] = 0
        assert cb.get(pool.pool_id, chain, range(4)).loaded == [True] * 4
        assert np.array_equal(shm.array()[: len(blocks)], blocks)
        wrong.release(lease)
        assert cb.lookup(chain).prefix_len == 4
        assert cb.check().problems == []


def test_regression_a_pinning_lookup_whose_client_gave_up_during_the_l3_probe_kept_its_pins(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A pinning Lookup whose chain is missing locally waits for the L3 probe; a client that
    gave up meanwhile (its timeout, a hung Redis) never learned the lease the Lookup then
    took, and its blocks stayed pinned until the lease expired (30 s by default), counted
    against the session's and tenant's lease limits: a client retrying on its timeout piled
    up a lease a try. Now such a lease is released at once, as a RegisterPool whose client
    left unregisters its pool: by the daemon where the call's deadline passed first (a bare
    gRPC call here), by the client where the answer came within the call's gRPC deadline,
    which ``ANSWER_GRACE_S`` puts past the caller's time (the client's calls)."""
    # The probe's deadline past the clients' 0.5 s, as node()'s 3 s is, but not by seconds
    # that each Lookup waits out: the daemon reads the call's deadline on its own clock.
    a = node(
        daemon_factory, tmp_path, "a", fresh_redis.url, l3_prefix, "tiers.l3.probe_deadline_ms=1000"
    )
    chain = keys(4, 6)
    with (
        a.client() as client,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
        grpc.insecure_channel(a.address) as channel,
    ):
        pool = client.register_pool(shm, LAYOUT)
        client.put(pool.pool_id, chain[:2], range(2))  # the rest of the chain is probed
        looked_up = client.stats().counters.get("lookup_keys", 0)
        fresh_redis.pause()
        try:
            bare = pb_grpc.KVTierStub(channel).Lookup
            request = pb.LookupRequest(session_id=client.session_id, keys=chain, pin=True)
            for _ in range(3):
                with pytest.raises(DeadlineExceededError):
                    client.lookup(chain, pin=True, timeout_s=0.5)
                with pytest.raises(grpc.RpcError) as e:
                    bare(request, timeout=0.5)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The Lookups run on to their end (the probe's deadline) without their client.
            wait_for(lambda: client.stats().counters.get("lookup_keys", 0) == looked_up + 24)
        finally:
            fresh_redis.resume()
        wait_for(lambda: client.stats().gauges["leases"] == 0)  # the client's Releases
        assert client.stats().gauges["blocks_pinned"] == 0
        assert client.check().problems == []
        assert client.lookup(chain, pin=True).lease_id  # a client that waits gets its lease


def test_regression_a_tenants_pins_and_hints_of_blocks_found_in_l3_held_the_whole_top_tier(
    daemon_factory, tmp_path, redis_server, l3_prefix
):
    """A tenant's pins and hints protect at most its share of the top tier
    (policy.hint_max_share), each block charged its size. A block a probe found in L3 had
    no size until a Get named it: pinned or hinted then, it was charged nothing, and the Get
    that followed promoted it into L1, protected. A tenant that pinned (or hinted) the
    blocks it found there held every slot of L1 and every other tenant's put was
    REJECTED_FULL (e3e335c then left such blocks unpinned and unhinted). The probe now sizes
    them: they are charged as blocks held here, so a tenant pins them up to its share and no
    further, and hints them as far as its budget goes."""
    tokens, tenants = token_tenants(tmp_path, "alice", "bob")
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix, tenants)
    b = node(
        daemon_factory,
        tmp_path,
        "b",
        redis_server.url,
        l3_prefix,
        tenants,
        "policy.protect_s=0",
        "tiers.l2.enabled=false",  # no room below L1 for bob's puts
        "tiers.l1.capacity_bytes=4MiB",  # 128 blocks
        "tiers.l1.segment_bytes=1MiB",
    )
    chain = keys(192, 7)
    with a.client(token=tokens["alice"]) as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        for s in range(0, len(chain), 64):
            ca.put(pool.pool_id, chain[s : s + 64], range(64))
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == len(chain))
    with (
        b.client(token=tokens["alice"]) as alice,
        b.client(token=tokens["bob"]) as bob,
        SharedMemoryPool.for_layout(LAYOUT) as alice_shm,
        SharedMemoryPool.for_layout(LAYOUT) as bob_shm,
    ):
        alice_pool = alice.register_pool(alice_shm, LAYOUT)
        # 64 blocks of 32 KiB are alice's share (half of 4 MiB): the first pin and the first
        # hint fill it, each charged 32 blocks.
        assert LAYOUT.block_bytes == 32 << 10
        for s in range(0, len(chain), 32):
            part = chain[s : s + 32]
            lease = 0
            if s == 0:
                lease = alice.lookup(part, pin=True, lease_ms=60_000).lease_id
                assert lease
            elif s % 64:
                alice.lookup(part)
                alice.prefetch(part, deadline_ms=60_000)
            else:
                with pytest.raises(ResourceExhaustedError, match="hint_max_share"):
                    alice.lookup(part, pin=True, lease_ms=60_000)
            assert alice.get(alice_pool.pool_id, part, range(32), lease_id=lease).prefix_len == 32
        counters = alice.stats().counters
        assert counters["hinted_blocks"] == 32
        assert counters["hints_over_budget_blocks"] == 64
        bob_pool = bob.register_pool(bob_shm, LAYOUT)
        stored = bob.put(bob_pool.pool_id, keys(32, 8), range(32))
        assert stored.statuses == [PutStatus.STORED] * 32
        assert alice.check().problems == []


def test_regression_without_tenants_a_pinning_lookup_of_blocks_found_in_l3_pins_them(
    daemon_factory, tmp_path, redis_server, l3_prefix
):
    """e3e335c stopped pinning and hinting blocks a lookup found only in L3 whose size no
    Get had given yet, everywhere, for a hole of the tenants' hint budget (charged nothing,
    such blocks went into L1 protected past their owner's share). Without tenants there is
    no budget to pass: the vLLM connector's pinning Lookup of such blocks got no lease, and
    the copy in L1 that its worker's Get made was no longer kept for the rest of the load
    (a layer-wise load's later layers then read from L3 again). They are pinned."""
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix)
    b = node(
        daemon_factory,
        tmp_path,
        "b",
        redis_server.url,
        l3_prefix,
        "policy.protect_s=0",
        "tiers.l2.enabled=false",  # no room below L1 for the puts that press on it
        "tiers.l1.capacity_bytes=4MiB",  # 128 blocks
        "tiers.l1.segment_bytes=1MiB",
    )
    chain = keys(32, 12)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        ca.put(pool.pool_id, chain, range(32))
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == len(chain))
    with b.client() as cb, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = cb.register_pool(shm, LAYOUT)
        assert cb.lookup(chain).prefix_len == 32  # probed: in the table, sized
        lease = cb.lookup(chain, pin=True).lease_id
        assert lease
        assert cb.stats().gauges["blocks_pinned"] == 32
        assert cb.get(pool.pool_id, chain, range(32), lease_id=lease).prefix_len == 32
        others = keys(192, 13)
        for s in range(0, len(others), 64):
            cb.put(pool.pool_id, others[s : s + 64], range(64))
        assert cb.lookup(chain).tiers == [Tier.L1_HOST] * 32  # kept in L1 by the lease
        cb.release(lease)
        assert cb.check().problems == []


def test_regression_a_prefetch_left_blocks_found_only_in_l3_there(
    daemon_factory, tmp_path, redis_server, l3_prefix
):
    """README: a Prefetch promotes the blocks held below L1 ahead of use. Blocks a lookup
    found only in L3 had no size until a Get named them, and the promotion skipped them: a
    Prefetch (the vLLM connector's hints of a queued request's hit) scheduled them, counted
    them wasted, and left them in L3 for the Get to wait on. The probe now sizes them: they
    are promoted into L1, and the Get that follows finds them there."""
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix)
    b = node(daemon_factory, tmp_path, "b", redis_server.url, l3_prefix)
    chain = keys(16, 14)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        ca.put(pool.pool_id, chain, range(16))
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == len(chain))
    with b.client() as cb, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert cb.lookup(chain).tiers == [Tier.L3_REMOTE] * 16
        first = cb.prefetch(chain[:8])
        hinted = cb.prefetch(chain[8:], deadline_ms=60_000)
        assert (first.scheduled, hinted.scheduled) == (8, 8)
        wait_for(lambda: cb.lookup(chain).tiers == [Tier.L1_HOST] * 16)
        pool = cb.register_pool(shm, LAYOUT)
        assert cb.get(pool.pool_id, chain, range(16)).loaded == [True] * 16
        counters = cb.stats().counters
        assert counters["prefetch_used"] == 16 and counters["prefetch_wasted"] == 0
        assert counters["hinted_blocks"] == 8
        assert cb.check().problems == []


def test_regression_a_password_rotated_on_the_store_and_in_its_file_left_l3_down_until_a_restart(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """The password file was read once, at start: a store restarted with a new password
    refused every reconnection attempt, and the node served without L3 until the daemon
    restarted, even once the file held the new password (a SIGHUP did not read it either).
    Each reconnection attempt reads the file again."""
    secret = tmp_path / "l3.password"
    secret.write_text("first-Pw\n")
    secret.chmod(0o600)
    fresh_redis.kill()
    fresh_redis.password = "first-Pw"
    fresh_redis.start()
    a = node(
        daemon_factory,
        tmp_path,
        "a",
        fresh_redis.url,
        l3_prefix,
        f"tiers.l3.password_file={secret}",
        "tiers.l3.backoff_max_s=1",
    )
    chain = keys(4, 6)

    def l3_state(client) -> str:
        (l3,) = [t for t in client.stats().tiers if t.tier == Tier.L3_REMOTE]
        return l3.state

    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        fresh_redis.kill()
        fresh_redis.password = "second-Pw"
        fresh_redis.start()
        # The first call after the restart meets the refusal and marks the tier down.
        assert ca.lookup(keys(4, 7)).prefix_len == 0
        assert "AuthenticationError" in l3_state(ca)
        secret.write_text("second-Pw\n")
        wait_for(lambda: l3_state(ca) == "ok")
        assert ca.put(pool.pool_id, chain, range(4)).prefix_len == 4
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 4)
    raw = redis.Redis(host="127.0.0.1", port=fresh_redis.port, password="second-Pw")
    assert len(raw.keys(f"{l3_prefix}*")) == 4


def test_regression_a_start_that_failed_after_binding_left_its_sockets(
    tmp_path, fresh_redis, l3_prefix
):
    """L3 connects after both sockets are bound: a store refusing the password stopped the
    start (exit 1), and the gRPC socket and its credential socket stayed, nobody listening,
    for engines to find. Both go with the failed start."""
    secret = tmp_path / "l3.password"
    secret.write_text("not-the-Pw\n")
    secret.chmod(0o600)
    fresh_redis.kill()
    fresh_redis.password = "the-Pw"
    fresh_redis.start()
    sockets = tmp_path / "run"
    started = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon"]
        + [
            f"--set={setting}"
            for setting in (
                f"server.socket={sockets / 'kvtierd.sock'}",
                "tiers.l1.capacity_bytes=64MiB",
                "tiers.l3.enabled=true",
                f"tiers.l3.urls=[{fresh_redis.url}]",
                f"tiers.l3.key_prefix='{l3_prefix}'",
                f"tiers.l3.password_file={secret}",
            )
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 1, started.stderr
    assert "cannot start" in started.stderr and "refused credentials" in started.stderr
    assert sorted(p.name for p in sockets.iterdir()) == []


def test_regression_a_store_out_of_memory_stopped_the_nodes_l3_writes_for_good(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A store that refused writes for lack of memory paused them for a backoff period, and
    only a write sent after it could end the pause; but the daemon offered L3 no write while
    the tier said degraded_nospace, which it said until such a write went through. So the
    node wrote nothing to L3 again, and L3 stayed degraded, until a restart, however much
    memory the store had since. Once the backoff is over the tier takes writes again."""
    a = node(daemon_factory, tmp_path, "a", fresh_redis.url, l3_prefix, "tiers.l3.backoff_max_s=1")
    raw = redis.Redis(host="127.0.0.1", port=fresh_redis.port)

    def l3_state(client) -> str:
        (l3,) = [t for t in client.stats().tiers if t.tier == Tier.L3_REMOTE]
        return l3.state

    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", str(raw.info("memory")["used_memory"] + (64 << 10)))
        ca.put(pool.pool_id, keys(16, 8), range(16))
        wait_for(lambda: l3_state(ca).startswith("degraded_nospace"))
        raw.config_set("maxmemory", "0")
        chains = iter(range(100, 10_000))

        def puts_reach_l3() -> bool:
            ca.put(pool.pool_id, keys(2, next(chains)), range(2))
            return l3_state(ca) == "ok"

        wait_for(puts_reach_l3)
        chain = keys(4, 9)
        ca.put(pool.pool_id, chain, range(4))
        # Written behind: the chain reaches the store once its copies have run (a count of
        # copies read after the put may already include them).
        wait_for(lambda: all(raw.exists(f"{l3_prefix}0:{k.hex()}") for k in chain))


def l3_blocks(client) -> int:
    (l3,) = [t for t in client.stats().tiers if t.tier == Tier.L3_REMOTE]
    return l3.blocks


def delete_when_not_busy(client, chain: list[bytes]) -> int:
    """Delete ``chain`` again until no block of it is busy (a copy still ending in the
    daemon); how many were deleted in all."""
    deleted = []

    def delete() -> bool:
        out = client.delete(chain)
        deleted.append(out.deleted)
        return out.busy == 0

    wait_for(delete)
    return sum(deleted)


def put_all(client, pool_id: int, chain: list[bytes]) -> None:
    for s in range(0, len(chain), 64):
        part = chain[s : s + 64]
        assert client.put(pool_id, part, range(len(part))).prefix_len == len(part)


def test_regression_blocks_known_only_in_l3_were_kept_after_l3_dropped_them(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A block the node wrote to L3 and then evicted locally kept its row for good (the
    balancer skips L3): once L3 dropped it (here its ttl_s), the node's stats still counted
    it in L3 and a Lookup answered L3_REMOTE for it, a hit the Get then missed. Such a row
    is asked about again by a Lookup once L3 has not confirmed it for known_s (at most ttl_s),
    and forgotten after twice that."""
    a = node(
        daemon_factory,
        tmp_path,
        "a",
        fresh_redis.url,
        l3_prefix,
        "tiers.l2.enabled=false",
        "tiers.l1.capacity_bytes=8MiB",  # 256 blocks
        "tiers.l1.segment_bytes=4MiB",
        "tiers.l3.ttl_s=2",
        "policy.protect_s=0",
        "mover.batch_blocks=64",  # the expired rows are forgotten a batch per pass
    )
    old, new = keys(256, 20), keys(256, 21)
    raw = redis.Redis.from_url(fresh_redis.url)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        put_all(ca, pool.pool_id, old)
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == len(old))
        put_all(ca, pool.pool_id, new)  # presses the old blocks out of L1: only in L3 now
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 512)
        wait_for(lambda: not raw.keys(f"{l3_prefix}*"))  # expired in Redis
        wait_for(lambda: ca.lookup(old).prefix_len == 0)
        in_l1 = sum(t == Tier.L1_HOST for t in ca.lookup(old + new).tiers)

        # Every L3 copy went: the rows held only there, dropped by a lookup's probe or
        # forgotten, and the copies of the blocks also held in L1, which the last lookup's
        # probe (the whole chain past its first miss) found expired too, or which were
        # dropped half ttl_s after L3 last confirmed them. Those blocks, looked up, are
        # written to L3 again: the rows left with an L3 column (each dropped again half
        # ttl_s later: counted again). So the L3 count settles at most at the blocks in L1
        # (it was awaited equal to them, which a loaded machine's writes, spread over more
        # than half of ttl_s, need not ever reach).
        def every_copy_went() -> bool:
            st = ca.stats()
            gone = sum(
                st.counter(name, tier="L3")
                for name in ("copies_lost", "rows_forgotten", "copies_expired")
            )
            return gone >= 512 and l3_blocks(ca) <= in_l1

        wait_for(every_copy_went)
        # Put again, the blocks are written to L3 again and found there by another lookup
        # (once L1 has room: its blocks may still be on their way to L3, not evictable).
        wait_for(lambda: ca.put(pool.pool_id, old[:64], range(64)).prefix_len == 64)
        wait_for(lambda: len(raw.keys(f"{l3_prefix}*")) >= 64)
        assert ca.check().problems == []


@pytest.mark.slow
def test_regression_a_pinned_or_hinted_block_known_only_in_l3_is_kept_until_its_hold_ends(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """Rows held only in L3 that L3 has not confirmed for twice known_s are forgotten, but
    not while a lease pins them or a hint protects them: the engine plans to load them. The
    values are removed from Redis behind the node's back, and no lookup asks L3 about them
    (it would drop them): the node's L3 count shows which rows it kept."""
    a = node(
        daemon_factory,
        tmp_path,
        "a",
        fresh_redis.url,
        l3_prefix,
        "tiers.l2.enabled=false",
        "tiers.l1.capacity_bytes=4MiB",  # 128 blocks
        "tiers.l1.segment_bytes=1MiB",
        "tiers.l3.ttl_s=0",
        "tiers.l3.known_s=1",
        "policy.protect_s=0",
    )
    chain, later, filler = keys(16, 22), keys(4, 23), keys(128, 24)
    raw = redis.Redis.from_url(fresh_redis.url)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        put_all(ca, pool.pool_id, chain)
        put_all(ca, pool.pool_id, later)  # confirmed in L3 after the chain
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 20)
        assert ca.evict(chain + later, Tier.L1_HOST).evicted == 20  # only in L3 now
        # L1 full of pinned blocks: the hinted blocks' promotion finds no room.
        leases = []
        for s in range(0, len(filler), 64):
            put_all(ca, pool.pool_id, filler[s : s + 64])
            leases.append(ca.lookup(filler[s : s + 64], pin=True).lease_id)
        lease = ca.lookup(chain[:4], pin=True).lease_id
        assert lease
        ca.prefetch(chain[4:8], deadline_ms=20_000)  # a hint
        for k in chain[:8]:
            (name,) = raw.keys(f"{l3_prefix}*{k.hex()}")
            raw.delete(name)
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 148)
        # Forgotten: the chain's unheld blocks, and the later ones, so every held block
        # was old enough at a sweep since.
        wait_for(lambda: ca.stats().counter("rows_forgotten", tier="L3") == 12)
        assert l3_blocks(ca) == 8 + len(filler)  # kept, and the blocks also held in L1
        ca.release(lease)
        wait_for(lambda: l3_blocks(ca) == 4 + len(filler))
        wait_for(lambda: l3_blocks(ca) == len(filler), timeout_s=60)
        assert ca.stats().counter("rows_forgotten", tier="L3") == 20
        assert ca.lookup(chain[:8]).prefix_len == 0
        for held in leases:
            ca.release(held)
        assert ca.check().problems == []


def only_in_l3_node(
    daemon_factory,
    tmp_path,
    fresh_redis,
    l3_prefix,
    protect_s: int,
    known_s: int = 1,
    ttl_s: int = 0,
    probe_deadline_ms: int = 3000,
):
    """A node without L2 whose L3 confirmations last ``known_s``, with ``protect_s`` and
    L3's ``ttl_s``. Its lookups wait ``probe_deadline_ms`` for L3's answers: generous, as
    a loaded machine's probe could miss the default 50 ms, answered absent."""
    return node(
        daemon_factory,
        tmp_path,
        "a",
        fresh_redis.url,
        l3_prefix,
        "tiers.l2.enabled=false",
        f"tiers.l3.ttl_s={ttl_s}",
        f"tiers.l3.known_s={known_s}",
        f"policy.protect_s={protect_s}",
        f"tiers.l3.probe_deadline_ms={probe_deadline_ms}",
    )


def put_only_in_l3(ca, shm, chain: list[bytes], seed: int):
    """Random bytes in ``shm``'s pool, ``chain`` put from its first pages, written behind to
    L3 and evicted from L1 (once the put's protection ends): held only in L3. Returns the
    pool id, the pool's array and a copy of the bytes put."""
    data = shm.array()
    data[:] = np.random.default_rng(seed).integers(0, 256, len(data), dtype=np.uint8)
    want = data.copy()
    pool_id = ca.register_pool(shm, LAYOUT).pool_id
    put_all(ca, pool_id, chain)
    wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == len(chain))
    evicted = []

    def evict() -> bool:
        out = ca.evict(chain, Tier.L1_HOST)
        evicted.append(out.evicted)
        return out.busy == 0

    wait_for(evict)
    assert sum(evicted) == len(chain)
    return pool_id, data, want


def test_regression_a_stop_drained_for_twice_server_drain_timeout_s(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """The stop gave requests server.drain_timeout_s twice: gRPC's grace to the calls in
    progress, then as long again to the requests whose clients had left, before the flush's
    own tiers.l2.flush_timeout_s (10 + 10 + 60 s by default, against the unit's 90 s, below
    which README keeps drain plus flush). Here two Gets read blocks held only in L3 from a
    Redis that no longer answers, one whose client gives up after 1 s, one that holds the
    grace: the first one's read timed out (L3 marked unreachable) 7 s after it began, within
    twice the 4 s drain; it is cancelled once one has passed."""
    a = node(
        daemon_factory,
        tmp_path,
        "a",
        fresh_redis.url,
        l3_prefix,
        "tiers.l2.enabled=false",
        "policy.protect_s=0",
        "tiers.l3.known_s=3600",
        "tiers.l3.op_timeout_s=7",
        "server.drain_timeout_s=4",
    )
    chain = keys(4, 81)
    ended: list[Exception] = []

    def get(client, pool_id: int, timeout_s: float) -> None:
        try:
            client.get(pool_id, chain, range(4), timeout_s=timeout_s)
        except Exception as e:  # the deadline or the stop ends the call
            ended.append(e)

    with (
        a.client() as ca,
        a.client() as cb,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
        SharedMemoryPool.for_layout(LAYOUT) as shm_b,
    ):
        pool_id, _, _ = put_only_in_l3(ca, shm, chain, seed=81)
        pool_b = cb.register_pool(shm_b, LAYOUT).pool_id
        fresh_redis.pause()
        left = threading.Thread(target=get, args=(ca, pool_id, 1.0))
        held = threading.Thread(target=get, args=(cb, pool_b, 60.0))
        left.start()
        held.start()
        left.join(30)
        assert len(ended) == 1, ended  # its client gave up; the daemon's Get runs on
        assert a.stop() == 0
        held.join(30)
    assert len(ended) == 2, ended
    assert "kvtierd stopped" in a.log()
    assert "L3 unreachable" not in a.log(), a.log()


def test_a_block_forgotten_while_still_in_l3_is_found_again_and_loads_byte_exact(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    a = only_in_l3_node(daemon_factory, tmp_path, fresh_redis, l3_prefix, protect_s=0)
    chain = keys(16, 24)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool_id, data, want = put_only_in_l3(ca, shm, chain, 25)
        wait_for(lambda: ca.stats().counter("rows_forgotten", tier="L3") == 16)
        assert l3_blocks(ca) == 0
        found = ca.lookup(chain, pin=True)  # probes L3 again
        assert found.tiers == [Tier.L3_REMOTE] * 16 and found.lease_id
        data[:] = 0
        got = ca.get(pool_id, chain, range(32, 48), lease_id=found.lease_id)
        assert got.loaded == [True] * 16
        bb = LAYOUT.block_bytes
        for i in range(16):
            assert np.array_equal(data[(32 + i) * bb : (33 + i) * bb], want[i * bb : (i + 1) * bb])
        ca.release(found.lease_id)
        assert ca.check().problems == []


@pytest.mark.slow
def test_regression_a_block_known_only_in_l3_was_forgotten_while_lookups_used_it(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """The sweep forgot a row unconfirmed by L3 for known_s even while Lookups kept answering
    it, and a Get after such a Lookup missed a block still in Redis (a Get does not probe L3).
    The sweep takes what an eviction would: a row a request used within the protection
    period stays; once unused it goes as before."""
    a = only_in_l3_node(daemon_factory, tmp_path, fresh_redis, l3_prefix, protect_s=1)
    chain = keys(16, 27)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool_id, data, want = put_only_in_l3(ca, shm, chain, 27)
        # Looked up every 0.1 s for three known_s (the sweep runs every quarter of it).
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            assert ca.lookup(chain).tiers == [Tier.L3_REMOTE] * 16
            time.sleep(0.1)
        assert ca.stats().counter("rows_forgotten", tier="L3") == 0
        data[:] = 0
        assert ca.get(pool_id, chain, range(32, 48)).loaded == [True] * 16
        bb = LAYOUT.block_bytes
        assert np.array_equal(data[32 * bb : 48 * bb], want[: 16 * bb])
        # The Get confirmed them; unused from now on, they go.
        wait_for(lambda: ca.evict(chain, Tier.L1_HOST).busy == 0)
        wait_for(lambda: ca.stats().counter("rows_forgotten", tier="L3") == 16)


def test_regression_a_get_while_l3_did_not_answer_forgot_the_blocks_it_still_held(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A read of L3 told the daemon only read or not per block, so a read that timed out
    (Redis hung) dropped the node's record of the blocks' L3 copies as if Redis had lost
    them: during an outage every Get of a block held only there forgot it. Such a Get now
    misses, counted as L3 read errors, and the blocks stay known there: once Redis answers
    again the next Get reads them (no Lookup needed to find them again). A block deleted from
    Redis behind the node's back is still forgotten by the Get that misses it."""
    a = node(
        daemon_factory,
        tmp_path,
        "a",
        fresh_redis.url,
        l3_prefix,
        "tiers.l2.enabled=false",
        "policy.protect_s=0",
        "tiers.l3.known_s=3600",
        "tiers.l3.op_timeout_s=1",
        "tiers.l3.backoff_max_s=1",
        "policy.readahead_blocks=0",  # a Get reads only what it names
    )
    chain = keys(6, 56)
    raw = redis.Redis.from_url(fresh_redis.url)
    bb = LAYOUT.block_bytes
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool_id, data, want = put_only_in_l3(ca, shm, chain, 56)
        assert l3_blocks(ca) == 6
        fresh_redis.pause()
        try:
            assert ca.get(pool_id, chain[:4], range(32, 36)).loaded == [False] * 4
            stats = ca.stats()
            assert stats.counter("copies_lost", tier="L3") == 0
            assert l3_blocks(ca) == 6
            assert stats.counter("l3_read_errors") == 4
            # L3 is down: a Lookup answers its blocks as misses (a Get of them could only
            # miss), the records kept.
            assert ca.lookup(chain).prefix_len == 0
            assert l3_blocks(ca) == 6
        finally:
            fresh_redis.resume()

        def l3_ok() -> bool:
            (l3,) = [t for t in ca.stats().tiers if t.tier == Tier.L3_REMOTE]
            return l3.state == "ok"

        wait_for(l3_ok)
        assert ca.lookup(chain).prefix_len == 6
        data[:] = 0
        assert ca.get(pool_id, chain[:4], range(32, 36)).loaded == [True] * 4
        assert np.array_equal(data[32 * bb : 36 * bb], want[: 4 * bb])
        raw.delete(l3_key(raw, l3_prefix, chain[4]))
        assert ca.get(pool_id, chain[4:5], range(36, 37)).loaded == [False]
        assert ca.stats().counter("copies_lost", tier="L3") == 1
        assert l3_blocks(ca) == 5
        assert ca.lookup(chain[4:]).prefix_len == 0
        assert ca.check().problems == []


def l3_key(raw, prefix: str, key: bytes) -> bytes:
    (name,) = raw.keys(f"{prefix}*{key.hex()}")
    return name


def test_regression_a_block_l3_dropped_answered_l3_hits_while_lookups_kept_using_it(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A row held only in L3 answered L3_REMOTE for as long as Lookups kept using it (the
    sweep keeps rows a request used within protect_s) though Redis no longer had the block: a
    hit the engine planned a load on, until a Get's read failed. A Lookup asks L3 again about
    the rows of its chain it has not confirmed for known_s: a block Redis dropped is missing
    from then on (the first such ends the prefix) and leaves the node's L3 count; the others
    are confirmed and load byte-exact."""
    # Rows unconfirmed for 4 s are forgotten: well after the first lookup comes.
    a = only_in_l3_node(daemon_factory, tmp_path, fresh_redis, l3_prefix, protect_s=1, known_s=2)
    chain = keys(16, 28)
    raw = redis.Redis.from_url(fresh_redis.url)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool_id, data, want = put_only_in_l3(ca, shm, chain, 28)
        assert l3_blocks(ca) == 16
        gone = [8, 12, 13, 14, 15]
        raw.delete(*[l3_key(raw, l3_prefix, chain[i]) for i in gone])

        def asked_again() -> bool:
            found = ca.lookup(chain)
            assert found.tiers[:8] == [Tier.L3_REMOTE] * 8
            return found.prefix_len == 8

        wait_for(asked_again)
        kept = [Tier.L3_REMOTE] * 8 + [0] + [Tier.L3_REMOTE] * 3 + [0] * 4
        assert ca.lookup(chain).tiers == kept
        assert l3_blocks(ca) == 11
        assert ca.stats().counter("copies_lost", tier="L3") == 5
        data[:] = 0
        assert ca.get(pool_id, chain[:8], range(32, 40)).loaded == [True] * 8
        bb = LAYOUT.block_bytes
        assert np.array_equal(data[32 * bb : 40 * bb], want[: 8 * bb])
        assert ca.check().problems == []


def test_a_lookup_whose_l3_probe_is_late_keeps_every_row(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A Lookup asks L3 about the rows it has not confirmed for known_s; an answer that comes
    after probe_deadline_ms tells nothing: the rows answer as before. Once L3 answers again,
    the rows whose blocks it dropped go."""
    a = only_in_l3_node(
        daemon_factory,
        tmp_path,
        fresh_redis,
        l3_prefix,
        protect_s=1,
        known_s=2,
        probe_deadline_ms=50,
    )
    chain = keys(16, 29)
    raw = redis.Redis.from_url(fresh_redis.url)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        put_only_in_l3(ca, shm, chain, 29)
        raw.delete(*[l3_key(raw, l3_prefix, k) for k in chain[8:]])
        late = ca.stats().counter("l3_probe_late")
        fresh_redis.pause()
        try:
            # Every lookup's probe once the rows are unconfirmed for known_s is late (the
            # deadline is 50 ms), and the lookups keep the rows from the sweep.
            def answered_as_before() -> bool:
                assert ca.lookup(chain).tiers == [Tier.L3_REMOTE] * 16
                return ca.stats().counter("l3_probe_late") >= late + 3

            wait_for(answered_as_before)
        finally:
            fresh_redis.resume()
        assert l3_blocks(ca) == 16
        assert ca.stats().counter("copies_lost", tier="L3") == 0
        wait_for(lambda: ca.lookup(chain).prefix_len == 8)
        assert l3_blocks(ca) == 8
        assert ca.check().problems == []


def test_regression_a_known_s_lowered_at_sighup_applied_only_after_the_old_quarter(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """known_s is live at SIGHUP, but the sweep's next run was fixed at the last one plus a
    quarter of the old known_s: lowered from an hour, it forgot nothing for 15 minutes."""
    import signal

    from harness import DaemonProcess

    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  l3:\n    known_s: 3600\n")
    overrides = [
        "tiers.l2.enabled=false",
        "tiers.l3.enabled=true",
        f"tiers.l3.urls=[{fresh_redis.url}]",
        f"tiers.l3.key_prefix='{l3_prefix}'",
        "tiers.l3.admission=always",
        "tiers.l3.ttl_s=0",
        "policy.protect_s=0",
    ]
    sets = [arg for o in overrides for arg in ("--set", o)]
    a = DaemonProcess(
        tmp_path, f"{daemon_factory._sockdir}/known.sock", ["--config", str(path), *sets]
    )
    daemon_factory._daemons.append(a)
    a.start()
    chain = keys(16, 26)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        put_all(ca, pool.pool_id, chain)
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == len(chain))
        assert ca.evict(chain, Tier.L1_HOST).evicted == 16
        time.sleep(0.5)  # balancer passes (0.1 s apart): the sweep ran, its next run set
        path.write_text("tiers:\n  l3:\n    known_s: 1\n")
        a.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: ca.stats().counter("rows_forgotten", tier="L3") == 16)
        assert l3_blocks(ca) == 0
        assert ca.check().problems == []


def test_regression_a_delete_the_store_could_not_apply_came_back_through_the_next_lookup(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A Delete whose UNLINKs the store did not carry out (down, or refused) left the blocks
    in Redis, and the next Lookup's probe found them again: a deleted block served. Until the
    store confirms the removal the node answers those keys absent, and it sends the removal
    again once the store takes it."""
    a = only_in_l3_node(daemon_factory, tmp_path, fresh_redis, l3_prefix, protect_s=0)
    chain = keys(16, 30)
    raw = redis.Redis.from_url(fresh_redis.url)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        put_only_in_l3(ca, shm, chain, 31)
        assert len(raw.keys(f"{l3_prefix}*")) == 16
        raw.execute_command("ACL", "SETUSER", "default", "-unlink")
        try:
            assert ca.delete(chain[8:]).deleted == 8
            assert len(raw.keys(f"{l3_prefix}*")) == 16  # the store kept them
            found = ca.lookup(chain)
            assert found.tiers == [Tier.L3_REMOTE] * 8 + [Tier.ABSENT] * 8
            assert ca.lookup(chain[8:]).prefix_len == 0
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
        assert ca.delete(keys(1, 32)).missing == 1  # accepted: the refused ones go too
        wait_for(lambda: len(raw.keys(f"{l3_prefix}*")) == 8)
        assert ca.lookup(chain[8:]).prefix_len == 0
        assert ca.lookup(chain).prefix_len == 8
        assert ca.check().problems == []


@pytest.mark.parametrize("kept_in", ["l2", "removals_file"])
def test_regression_a_delete_the_store_had_not_applied_came_back_after_a_crash(
    daemon_factory, tmp_path, fresh_redis, l3_prefix, kept_in
):
    """The removals the store had not confirmed were remembered in memory only: after a
    restart (here a SIGKILL right after the Delete answered) the next Lookup found the deleted
    blocks in Redis again. They are kept in L2's index, or without L2 in
    ``tiers.l3.removals_file``: the restart answers them absent and sends the UNLINKs again;
    a key put again after its Delete is neither kept nor deleted by the restart."""
    if kept_in == "l2":
        journal = tmp_path / "a" / "l2" / "index.sqlite3"
        a = node(daemon_factory, tmp_path, "a", fresh_redis.url, l3_prefix)
    else:
        journal = tmp_path / "removals.sqlite3"
        a = node(
            daemon_factory,
            tmp_path,
            "a",
            fresh_redis.url,
            l3_prefix,
            "tiers.l2.enabled=false",
            f"tiers.l3.removals_file={journal}",
        )
    chain = keys(8, 33)
    raw = redis.Redis.from_url(fresh_redis.url)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool_id = ca.register_pool(shm, LAYOUT).pool_id
        put_all(ca, pool_id, chain)
        wait_for(lambda: len(raw.keys(f"{l3_prefix}*")) == 8)
        raw.execute_command("ACL", "SETUSER", "default", "-unlink")
        try:
            # The L3 copies reached Redis, yet a copy may still be ending in the daemon
            # (busy to a Delete): deleted once none is.
            assert delete_when_not_busy(ca, chain[4:]) == 4
            # Put again after its Delete: no longer a removal, and written to L3 again.
            before = ca.stats().counter("copies", direction="L1->L3")
            assert ca.put(pool_id, chain[7:], [7]).prefix_len == 1
            wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == before + 1)
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
    a.kill()
    assert len(raw.keys(f"{l3_prefix}*")) == 8  # the store kept them
    a.start()
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert ca.lookup(chain[4:7]).prefix_len == 0
        wait_for(lambda: len(raw.keys(f"{l3_prefix}*")) == 5)
        assert ca.lookup(chain[4:7]).prefix_len == 0
        assert ca.lookup(chain[7:]).prefix_len == 1
        assert ca.lookup(chain[:4]).prefix_len == 4  # from L3: only L1 held them
        pool_id = ca.register_pool(shm, LAYOUT).pool_id
        assert ca.get(pool_id, chain[:4], range(4)).loaded == [True] * 4
        assert ca.check().problems == []
    a.stop()
    # Confirmed: out of the journal too, so the next start has nothing to send again.
    index = sqlite3.connect(journal)
    try:
        assert index.execute("SELECT COUNT(*) FROM l3_removals").fetchone() == (0,)
    finally:
        index.close()


def test_regression_removals_kept_in_l2_were_lost_or_came_back_when_removals_file_was_set(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A node with L2 kept its unconfirmed removals in L2's index; restarted with
    ``tiers.l3.removals_file`` set, it read only the file: the deleted block was found in L3
    again. And the entry stayed in L2's index: once the key was put again (its value written
    to L3) and the node restarted with the file unset again, it took that stale entry up and
    sent the key's UNLINK again, deleting the value put since. The start moves L2's entries
    into the file."""
    removals_file = f"tiers.l3.removals_file={tmp_path / 'removals.sqlite3'}"
    a = node(daemon_factory, tmp_path, "a", fresh_redis.url, l3_prefix)
    chain = keys(8, 34)
    raw = redis.Redis.from_url(fresh_redis.url)
    try:
        with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
            put_all(ca, ca.register_pool(shm, LAYOUT).pool_id, chain)
            wait_for(lambda: len(raw.keys(f"{l3_prefix}*")) == 8)
            raw.execute_command("ACL", "SETUSER", "default", "-unlink")
            # The copy reached Redis, yet may still be ending in the daemon (busy to a
            # Delete): deleted once it is not. Its UNLINK is refused: kept in L2's index.
            assert delete_when_not_busy(ca, chain[7:]) == 1
        a.stop()
        a.overrides += ["--set", removals_file]
        a.start()
        with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
            assert ca.lookup(chain[7:]).prefix_len == 0
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
            before = ca.stats().counter("copies", direction="L1->L3")
            assert ca.put(ca.register_pool(shm, LAYOUT).pool_id, chain[7:], [7]).prefix_len == 1
            wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == before + 1)
        a.stop()
        del a.overrides[-2:]
        a.start()
        with a.client() as ca:
            assert ca.lookup(chain[7:]).prefix_len == 1
            assert ca.stats().counters["l3_remove_retried"] == 0  # nothing taken up
        assert len(raw.keys(f"{l3_prefix}*")) == 8
    finally:
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")


@pytest.mark.slow
def test_regression_a_block_held_here_kept_an_l3_copy_that_had_expired_and_was_never_written_again(
    daemon_factory, tmp_path, fresh_redis, l3_prefix
):
    """A block also held locally is read locally, so nothing confirmed its L3 copy again: once
    the copy expired in Redis (ttl_s), the node still counted it, never wrote the block there
    again (L3's admission writes blocks without a copy there), and other nodes lost it for
    as long as this one kept it. The copy is dropped from the table half of ttl_s after it
    was written, and the next access writes the block there again."""
    a = only_in_l3_node(daemon_factory, tmp_path, fresh_redis, l3_prefix, protect_s=0, ttl_s=4)
    chain = keys(16, 40)
    raw = redis.Redis.from_url(fresh_redis.url)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        data = shm.array()
        data[:] = np.random.default_rng(41).integers(0, 256, len(data), dtype=np.uint8)
        want = data.copy()
        pool_id = ca.register_pool(shm, LAYOUT).pool_id
        put_all(ca, pool_id, chain)
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 16)
        assert l3_blocks(ca) == 16
        wait_for(lambda: ca.stats().counter("copies_expired", tier="L3") == 16)
        assert l3_blocks(ca) == 0  # counted out, though still held in L1
        assert ca.lookup(chain).tiers == [Tier.L1_HOST] * 16
        wait_for(lambda: not raw.keys(f"{l3_prefix}*"))  # expired in Redis meanwhile
        data[:] = 0
        assert ca.get(pool_id, chain, range(16, 32)).loaded == [True] * 16
        bb = LAYOUT.block_bytes
        assert np.array_equal(data[16 * bb : 32 * bb], want[: 16 * bb])
        # Read here, and written to L3 again with a fresh expiry.
        wait_for(lambda: len(raw.keys(f"{l3_prefix}*")) == 16)
        wait_for(lambda: l3_blocks(ca) == 16)


def test_regression_a_copy_from_l3_to_l2_wrote_the_blocks_l3_could_not_read(
    daemon_factory, tmp_path, redis_server, l3_prefix
):
    """A copy from L3 to L2 (here a durable put of blocks held only in L3) stages the values
    in fresh host buffers, and wrote every buffer to L2, also those whose read had failed:
    their buffers held whatever the memory held before (seen: freed Redis command buffers),
    and L2 stored and indexed those bytes with their own checksum. The copy failed and the
    slots were freed again, but a crash in between left rows that the next start served as
    the blocks (wrong bytes, found in a SIGKILL loop). Blocks not read are not written."""
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix, "policy.protect_s=0")
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    chain = keys(4, 40)
    with a.client() as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        ca.put(pool.pool_id, chain, range(4))
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 4)
        assert ca.evict(chain, Tier.L1_HOST).evicted == 4
        assert ca.evict(chain, Tier.L2_DISK).evicted == 4
        assert ca.lookup(chain).tiers == [Tier.L3_REMOTE] * 4
        for k in raw.keys(f"{l3_prefix}*"):
            value = bytearray(raw.get(k))
            value[-1] ^= 0xFF
            raw.set(k, bytes(value))
        written = ca.stats().counters["l2_committed_blocks"]
        assert ca.put(pool.pool_id, chain, range(4), durable=True).persisted == [False] * 4
        assert ca.stats().counters["l2_committed_blocks"] == written
        assert ca.stats().counters["l3_read_bad_checksum"] == 4
        assert ca.check().problems == []


def test_regression_blocks_a_tenant_found_in_l3_and_kept_on_disk_lost_their_tenant_at_a_restart(
    daemon_factory, tmp_path, redis_server, l3_prefix
):
    """Blocks a lookup finds in L3 join the table as the tenant's, but only a put recorded
    the namespace's tenant on the disk tier: blocks of another node's that a tenant loaded
    here and that went down to L2 (never put on this node) came back at the next start with
    no tenant, counted to 'default' (a tenant's name the config allows): off their tenant's
    usage and quota, and on another's. The lookup that brings them in records it."""
    tokens, tenants = token_tenants(tmp_path, "alice", "bob")
    a = node(daemon_factory, tmp_path, "a", redis_server.url, l3_prefix, tenants)
    b = node(
        daemon_factory, tmp_path, "b", redis_server.url, l3_prefix, tenants, "policy.protect_s=0"
    )
    chain = keys(8, 60)
    with a.client(token=tokens["alice"]) as ca, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = ca.register_pool(shm, LAYOUT)
        assert ca.put(pool.pool_id, chain, range(8)).prefix_len == 8
        wait_for(lambda: ca.stats().counter("copies", direction="L1->L3") == 8)
    with b.client(token=tokens["alice"]) as cb, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = cb.register_pool(shm, LAYOUT)
        assert cb.lookup(chain).tiers == [Tier.L3_REMOTE] * 8
        assert cb.get(pool.pool_id, chain, range(8)).prefix_len == 8
        assert cb.evict(chain, Tier.L1_HOST).evicted == 8
        assert cb.lookup(chain).tiers == [Tier.L2_DISK] * 8
    b.restart()

    def l2_blocks(stats) -> dict[str, int]:
        return {
            t.tenant: u.blocks
            for t in stats.tenants
            for u in t.tiers
            if u.tier == Tier.L2_DISK and u.blocks
        }

    with b.client(token=tokens["alice"]) as cb:
        assert cb.lookup(chain).tiers == [Tier.L2_DISK] * 8
        assert l2_blocks(cb.stats()) == {"alice": 8}
