"""Requests whose clients cancel them (or whose deadline passes) still run to their end.

Found by the fuzz test (tests/test_fuzz.py): a Delete cancelled while the disk tier was
forgetting its blocks left their L2 slots allocated for good (the invariant check counted
more slots than blocks) and their index rows in place, so the deleted blocks came back after
a restart; Puts cancelled during their copies left L1 slots allocated that no block held.
gRPC cancels a handler's coroutine at whatever await it is in; the servicer now lets
the request finish and only drops its answer.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
from test_l2_daemon import l2_args

from kvtier.client import Client, PoolLayout, SharedMemoryPool, Tier
from kvtier.proto import kvtier_pb2 as pb

LAYOUT = PoolLayout.staging(
    num_layers=2, num_pages=64, block_tokens=4, chunk_bytes=8192, kv_count=1, dtype="uint8"
)
BLOCK = LAYOUT.block_bytes


def _small_daemon(daemon_factory, tmp_path, *extra: str):
    return daemon_factory(
        "policy.protect_s=0",
        "tiers.l1.segment_bytes=1MiB",
        *l2_args(tmp_path / "l2", "tiers.l2.capacity_bytes=8MiB", "tiers.l2.file_bytes=8MiB"),
        *extra,
        l1_bytes="2MiB",
    )


def test_regression_cancelled_deletes_leaked_l2_slots_and_the_blocks_came_back(
    daemon_factory, tmp_path
):
    d = _small_daemon(daemon_factory, tmp_path)
    deleted: list[bytes] = []
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        for r in range(40):
            ks = [os.urandom(32) for _ in range(8)]
            client.put(pool.pool_id, ks, range(8))
            assert client.evict(ks, "L1").evicted == 8
            call = client._stub.Delete.future(
                pb.DeleteRequest(session_id=client.session_id, keys=ks)
            )
            time.sleep(0.0005 * (r % 5))  # cancelled at every step of the delete
            call.cancel()
            found = client.lookup(ks)
            if found.prefix_len == 0:
                deleted += ks
        check = client.check(settle_s=5)
        assert check.problems == [] and check.strict
    assert len(deleted) >= 8 * 10  # most deletes reached the daemon
    d.restart()  # SIGTERM, then a new process reads the disk tier's index
    with d.client() as client:
        assert client.lookup(deleted).tiers == [Tier.ABSENT] * len(deleted)
        assert client.check(settle_s=5).problems == []


def test_regression_cancelled_puts_left_slots_no_block_held(daemon_factory, tmp_path):
    """Puts of one content are cancelled mid-copy while puts of another follow: the slots
    add up afterwards (before the fix L1 had 128 slots allocated for 79 blocks), and every
    block reads back exactly as stored."""
    d = _small_daemon(daemon_factory, tmp_path)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        data = shm.array().reshape(LAYOUT.num_pages, BLOCK)
        rng = np.random.default_rng(0)
        data[:32] = 0xEE  # what cancelled puts copy
        kept: dict[bytes, np.ndarray] = {}
        for r in range(60):
            doomed = [os.urandom(32) for _ in range(16)]
            call = client._stub.Put.future(
                pb.PutRequest(
                    session_id=client.session_id,
                    pool_id=pool.pool_id,
                    keys=doomed,
                    pages=list(range(16)),
                )
            )
            time.sleep(0.0002 * (r % 7))
            call.cancel()
            ks = [os.urandom(32) for _ in range(8)]
            data[32:40] = rng.integers(0, 255, (8, BLOCK), dtype=np.uint8)
            assert client.put(pool.pool_id, ks, range(32, 40)).stored == 8
            kept.update({k: data[32 + i].copy() for i, k in enumerate(ks)})
            if len(kept) > 96:  # keep them in L1 (2 MiB) and L2 without pressure
                old = list(kept)[:32]
                client.delete(old)
                for k in old:
                    del kept[k]
        keys = list(kept)
        for start in range(0, len(keys), 16):
            chunk = keys[start : start + 16]
            got = client.get(pool.pool_id, chunk, range(40, 40 + len(chunk)))
            assert all(got.loaded)
            for i, k in enumerate(chunk):
                assert np.array_equal(data[40 + i], kept[k]), "a block read back wrong"
        assert client.check(settle_s=5).problems == []


async def test_regression_a_register_pool_past_its_deadline_left_the_pool_registered(monkeypatch):
    """A client that gave up on a RegisterPool (its deadline passed while the daemon mapped
    the memory or worked through other requests) was not seen until grpc dropped the
    answer: the pool stayed mapped and counted toward the session's pools, under an id the
    client never learned, until the session ended; with one pool allowed, registering the
    memory again was RESOURCE_EXHAUSTED. Now a registration whose deadline passed before
    the answer went out is undone at once. Runs a real gRPC server in this process, whose
    registry, once the first registration is made, holds the event loop (so grpc cannot
    tell the handler of the cancel) until the client has given up and the call's deadline
    (its arrival plus the timeout) has passed by the daemon's clock."""
    from kvtier.client import credentials
    from kvtier.client.flows import PoolBinding
    from kvtier.daemon.config import load_config
    from kvtier.daemon.pools import PoolRegistry
    from kvtier.daemon.server import Daemon

    timeout_s = 1.0
    gave_up = threading.Event()
    held: list[float] = []  # when the held registration began (it arrived before)
    register_fd = PoolRegistry.register_fd

    async def held_register_fd(self: PoolRegistry, *args: Any, **kwargs: Any) -> Any:
        pool = await register_fd(self, *args, **kwargs)
        if not held and not gave_up.is_set():
            held.append(time.time())
            gave_up.wait(30)
            while time.time() < held[0] + 2 * timeout_s:  # grpc's deadline is behind us
                time.sleep(0.01)
        return pool

    monkeypatch.setattr(PoolRegistry, "register_fd", held_register_fd)

    def client_side(address: str) -> None:
        with Client(address) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
            cred = credentials.cred_socket_path(address)
            assert cred is not None
            request = PoolBinding(shm, LAYOUT, None).register_request(
                credentials.pool_ticket(cred, shm.fd, 30.0)
            )
            request.session_id = client.session_id
            with pytest.raises(grpc.RpcError) as lost:
                client.stub.RegisterPool(request, timeout=timeout_s)
            assert lost.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gave_up.set()
            pool = client.register_pool(shm, LAYOUT)  # the memory again, within the limit
            check = client.check()
            assert check.problems == [] and check.pools == 1
            assert client.stats().gauges["pools"] == 1
            client.unregister_pool(pool.pool_id)

    sockdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    config = load_config(
        None,
        [
            f"server.socket={sockdir}/d.sock",
            "tiers.l1.capacity_bytes=8MiB",
            "tiers.l1.segment_bytes=1MiB",
            "server.max_pools_per_session=1",
        ],
        environ={},
    )
    daemon = Daemon(config)
    await daemon.start()
    try:
        await asyncio.to_thread(client_side, daemon.addresses[0])
    finally:
        gave_up.set()
        await daemon.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
    assert held, "the first registration never reached the registry"


def test_large_requests_whose_clients_left_at_every_point_of_their_turn_held_no_turn(daemon):
    """A large request's handler starts in its turn (``daemon/stepturns.py``): one turn held
    for good would hang every later large request of every tenant. Clients leave their large
    Lookups at every point (waiting for the turn, handed it, in the handler, after it: a
    cancel after 0 to 3 ms, a deadline of 1 to 4 ms), some naming no open session (their
    handler raises); then a large Lookup of each kind is still answered."""
    keys = [os.urandom(32) for _ in range(4096)]
    with daemon.client() as client, grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        client.lookup(keys[:1])  # its session opens
        lookup = channel.unary_unary(
            "/kvtier.v1.KVTier/Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        ok = pb.LookupRequest(session_id=client.session_id, keys=keys)
        bad = pb.LookupRequest(session_id="0" * 32, keys=keys)
        rng = random.Random(0)
        for _ in range(30):
            calls = [
                lookup.future(rng.choice((ok, bad)), timeout=rng.choice((None, 0.001 * i)))
                for i in range(1, 17)
            ]
            time.sleep(rng.uniform(0, 0.003))
            for call in calls:
                if rng.random() < 0.5:
                    call.cancel()
            for call in calls:
                if not call.cancelled():
                    call.exception(timeout=60)  # answered, or its deadline passed
        assert client.lookup(keys, timeout_s=60).prefix_len == 0
        with pytest.raises(grpc.RpcError) as e:
            lookup(bad, timeout=60)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert client.stats().counters["requests_step_waited"] > 0
