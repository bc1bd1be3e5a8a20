"""The L3 tier against a real 3-master Redis Cluster: blocks spread over every master, slot
migration (ASK while a slot moves, MOVED after) followed mid-workload, and a master killed
mid-workload: calls fail fast as misses, the tier comes back with the master (empty); the
whole cluster restarted, Deletes while it is down, one master out of memory. With a replica
per master: failover to the replica and back under traffic, and a master back without its
replica. Without full coverage: a master lost for good, the others served. A master just
killed, before the others count it failed: the others served from the first call; started
again a moment later, it serves again at one of the lost masters' doubling rechecks; dead
already when the tier starts or reconnects, the others served likewise.

Slower than the single-node suite (a cluster is formed once per module, a failure takes the
cluster's node timeout to be noticed): run with ``make test-l3-cluster``; ``make test``
deselects the ``redis_cluster`` marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio.cluster
import redis.cluster
from redis.crc import key_slot
from redis_servers import (
    OP_TIMEOUT_S,
    SLACK_S,
    ServerLookups,
    counted_failed,
    data,
    empty,
    host,
    partial_cluster,
    ref,
    wait_for,
)

from kvtier.bench.redis_proc import RedisClusterProcs, free_ports
from kvtier.daemon import loops
from kvtier.daemon.loops import EVENT_LOOPS
from kvtier.tiers.base import PROBE_ABSENT, PROBE_UNKNOWN, BlockRef, Health, TierUnavailable
from kvtier.tiers.remote.codec import KeyNamer, checksum, header
from kvtier.tiers.remote.options import RemoteOptions
from kvtier.tiers.remote.tier import RemoteTier

pytestmark = pytest.mark.redis_cluster

CLUSTER_OP_TIMEOUT_S = 1.0
NODE_TIMEOUT_S = 1.0  # the fixtures' clusters'


@pytest.fixture(scope="module")
def redis_cluster_partial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """``partial_cluster``, shared by the module's tests."""
    yield from partial_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def redis_cluster_hostnames(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterProcs]:
    """As ``redis_cluster_partial``, its nodes announced by hostname: CLUSTER SLOTS, whence
    the client's names, gives the hostname; CLUSTER NODES gives the address, the hostname
    after it. The hostname, 127.1, resolves to 127.0.0.1 on any machine without a name
    service, and is not "localhost", which redis-py replaces with its address."""
    cluster = RedisClusterProcs(
        tmp_path_factory.mktemp("redis-cluster-hostnames"),
        masters=3,
        extra_config="\n".join(
            (
                "cluster-require-full-coverage no",
                "cluster-preferred-endpoint-type hostname",
                "cluster-announce-hostname 127.1",
            )
        ),
    )
    cluster.start()
    yield cluster
    cluster.stop()


def cluster_options(cluster: RedisClusterProcs, prefix: str, **kw: Any) -> RemoteOptions:
    """The tier's options for ``cluster``, with generous timeouts: with 1 s, a loaded
    machine's round trips timed out and came back as misses. The test of a killed master
    gives it ``CLUSTER_OP_TIMEOUT_S``."""
    base: dict[str, Any] = {
        "urls": tuple(cluster.urls),
        "mode": "cluster",
        "key_prefix": prefix,
        "op_timeout_s": 30.0,
        "connect_timeout_s": 10.0,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3,
        "probe_deadline_ms": 3000.0,
    }
    base.update(kw)
    return RemoteOptions(**base)


@contextlib.asynccontextmanager
async def opened(opts: RemoteOptions, **kw: Any) -> AsyncIterator[RemoteTier]:
    tier = RemoteTier(opts, **kw)
    await tier.start()
    try:
        yield tier
    finally:
        await tier.close()


def slot_of(namer: KeyNamer, block: BlockRef) -> int:
    return key_slot(namer.key(block.ns, block.key))


async def test_blocks_spread_over_every_master_and_round_trip(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    nbytes = 64 << 10
    chain = [ref(i) for i in range(64)]
    src = [data(i, nbytes) for i in range(64)]
    async with opened(cluster_options(redis_cluster, l3_prefix, ttl_s=100)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * 64
        assert await tier.probe(chain) == [nbytes] * 64
        dest = empty(64, nbytes)
        assert await tier.read(chain, nbytes, host(dest)) == [True] * 64
        assert [bytes(d) for d in dest] == src
        await tier.remove(chain[10:11])
        assert len(await tier.probe(chain)) == 10
        # Each value's age from its expiry, asked of the master of its slot.
        raw = redis.cluster.RedisCluster.from_url(redis_cluster.urls[0])
        namer = KeyNamer(l3_prefix)
        for block in chain[20:]:
            raw.pexpire(namer.key(block.ns, block.key), 40_000)  # written 60 s ago
        raw.close()
        ages = await tier.value_ages(chain)
        assert ages[10] == 0.0 and all(0.0 <= age < 50.0 for age in ages[:20])
        assert all(60.0 <= age < 100.0 for age in ages[20:])
    counts = [int(n.cli("DBSIZE").strip()) for n in redis_cluster.nodes]
    assert all(c > 0 for c in counts), counts


async def test_regression_a_cluster_whose_chosen_ports_were_taken_failed_to_form(
    tmp_path_factory: pytest.TempPathFactory, l3_prefix: str
) -> None:
    """A node's port, or its bus port, chosen free and bound by another process (another
    test's server or connection) before the node bound it: the node exited with "Address
    already in use" and the fixture's setup failed. The node now starts on fresh ports."""
    with contextlib.ExitStack() as stack:
        taken = []
        for _ in range(2):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            taken.append(int(s.getsockname()[1]))
        # The first node's port and the second's bus port are taken, once.
        firsts = [[taken[0], *free_ports(1)], [*free_ports(1), taken[1]]]
        cluster = RedisClusterProcs(
            tmp_path_factory.mktemp("redis-cluster-taken"),
            masters=3,
            choose_ports=lambda n: firsts.pop(0) if firsts else free_ports(n),
        )
        cluster.start()
        try:
            assert not {p for n in cluster.nodes for p in (n.port, n.cluster_port)} & set(taken)
            chain, nbytes = [ref(i) for i in range(16)], 4096
            src = [data(i, nbytes) for i in range(16)]
            async with opened(cluster_options(cluster, l3_prefix)) as tier:
                assert await tier.write(chain, nbytes, host(src)) == [True] * 16
                dest = empty(16, nbytes)
                assert await tier.read(chain, nbytes, host(dest)) == [True] * 16
                assert [bytes(d) for d in dest] == src
        finally:
            cluster.stop()


def ids_in_one_slot(namer: KeyNamer, count: int) -> tuple[int, list[int]]:
    """The first cluster slot that ``count`` of the blocks ``ref(0)``, ``ref(1)``, ... fall
    into, and those blocks' ids."""
    by_slot: dict[int, list[int]] = defaultdict(list)
    i = 0
    while True:
        slot = slot_of(namer, ref(i))
        by_slot[slot].append(i)
        if len(by_slot[slot]) == count:
            return slot, by_slot[slot]
        i += 1


async def test_a_slot_moving_is_followed_through_ask_then_moved(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    """Migrate one slot by hand: while it is half moved the old owner answers ASK for the
    keys already gone; once it is moved every node answers MOVED. Reads, probes and writes
    follow both, byte-exact."""
    nbytes = 16 << 10
    namer = KeyNamer(l3_prefix)
    slot, ids = ids_in_one_slot(namer, 7)
    blocks = [ref(j) for j in ids]
    keys = [namer.key(b.ns, b.key).decode() for b in blocks]
    source = redis_cluster.owner_of_slot(slot)
    target = next(n for n in redis_cluster.nodes if n is not source)
    source_id, target_id = redis_cluster.node_id(source), redis_cluster.node_id(target)

    async with opened(cluster_options(redis_cluster, l3_prefix)) as tier:
        assert (
            await tier.write(blocks[:6], nbytes, host([data(j, nbytes) for j in ids[:6]]))
            == [True] * 6
        )
        target.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
        source.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
        source.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys[:3])
        assert int(source.cli("CLUSTER", "COUNTKEYSINSLOT", str(slot))) == 3

        # Half moved: ASK for blocks 0-2, served by the source for 3-5.
        dest = empty(6, nbytes)
        assert await tier.read(blocks[:6], nbytes, host(dest)) == [True] * 6
        assert [bytes(d) for d in dest] == [data(j, nbytes) for j in ids[:6]]
        assert len(await tier.probe(blocks[:6])) == 6
        # A new key in a migrating slot goes to the target (ASK).
        assert await tier.write(blocks[6:], nbytes, host([data(ids[6], nbytes)])) == [True]
        assert int(target.cli("CLUSTER", "COUNTKEYSINSLOT", str(slot))) == 4

        source.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys[3:6])
        for node in redis_cluster.nodes:
            node.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        assert redis_cluster.owner_of_slot(slot) is target

        # Moved: MOVED from the old owner, then straight to the new one.
        dest = empty(7, nbytes)
        assert await tier.read(blocks, nbytes, host(dest)) == [True] * 7
        assert [bytes(d) for d in dest] == [data(j, nbytes) for j in ids]
        assert len(await tier.probe(blocks)) == 7
        await tier.remove(blocks[:1])
        assert await tier.probe(blocks) == []
        c = tier.stats().counters
        assert c["read_errors"] == c["write_errors"] == c["remove_errors"] == 0
        assert tier.health().state is Health.OK


async def test_resharding_mid_workload_loses_nothing(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    """``redis-cli --cluster reshard`` moves 800 slots (and their keys) while reads and probes
    of 32 blocks at a time run without pause over all of them, from 8 callers at once: none
    misses, and the tier never goes down (redis-py closed every connection of the client at
    each fifth MOVED, the other callers' pipelines in flight with it)."""
    nbytes = 4096
    n = 2048
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    namer = KeyNamer(l3_prefix)
    source = redis_cluster.nodes[0]
    target = redis_cluster.nodes[2]
    owners_before = {
        i: redis_cluster.owner_of_slot(slot_of(namer, b)).port for i, b in enumerate(chain)
    }
    async with opened(cluster_options(redis_cluster, l3_prefix)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        done = asyncio.Event()
        rounds = 0
        bad: list[str] = []
        step = 32  # short calls: many of them run while the slots move

        async def workload(first: int) -> None:
            nonlocal rounds
            lo = first
            while not done.is_set():
                lo = (lo + step) % n
                dest = empty(step, nbytes)
                hits = await tier.read(chain[lo : lo + step], nbytes, host(dest))
                if not all(hits):
                    bad.append(f"round {rounds}: {len(hits) - hits.count(True)} misses")
                elif [bytes(d) for d in dest] != src[lo : lo + step]:
                    bad.append(f"round {rounds}: wrong bytes")
                found = await tier.probe(chain[lo : lo + step])
                if found != [nbytes] * step:
                    bad.append(f"round {rounds}: probe {found}")
                rounds += 1
                # A tier down answers without awaiting: let the reshard's end be seen.
                await asyncio.sleep(0.001)

        tasks = [asyncio.create_task(workload(w * n // 8)) for w in range(8)]
        reshard = await asyncio.to_thread(
            subprocess.run,
            [
                source.cli_bin,
                "--cluster",
                "reshard",
                source.address,
                "--cluster-from",
                redis_cluster.node_id(source),
                "--cluster-to",
                redis_cluster.node_id(target),
                "--cluster-slots",
                "800",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        during = rounds
        done.set()
        await asyncio.gather(*tasks)
        assert reshard.returncode == 0, reshard.stdout[-2000:] + reshard.stderr
        assert during >= 8 and bad == []
        assert tier.stats().counters["down_transitions"] == 0
        assert tier.health().state is Health.OK
    owners_after = {
        i: redis_cluster.owner_of_slot(slot_of(namer, b)).port for i, b in enumerate(chain)
    }
    moved = [i for i in range(n) if owners_before[i] != owners_after[i]]
    assert moved, "the reshard moved none of the test's blocks"
    assert all(owners_after[i] == target.port for i in moved)


async def test_a_master_killed_mid_workload_fails_fast_and_comes_back(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    nbytes = 64 << 10
    n = 48
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    namer = KeyNamer(l3_prefix)
    victim = redis_cluster.nodes[1]
    async with opened(fail_fast_options(redis_cluster, l3_prefix)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        on_victim = {
            i
            for i, b in enumerate(chain)
            if redis_cluster.owner_of_slot(slot_of(namer, b)) is victim
        }
        assert on_victim and len(on_victim) < n
        stop = asyncio.Event()
        slowest = [0.0]
        calls = [0]

        async def timed(coro: Any) -> Any:
            t0 = time.monotonic()
            out = await coro
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            calls[0] += 1
            return out

        async def workload() -> None:
            while not stop.is_set():
                await timed(tier.read(chain, nbytes, host(empty(n, nbytes))))
                await timed(tier.probe(chain))
                await timed(tier.write(chain[:4], nbytes, host(src[:4])))
                await asyncio.sleep(0.005)

        task = asyncio.create_task(workload())
        await asyncio.sleep(0.3)
        victim.kill()
        await wait_for("L3 to go down", lambda: tier.health().state is Health.DOWN)
        # The cluster's own waits off the loop: run on it they held every call of the
        # workload in flight meanwhile, and counted that in its slowest call.
        await asyncio.to_thread(redis_cluster.wait_fail)
        before = calls[0]
        # Calls keep answering while it is down (victim.start comes after).
        await wait_for("a call answered while L3 is down", lambda: calls[0] > before)
        victim.start()  # rejoins with its slots (nodes.conf), holding nothing
        await asyncio.to_thread(redis_cluster.wait_ok)
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK, 30.0)
        stop.set()
        await task  # any exception in a call fails here
        assert slowest[0] < CLUSTER_OP_TIMEOUT_S + OP_TIMEOUT_S + SLACK_S, slowest[0]
        c = tier.stats().counters
        assert c["down_transitions"] >= 1 and c["reconnects"] >= 1
        assert c["read_skipped_down"] > 0

        # The restarted master came back empty: its blocks are misses, the others are intact.
        dest = empty(n, nbytes)
        hits = await tier.read(chain, nbytes, host(dest))
        for i in range(n):
            if i not in on_victim:
                assert hits[i] and bytes(dest[i]) == src[i], i
            elif i >= 4:  # blocks 0-3 the workload may have written again since
                assert not hits[i], i
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        assert len(await tier.probe(chain)) == n


async def test_ask_goes_with_its_command_when_a_node_has_several_connections(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    """redis-py sends ASKING and the redirected command through two calls, each taking a
    free connection of the node's pool: with several free (calls made in parallel before),
    the command went out without its ASKING, and every key already moved of a migrating slot
    was a failed read (and an unknown probe, a failed write or removal) until the slot moved
    on."""
    nbytes = 4096
    namer = KeyNamer(l3_prefix)
    slot, ids = ids_in_one_slot(namer, 5)
    blocks = [ref(j) for j in ids]
    keys = [namer.key(b.ns, b.key).decode() for b in blocks]
    source = redis_cluster.owner_of_slot(slot)
    target = next(n for n in redis_cluster.nodes if n is not source)
    source_id, target_id = redis_cluster.node_id(source), redis_cluster.node_id(target)
    spread = [ref(10_000 + j) for j in range(64)]
    async with opened(cluster_options(redis_cluster, l3_prefix)) as tier:
        assert await tier.write(blocks[:4], nbytes, host([data(j, nbytes) for j in ids[:4]]))
        assert all(await tier.write(spread, nbytes, host([data(1, nbytes)] * 64)))
        # Several connections to every node.
        await asyncio.gather(
            *(tier.read(spread, nbytes, host(empty(64, nbytes))) for _ in range(4))
        )
        try:
            target.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
            source.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
            source.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys[:2])
            dest = empty(4, nbytes)
            assert await tier.read(blocks[:4], nbytes, host(dest)) == [True] * 4
            assert [bytes(d) for d in dest] == [data(j, nbytes) for j in ids[:4]]
            assert await tier.probe(blocks[:4]) == [nbytes] * 4
            assert await tier.write(blocks[4:], nbytes, host([data(ids[4], nbytes)])) == [True]
            await tier.remove(blocks[:1])
            c = tier.stats().counters
            assert c["read_errors"] == c["write_errors"] == c["remove_errors"] == 0
            assert int(target.cli("CLUSTER", "COUNTKEYSINSLOT", str(slot))) == 2
        finally:
            # Finish the move, so that the module's cluster is whole for the next test.
            rest = source.cli("CLUSTER", "GETKEYSINSLOT", str(slot), "100").split()
            if rest:
                source.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *rest)
            for node in redis_cluster.nodes:
                node.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)


async def test_regression_an_error_answer_to_asking_left_its_command_s_reply_unread(
    redis_cluster: RedisClusterProcs, l3_prefix: str, tmp_path: Any
) -> None:
    """An ASKING sent just before its command whose answer is an error (here a user the ACL
    denies ASKING) raised before the command's own reply was read: the connection went back
    to the pool with that reply unread, and each later call on it read the reply of the call
    before (another block's value, refused by its key: 25 of 64 blocks missed, read_bad_key
    25). Both replies are read; that call fails, the next are right."""
    nbytes = 4096
    namer = KeyNamer(l3_prefix)
    slot, ids = ids_in_one_slot(namer, 4)
    blocks = [ref(j) for j in ids]
    keys = [namer.key(b.ns, b.key).decode() for b in blocks]
    source = redis_cluster.owner_of_slot(slot)
    target = next(n for n in redis_cluster.nodes if n is not source)
    source_id, target_id = redis_cluster.node_id(source), redis_cluster.node_id(target)
    spread_ids = list(range(20_000, 20_064))
    spread = [ref(j) for j in spread_ids]
    secret = tmp_path / "secret"
    secret.write_text("kvt-pw\n")
    secret.chmod(0o600)
    for node in redis_cluster.nodes:
        node.cli("ACL", "SETUSER", "kvt-noask", "on", ">kvt-pw", "~*", "&*", "+@all", "-asking")
    opts = cluster_options(
        redis_cluster, l3_prefix, username="kvt-noask", password_file=str(secret)
    )
    try:
        async with opened(opts) as tier:
            assert await tier.write(blocks, nbytes, host([data(j, nbytes) for j in ids]))
            assert all(
                await tier.write(spread, nbytes, host([data(j, nbytes) for j in spread_ids]))
            )
            target.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
            source.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
            source.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys[:2])
            # The moved keys cannot be read by this user (no ASKING); the others can.
            got = await tier.read(blocks, nbytes, host(empty(4, nbytes)))
            assert got[2:] == [True, True]
            for _ in range(4):
                dest = empty(64, nbytes)
                hits = await tier.read(spread, nbytes, host(dest))
                assert hits == [True] * 64
                assert [bytes(d) for d in dest] == [data(j, nbytes) for j in spread_ids]
    finally:
        rest = source.cli("CLUSTER", "GETKEYSINSLOT", str(slot), "100").split()
        if rest:
            source.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *rest)
        for node in redis_cluster.nodes:
            node.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
            node.cli("ACL", "DELUSER", "kvt-noask")


class Traffic:
    """Reads, probes and writes of ``chain`` from one caller without pause, until
    ``stop``: the slowest call, every read that filled a buffer with bytes other than its
    block's (each block's bytes are its own, ``data(i)``: wrong bytes cannot pass as
    right), and the tier's health after each round."""

    def __init__(self, tier: RemoteTier, n: int, nbytes: int) -> None:
        self.tier, self.n, self.nbytes = tier, n, nbytes
        self.chain = [ref(i) for i in range(n)]
        self.src = [data(i, nbytes) for i in range(n)]
        self.slowest_s = 0.0
        self.rounds = 0
        self.wrong: list[str] = []
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _timed(self, coro: Any) -> Any:
        t0 = time.monotonic()
        out = await coro
        self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
        return out

    async def _run(self) -> None:
        n, nbytes = self.n, self.nbytes
        while not self._done.is_set():
            dest = empty(n, nbytes)
            hits = await self._timed(self.tier.read(self.chain, nbytes, host(dest)))
            self.wrong += [
                f"round {self.rounds}: block {i}"
                for i in range(n)
                if hits[i] and bytes(dest[i]) != self.src[i]
            ]
            await self._timed(self.tier.probe(self.chain))
            await self._timed(self.tier.write(self.chain[:4], nbytes, host(self.src[:4])))
            self.rounds += 1
            # A tier down answers without awaiting: let the test's own steps run.
            await asyncio.sleep(0.005)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._done.set()
        assert self._task is not None
        await self._task  # any exception in a call fails here


async def until_primary(cluster: RedisClusterProcs, node: Any, timeout_s: float = 30.0) -> None:
    """Until ``node`` is a master (asked off the loop: the traffic goes on meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while node not in await asyncio.to_thread(cluster.primaries):
        assert time.monotonic() < deadline, f"node {node.port} did not become a master"
        await asyncio.sleep(0.05)


def fail_fast_options(cluster: RedisClusterProcs, prefix: str, **kw: Any) -> RemoteOptions:
    """The options of the tests that take nodes away: a call waits ``CLUSTER_OP_TIMEOUT_S``
    at most. ``kw`` as for ``cluster_options``."""
    return cluster_options(
        cluster, prefix, op_timeout_s=CLUSTER_OP_TIMEOUT_S, connect_timeout_s=0.5, **kw
    )


async def test_regression_l3_flapped_while_a_master_back_without_replica_was_seen_failed(
    redis_cluster_replicated: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master and its replica die (no failover: the cluster is down), then the master
    comes back: the other nodes report ok at once while it answers CLUSTERDOWN for its first
    seconds. The reconnection asked one node's CLUSTER INFO, found ok, and the next call to
    the returned master marked L3 down again (11 and 16 down transitions in two runs here;
    24 in a second on a hand-made cluster). It goes down once and comes back once."""
    cluster = redis_cluster_replicated
    async with opened(fail_fast_options(cluster, l3_prefix)) as tier:
        traffic = Traffic(tier, 48, 16 << 10)
        assert await tier.write(traffic.chain, traffic.nbytes, host(traffic.src)) == [True] * 48
        traffic.start()
        victim = cluster.primaries()[1]
        (replica,) = cluster.replicas_of(victim)
        replica.kill()  # first, so that it cannot take over
        victim.kill()
        await wait_for("L3 to go down", lambda: tier.health().state is Health.DOWN)
        await asyncio.to_thread(cluster.wait_fail)
        # Past twice the node timeout after a master was counted failed, the others take it
        # back as soon as it answers, while it serves nothing for its first 2 s: then most
        # nodes report ok and it answers CLUSTERDOWN.
        await asyncio.sleep(2 * NODE_TIMEOUT_S)
        victim.start()  # rejoins with its slots (nodes.conf), holding nothing
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK, 30.0)
        replica.start()
        await asyncio.to_thread(cluster.wait_ok)
        await traffic.stop()
        assert traffic.wrong == []
        c = tier.stats().counters
        assert (c["down_transitions"], c["reconnects"]) == (1, 1)
        assert tier.health().state is Health.OK


async def test_a_master_killed_under_traffic_fails_over_to_its_replica_and_back(
    redis_cluster_replicated: RedisClusterProcs, l3_prefix: str
) -> None:
    """SIGKILL a master under traffic: its replica takes over, L3 comes back on its own
    (no wrong bytes, no call past its timeout, nothing lost: the replica had caught up);
    the old master returns as the new one's replica, and a ``CLUSTER FAILOVER`` on it makes
    it the master again, neither of which takes L3 down."""
    cluster = redis_cluster_replicated
    async with opened(fail_fast_options(cluster, l3_prefix)) as tier:
        traffic = Traffic(tier, 48, 16 << 10)
        assert await tier.write(traffic.chain, traffic.nbytes, host(traffic.src)) == [True] * 48
        await asyncio.to_thread(cluster.wait_replicated)
        traffic.start()
        victim = cluster.primaries()[0]
        (replica,) = cluster.replicas_of(victim)
        victim.kill()
        await until_primary(cluster, replica)
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK, 30.0)
        assert tier.stats().counters["down_transitions"] <= 1

        victim.start()  # empty; learns it was replaced and replicates the new master
        await asyncio.to_thread(cluster.wait_ok)
        assert victim in cluster.replicas_of(replica)
        victim.cli("CLUSTER", "FAILOVER")
        await until_primary(cluster, victim)
        await asyncio.to_thread(cluster.wait_ok)
        await traffic.stop()

        assert traffic.wrong == []
        assert traffic.slowest_s < CLUSTER_OP_TIMEOUT_S + OP_TIMEOUT_S + SLACK_S
        c = tier.stats().counters
        assert c["down_transitions"] <= 1 and c["reconnects"] == c["down_transitions"]
        assert tier.health().state is Health.OK
        dest = empty(48, traffic.nbytes)
        assert await tier.read(traffic.chain, traffic.nbytes, host(dest)) == [True] * 48
        assert [bytes(d) for d in dest] == traffic.src


async def test_deletes_during_a_cluster_outage_do_not_come_back(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    """Blocks deleted while the cluster is down (a master lost: every node answers
    CLUSTERDOWN, the blocks on the others still stored) answer absent meanwhile, and are gone
    from the store once it is back: none is found again, through the tier or by asking the
    store itself."""
    nbytes = 4096
    n = 48
    chain = [ref(i) for i in range(n)]
    namer = KeyNamer(l3_prefix)
    victim = redis_cluster.nodes[2]
    async with opened(fail_fast_options(redis_cluster, l3_prefix)) as tier:
        assert (
            await tier.write(chain, nbytes, host([data(i, nbytes) for i in range(n)])) == [True] * n
        )
        victim.kill()
        await asyncio.to_thread(redis_cluster.wait_fail)
        # A call meets the outage (CLUSTERDOWN, or the lost master's closed connection).
        await tier.read(chain, nbytes, host(empty(n, nbytes)))
        await wait_for("L3 to go down", lambda: tier.health().state is Health.DOWN)
        await tier.remove(chain[: n // 2])
        assert tier.stats().gauges["removals_unconfirmed"] == n // 2
        assert len(await tier.probe(chain)) == 0
        victim.start()  # empty, with its slots
        await asyncio.to_thread(redis_cluster.wait_ok)
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK, 30.0)
        await wait_for(
            "the removals to be confirmed",
            lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
            30.0,
        )
        found = await tier.read(chain, nbytes, host(empty(n, nbytes)))
        assert not any(found[: n // 2])
    raw = redis.cluster.RedisCluster.from_url(redis_cluster.urls[0])
    try:
        assert [raw.exists(namer.key(b.ns, b.key)) for b in chain[: n // 2]] == [0] * (n // 2)
    finally:
        raw.close()


async def test_a_whole_cluster_restarted_is_a_cold_tier_back_without_a_restart(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    """Every node stopped, then started again (empty, each with its slots): L3 goes down,
    comes back on its own, once, and finds none of the blocks it held; new ones round-trip."""
    nbytes = 4096
    n = 32
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    async with opened(fail_fast_options(redis_cluster, l3_prefix)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        for node in redis_cluster.nodes:
            node.stop()
        await tier.read(chain, nbytes, host(empty(n, nbytes)))
        await wait_for("L3 to go down", lambda: tier.health().state is Health.DOWN)
        for node in redis_cluster.nodes:
            node.start()
        await asyncio.to_thread(redis_cluster.wait_ok)
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK, 30.0)
        assert await tier.probe(chain) == []
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        dest = empty(n, nbytes)
        assert await tier.read(chain, nbytes, host(dest)) == [True] * n
        assert [bytes(d) for d in dest] == src
        c = tier.stats().counters
        assert (c["down_transitions"], c["reconnects"]) == (1, 1)


async def test_one_full_master_pauses_its_own_writes_only_and_never_takes_l3_down(
    redis_cluster: RedisClusterProcs, l3_prefix: str
) -> None:
    """One master at its maxmemory with noeviction refuses writes (OOM) while the others
    store theirs: the refused blocks answer False, counted in write_no_space; L3 reports
    degraded_nospace naming that master, never down, and reads go on from every master, the
    full one included. During its backoff the blocks of the full master's slots are declined
    (counted in write_skipped_down, nothing sent to it) while the other masters go on
    storing theirs: the pause was of every master's writes. Once it has room, a write
    after the backoff ends the pause."""
    nbytes = 4096
    n = 48
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    namer = KeyNamer(l3_prefix)
    full = redis_cluster.nodes[0]
    on_full = [
        i for i, b in enumerate(chain) if redis_cluster.owner_of_slot(slot_of(namer, b)) is full
    ]
    assert on_full and len(on_full) < n
    # The tier's clock moves only when the test moves it: a pause's backoff is not over
    # until then, however long a loaded machine takes over a step. With a real clock, the
    # backoff (50 ms at most) was over by the time the health was asked, which said ok.
    now = [1000.0]
    opts = fail_fast_options(redis_cluster, l3_prefix)
    async with opened(opts, clock=lambda: now[0]) as tier:
        assert await tier.write(chain[:16], nbytes, host(src[:16])) == [True] * 16
        full.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        full.cli("CONFIG", "SET", "maxmemory", "1")
        try:
            stored = await tier.write(chain[16:32], nbytes, host(src[16:32]))
            refused = [i for i in on_full if 16 <= i < 32]
            assert [i for i in range(16, 32) if not stored[i - 16]] == refused
            health = tier.health()
            assert health.state is Health.DEGRADED_NOSPACE
            assert full.address in health.detail and health.partial, health
            assert "other masters serve and take writes" in health.detail, health
            c = tier.stats().counters
            assert (c["write_no_space"], c["write_skipped_down"]) == (len(refused), 0)
            # Within the backoff: the full master's blocks declined, the others stored.
            stored = await tier.write(chain[32:], nbytes, host(src[32:]))
            declined = [i for i in on_full if i >= 32]
            assert [i for i in range(32, n) if not stored[i - 32]] == declined
            c = tier.stats().counters
            assert (c["write_no_space"], c["write_skipped_down"]) == (len(refused), len(declined))
            dest = empty(n, nbytes)
            hits = await tier.read(chain, nbytes, host(dest))
            assert hits == [i < 16 or i not in on_full for i in range(n)]
            assert all(bytes(dest[i]) == src[i] for i in range(n) if hits[i])
        finally:
            full.cli("CONFIG", "SET", "maxmemory", "0")
        assert tier.stats().counters["down_transitions"] == 0
    async with opened(opts, clock=lambda: now[0]) as tier:
        full.cli("CONFIG", "SET", "maxmemory", "1")
        try:
            await tier.write(chain, nbytes, host(src))
            assert tier.health().state is Health.DEGRADED_NOSPACE
        finally:
            full.cli("CONFIG", "SET", "maxmemory", "0")
        now[0] += opts.backoff_max_s
        # The backoff over, the master counts as taking writes, but is still paused.
        assert tier.health().state is Health.OK
        assert tier.stats().gauges["up"] == 0.0
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        assert tier.health().state is Health.OK
        assert tier.stats().gauges["up"] == 1.0  # the write ended the pause
        assert tier.stats().counters["down_transitions"] == 0


@contextlib.asynccontextmanager
async def master_lost(cluster: RedisClusterProcs, victim: Any) -> AsyncIterator[None]:
    """``victim`` killed, and counted failed by the other nodes before the body runs; started
    again at the end unless the body did, and the cluster ok again."""
    victim.kill()
    try:
        await wait_for(
            "the others to count the master failed", lambda: counted_failed(cluster, victim), 30.0
        )
        yield
    finally:
        if not victim.running:
            victim.start()
        await asyncio.to_thread(cluster.wait_ok)


def blocks_over(
    cluster: RedisClusterProcs, prefix: str, victim: Any, n: int, nbytes: int
) -> tuple[list[BlockRef], list[bytes], set[int]]:
    """``n`` blocks of ``nbytes``, their bytes, and the positions of those of them that
    ``victim`` serves (some, not all)."""
    chain = [ref(i) for i in range(n)]
    namer = KeyNamer(prefix)
    on_victim = {
        i for i, b in enumerate(chain) if cluster.owner_of_slot(slot_of(namer, b)) is victim
    }
    assert on_victim and len(on_victim) < n
    return chain, [data(i, nbytes) for i in range(n)], on_victim


def lost_hits(on_victim: set[int], n: int) -> list[bool | None]:
    """What a read of ``n`` blocks answers while the master of those ``on_victim`` is lost:
    None for them (nothing said), True for the others."""
    return [None if i in on_victim else True for i in range(n)]


async def test_a_master_lost_for_good_leaves_l3_serving_the_other_masters_degraded(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str
) -> None:
    """With ``cluster-require-full-coverage no``, a master killed for good (no replica):
    the other masters go on serving their slots. The first call that meets the lost master
    marks it lost (L3 went down then, until a reconnection), and L3 is degraded_io naming
    that master, never down: its slots' blocks are misses (unknown to a probe, declined
    writes, counted) while the others' are read, probed and written; a Delete of its blocks
    is sent once it is back. It kept the tier down for as long as
    the master was gone (every primary had to answer). Once the master is back, L3 is ok
    again on its own and every block is written."""
    cluster = redis_cluster_partial
    nbytes = 4096
    n = 48
    victim = cluster.nodes[1]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    async with opened(fail_fast_options(cluster, l3_prefix)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        victim.kill()
        await wait_for(
            "the others to count the master failed", lambda: counted_failed(cluster, victim), 30.0
        )
        # Meets the lost master: its blocks are misses, the others' are read.
        hits = await tier.read(chain, nbytes, host(empty(n, nbytes)))
        assert hits == lost_hits(on_victim, n)
        assert tier.health().state is Health.DEGRADED_IO
        health = tier.health()
        assert victim.address in health.detail and health.partial, health
        assert "other masters serve and take writes" in health.detail, health
        for _ in range(3):
            dest = empty(n, nbytes)
            hits = await tier.read(chain, nbytes, host(dest))
            # The lost master's blocks: misses that say nothing of them (None).
            assert hits == lost_hits(on_victim, n)
            assert all(bytes(dest[i]) == src[i] for i in range(n) if hits[i])
            sizes = await tier.probe_each(chain)
            assert sizes == [PROBE_UNKNOWN if i in on_victim else nbytes for i in range(n)]
            stored = await tier.write(chain, nbytes, host(src))
            assert stored == [i not in on_victim for i in range(n)]
        c = tier.stats().counters
        assert c["read_skipped_down"] == 3 * len(on_victim)
        assert c["write_skipped_down"] == 3 * len(on_victim)
        assert (c["down_transitions"], c["reconnects"]) == (0, 0)
        assert tier.health().state is Health.DEGRADED_IO
        # A Delete: the other masters' keys go at once, the lost one's once it is back.
        gone = [min(on_victim), min(set(range(n)) - on_victim)]
        await tier.remove([chain[i] for i in gone])
        assert tier.stats().gauges["removals_unconfirmed"] == 1
        sizes = await tier.probe_each([chain[i] for i in gone])
        assert sizes[0] == PROBE_ABSENT and sizes[1] == PROBE_ABSENT

        victim.start()  # empty, with its slots
        await asyncio.to_thread(cluster.wait_ok)
        await wait_for("L3 to be ok again", lambda: tier.health().state is Health.OK, 30.0)
        await wait_for(
            "the removal to be confirmed",
            lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
            30.0,
        )
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        dest = empty(n, nbytes)
        assert await tier.read(chain, nbytes, host(dest)) == [True] * n
        assert [bytes(d) for d in dest] == src
        assert tier.stats().counters["down_transitions"] == 0


@pytest.fixture
def redis_cluster_slow_verdict(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterProcs]:
    """Three masters, no replicas, full coverage required (the default), whose nodes count a
    silent master failed only after a minute (``cluster-node-timeout``; 15 s by default): a
    test's body runs before the cluster's verdict on a master it kills."""
    cluster = RedisClusterProcs(
        tmp_path_factory.mktemp("redis-cluster-slow-verdict"), masters=3, node_timeout_ms=60_000
    )
    cluster.start()
    yield cluster
    cluster.stop()


async def test_regression_a_master_just_killed_took_l3_down_for_every_master(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master killed (no replica) and not yet counted failed by the others (for the
    cluster's node timeout, 15 s by default, they serve their slots): the first calls that
    reached it took L3 down for every master until a reconnection found the cluster's
    verdict, as redis-py's cluster pipeline fails as a whole when one node's connection
    does, so no master's blocks were read or written meanwhile. Its master is lost at once
    instead: its blocks are misses that keep their records (read None, ``unserved``), the
    others' are read, probed and written from the first call on (two at once: one meets the
    pooled connection, the other a refused one), L3 degraded_io and partial, never down;
    once the master is back, L3 is whole again."""
    cluster = redis_cluster_slow_verdict
    nbytes = 4096
    n = 48
    victim = cluster.nodes[1]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    expected_hits = lost_hits(on_victim, n)
    async with opened(fail_fast_options(cluster, l3_prefix)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        victim.kill()
        dests = [empty(n, nbytes), empty(n, nbytes)]
        hits = await asyncio.gather(*(tier.read(chain, nbytes, host(d)) for d in dests))
        assert hits == [expected_hits, expected_hits]
        for _ in range(2):
            dest = empty(n, nbytes)
            assert await tier.read(chain, nbytes, host(dest)) == expected_hits
            dests.append(dest)
            assert await tier.write(chain, nbytes, host(src)) == [
                i not in on_victim for i in range(n)
            ]
            sizes = await tier.probe_each(chain)
            assert sizes == [PROBE_UNKNOWN if i in on_victim else nbytes for i in range(n)]
            assert tier.unserved(chain) == sorted(on_victim)
        assert all(bytes(d[i]) == src[i] for d in dests for i in range(n) if i not in on_victim)
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and health.partial, health
        assert victim.address in health.detail, health
        assert not counted_failed(cluster, victim)  # all of it before the cluster's verdict
        assert tier.stats().counters["down_transitions"] == 0

        victim.start()  # empty, with its slots
        await asyncio.to_thread(cluster.wait_ok)
        await wait_for("L3 to be whole again", lambda: tier.health().state is Health.OK, 30.0)
        assert tier.unserved(chain) == []
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        dest = empty(n, nbytes)
        assert await tier.read(chain, nbytes, host(dest)) == [True] * n
        assert [bytes(d) for d in dest] == src
        assert tier.stats().counters["down_transitions"] == 0


async def test_regression_a_master_dead_at_the_start_or_reconnection_kept_l3_down(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master already dead (its connections refused) when the tier starts, or when L3
    reconnects after ``down``, before the others count it failed: the check counted it lost
    only once they did (the cluster's node timeout, 15 s by default; a minute here), and L3
    stayed down for every master meanwhile, where a call that meets it loses it at once. The
    check loses it at once too: the others' blocks are served from the first call, L3
    degraded_io and partial."""
    cluster = redis_cluster_slow_verdict
    nbytes = 4096
    n = 48
    victim = cluster.nodes[1]
    others = [node for node in cluster.nodes if node is not victim]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    expected_hits = lost_hits(on_victim, n)
    async with opened(fail_fast_options(cluster, l3_prefix)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
    victim.kill()
    async with opened(fail_fast_options(cluster, l3_prefix)) as tier:
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and health.partial, health
        assert await tier.read(chain, nbytes, host(empty(n, nbytes))) == expected_hits
        # Down (neither of the others answers in time), then reconnected with the victim
        # still dead.
        for node in others:
            node.cli("CLIENT", "PAUSE", str(int(3 * CLUSTER_OP_TIMEOUT_S * 1000)), "ALL")
        try:
            assert await tier.read(chain, nbytes, host(empty(n, nbytes))) == [None] * n
            assert tier.health().state is Health.DOWN
        finally:
            for node in others:
                node.cli("CLIENT", "UNPAUSE")
        await wait_for(
            "L3 to serve the others again", lambda: tier.health().state is not Health.DOWN
        )
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and victim.address in health.detail, health
        dest = empty(n, nbytes)
        assert await tier.read(chain, nbytes, host(dest)) == expected_hits
        assert all(bytes(dest[i]) == src[i] for i in range(n) if i not in on_victim)
        assert not counted_failed(cluster, victim)  # all of it before the cluster's verdict
        assert tier.stats().counters["down_transitions"] == 1


async def test_regression_a_master_restarted_after_a_call_lost_it_stayed_lost_backoff_max_s(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master killed and started again a moment later (a restart), before the others count
    it failed: the call that met it lost it, and the monitor's first check, after about
    ``backoff_initial_s``, found it still refusing. Every check after that came half to
    whole ``backoff_max_s`` later (15-30 s by default; 150-300 s here), the master's blocks
    misses and its writes declined all that while though it served again. The checks double
    from ``backoff_initial_s`` instead, as the reconnection's while L3 is down: L3 is whole
    again soon after the master is back."""
    cluster = redis_cluster_slow_verdict
    victim = cluster.nodes[1]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, 48, 4096)
    async with opened(fail_fast_options(cluster, l3_prefix, backoff_max_s=300.0)) as tier:
        assert await tier.write(chain, 4096, host(src)) == [True] * 48
        victim.kill()
        hits = await tier.read(chain, 4096, host(empty(48, 4096)))
        assert hits == lost_hits(on_victim, 48)
        await wait_for(
            "a second check of the lost master",
            lambda: tier.stats().counters["reconnect_attempts"] >= 2,
        )
        assert tier.health().state is Health.DEGRADED_IO  # the first found it still lost
        victim.start()  # empty, with its slots
        await asyncio.to_thread(cluster.wait_ok)
        await wait_for("L3 to be whole again", lambda: tier.health().state is Health.OK, 30.0)
        assert await tier.write(chain, 4096, host(src)) == [True] * 48
        assert tier.stats().counters["down_transitions"] == 0


@pytest.mark.slow
async def test_regression_a_hung_master_took_l3_down_for_every_master(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master that answers nothing (its redis-server stopped: a hung process, a host
    gone), before the others count it failed: a call that waited for it timed out as a
    whole, the other masters' replies with it, and L3 went down for every master until a
    reconnection found the cluster's verdict (its node timeout: 15 s by default, a minute
    here). The timeout is the hung master's own instead, as a refused connection is: its
    commands answer it within the op timeout, the others' are served in the same call, and
    it is lost on its own (degraded_io naming it, never down). A call that waited for a
    connection meanwhile (one bulk connection here) sends it nothing once it is lost. The
    start's check loses it at once likewise (it waited for the cluster's verdict, L3 down
    meanwhile). It is rechecked with the lost masters' backoff, and serves again once it
    answers."""
    cluster = redis_cluster_slow_verdict
    nbytes = 4096
    n = 48
    victim = cluster.nodes[1]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    expected_hits = lost_hits(on_victim, n)
    async with opened(fail_fast_options(cluster, l3_prefix, pool_size=2)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        victim.pause()
        try:
            dests = [empty(n, nbytes), empty(n, nbytes)]
            hits = await asyncio.gather(*(tier.read(chain, nbytes, host(d)) for d in dests))
            assert hits == [expected_hits, expected_hits]
            c = tier.stats().counters
            # The first read timed out at the hung master; the second, which waited for the
            # connection, found it lost and asked the others only.
            assert c["read_errors"] == len(on_victim), c
            assert c["read_skipped_down"] == len(on_victim), c
            assert c["timeouts"] == 1, c
            health = tier.health()
            assert health.state is Health.DEGRADED_IO and health.partial, health
            assert victim.address in health.detail, health
            dest = empty(n, nbytes)
            assert await tier.read(chain, nbytes, host(dest)) == expected_hits
            dests.append(dest)
            assert all(bytes(d[i]) == src[i] for d in dests for i in range(n) if i not in on_victim)
            assert await tier.write(chain, nbytes, host(src)) == [
                i not in on_victim for i in range(n)
            ]
            sizes = await tier.probe_each(chain)
            assert sizes == [PROBE_UNKNOWN if i in on_victim else nbytes for i in range(n)]
            assert tier.unserved(chain) == sorted(on_victim)
            await wait_for(
                "a second check of the hung master",
                lambda: tier.stats().counters["reconnect_attempts"] >= 2,
            )
            assert tier.health().state is Health.DEGRADED_IO  # still hung
            # A tier started meanwhile loses it at once too.
            async with opened(fail_fast_options(cluster, l3_prefix)) as second:
                health = second.health()
                assert health.state is Health.DEGRADED_IO, health
                assert victim.address in health.detail, health
                assert await second.read(chain, nbytes, host(empty(n, nbytes))) == expected_hits
            assert not counted_failed(cluster, victim)  # all of it before the cluster's verdict
        finally:
            victim.resume()
        await wait_for("L3 to be whole again", lambda: tier.health().state is Health.OK, 30.0)
        # The master kept its blocks while it was stopped.
        dest = empty(n, nbytes)
        assert await tier.read(chain, nbytes, host(dest)) == [True] * n
        assert [bytes(d) for d in dest] == src
        assert tier.stats().counters["down_transitions"] == 0


@pytest.mark.slow
async def test_regression_a_probe_queued_behind_a_hung_master_was_not_counted_as_skipping_it(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """``probe_skipped_down`` counts the probes that left keys unasked, their master lost. A
    probe that waited for its connection while the one ahead of it timed out at a hung master
    asked the others only (the master lost by then), yet was not counted: only a master lost
    before a probe began to wait was."""
    cluster = redis_cluster_slow_verdict
    nbytes, n = 4096, 48
    victim = cluster.nodes[1]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    expected = [PROBE_UNKNOWN if i in on_victim else nbytes for i in range(n)]
    # One connection per master for probes and removals (a quarter of 2, at least one).
    async with opened(fail_fast_options(cluster, l3_prefix, pool_size=2)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        victim.pause()
        try:
            sizes = await asyncio.gather(tier.probe_each(chain), tier.probe_each(chain))
            assert sizes == [expected, expected]
            c = tier.stats().counters
            # The first timed out at the hung master, which the second found lost.
            assert c["timeouts"] == 1, c
            assert c["probe_skipped_down"] == 1, c
        finally:
            victim.resume()


@pytest.mark.slow
async def test_regression_a_late_probe_queued_behind_a_hung_master_was_not_counted_as_skipping_it(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """As above, with the probe deadline (100 ms) shorter than the op timeout, as with the
    defaults (50 ms, 2 s): both probes are late, and the second's round trip, going on after
    its caller stopped waiting, asks the others only once the first has timed out at the hung
    master. It was counted when its caller stopped waiting, before its round trip had a
    connection: never."""
    cluster = redis_cluster_slow_verdict
    nbytes, n = 4096, 48
    victim = cluster.nodes[1]
    chain, src, _ = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    opts = fail_fast_options(cluster, l3_prefix, pool_size=2, probe_deadline_ms=100.0)
    async with opened(opts) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        victim.pause()
        try:
            sizes = await asyncio.gather(tier.probe_each(chain), tier.probe_each(chain))
            assert sizes == [[PROBE_UNKNOWN] * n] * 2
            await wait_for(
                "the second probe's round trip to be counted as skipping the lost master",
                lambda: tier.stats().counters["probe_skipped_down"] > 0,
            )
            c = tier.stats().counters
            assert (c["probe_late"], c["timeouts"], c["probe_skipped_down"]) == (2, 1, 1), c
        finally:
            victim.resume()


@pytest.mark.slow
async def test_regression_a_read_of_a_lost_masters_keys_that_l3_went_down_under_counted_them_nowhere(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """A read that leaves a lost master's keys unasked counts them in ``read_skipped_down``,
    and what it asked in ``read_errors`` where L3 went down before it was sent: here it
    waited for its connection while the read ahead of it timed out at the two other
    masters, hung too. Its lost master's keys were counted in neither."""
    cluster = redis_cluster_slow_verdict
    nbytes, n = 4096, 48
    victim = cluster.nodes[1]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    others = [node for node in cluster.nodes if node is not victim]
    # One connection per master for reads (the other of 2 kept for probes and removals).
    async with opened(fail_fast_options(cluster, l3_prefix, pool_size=2)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        victim.pause()
        try:
            dest = empty(n, nbytes)
            assert await tier.read(chain, nbytes, host(dest)) == lost_hits(on_victim, n)
            assert tier.health().state is Health.DEGRADED_IO
            before = tier.stats().counters
            for node in others:
                node.pause()
            try:
                both = await asyncio.gather(
                    *(tier.read(chain, nbytes, host(empty(n, nbytes))) for _ in range(2))
                )
                assert both == [[None] * n] * 2
                assert tier.health().state is Health.DOWN
                c = tier.stats().counters
                # The first timed out at the others; the second found L3 down.
                assert c["timeouts"] - before["timeouts"] == 1, c
                assert c["read_errors"] - before["read_errors"] == 2 * (n - len(on_victim))
                assert c["read_skipped_down"] - before["read_skipped_down"] == 2 * len(on_victim)
            finally:
                for node in others:
                    node.resume()
        finally:
            victim.resume()


@pytest.mark.slow
async def test_regression_a_delete_queued_behind_a_hung_master_sent_it_its_unlinks_and_waited(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str
) -> None:
    """A Delete whose UNLINKs waited for their connection while the one ahead of them timed
    out at a hung master (lost by then) still sent that master its UNLINKs, and waited the
    op timeout for their replies (counted as errors, remembered), where reads, probes and
    writes so queued send it nothing. Its keys there are remembered at once instead, as a
    Delete's begun once the master was lost, and sent once it is back; the others' go."""
    cluster = redis_cluster_slow_verdict
    nbytes, n = 4096, 48
    victim = cluster.nodes[1]
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    mine = sorted(on_victim)
    assert len(mine) >= 2
    others = [i for i in range(n) if i not in on_victim]
    first = mine[: len(mine) // 2] + others[: len(others) // 2]
    second = [i for i in range(n) if i not in first]
    # One connection per master for probes and removals (a quarter of 2, at least one).
    async with opened(fail_fast_options(cluster, l3_prefix, pool_size=2)) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
        victim.pause()
        try:
            await asyncio.gather(*(tier.remove([chain[i] for i in d]) for d in (first, second)))
            stats = tier.stats()
            # The first timed out at the hung master, which the second found lost.
            assert stats.counters["remove_errors"] == len(mine) // 2, stats.counters
            assert stats.counters["remove_skipped_down"] == len(mine) - len(mine) // 2
            assert stats.gauges["removals_unconfirmed"] == len(mine)
            assert await tier.probe_each(chain) == [PROBE_ABSENT] * n
        finally:
            victim.resume()
        await wait_for(
            "the lost master's removals to be confirmed",
            lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
            30.0,
        )
        assert tier.health().state is Health.OK
        assert await tier.probe_each(chain) == [PROBE_ABSENT] * n


@pytest.mark.slow
async def test_regression_a_start_met_a_hung_master_twice_and_l3_was_down(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str, monkeypatch: Any
) -> None:
    """The hung master is slot 0's master, redis-py's default node, and the first startup
    node asked (redis-py shuffles them: here kept in ``urls``' order, the hung one first):
    a start (or reconnection) asked it for the map (CLUSTER SLOTS), then for the command
    table (COMMAND), each wait an op timeout, while ``_initialize`` had the connect timeout
    and one op timeout: the check failed and L3 was down (at each start or reconnection
    whose shuffle drew it first: 1 of 4 runs here unpatched), though the others served."""
    monkeypatch.setattr(redis.asyncio.cluster.random, "shuffle", lambda nodes: None)
    cluster = redis_cluster_slow_verdict
    nbytes, n = 4096, 48
    victim = cluster.owner_of_slot(0)
    chain, src, on_victim = blocks_over(cluster, l3_prefix, victim, n, nbytes)
    urls = [victim.url] + [u for u in cluster.urls if u != victim.url]
    opts = fail_fast_options(cluster, l3_prefix, urls=tuple(urls))
    async with opened(opts) as tier:
        assert await tier.write(chain, nbytes, host(src)) == [True] * n
    victim.pause()
    try:
        async with opened(opts) as tier:
            health = tier.health()
            assert health.state is Health.DEGRADED_IO, health
            assert victim.address in health.detail, health
            dest = empty(n, nbytes)
            assert await tier.read(chain, nbytes, host(dest)) == lost_hits(on_victim, n)
    finally:
        victim.resume()


@pytest.mark.slow
@pytest.mark.parametrize("kind", EVENT_LOOPS)
def test_a_write_timed_out_at_a_hung_master_stores_the_others_and_none_of_its_bodies_later(
    redis_cluster_slow_verdict: RedisClusterProcs, l3_prefix: str, kind: str
) -> None:
    """A write whose pipeline spans a hung master and live ones: the live masters store
    their blocks within the op timeout (the whole write timed out before, none stored), and
    the hung master's connection, cut off mid-body, is aborted, not closed: uvloop's
    transports keep what they have not sent by reference, and a graceful close sent it once
    the master read again, the caller's buffers rewritten by then, under the old key and
    header. What the master holds is each block as it was, or nothing."""
    cluster = redis_cluster_slow_verdict
    victim = cluster.nodes[1]
    namer = KeyNamer(l3_prefix)
    nbytes = 8 << 20  # far more than the socket buffers take while the master is stopped
    on_victim: list[int] = []
    elsewhere: list[int] = []
    for i in range(1000):
        mine = cluster.owner_of_slot(slot_of(namer, ref(i))) is victim
        (on_victim if mine else elsewhere).append(i)
        if len(on_victim) >= 2 and elsewhere:
            break
    ids = on_victim[:2] + elsewhere[:1]
    blocks = [ref(i) for i in ids]
    orig = [data(i, nbytes) for i in ids]
    raw = redis.Redis(host="127.0.0.1", port=victim.port)

    def others() -> set[str]:
        return {c["id"] for c in raw.client_list()} - {str(raw.client_id())}

    async def run() -> None:
        # Time for the live master to take its 8 MiB on a loaded machine.
        opts = cluster_options(cluster, l3_prefix, op_timeout_s=3.0, connect_timeout_s=0.5)
        async with opened(opts) as tier:
            assert await tier.probe_each(blocks) == [PROBE_ABSENT] * 3  # connections made
            before = others()
            src = [bytearray(b) for b in orig]
            victim.pause()
            try:
                assert await tier.write(blocks, nbytes, host(src)) == [False, False, True]
                assert tier.health().state is Health.DEGRADED_IO
                for buf in src:
                    buf[:] = bytes(nbytes)  # the caller's again, and rewritten
            finally:
                victim.resume()
            await wait_for("the hung connections to end", lambda: not before & others())

    loops.run(run(), kind)
    for block, value in zip(blocks[:2], orig[:2], strict=True):
        key = namer.key(block.ns, block.key)
        assert raw.get(key) in (None, header(nbytes, checksum(value), key) + value)
    raw.close()


async def test_regression_a_connection_its_server_closed_in_the_pool_lost_a_healthy_master(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master that closed the tier's idle connections (its ``timeout``, CLIENT KILL, a
    restart) and serves: the next call reconnects, as redis-py's own pool does for a single
    server (a cluster node's pool hands out what it holds). Sent over the closed connection,
    that call's commands to the master read its EOF, and the master was lost (its blocks
    misses, writes declined) until the monitor asked again, L3 degraded; before c68c6d4,
    L3 down."""
    victim = redis_cluster_partial.nodes[1]
    chain, src, _ = blocks_over(redis_cluster_partial, l3_prefix, victim, 48, 4096)
    async with opened(cluster_options(redis_cluster_partial, l3_prefix)) as tier:
        assert await tier.write(chain, 4096, host(src)) == [True] * 48
        victim.cli("CLIENT", "KILL", "TYPE", "normal")  # (not its own)
        await wait_for(
            "the master to close the tier's connections",
            lambda: len(victim.cli("CLIENT", "LIST", "TYPE", "normal").splitlines()) == 1,
        )
        await asyncio.sleep(0.1)  # the loop reads their EOFs, as while they idle
        dest = empty(48, 4096)
        assert await tier.read(chain, 4096, host(dest)) == [True] * 48
        assert [bytes(d) for d in dest] == src
        assert tier.health().state is Health.OK, tier.health()
        assert tier.stats().counters["connection_errors"] == 0


async def test_regression_a_lost_master_and_the_others_full_stop_the_daemon_s_writes(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str
) -> None:
    """One master lost and every other one out of memory: no master takes a write, so L3's
    health accepts none (the daemon stops offering blocks) and names the full masters too.
    The lost master's degraded_io was reported partial whatever the others' state, so the
    daemon went on offering every block to a tier that declined them all."""
    cluster = redis_cluster_partial
    nbytes = 4096
    n = 16
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    victim = cluster.nodes[2]
    others = [node for node in cluster.nodes if node is not victim]
    async with master_lost(cluster, victim):
        try:
            # Lost from the start (no call meets it): the pauses below outlast the test.
            opts = fail_fast_options(cluster, l3_prefix, backoff_initial_s=60.0, backoff_max_s=60.0)
            async with opened(opts) as tier:
                health = tier.health()
                assert health.state is Health.DEGRADED_IO and health.accepts_writes, health
                for node in others:
                    node.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
                    node.cli("CONFIG", "SET", "maxmemory", "1")
                assert await tier.write(chain, nbytes, host(src)) == [False] * n
                c = tier.stats().counters
                assert c["write_no_space"] > 0 and c["write_skipped_down"] > 0
                health = tier.health()
                assert not health.accepts_writes and not health.partial, health
                assert all(node.address in health.detail for node in cluster.nodes), health
                assert tier.stats().counters["down_transitions"] == 0
        finally:
            for node in others:
                node.cli("CONFIG", "SET", "maxmemory", "0")


async def test_regression_a_lost_master_back_cut_off_the_writes_in_flight_to_the_others(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str
) -> None:
    """A lost master back: the fresh client that found it is swapped in while the tier
    serves, and the writes then in flight to the other masters on the client it replaces
    are stored, not cut off. The replaced client was closed at once, failing them (every
    block False, as if the store were unreachable), though nothing was wrong with their
    masters."""
    cluster = redis_cluster_partial
    nbytes = 4096
    n = 48
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    namer = KeyNamer(l3_prefix)
    victim, held = cluster.nodes[1], cluster.nodes[0]
    on_held = [i for i, b in enumerate(chain) if cluster.owner_of_slot(slot_of(namer, b)) is held]
    assert on_held
    # Lost from the start; the op timeout outlasts the write held below.
    async with master_lost(cluster, victim), opened(cluster_options(cluster, l3_prefix)) as tier:
        assert tier.health().state is Health.DEGRADED_IO
        blocks = [chain[i] for i in on_held]
        # The write is sent, and waits for its master to take writes again.
        held.cli("CLIENT", "PAUSE", "25000", "WRITE")
        try:
            write = asyncio.create_task(tier.write(blocks, nbytes, host([src[i] for i in on_held])))
            await wait_for(
                "the write to be sent", lambda: tier.stats().gauges["inflight_ops"] == 1, 30.0
            )
            victim.start()
            await asyncio.to_thread(cluster.wait_ok)
            await wait_for("L3 to be ok again", lambda: tier.health().state is Health.OK, 30.0)
        finally:
            held.cli("CLIENT", "UNPAUSE")
        assert await write == [True] * len(blocks)
        dest = empty(len(blocks), nbytes)
        assert await tier.read(blocks, nbytes, host(dest)) == [True] * len(blocks)
        assert tier.stats().counters["down_transitions"] == 0


def served_slots(node: Any) -> set[int]:
    """The slots ``node`` serves, as it says itself."""
    for line in node.cli("CLUSTER", "NODES").splitlines():
        fields = line.split()
        if "myself" in fields[2].split(","):
            ranges = [r.partition("-") for r in fields[8:] if not r.startswith("[")]
            return {s for lo, _, hi in ranges for s in range(int(lo), int(hi or lo) + 1)}
    return set()


async def test_regression_deletes_while_a_master_is_lost_did_not_each_look_up_every_removal(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a master is lost, each Delete the store took started a resend of the removals
    remembered for it, which looked up the master of every remembered key to find none it
    could send: with 100,000 of them, 77 ms of the event loop per Delete (measured). Once a
    resend found them all waiting for the lost master, a Delete starts none, until a removal
    that may go is remembered; the lost master's removals still go once it is back."""
    cluster = redis_cluster_partial
    namer = KeyNamer(l3_prefix)
    victim = cluster.nodes[1]
    chain = [ref(i) for i in range(2400)]
    victim_slots = served_slots(victim)  # asked once: a redis-cli run per block is slow
    on_victim = [b for b in chain if slot_of(namer, b) in victim_slots]
    others = [b for b in chain if slot_of(namer, b) not in victim_slots][:20]
    async with master_lost(cluster, victim), opened(cluster_options(cluster, l3_prefix)) as tier:
        assert tier.health().state is Health.DEGRADED_IO
        await tier.remove(on_victim)
        assert tier.stats().gauges["removals_unconfirmed"] == len(on_victim)
        lookups = ServerLookups(tier, monkeypatch)
        for block in others:
            await tier.remove([block])
            await wait_for("the resend to end", lambda: tier._resending is None, 30.0)
        # The first resend looks them all up; the Deletes' own keys are looked up too.
        assert lookups.keys <= len(on_victim) + 2 * len(others), lookups.keys
        assert tier.stats().gauges["removals_unconfirmed"] == len(on_victim)
        victim.start()
        await asyncio.to_thread(cluster.wait_ok)
        await wait_for(
            "the lost master's removals to be confirmed",
            lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
            30.0,
        )


async def test_regression_one_master_refusing_the_password_stops_the_start(
    redis_cluster: RedisClusterProcs, l3_prefix: str, tmp_path: Any
) -> None:
    """One master refuses the tier's password (the others take it): the start is refused,
    naming the credentials, as when every master refuses it. A refusal is no lost master:
    redis-py's AuthenticationError is a ConnectionError, and counting it one as a fault of
    the connection started the tier down, retrying for ever with the wrong password."""
    secret = tmp_path / "l3.password"
    secret.write_text("right-pw\n")
    secret.chmod(0o600)
    odd = redis_cluster.nodes[2]
    for node in redis_cluster.nodes:
        node.cli("CONFIG", "SET", "requirepass", "other-pw" if node is odd else "right-pw")
        node.password = "other-pw" if node is odd else "right-pw"
    try:
        tier = RemoteTier(cluster_options(redis_cluster, l3_prefix, password_file=str(secret)))
        try:
            with pytest.raises(TierUnavailable, match="credentials"):
                await tier.start()
        finally:
            await tier.close()  # closed already by a refused start
    finally:
        for node in redis_cluster.nodes:
            node.cli("CONFIG", "SET", "requirepass", "")
            node.password = None


class _TopJitter(random.Random):
    """Every jitter at the top of its range."""

    def uniform(self, a: float, b: float) -> float:
        return b


async def test_regression_a_master_lost_where_the_cluster_announces_hostnames_kept_l3_down(
    redis_cluster_hostnames: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master lost while the cluster announces its nodes by hostname (cluster-preferred-
    endpoint-type hostname): L3 serves the other masters, degraded_io naming the lost one,
    as where nodes are known by address. The check matched the client's name for the lost
    master (the hostname's) with the address in CLUSTER NODES, found no node counting it
    failed, and kept the tier down for as long as the master was gone."""
    cluster = redis_cluster_hostnames
    victim = cluster.nodes[1]
    async with master_lost(cluster, victim), opened(cluster_options(cluster, l3_prefix)) as tier:
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and health.partial, health
        assert f"127.1:{victim.port}" in health.detail, health


async def test_regression_the_lost_master_recheck_ignored_the_injected_rng(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str
) -> None:
    """The recheck of a lost master is jittered by the tier's rng (injected: the whole
    backoff here, 300 s), as its other backoffs are; it took the global random's."""
    cluster = redis_cluster_partial
    victim = cluster.nodes[2]
    async with master_lost(cluster, victim):
        tier = RemoteTier(
            cluster_options(cluster, l3_prefix, backoff_initial_s=300.0, backoff_max_s=300.0),
            rng=_TopJitter(),
        )
        started = time.monotonic()
        await tier.start()
        try:
            assert tier.health().state is Health.DEGRADED_IO
            assert started + 300.0 <= tier._lost_retry_at <= time.monotonic() + 300.0
        finally:
            await tier.close()


async def test_regression_retry_in_s_read_0_while_a_lost_master_s_recheck_was_pending(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str
) -> None:
    """While a master is lost, the ``retry_in_s`` gauge says when the monitor asks again
    whether it is back (here the whole backoff, 300 s, on a clock that stands still), as it
    says while L3 is down when the reconnection is due. It read 0, as for a tier with
    nothing to retry."""
    cluster = redis_cluster_partial
    async with master_lost(cluster, cluster.nodes[2]):
        opts = cluster_options(cluster, l3_prefix, backoff_initial_s=300.0, backoff_max_s=300.0)
        tier = RemoteTier(opts, clock=lambda: 1000.0, rng=_TopJitter())
        await tier.start()
        try:
            assert tier.health().state is Health.DEGRADED_IO
            assert tier.stats().gauges["retry_in_s"] == 300.0
        finally:
            await tier.close()


async def test_regression_the_master_of_slot_0_lost_kept_l3_down(
    redis_cluster_partial: RedisClusterProcs, l3_prefix: str
) -> None:
    """The master of slot 0 lost, the others serving: L3 serves them, degraded_io, as with
    any other master lost. redis-py asks its default node (the first primary of CLUSTER
    SLOTS, slot 0's) for the command table as the client is made, which failed on every
    attempt while that master was gone: the tier stayed down."""
    cluster = redis_cluster_partial
    victim = cluster.owner_of_slot(0)
    nbytes = 4096
    n = 16
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    namer = KeyNamer(l3_prefix)
    on_victim = [slot_of(namer, b) in served_slots(victim) for b in chain]
    async with master_lost(cluster, victim), opened(cluster_options(cluster, l3_prefix)) as tier:
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and victim.address in health.detail, health
        stored = await tier.write(chain, nbytes, host(src))
        assert stored == [not lost for lost in on_victim]


async def test_regression_a_full_master_failed_over_kept_l3_s_up_gauge_at_0(
    redis_cluster_replicated: RedisClusterProcs, l3_prefix: str
) -> None:
    """A master paused for lack of memory, then failed over to its replica: once the tier
    serves through a client that knows the new master (here the one that found a lost
    master back), the old one's pause counts no more and the ``up`` gauge is 1 again. The
    pause, ended only by a write to its master that goes through, stayed for good (no
    write goes to a replica), and ``up`` with it at 0."""
    cluster = redis_cluster_replicated
    nbytes = 4096
    n = 32
    chain = [ref(i) for i in range(n)]
    src = [data(i, nbytes) for i in range(n)]
    lost, full, _ = cluster.primaries()
    (lost_replica,) = cluster.replicas_of(lost)
    (full_replica,) = cluster.replicas_of(full)
    for node in cluster.nodes:
        node.cli("CONFIG", "SET", "cluster-require-full-coverage", "no")
    try:
        lost_replica.kill()  # first, so that it cannot take over
        lost.kill()
        await wait_for(
            "the others to count the master failed", lambda: counted_failed(cluster, lost), 30.0
        )
        async with opened(cluster_options(cluster, l3_prefix)) as tier:
            assert tier.health().state is Health.DEGRADED_IO
            full.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
            full.cli("CONFIG", "SET", "maxmemory", "1")
            try:
                await tier.write(chain, nbytes, host(src))
                assert tier.stats().counters["write_no_space"] > 0
            finally:
                full.cli("CONFIG", "SET", "maxmemory", "0")
            full_replica.cli("CLUSTER", "FAILOVER")
            await until_primary(cluster, full_replica)
            lost.start()
            lost_replica.start()
            await asyncio.to_thread(cluster.wait_ok)
            await wait_for("L3 to be ok again", lambda: tier.health().state is Health.OK, 30.0)
            assert await tier.write(chain, nbytes, host(src)) == [True] * n
            await wait_for("L3 to be up", lambda: tier.stats().gauges["up"] == 1.0, 10.0)
    finally:
        for node in (lost, lost_replica):
            if not node.running:
                node.start()
        for node in cluster.nodes:
            node.cli("CONFIG", "SET", "cluster-require-full-coverage", "yes")
        await asyncio.to_thread(cluster.wait_ok)
