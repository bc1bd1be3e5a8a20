"""The wire API end to end: a real daemon subprocess, the real client, real shared memory."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
from harness import DaemonProcess

from kvtier.client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    Namespace,
    NotFoundError,
    PermissionDeniedError,
    PoolLayout,
    PutStatus,
    SharedMemoryPool,
    Tier,
    credentials,
)
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

BLOCK_TOKENS = 4
LAYOUTS = {
    "vllm": PoolLayout.vllm(
        num_layers=3,
        num_pages=16,
        block_tokens=BLOCK_TOKENS,
        num_kv_heads=2,
        head_dim=8,
        dtype="float16",
    ),
    "flashinfer": PoolLayout.flashinfer(
        num_layers=3,
        num_pages=16,
        block_tokens=BLOCK_TOKENS,
        num_kv_heads=2,
        head_dim=8,
        dtype="float16",
    ),
    "staging": PoolLayout.staging(
        num_layers=3, num_pages=16, block_tokens=BLOCK_TOKENS, chunk_bytes=128, dtype="float16"
    ),
}


def random_fill(shm: SharedMemoryPool, seed: int) -> np.ndarray:
    data = shm.array()
    data[:] = np.random.default_rng(seed).integers(0, 256, len(data), dtype=np.uint8)
    return data


def block_bytes_of(layout: PoolLayout, data: np.ndarray, page: int) -> bytes:
    """A page's block as the daemon defines it: its chunks, layer by layer, K before V."""
    t = layout.chunk_table
    return b"".join(
        data[int(b + page * s) : int(b + page * s + n)].tobytes()
        for b, s, n in zip(t.pool_base, t.page_stride, t.length, strict=True)
    )


def keys_for(n: int, tag: str = "") -> list[bytes]:
    ns = Namespace(model=f"test-model{tag}", kv_dtype="float16", block_tokens=BLOCK_TOKENS)
    from kvtier.client import block_keys

    return block_keys(ns, list(range(n * BLOCK_TOKENS)))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_is_byte_exact(namespaced_daemon, name):
    layout = LAYOUTS[name]
    with namespaced_daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        data = random_fill(shm, 1)
        pool = client.register_pool(shm, layout)
        assert pool.block_bytes == layout.block_bytes
        keys = keys_for(6, name)
        src_pages = [3, 0, 7, 1, 15, 9]
        expected = [block_bytes_of(layout, data, p) for p in src_pages]
        put = client.put(pool.pool_id, keys, src_pages)
        assert put.statuses == [PutStatus.STORED] * 6 and put.stored == 6

        data[:] = 0
        dst_pages = [10, 11, 2, 4, 5, 6]
        got = client.get(pool.pool_id, keys, dst_pages)
        assert got.loaded == [True] * 6 and got.prefix_len == 6
        assert [block_bytes_of(layout, data, p) for p in dst_pages] == expected
        # Nothing outside the destination pages was written.
        untouched = set(range(layout.num_pages)) - set(dst_pages)
        assert all(block_bytes_of(layout, data, p) == bytes(layout.block_bytes) for p in untouched)


def test_layouts_with_equal_chunks_share_blocks(namespaced_daemon):
    """A block stored from a vLLM pool loads into a FlashInfer pool: the block format is the
    chunks, not the page layout."""
    vllm, flash = LAYOUTS["vllm"], LAYOUTS["flashinfer"]
    with (
        namespaced_daemon.client() as client,
        SharedMemoryPool.for_layout(vllm) as a,
        SharedMemoryPool.for_layout(flash) as b,
    ):
        data_a = random_fill(a, 2)
        pa, pb_ = client.register_pool(a, vllm), client.register_pool(b, flash)
        keys = keys_for(3, "shared")
        client.put(pa.pool_id, keys, [0, 1, 2])
        assert client.get(pb_.pool_id, keys, [5, 6, 7]).prefix_len == 3
        data_b = b.array()
        for src, dst in zip([0, 1, 2], [5, 6, 7], strict=True):
            assert block_bytes_of(vllm, data_a, src) == block_bytes_of(flash, data_b, dst)


def test_lookup_reports_prefix_tiers_and_pins(namespaced_daemon):
    layout = LAYOUTS["staging"]
    with namespaced_daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        random_fill(shm, 3)
        pool = client.register_pool(shm, layout)
        keys = keys_for(5, "lookup")
        client.put(pool.pool_id, [keys[0], keys[1], keys[3]], [0, 1, 3])
        res = client.lookup(keys)
        assert res.prefix_len == 2
        assert res.tiers == [Tier.L1_HOST, Tier.L1_HOST, Tier.ABSENT, Tier.L1_HOST, Tier.ABSENT]
        assert res.lease_id == 0
        pinned = client.lookup(keys, pin=True, lease_ms=5_000)
        assert pinned.lease_id != 0
        # A pinned block cannot be deleted; once released it can.
        assert client.delete([keys[0]]).busy == 1
        client.release(pinned.lease_id)
        assert client.delete([keys[0]]).deleted == 1
        assert client.lookup(keys).prefix_len == 0
        with pytest.raises(NotFoundError):
            client.release(pinned.lease_id)


def test_regression_delete_and_evict_counted_a_missing_key_named_twice_twice(daemon_factory):
    """Delete, Evict and Prefetch count distinct keys: a key named three times is one block,
    or one missing key. Regression: blocks were counted once but a missing key once per
    naming (missing=3 below, where Prefetch answers 1)."""
    layout = LAYOUTS["staging"]
    d = daemon_factory("policy.protect_s=0")
    with d.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        random_fill(shm, 5)
        pool = client.register_pool(shm, layout)
        a, b, absent = keys_for(3, "named-twice")
        client.put(pool.pool_id, [a, b], [0, 1])
        ev = client.evict([a] * 3 + [absent] * 3, "L1")
        assert (ev.evicted, ev.missing, ev.busy) == (1, 1, 0)
        assert client.prefetch([absent] * 3 + [b] * 3).missing == 1
        de = client.delete([b] * 3 + [a] * 3 + [absent] * 3)
        assert (de.deleted, de.missing, de.busy) == (1, 2, 0)
        assert client.lookup([a, b]).tiers == [Tier.ABSENT] * 2


def test_put_of_existing_keys_copies_nothing(namespaced_daemon):
    layout = LAYOUTS["staging"]
    with namespaced_daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        data = random_fill(shm, 4)
        pool = client.register_pool(shm, layout)
        keys = keys_for(2, "exists")
        original = block_bytes_of(layout, data, 0)
        client.put(pool.pool_id, keys[:1], [0])
        data[:] = 7
        again = client.put(pool.pool_id, keys, [0, 1])
        assert again.statuses == [PutStatus.EXISTS, PutStatus.STORED]
        data[:] = 0
        client.get(pool.pool_id, keys[:1], [2])
        assert block_bytes_of(layout, data, 2) == original


def test_single_key_puts_get_their_own_result_call_after_call(namespaced_daemon):
    """A single-key Put that is not durable is answered with a response built once per
    result (server._ONE_PUT_RESPONSE): each call gets its own result's, whatever the calls
    before it got."""
    layout = LAYOUTS["staging"]
    with namespaced_daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        random_fill(shm, 4)
        pool = client.register_pool(shm, layout)
        for key in keys_for(2, "one-by-one"):
            first = client.put(pool.pool_id, [key], [0])
            assert (first.statuses, first.stored) == ([PutStatus.STORED], 1)
            again = client.put(pool.pool_id, [key], [1])
            assert (again.statuses, again.stored) == ([PutStatus.EXISTS], 0)


def test_asyncio_client_has_the_same_surface(namespaced_daemon):
    import asyncio

    from kvtier.client import AsyncClient

    layout = LAYOUTS["vllm"]
    ns = Namespace(model="async", kv_dtype="float16", block_tokens=BLOCK_TOKENS)

    async def scenario() -> tuple[int, int, bool]:
        async with AsyncClient(
            namespaced_daemon.address, namespace=namespaced_daemon.namespace
        ) as client:
            with SharedMemoryPool.for_layout(layout) as shm:
                data = random_fill(shm, 5)
                pool = await client.register_pool(shm, layout, ns)
                tokens = list(range(5 * BLOCK_TOKENS + 2))
                expected = [block_bytes_of(layout, data, p) for p in range(5)]
                stored = await pool.store(tokens, range(5))
                data[:] = 0
                loaded = await pool.load(tokens, range(5))
                same = [block_bytes_of(layout, data, p) for p in range(5)] == expected
                assert (await client.lookup(pool.keys(tokens))).prefix_len == 5
                assert await client.health()
                return stored, loaded, same

    assert asyncio.run(scenario()) == (20, 20, True)


CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np
    from kvtier.client import Client, Namespace, PoolLayout, SharedMemoryPool
    address, seed, shared_seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    layout = PoolLayout.vllm(num_layers=4, num_pages=64, block_tokens=8, num_kv_heads=2,
                             head_dim=16, dtype="float16")
    ns = Namespace(model="concurrent", kv_dtype="float16", block_tokens=8)
    rng = np.random.default_rng(seed)
    with Client(address) as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout, ns)
        data = shm.array()
        for round in range(20):
            # Private tokens: content is a function of the seed, so it must come back exact.
            tokens = [seed * 100000 + round * 1000 + i for i in range(8 * 16)]
            data[:] = rng.integers(0, 256, len(data), dtype=np.uint8)
            expected = data.copy()
            assert pool.store(tokens, range(16)) == 128
            data[:] = 0
            assert pool.load(tokens, range(16, 32)) == 128
            t = layout.chunk_table
            for src, dst in zip(range(16), range(16, 32)):
                for b, s, n in zip(t.pool_base, t.page_stride, t.length):
                    a = expected[int(b + src * s): int(b + src * s + n)]
                    c = data[int(b + dst * s): int(b + dst * s + n)]
                    assert np.array_equal(a, c), (round, src)
            # A prefix both processes store with equal bytes.
            shared = [shared_seed + i for i in range(8 * 8)]
            data[:] = 42
            pool.store(shared, range(8))
            data[:] = 0
            assert pool.load(shared, range(8)) == 64
            assert (data[: layout.extent_bytes][data[: layout.extent_bytes] != 0] == 42).all()
    print("ok")
    """
)


def test_two_client_processes_at_once(daemon):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT_SCRIPT, daemon.address, str(seed), "7"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "ok"
    with daemon.client() as client:
        stats = client.stats()
        # Stats needs a session: this client's own is the only one left.
        assert stats.gauges["sessions"] == 1 and stats.gauges["pools"] == 0


def test_a_dead_client_leaves_no_pools_or_pins(daemon):
    script = textwrap.dedent(
        """
        import os, sys, time
        from kvtier.client import Client, PoolLayout, SharedMemoryPool
        layout = PoolLayout.staging(num_layers=1, num_pages=4, block_tokens=1, chunk_bytes=64)
        client = Client(sys.argv[1])
        shm = SharedMemoryPool.for_layout(layout, backing="shm")
        pool = client.register_pool(shm, layout)
        key = bytes(range(32))
        client.put(pool.pool_id, [key], [0])
        print(client.lookup([key], pin=True, lease_ms=600000).lease_id, shm.path, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, daemon.address], stdout=subprocess.PIPE, text=True
    )
    shm_path = None
    try:
        lease, shm_path = proc.stdout.readline().split()
        assert int(lease) > 0
        with daemon.client() as client:
            assert client.stats().gauges["pools"] == 1
            assert client.stats().gauges["leases"] == 1
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 10
            while client.stats().gauges["pools"] and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = client.stats()
            assert stats.gauges["pools"] == 0 and stats.gauges["leases"] == 0
            # The block is no longer pinned: it can be deleted.
            assert client.delete([bytes(range(32))]).deleted == 1
    finally:
        proc.kill()
        proc.wait()
        if shm_path:  # the killed client could not remove its pool's name
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path)


def test_regression_a_load_whose_first_block_was_missing_kept_the_rest_pinned(daemon):
    """Found by the soak: a pinning Lookup pins every block it finds, also past a missing
    first one; the load flow then stopped at the empty prefix without releasing the lease,
    so those blocks stayed pinned (unevictable) for lease_default_ms."""
    layout = LAYOUTS["staging"]
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        keys = keys_for(4, "missing-head")
        assert pool.store_keys(keys[1:], [1, 2, 3], parent_key=keys[0]) == 3
        assert pool.load_keys(keys, [4, 5, 6, 7]) == 0
        gauges = client.stats().gauges
        assert gauges["leases"] == 0 and gauges["blocks_pinned"] == 0


def test_a_load_fills_the_pages_it_is_given_and_a_store_needs_one_per_key(daemon):
    """A load given fewer pages than keys loads the stored prefix that fits them (an engine
    loads into the pages it has free) and leaves nothing pinned; a store given fewer pages
    than keys is refused before anything is sent."""
    layout = LAYOUTS["staging"]
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        data = random_fill(shm, seed=47)
        keys = keys_for(4, "fewer-pages")
        with pytest.raises(InvalidArgumentError, match="3 pages for 4 keys"):
            pool.store_keys(keys, [0, 1, 2])
        assert client.lookup(keys).prefix_len == 0
        assert pool.store_keys(keys, [0, 1, 2, 3]) == 4
        sent = [block_bytes_of(layout, data, page) for page in range(4)]
        assert pool.load_keys(keys, [8, 9]) == 2
        assert [block_bytes_of(layout, data, page) for page in (8, 9)] == sent[:2]
        assert block_bytes_of(layout, data, 10) != sent[2]  # untouched past the given pages
        gauges = client.stats().gauges
        assert gauges["leases"] == 0 and gauges["blocks_pinned"] == 0


def test_leases_expire(daemon):
    layout = LAYOUTS["staging"]
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        keys = keys_for(1, "expire")
        client.put(pool.pool_id, keys, [0])
        client.lookup(keys, pin=True, lease_ms=100)
        assert client.delete(keys).busy == 1
        deadline = time.monotonic() + 30
        while client.stats().gauges["leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.delete(keys).deleted == 1


# ------------------------------------------------------------------ bad inputs


def _raw_stub(daemon):
    channel = grpc.insecure_channel(daemon.address)
    return channel, pb_grpc.KVTierStub(channel)


def _open_raw_session(stub, address):
    ticket = credentials.session_ticket(credentials.cred_socket_path(address))
    call = stub.OpenSession(pb.OpenSessionRequest(client_name="raw", credential_ticket=ticket))
    return call, next(call).session_id


def _status(fn, *args):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    return info.value.code(), info.value.details()


@pytest.fixture
def raw(shared_daemon):
    daemon = shared_daemon
    # The module's other tests store blocks in this daemon too (each in its own namespace):
    # a refused request stores none, so the count is the same at the end.
    with daemon.client() as client:
        blocks = client.stats().gauges["blocks"]
    channel, stub = _raw_stub(daemon)
    call, session = _open_raw_session(stub, daemon.address)
    layout = LAYOUTS["staging"]
    shm = SharedMemoryPool.for_layout(layout, backing="shm")
    from kvtier.client.types import layout_to_pb

    reg = stub.RegisterPool(
        pb.RegisterPoolRequest(
            session_id=session,
            shm=pb.ShmRegion(name=shm.name, size_bytes=shm.size_bytes),
            layout=layout_to_pb(layout),
        )
    )
    yield stub, session, reg.pool_id, shm, layout, daemon.address
    call.cancel()
    shm.close()
    channel.close()
    # The daemon answers health checks after every refused request.
    with daemon.client() as client:
        assert client.health()
        assert client.stats().gauges["blocks"] == blocks


KEY = bytes(32)
C = grpc.StatusCode


@pytest.mark.parametrize(
    "case, expected",
    [
        ("page_out_of_range", C.INVALID_ARGUMENT),
        ("pages_keys_mismatch", C.INVALID_ARGUMENT),
        ("empty_batch", C.INVALID_ARGUMENT),
        ("oversized_batch", C.INVALID_ARGUMENT),
        ("short_key", C.INVALID_ARGUMENT),
        ("long_key", C.INVALID_ARGUMENT),
        ("unknown_pool", C.NOT_FOUND),
        ("unknown_session", C.NOT_FOUND),
        ("no_session", C.NOT_FOUND),
        ("duplicate_get_pages", C.INVALID_ARGUMENT),
        ("bad_parent_key", C.INVALID_ARGUMENT),
        ("lease_too_long", C.INVALID_ARGUMENT),
        ("release_unknown_lease", C.NOT_FOUND),
        ("layer_begin_without_end", C.INVALID_ARGUMENT),
        ("empty_layer_range", C.INVALID_ARGUMENT),
        ("layer_range_beyond_layout", C.INVALID_ARGUMENT),
    ],
)
def test_bad_block_requests_get_typed_status(raw, case, expected):
    stub, session, pool_id, _, layout, _ = raw
    put = stub.Put
    requests = {
        "page_out_of_range": (
            put,
            pb.PutRequest(
                session_id=session, pool_id=pool_id, keys=[KEY], pages=[layout.num_pages]
            ),
        ),
        "pages_keys_mismatch": (
            put,
            pb.PutRequest(session_id=session, pool_id=pool_id, keys=[KEY], pages=[0, 1]),
        ),
        "empty_batch": (put, pb.PutRequest(session_id=session, pool_id=pool_id)),
        "oversized_batch": (stub.Lookup, pb.LookupRequest(session_id=session, keys=[KEY] * 5000)),
        "short_key": (stub.Lookup, pb.LookupRequest(session_id=session, keys=[b"\x01" * 31])),
        "long_key": (
            put,
            pb.PutRequest(session_id=session, pool_id=pool_id, keys=[b"\x01" * 33], pages=[0]),
        ),
        "unknown_pool": (
            put,
            pb.PutRequest(session_id=session, pool_id=12345, keys=[KEY], pages=[0]),
        ),
        "unknown_session": (
            put,
            pb.PutRequest(session_id="nope", pool_id=pool_id, keys=[KEY], pages=[0]),
        ),
        "no_session": (stub.Lookup, pb.LookupRequest(keys=[KEY], pin=True)),
        "duplicate_get_pages": (
            stub.Get,
            pb.GetRequest(session_id=session, pool_id=pool_id, keys=[KEY, KEY], pages=[1, 1]),
        ),
        "bad_parent_key": (
            put,
            pb.PutRequest(
                session_id=session, pool_id=pool_id, keys=[KEY], pages=[0], parent_key=b"x"
            ),
        ),
        "lease_too_long": (
            stub.Lookup,
            pb.LookupRequest(session_id=session, keys=[KEY], pin=True, lease_ms=10**9),
        ),
        "release_unknown_lease": (stub.Release, pb.ReleaseRequest(session_id=session, lease_id=99)),
        "layer_begin_without_end": (
            stub.Get,
            pb.GetRequest(
                session_id=session, pool_id=pool_id, keys=[KEY], pages=[0], layer_begin=1
            ),
        ),
        "empty_layer_range": (
            stub.Get,
            pb.GetRequest(
                session_id=session,
                pool_id=pool_id,
                keys=[KEY],
                pages=[0],
                layer_begin=2,
                layer_end=2,
            ),
        ),
        "layer_range_beyond_layout": (
            stub.Get,
            pb.GetRequest(
                session_id=session,
                pool_id=pool_id,
                keys=[KEY],
                pages=[0],
                layer_begin=1,
                layer_end=len(layout.layers) + 1,
            ),
        ),
    }
    fn, request = requests[case]
    code, details = _status(fn, request)
    assert code == expected, details
    assert details  # every refusal says why


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_shm", C.NOT_FOUND),
        ("bad_shm_name", C.INVALID_ARGUMENT),
        ("declared_size_too_big", C.INVALID_ARGUMENT),
        ("layout_beyond_region", C.INVALID_ARGUMENT),
        ("overlapping_kv", C.INVALID_ARGUMENT),
        ("bad_kv_count", C.INVALID_ARGUMENT),
        ("no_layers", C.INVALID_ARGUMENT),
        ("no_dtype", C.INVALID_ARGUMENT),
        ("no_region", C.INVALID_ARGUMENT),
        ("cuda_ipc_without_gpu", C.FAILED_PRECONDITION),
        # Malformed CUDA IPC regions are the request's fault on any host, one without a GPU
        # tier included (they were FAILED_PRECONDITION here, "need the GPU tier").
        ("cuda_ipc_truncated_handle", C.INVALID_ARGUMENT),
        ("cuda_ipc_overlapping_buffers", C.INVALID_ARGUMENT),
        ("cuda_ipc_layout_beyond_buffers", C.INVALID_ARGUMENT),
        ("cuda_ipc_size_beyond_2_62", C.INVALID_ARGUMENT),
        ("block_larger_than_slot", C.INVALID_ARGUMENT),
    ],
)
def test_bad_registrations_get_typed_status(raw, case, expected):
    stub, session, _, shm, layout, _ = raw
    from kvtier.client.types import layout_to_pb

    good = layout_to_pb(layout)
    region = pb.ShmRegion(name=shm.name, size_bytes=shm.size_bytes)

    def layer_layout(**kw):
        base = dict(offset=0, kv_count=2, kv_stride=64, page_stride=128, chunk_bytes=64)
        base.update(kw)
        return pb.PoolLayout(
            layers=[pb.LayerLayout(**base)], num_pages=4, block_tokens=1, dtype=pb.DTYPE_UINT8
        )

    reqs = {
        "missing_shm": pb.RegisterPoolRequest(
            shm=pb.ShmRegion(name="kvtier-does-not-exist", size_bytes=shm.size_bytes), layout=good
        ),
        "bad_shm_name": pb.RegisterPoolRequest(
            shm=pb.ShmRegion(name="../etc/passwd", size_bytes=4096), layout=good
        ),
        "declared_size_too_big": pb.RegisterPoolRequest(
            shm=pb.ShmRegion(name=shm.name, size_bytes=shm.size_bytes * 2), layout=good
        ),
        "layout_beyond_region": pb.RegisterPoolRequest(
            shm=region, layout=layer_layout(offset=shm.size_bytes)
        ),
        "overlapping_kv": pb.RegisterPoolRequest(shm=region, layout=layer_layout(kv_stride=32)),
        "bad_kv_count": pb.RegisterPoolRequest(shm=region, layout=layer_layout(kv_count=3)),
        "no_layers": pb.RegisterPoolRequest(
            shm=region, layout=pb.PoolLayout(num_pages=1, block_tokens=1, dtype=pb.DTYPE_UINT8)
        ),
        "no_dtype": pb.RegisterPoolRequest(
            shm=region, layout=pb.PoolLayout(layers=good.layers, num_pages=1, block_tokens=1)
        ),
        "no_region": pb.RegisterPoolRequest(layout=good),
        "cuda_ipc_without_gpu": pb.RegisterPoolRequest(
            cuda_ipc=pb.CudaIpcRegion(handle=b"x" * 64, size_bytes=layout.extent_bytes),
            layout=good,
        ),
        "cuda_ipc_truncated_handle": pb.RegisterPoolRequest(
            cuda_ipc=pb.CudaIpcRegion(handle=b"x" * 3, size_bytes=layout.extent_bytes),
            layout=good,
        ),
        "cuda_ipc_overlapping_buffers": pb.RegisterPoolRequest(
            cuda_ipc=pb.CudaIpcRegion(
                buffers=[
                    pb.CudaIpcBuffer(handle=b"x" * 64, size_bytes=layout.extent_bytes),
                    pb.CudaIpcBuffer(handle=b"y" * 64, size_bytes=4096, pool_offset=4096),
                ]
            ),
            layout=good,
        ),
        "cuda_ipc_layout_beyond_buffers": pb.RegisterPoolRequest(
            cuda_ipc=pb.CudaIpcRegion(handle=b"x" * 64, size_bytes=4096), layout=good
        ),
        "cuda_ipc_size_beyond_2_62": pb.RegisterPoolRequest(
            cuda_ipc=pb.CudaIpcRegion(handle=b"x" * 64, size_bytes=2**64 - 1), layout=good
        ),
        "block_larger_than_slot": pb.RegisterPoolRequest(
            shm=pb.ShmRegion(name=shm.name, size_bytes=shm.size_bytes),
            layout=pb.PoolLayout(
                layers=[
                    pb.LayerLayout(
                        offset=0, kv_count=1, kv_stride=0, page_stride=0, chunk_bytes=65 << 20
                    )
                ],
                num_pages=1,
                block_tokens=1,
                dtype=pb.DTYPE_UINT8,
            ),
        ),
    }
    request = reqs[case]
    request.session_id = session
    if case == "block_larger_than_slot":
        big = SharedMemoryPool(66 << 20, backing="shm")
        request.shm.name, request.shm.size_bytes = big.name, big.size_bytes
    code, details = _status(stub.RegisterPool, request)
    if case == "block_larger_than_slot":
        big.close()
    assert code == expected, details


def test_a_pool_of_another_session_is_off_limits(raw):
    stub, _, pool_id, _, _, address = raw
    call, other = _open_raw_session(stub, address)
    try:
        code, _ = _status(
            stub.Put, pb.PutRequest(session_id=other, pool_id=pool_id, keys=[KEY], pages=[0])
        )
        assert code == C.PERMISSION_DENIED
        code, _ = _status(
            stub.UnregisterPool, pb.UnregisterPoolRequest(session_id=other, pool_id=pool_id)
        )
        assert code == C.PERMISSION_DENIED
    finally:
        call.cancel()


def test_block_size_mismatch_is_refused(namespaced_daemon):
    small = PoolLayout.staging(num_layers=1, num_pages=2, block_tokens=1, chunk_bytes=64)
    big = PoolLayout.staging(num_layers=1, num_pages=2, block_tokens=1, chunk_bytes=128)
    with (
        namespaced_daemon.client() as client,
        SharedMemoryPool.for_layout(small) as a,
        SharedMemoryPool.for_layout(big) as b,
    ):
        pa, pb_ = client.register_pool(a, small), client.register_pool(b, big)
        client.put(pa.pool_id, [KEY], [0])
        with pytest.raises(InvalidArgumentError, match="stored with 128 bytes"):
            client.get(pb_.pool_id, [KEY], [0])
        with pytest.raises(InvalidArgumentError):
            client.put(pb_.pool_id, [KEY], [0])
        assert client.health()


def test_client_errors_are_typed(namespaced_daemon):
    layout = LAYOUTS["staging"]
    with (
        namespaced_daemon.client() as a,
        namespaced_daemon.client() as b,
        SharedMemoryPool.for_layout(layout) as shm,
    ):
        with pytest.raises(InvalidArgumentError):
            a.lookup([])
        with pytest.raises(NotFoundError):
            a.unregister_pool(42)
        pool = a.register_pool(shm, layout)
        with pytest.raises(PermissionDeniedError):
            b.put(pool.pool_id, [KEY], [0])


def test_a_fenced_pool_is_confirmed_free_and_registers_again_on_next_use(daemon):
    layout = LAYOUTS["staging"]
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        random_fill(shm, 3)
        pool = client.register_pool(shm, layout)
        first = pool.pool_id
        assert client.put(first, [KEY], [0]).stored == 1
        assert client.fence_pool(pool.binding, timeout_s=5) is True
        assert client.stats().gauges["pools"] == 0
        # The next call through the pool registers the memory again, under a new id.
        assert client.get(client.pool_id_of(pool.binding), [KEY], [1]).loaded == [True]
        assert pool.pool_id != first
        # A daemon that cannot answer cannot confirm the fence.
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            assert client.fence_pool(pool.binding, timeout_s=0.5) is False
        finally:
            daemon.proc.send_signal(signal.SIGCONT)


class _Refused(grpc.RpcError):
    """What gRPC raises for a call the daemon's HTTP/2 layer refused unrun."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Stream removed (RST_STREAM (Received RST_STREAM with error code 7))"


def test_a_fence_refused_unrun_is_sent_again_and_confirmed(daemon):
    """A fence's UnregisterPool refused unrun (the connection had 256 calls open) ran
    nothing: the client sends it again as its other calls, and the fence is confirmed, not
    reported unconfirmed (pages the engine would then hold back for good)."""
    layout = LAYOUTS["staging"]
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        real, refused = client.stub.UnregisterPool, []

        def once_refused(request, timeout=None):
            if not refused:
                refused.append(request.pool_id)
                raise _Refused()
            return real(request, timeout=timeout)

        client.stub.UnregisterPool = once_refused
        assert client.fence_pool(pool.binding, timeout_s=5) is True
        assert refused and client.stats().gauges["pools"] == 0


def test_regression_a_fence_racing_close_on_another_thread_raised_a_bare_value_error(daemon):
    """A ``fence_pool`` whose UnregisterPool was sent just as another thread closed the
    client (the GPU connector's fence thread at shutdown) raised gRPC's bare ValueError for
    a call on a closed channel, past the caller's ``except KvtierError``. The session is gone
    with the client, so the fence cannot be confirmed: False, as the docstring says."""
    layout = LAYOUTS["staging"]
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        real = client.stub.UnregisterPool

        def closed_meanwhile(request, timeout=None):
            client.close()
            return real(request, timeout=timeout)

        client.stub.UnregisterPool = closed_meanwhile
        assert client.fence_pool(pool.binding, timeout_s=5) is False


class _RefusedCall:
    """An OpenSession stream (blocking or asyncio) that the daemon's HTTP/2 layer refused."""

    def __next__(self) -> object:
        raise _Refused()

    async def read(self) -> object:
        raise _Refused()

    def cancel(self) -> bool:
        return False


class _RefusedFuture:
    """A ``.future()`` of a call the daemon's HTTP/2 layer refused, already done."""

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException:
        return _Refused()

    def add_done_callback(self, fn) -> None:
        fn(self)


def _refused_first(real, calls: list[object]):
    """``real``, except that its first call (of any number of those below) is refused."""

    def send(request, *args, **kwargs):
        calls.append(request)
        if len(calls) == 1:
            return _RefusedCall()
        return real(request, *args, **kwargs)

    return send


def test_regression_a_session_refused_unrun_was_not_opened_again(daemon):
    """The client sent every call again that the daemon's gRPC refused unrun (the connection
    had 256 calls open; a process's clients share one), but not OpenSession, a stream: the
    refusal became the caller's UnavailableError ("RST_STREAM ... error code 7", 12 of 54
    sessions opened beside 300 threads of lookups on the same connection). It is sent again,
    ticket and all: the daemon never saw it."""
    with daemon.client(timeout_s=5) as client:
        calls: list[object] = []
        client.stub.OpenSession = _refused_first(client.stub.OpenSession, calls)
        assert client.session_id and len(calls) == 2
        assert client.lookup([KEY]).prefix_len == 0

    async def run() -> int:
        async with AsyncClient(daemon.address, timeout_s=5) as client:
            calls.clear()
            client.stub.OpenSession = _refused_first(client.stub.OpenSession, calls)
            assert await client.session()
            return (await client.lookup([KEY])).prefix_len

    assert asyncio.run(run()) == 0 and len(calls) == 2


# A daemon whose credential tickets live as many seconds as its first argument says.
_ENTRY_SHORT_TICKETS = """
import functools, sys
from kvtier.daemon import server
server.TicketBook = functools.partial(server.TicketBook, ttl_s=float(sys.argv.pop(1)))
from kvtier.daemon.entry import main
sys.exit(main())
"""


def _refused_for(real, seconds: float, tickets: list[bytes]):
    """``real``, except that every call within ``seconds`` of the first is refused unrun;
    ``tickets`` gets each call's credential ticket."""
    first: list[float] = []

    def send(request, *args, **kwargs):
        tickets.append(request.credential_ticket)
        first.append(time.monotonic())
        if first[-1] - first[0] < seconds:
            return _RefusedCall()
        return real(request, *args, **kwargs)

    return send


def test_regression_a_session_refused_unrun_past_its_tickets_life_was_unauthenticated(
    tmp_path, daemon_factory, monkeypatch
):
    """OpenSession went out again with the ticket it first got for as long as the daemon's
    gRPC refused it unrun (up to the client's timeout, 30 s by default), but the daemon keeps
    a ticket 10 s: refusals that outlasted it ended in UnauthenticatedError ("the credential
    ticket is unknown, already used or expired"), which said nothing of the refusals. A
    ticket held ``TICKET_REUSE_S`` is replaced before the next send; the daemon's check of
    it is unchanged. Here the daemon keeps tickets 1 s, the client replaces them at 0.25 s,
    and the refusals outlast the first ticket."""
    ttl_s = 1.0
    d = DaemonProcess(
        tmp_path,
        f"{daemon_factory._sockdir}/tickets.sock",
        ["--set", "tiers.l1.capacity_bytes=64MiB"],
        entry=("-c", _ENTRY_SHORT_TICKETS, str(ttl_s)),
    )
    daemon_factory._daemons.append(d)
    d.start()
    monkeypatch.setattr(credentials, "TICKET_REUSE_S", 0.25)
    tickets: list[bytes] = []
    with d.client(timeout_s=10) as client:
        client.stub.OpenSession = _refused_for(client.stub.OpenSession, ttl_s + 0.3, tickets)
        assert client.session_id and client.lookup([KEY]).prefix_len == 0
    assert len(tickets) > 2 and tickets[-1] != tickets[0]

    async def run() -> int:
        async with AsyncClient(d.address, timeout_s=10) as client:
            tickets.clear()
            client.stub.OpenSession = _refused_for(client.stub.OpenSession, ttl_s + 0.3, tickets)
            assert await client.session()
            return (await client.lookup([KEY])).prefix_len

    assert asyncio.run(run()) == 0
    assert len(tickets) > 2 and tickets[-1] != tickets[0]


def test_regression_an_unregistration_not_waited_for_was_lost_when_refused_unrun(daemon):
    """``unregister_pool_nowait`` sent its UnregisterPool once: refused unrun, the daemon kept
    the pool, and its memory mapped, until the session ended. It is sent again as the
    client's other calls are."""
    layout = LAYOUTS["staging"]
    with daemon.client(timeout_s=5) as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        assert client.stats().gauges["pools"] == 1
        real, sent = client.stub.UnregisterPool, []

        class OnceRefused:
            def future(self, request, timeout=None):
                sent.append(request.pool_id)
                return _RefusedFuture() if len(sent) == 1 else real.future(request, timeout=timeout)

        client.stub.UnregisterPool = OnceRefused()
        pool_id = pool.pool_id
        client.unregister_pool_nowait(pool.binding)
        deadline = time.monotonic() + 30
        while client.stats().gauges["pools"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stats().gauges["pools"] == 0 and sent == [pool_id] * 2


async def _pools_gauge_drops(client: AsyncClient) -> bool:
    deadline = time.monotonic() + 30
    while (await client.stats()).gauges["pools"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return (await client.stats()).gauges["pools"] == 0


async def test_an_async_client_unregisters_a_pool_without_waiting_as_the_blocking_one(daemon):
    """``AsyncClient`` had no ``unregister_pool_nowait``: an asyncio engine's close path
    could only await the answer (a hung daemon stalled it) or leave the pool to the
    session's end. It is a plain call, as the blocking client's: it forgets the pool id (the
    next use registers the memory again), sends UnregisterPool (again while refused unrun)
    and waits for nothing; what is no binding is refused by both clients alike."""
    layout = LAYOUTS["staging"]
    async with AsyncClient(daemon.address, timeout_s=5) as client:
        with SharedMemoryPool.for_layout(layout) as shm:
            pool = await client.register_pool(shm, layout)
            # Off the loop it cannot send, and forgets nothing (it forgot the pool first).
            with pytest.raises(RuntimeError, match="event loop"):
                await asyncio.to_thread(client.unregister_pool_nowait, pool.binding)
            assert pool.pool_id != 0
            assert client.unregister_pool_nowait(pool.binding) is None
            assert pool.pool_id == 0
            assert await _pools_gauge_drops(client)
            assert await client.pool_id_of(pool.binding) == pool.pool_id != 0
            assert (await client.stats()).gauges["pools"] == 1

            real, sent = client.stub.UnregisterPool, []

            def once_refused(request, timeout=None):
                sent.append(request.pool_id)
                if len(sent) == 1:

                    async def refused():
                        raise _Refused()

                    return refused()
                return real(request, timeout=timeout)

            client.stub.UnregisterPool = once_refused
            pool_id = pool.pool_id
            client.unregister_pool_nowait(pool.binding)
            assert await _pools_gauge_drops(client) and sent == [pool_id] * 2

            with pytest.raises(InvalidArgumentError, match="binding"):
                client.unregister_pool_nowait(pool)
    with daemon.client() as blocking, pytest.raises(InvalidArgumentError, match="binding"):
        blocking.unregister_pool_nowait(pool)


def test_pool_survives_daemon_restart_through_reregistration(daemon):
    layout = LAYOUTS["staging"]
    ns = Namespace(model="restart", kv_dtype="float16", block_tokens=BLOCK_TOKENS)
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        random_fill(shm, 9)
        pool = client.register_pool(shm, layout, ns)
        tokens = list(range(3 * BLOCK_TOKENS))
        assert pool.store(tokens, range(3)) == 12
        daemon.restart()
        # L1 is volatile: the restarted daemon has nothing, but the pool works again at once.
        assert pool.load(tokens, range(3)) == 0
        assert pool.store(tokens, range(3)) == 12
        assert pool.load(tokens, range(3)) == 12


def test_regression_stop_waited_out_the_drain_timeout_for_open_sessions(daemon_factory):
    """Session streams never end by themselves, so a graceful stop used to wait the whole
    drain timeout whenever a client was connected."""
    d = daemon_factory("server.drain_timeout_s=20")
    with d.client() as client:
        client.lookup([KEY])  # opens a session
        started = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - started < 10


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_lookup_timeout_bounds_that_call_only(daemon, asynchronous):
    keys = [b"k" * 32]
    assert daemon.proc is not None

    async def lookup_async() -> float:
        async with AsyncClient(daemon.address, timeout_s=60) as client:
            await client.lookup(keys)  # the session is open
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                await client.lookup(keys, timeout_s=0.3)
            return time.monotonic() - t0

    def lookup_sync() -> float:
        with Client(daemon.address, timeout_s=60) as client:
            client.lookup(keys)
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                client.lookup(keys, timeout_s=0.3)
            return time.monotonic() - t0

    try:
        elapsed = asyncio.run(lookup_async()) if asynchronous else lookup_sync()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # The call's own bound, far below the client's 60 s (generous for a loaded machine).
    assert elapsed < 20


def _rate_limited_l2(tmp_path, rate: str = "256KiB") -> tuple[str, ...]:
    """An L2 of 64 MiB that writes ``rate`` a second: durable puts wait seconds for it."""
    return (
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / 'l2'}",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.segment_bytes=1MiB",
        f"tiers.l2.write_bytes_s={rate}",
    )


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_durable_puts_timeout_bounds_that_call_only(daemon_factory, tmp_path, asynchronous):
    """A durable put answers once the disk tier holds its blocks; on a rate-limited L2 a
    large one needed the client's timeout raised for every call. `put(timeout_s=...)` bounds
    that call only, both ways: 1 MiB at 384 KiB/s (1.67 s at least: the rate's burst is one
    second's worth) is stored by a client whose timeout is 1 s, and a durable put of 768 KiB
    (1 s at least, even from a full burst) given 0.5 s by a client of 60 s ends
    DeadlineExceededError. The daemon serves on: every invariant holds and the first blocks
    load back as stored. The short client registers its pool under the default timeout
    first: a registration given 1 s timed out on a loaded machine."""
    d = daemon_factory(*_rate_limited_l2(tmp_path, "384KiB"))
    layout = PoolLayout.staging(
        num_layers=1, num_pages=28, block_tokens=1, chunk_bytes=64 << 10, kv_count=1
    )
    first = [os.urandom(32) for _ in range(16)]
    second = [os.urandom(32) for _ in range(12)]

    async def puts_async(shm: SharedMemoryPool) -> tuple[list[bool], type[Exception]]:
        async with AsyncClient(d.address) as short:
            pool = await short.register_pool(shm, layout)
            short.timeout_s = 1.0
            stored = await short.put(pool.pool_id, first, range(16), durable=True, timeout_s=60)
        async with AsyncClient(d.address, timeout_s=60.0) as long:
            pool = await long.register_pool(shm, layout)
            try:
                await long.put(pool.pool_id, second, range(16, 28), durable=True, timeout_s=0.5)
            except DeadlineExceededError as e:
                return stored.persisted, type(e)
        raise AssertionError("the put outlived its 0.5 s")

    def puts_sync(shm: SharedMemoryPool) -> tuple[list[bool], type[Exception]]:
        with Client(d.address) as short:
            pool = short.register_pool(shm, layout)
            short.timeout_s = 1.0
            stored = short.put(pool.pool_id, first, range(16), durable=True, timeout_s=60)
        with Client(d.address, timeout_s=60.0) as long:
            pool = long.register_pool(shm, layout)
            with pytest.raises(DeadlineExceededError) as caught:
                long.put(pool.pool_id, second, range(16, 28), durable=True, timeout_s=0.5)
        return stored.persisted, caught.type

    with SharedMemoryPool.for_layout(layout) as shm:
        data = shm.array()
        data[:] = np.random.default_rng(7).integers(0, 256, data.size, dtype=np.uint8)
        end = 16 * layout.block_bytes  # pages 0..15, page after page
        sent = data[:end].copy()
        persisted, error = asyncio.run(puts_async(shm)) if asynchronous else puts_sync(shm)
        assert persisted == [True] * 16 and error is DeadlineExceededError
        with d.client(timeout_s=60.0) as client:
            result = client.check(settle_s=30.0)  # the cut-off put's writes may still run
            assert result.ok, result.problems
            pool = client.register_pool(shm, layout)
            data[:end] = 0
            assert client.get(pool.pool_id, first, range(16), timeout_s=30).prefix_len == 16
            assert np.array_equal(data[:end], sent)
        del data


@pytest.mark.slow
def test_regression_a_check_waiting_for_transfers_past_the_clients_timeout_timed_out(
    daemon_factory, tmp_path
):
    """`check(settle_s=S)` asks the daemon to wait up to S for transfers in flight, but the
    call ran under the client's timeout alone: with a durable put held up by L2's write
    rate, a client of timeout 1 s got DeadlineExceededError after 1 s (and `kvtier --timeout
    1 check --settle 3`, 'cannot reach kvtierd ... Is the daemon running?'). The call's
    timeout is the client's plus the wait: a client of 2 s waits out a settle of 2.5 s (not
    strict: the put is still in flight) and gets its answer. On a loaded machine a client of
    1 s timed out in its polls for the put's start, and a poll that saw it late left the
    check less than its 2 s of it, so these are longer."""
    d = daemon_factory(*_rate_limited_l2(tmp_path, "128KiB"))
    layout = PoolLayout.staging(num_layers=1, num_pages=12, block_tokens=1, chunk_bytes=64 << 10)
    keys = [os.urandom(32) for _ in range(12)]
    with d.client() as writer, SharedMemoryPool.for_layout(layout) as shm:
        pool = writer.register_pool(shm, layout)
        put = threading.Thread(
            target=lambda: writer.put(pool.pool_id, keys, range(12), durable=True)
        )
        # 768 KiB at 128 KiB/s: 5 s in flight at least (the first second's worth at once),
        # past the 2.5 s the check waits even when the polls below see it start late.
        put.start()
        deadline = time.monotonic() + 30
        with d.client() as admin:
            while not admin.stats().gauges.get("blocks_in_flight"):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            admin.timeout_s = 2.0
            started = time.monotonic()
            # Answered within its deadline, 2 + 2.5 s (DeadlineExceededError otherwise).
            result = admin.check(settle_s=2.5)
            assert not result.strict and result.ok  # it waited out the settle
            assert time.monotonic() - started > admin.timeout_s
        put.join(30)


def test_regression_a_refused_durable_put_bound_its_namespace(daemon_factory):
    """A durable put to a daemon with no persistent tier is refused (FAILED_PRECONDITION); it
    bound its namespace first, which then counted toward server.max_namespaces_per_tenant, so
    the tenant's next namespace was refused though nothing had been stored."""
    d = daemon_factory("server.max_namespaces_per_tenant=1")
    layout = LAYOUTS["staging"]
    with d.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        with pytest.raises(FailedPreconditionError, match="persistent tier"):
            client.put(pool.pool_id, [KEY], [0], durable=True, namespace="refused")
        result = client.put(pool.pool_id, [KEY], [0], namespace="stored")
        assert list(result.statuses) == [PutStatus.STORED]
        assert client.lookup([KEY], namespace="stored").prefix_len == 1


def test_a_pinning_lookup_naming_a_key_more_than_once_pins_its_block_once(daemon_factory):
    """A pinning Lookup that names a key more than once pins its block once, and its
    Release lets go of it: the block is evictable again (a pin per naming, with one Release,
    would keep it for good), and the daemon's check finds the pins matching the leases."""
    layout = LAYOUTS["staging"]
    d = daemon_factory("policy.protect_s=0")
    with d.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        random_fill(shm, 6)
        pool = client.register_pool(shm, layout)
        a, b = keys_for(2, "pinned-twice")
        client.put(pool.pool_id, [a, b], [0, 1])
        pinned = client.lookup([a, a, b, a], pin=True, lease_ms=60_000)
        assert pinned.lease_id != 0 and pinned.prefix_len == 4
        assert pinned.tiers == [Tier.L1_HOST] * 4
        assert client.check().problems == []
        assert client.evict([a], "L1").busy == 1
        client.release(pinned.lease_id)
        assert client.check().problems == []
        ev = client.evict([a, b], "L1")
        assert (ev.evicted, ev.missing, ev.busy) == (2, 0, 0)


# Runs kvtierd with every L1 write held while the file ``gate`` exists; a write touches the
# file ``started`` first.
_ENTRY_HOLDING_L1_WRITES = """
import os, sys, time
from pathlib import Path
from kvtier.daemon.entry import main
from kvtier.tiers.host import HostArena

gate, started = sys.argv.pop(1), sys.argv.pop(1)
write = HostArena.write

def held_write(self, batch):
    Path(started).touch()
    while os.path.exists(gate):
        time.sleep(0.002)
    return write(self, batch)

HostArena.write = held_write
sys.exit(main(sys.argv[1:]))
"""
# One 1 MiB block per page: a put's copy into L1 runs on a transfer thread, not inline.
BIG_LAYOUT = PoolLayout.staging(
    num_layers=4, num_pages=4, block_tokens=16, chunk_bytes=(1 << 20) // 8, dtype="uint8"
)


def test_a_key_a_put_still_writes_is_missing_to_prefetch_and_evict_and_busy_to_delete(
    daemon_factory, tmp_path
):
    """While a Put writes a new key (not stored yet, as Lookup says), Prefetch and Evict
    count it missing (not stored anywhere; no block in the tier) and Delete busy (kept: the
    key is there once the Put is done), as the proto says; the Put then stores it."""
    gate, started = tmp_path / "gate", tmp_path / "started"
    d = DaemonProcess(
        tmp_path,
        f"{daemon_factory._sockdir}/writes.sock",
        ["--set", "tiers.l1.capacity_bytes=64MiB", "--set", "policy.protect_s=0"],
        entry=("-c", _ENTRY_HOLDING_L1_WRITES, str(gate), str(started)),
    )
    daemon_factory._daemons.append(d)
    d.start()
    key = keys_for(1, "being-written")[0]
    gate.touch()
    try:
        with (
            d.client() as writer,
            d.client() as other,
            SharedMemoryPool.for_layout(BIG_LAYOUT) as shm,
            concurrent.futures.ThreadPoolExecutor(1) as threads,
        ):
            pool = writer.register_pool(shm, BIG_LAYOUT)
            putting = threads.submit(writer.put, pool.pool_id, [key], [0])
            deadline = time.monotonic() + 10
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert started.exists()  # the put's copy into L1 waits
            assert other.lookup([key]).tiers == [Tier.ABSENT]
            pf = other.prefetch([key])
            assert (pf.resident, pf.scheduled, pf.missing) == (0, 0, 1)
            ev = other.evict([key], "L1")
            assert (ev.evicted, ev.missing, ev.busy) == (0, 1, 0)
            de = other.delete([key])
            assert (de.deleted, de.missing, de.busy) == (0, 0, 1)
            gate.unlink()
            assert putting.result(30).statuses == [PutStatus.STORED]
            assert other.lookup([key]).tiers == [Tier.L1_HOST]
    finally:
        gate.unlink(missing_ok=True)
