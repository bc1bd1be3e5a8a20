"""The L3 tier against a real redis-server: byte-exact round trips (host buffers and pool
pages), prefix probes, verification of every value, tenant separation, the write budget, and
what happens when the server dies, hangs, restarts empty or runs out of memory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import held_port
from redis_servers import (
    OP_TIMEOUT_S,
    SLACK_S,
    ServerLookups,
    data,
    empty,
    host,
    raw_client,
    ref,
    wait_for,
)

from kvtier.bench.redis_proc import RedisServer, make_tls_files
from kvtier.daemon import logs, loops
from kvtier.daemon.loops import EVENT_LOOPS
from kvtier.kernels.layout import PoolLayout
from kvtier.tiers.base import (
    PROBE_ABSENT,
    PROBE_UNKNOWN,
    BlockRef,
    Health,
    PoolPages,
    TierUnavailable,
)
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.remote import journal as journal_module
from kvtier.tiers.remote import tier as tier_module
from kvtier.tiers.remote.codec import HEADER_BYTES, KeyNamer, checksum, header
from kvtier.tiers.remote.options import RemoteOptions
from kvtier.tiers.remote.tier import COUNTERS, RemoteTier


def options(server: RedisServer, prefix: str, **kw: Any) -> RemoteOptions:
    """The tier's options for ``server``. Its timeouts are generous: with 0.5 s, a loaded
    machine's writes and reads of a few MiB timed out, and the tier, marked down, answered
    misses. The tests of a hung store give it ``op_timeout_s=OP_TIMEOUT_S``."""
    base: dict[str, Any] = {
        "urls": (server.url,),
        "key_prefix": prefix,
        "op_timeout_s": 30.0,
        "connect_timeout_s": 10.0,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3,
        # Generous: a loaded test machine must not turn a hit into a late probe.
        "probe_deadline_ms": 2000.0,
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


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("nbytes", [4096, 10_000, 2 << 20])
async def test_host_buffers_round_trip_byte_exact(
    redis_server: RedisServer, l3_prefix: str, nbytes: int
) -> None:
    blocks = [ref(i) for i in range(8)]
    src = [data(i, nbytes) for i in range(8)]
    async with opened(options(redis_server, l3_prefix)) as tier:
        assert await tier.write(blocks, nbytes, host(src)) == [True] * 8
        # Destinations larger than the block: only the block's bytes are written.
        dest = empty(8, nbytes + 100)
        assert await tier.read(blocks, nbytes, host(dest)) == [True] * 8
        for d, s in zip(dest, src, strict=True):
            assert bytes(d[:nbytes]) == s
            assert bytes(d[nbytes:]) == bytes(100)
        c = tier.stats().counters
        assert c["write_stored"] == 8 and c["read_hits"] == 8
        assert c["bytes_written"] == c["bytes_read"] == 8 * nbytes
    # Header and bytes went out as separate chunks; stored, they are one value.
    key = KeyNamer(l3_prefix).key(blocks[5].ns, blocks[5].key)
    assert raw_client(redis_server).get(key) == header(nbytes, checksum(src[5]), key) + src[5]


async def test_values_of_every_size_in_turn_round_trip_on_the_same_connections(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    """The tier's connections keep their reply buffers between values of a few MiB and free
    larger ones (``wire``): values growing, shrinking and passing that size in turn, on the
    same few connections, come back byte-exact."""
    sizes = [2 << 20, 100, (3 << 20) + 7, 4096, 9 << 20, 2 << 20, 1, 5 << 20, 10_000]
    async with opened(options(redis_server, l3_prefix, pool_size=4)) as tier:
        for turn in range(2):
            for i, nbytes in enumerate(sizes):
                blocks = [ref(100 * turn + 10 * i + j) for j in range(3)]
                src = [data(7 * i + j + turn, nbytes) for j in range(3)]
                assert await tier.write(blocks, nbytes, host(src)) == [True] * 3
                dest = empty(3, nbytes)
                assert await tier.read(blocks, nbytes, host(dest)) == [True] * 3
                assert [bytes(d) for d in dest] == src
        assert tier.stats().counters["read_bad_checksum"] == 0


async def test_a_cancelled_read_unwinds_only_after_its_copies_end(
    redis_server: RedisServer, l3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large batches are verified and copied on a codec thread, into the caller's buffers:
    a caller cancelled meanwhile must not get them back while the thread still writes."""
    nbytes = 1 << 20
    blocks = [ref(i) for i in range(2)]
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real = tier_module._unframe_all

    def slow_unframe(*args: Any) -> Any:
        started.set()
        release.wait(10)
        out = real(*args)
        finished.set()
        return out

    async with opened(options(redis_server, l3_prefix)) as tier:
        assert (
            await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(2)]))
            == [True] * 2
        )
        monkeypatch.setattr(tier_module, "_unframe_all", slow_unframe)
        reader = asyncio.ensure_future(tier.read(blocks, nbytes, host(empty(2, nbytes))))
        await wait_for("the codec thread", started.is_set)
        reader.cancel()
        await asyncio.sleep(0.2)
        assert not reader.done()  # held while the thread copies
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert finished.is_set()


def _pool(layout: PoolLayout, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(layout.extent_bytes), np.uint8).copy()


def _gather(layout: PoolLayout, memory: np.ndarray, page: int) -> bytes:
    """A page's block the slow, obvious way: chunks layer by layer, K before V."""
    out = []
    for layer in layout.layers:
        for kv in range(layer.kv_count):
            start = layer.offset + kv * layer.kv_stride + page * layer.page_stride
            out.append(memory[start : start + layer.chunk_bytes].tobytes())
    return b"".join(out)


async def test_pool_pages_round_trip_across_layouts(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    shape = {"num_layers": 3, "num_pages": 8, "block_tokens": 4, "num_kv_heads": 2, "head_dim": 16}
    vllm = PoolLayout.vllm(**shape, dtype="float16")
    flash = PoolLayout.flashinfer(**shape, dtype="float16")
    nbytes = vllm.block_bytes
    src_mem, dst_mem = _pool(vllm, 1), _pool(flash, 2)
    before = dst_mem.copy()
    src_pages, dst_pages = [3, 0, 5], [1, 7, 2]
    blocks = [ref(i) for i in range(3)]
    src = PoolPages(vllm.chunk_table, src_mem, np.array(src_pages, dtype=np.int64))
    dest = PoolPages(flash.chunk_table, dst_mem, np.array(dst_pages, dtype=np.int64))
    async with opened(options(redis_server, l3_prefix)) as tier:
        assert await tier.write(blocks, nbytes, src) == [True] * 3
        assert await tier.read(blocks, nbytes, dest) == [True] * 3
    for sp, dp in zip(src_pages, dst_pages, strict=True):
        assert _gather(flash, dst_mem, dp) == _gather(vllm, src_mem, sp)
    # Pages not named are untouched.
    for page in set(range(8)) - set(dst_pages):
        assert _gather(flash, dst_mem, page) == _gather(flash, before, page)
    # The stored value is the header, then exactly the gathered block.
    namer = KeyNamer(l3_prefix)
    value = raw_client(redis_server).get(namer.key(blocks[0].ns, blocks[0].key))
    assert value is not None and value[HEADER_BYTES:] == _gather(vllm, src_mem, 3)


# ------------------------------------------------------------------------ probes


async def test_probe_answers_the_sizes_of_the_present_prefix(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    chain = [ref(i) for i in range(10)]
    async with opened(options(redis_server, l3_prefix)) as tier:
        assert await tier.probe(chain) == []
        assert await tier.probe([]) == []
        await tier.write(chain[:4], 4096, host([data(i, 4096) for i in range(4)]))
        await tier.write(chain[4:6], 8192, host([data(i, 8192) for i in range(4, 6)]))
        await tier.write(chain[8:9], 4096, host([data(8, 4096)]))  # present, but after a gap
        assert await tier.probe(chain) == [4096] * 4 + [8192] * 2
        assert await tier.probe(chain[:3]) == [4096] * 3
        assert await tier.probe(chain[1:]) == [4096] * 3 + [8192] * 2
        await tier.remove(chain[2:3])
        assert await tier.probe(chain) == [4096] * 2
        assert await tier.probe(chain[3:6]) == [4096, 8192, 8192]
        c = tier.stats().counters
        assert c["probe_late"] == 0 and c["remove_blocks"] == 1


async def test_values_that_are_no_block_end_the_probed_prefix(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    """A probe reads each value's header (GETRANGE): a value whose header does not parse, was
    written under another key, or a key of another type, is no block and ends the present
    prefix there; a value cut short after a good header keeps its block's size (its read
    fails: a miss, never a size that makes a Get of the right layout look wrong)."""
    chain = [ref(i) for i in range(5)]
    keys = [KeyNamer(l3_prefix).key(b.ns, b.key) for b in chain]
    r = raw_client(redis_server)
    async with opened(options(redis_server, l3_prefix)) as tier:
        await tier.write(chain, 4096, host([data(i, 4096) for i in range(5)]))
        good = r.get(keys[4])
        assert good is not None
        r.set(keys[4], good[: HEADER_BYTES + 100])  # cut short after its header
        assert await tier.probe(chain) == [4096] * 5
        r.set(keys[3], r.get(keys[0]))  # another key's value: its key tag says so
        assert await tier.probe(chain) == [4096] * 3
        r.delete(keys[2])
        r.rpush(keys[2], b"x")  # not a string: WRONGTYPE, in place
        assert await tier.probe(chain) == [4096] * 2
        r.set(keys[1], b"x" * HEADER_BYTES)  # a header's worth of junk
        assert await tier.probe(chain) == [4096]
        r.set(keys[0], b"short")
        assert await tier.probe(chain) == []
        # Damaged values say nothing about reachability.
        assert tier.health().state is Health.OK


async def test_a_late_probe_answers_zero_within_its_deadline(
    fresh_redis: RedisServer, l3_prefix: str
) -> None:
    """A hung store: the caller gets 0 by the deadline; the store is judged by the op timeout."""
    chain = [ref(i) for i in range(4)]
    opts = options(fresh_redis, l3_prefix, probe_deadline_ms=100.0, op_timeout_s=1.0)
    async with opened(opts) as tier:
        await tier.write(chain, 4096, host([data(i, 4096) for i in range(4)]))
        fresh_redis.pause()
        try:
            t0 = time.monotonic()
            assert await tier.probe(chain) == []
            assert time.monotonic() - t0 < 0.1 + SLACK_S
            assert tier.stats().counters["probe_late"] == 1
            await wait_for("the op timeout to mark L3 down", lambda: not tier.health().serves_reads)
            assert tier.stats().counters["timeouts"] >= 1
        finally:
            fresh_redis.resume()
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK)
        assert len(await tier.probe(chain)) == 4


async def test_probe_each_tells_absent_blocks_from_unknown_ones(
    fresh_redis: RedisServer, l3_prefix: str
) -> None:
    """Each block's size, or absent (no key, a value that is no block, a key of another type:
    the store said so), or unknown: every block when the answer is late or the store is
    down. A Lookup drops a copy it remembers only on absent."""
    chain = [ref(i) for i in range(5)]
    keys = [KeyNamer(l3_prefix).key(b.ns, b.key) for b in chain]
    r = raw_client(fresh_redis)
    opts = options(fresh_redis, l3_prefix, probe_deadline_ms=100.0, op_timeout_s=1.0)
    async with opened(opts) as tier:
        await tier.write(chain[:4], 4096, host([data(i, 4096) for i in range(4)]))
        r.set(keys[1], b"x" * HEADER_BYTES)  # a header's worth of junk
        r.delete(keys[2])
        r.rpush(keys[2], b"x")  # not a string: WRONGTYPE, in place
        assert await tier.probe_each(chain) == [
            4096,
            PROBE_ABSENT,
            PROBE_ABSENT,
            4096,
            PROBE_ABSENT,
        ]
        assert await tier.probe(chain) == [4096]
        fresh_redis.pause()
        try:
            assert await tier.probe_each(chain) == [PROBE_UNKNOWN] * 5  # late
            await wait_for("the op timeout to mark L3 down", lambda: not tier.health().serves_reads)
            assert await tier.probe_each(chain) == [PROBE_UNKNOWN] * 5  # down
        finally:
            fresh_redis.resume()
        c = tier.stats().counters
        assert c["probe_late"] == 1 and c["probe_skipped_down"] == 1 and c["probe_found"] == 4


async def test_value_ages_tell_how_long_ago_each_value_was_written_from_its_expiry(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    """Each value's age: ``ttl_s`` less the time it has left (another node's copy, written a
    while ago, is dated so); 0.0 where nothing tells (absent, no expiry, a value that
    outlives ``ttl_s``, or a tier whose values never expire)."""
    chain = [ref(i) for i in range(5)]
    keys = [KeyNamer(l3_prefix).key(b.ns, b.key) for b in chain]
    r = raw_client(redis_server)
    async with opened(options(redis_server, l3_prefix, ttl_s=100)) as tier:
        await tier.write(chain[:4], 4096, host([data(i, 4096) for i in range(4)]))
        r.pexpire(keys[1], 40_000)  # written 60 s ago
        r.persist(keys[2])
        r.pexpire(keys[3], 500_000)
        ages = await tier.value_ages(chain)
        assert 0.0 <= ages[0] < 10.0 and 60.0 <= ages[1] < 70.0
        assert ages[2:] == [0.0, 0.0, 0.0]
    async with opened(options(redis_server, l3_prefix, ttl_s=0)) as tier:
        assert await tier.value_ages(chain) == [0.0] * 5


# ------------------------------------------------------------------ verification


async def test_corrupted_values_are_misses_counted_by_reason(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    nbytes = 8192
    blocks = [ref(i) for i in range(8)]
    src = [data(i, nbytes) for i in range(8)]
    namer = KeyNamer(l3_prefix)
    keys = [namer.key(b.ns, b.key) for b in blocks]
    r = raw_client(redis_server)
    async with opened(options(redis_server, l3_prefix)) as tier:
        assert await tier.write(blocks[:6], nbytes, host(src[:6])) == [True] * 6
        flipped = bytearray(r.getrange(keys[0], HEADER_BYTES + 100, HEADER_BYTES + 100))
        flipped[0] ^= 0x40
        r.setrange(keys[0], HEADER_BYTES + 100, bytes(flipped))  # a bit flip in the bytes
        r.set(keys[1], b"not a kvtier value")  # too short, no magic
        r.setrange(keys[2], 4, b"\x09")  # a format version this build does not know
        r.set(keys[3], r.get(keys[3])[:-1])  # truncated
        r.set(keys[4], r.get(keys[5]))  # another block's value under this key
        r.rpush(keys[7], b"x")  # not a string at all
        dest = empty(8, nbytes)
        hits = await tier.read(blocks, nbytes, host(dest))
        assert hits == [False, False, False, False, False, True, False, False]
        assert bytes(dest[5]) == src[5]
        c = tier.stats().counters
        assert c["read_bad_checksum"] == 1
        assert c["read_bad_header"] == 2
        assert c["read_bad_length"] == 1
        assert c["read_bad_key"] == 1
        assert c["read_absent"] == 1  # block 6
        assert c["read_errors"] == 1  # block 7: WRONGTYPE
        # A request for another length is a miss too, never a short or long copy.
        assert await tier.read(blocks[5:6], nbytes - 1, host(empty(1, nbytes))) == [False]
        assert tier.stats().counters["read_bad_length"] == 2
        # Damaged values say nothing about reachability.
        assert tier.health().state is Health.OK


# ----------------------------------------------------------------------- tenants


async def test_tenant_namespaces_never_collide(redis_server: RedisServer, l3_prefix: str) -> None:
    nbytes = 4096
    same_key = ref(7).key
    a, b, c = BlockRef(1, same_key), BlockRef(2, same_key), BlockRef(3, same_key)
    async with opened(options(redis_server, l3_prefix)) as tier:
        await tier.write([a], nbytes, host([data(1, nbytes)]))
        await tier.write([b], nbytes, host([data(2, nbytes)]))
        assert await tier.probe([c]) == []
        dest = empty(2, nbytes)
        assert await tier.read([a, b], nbytes, host(dest)) == [True, True]
        assert bytes(dest[0]) == data(1, nbytes) and bytes(dest[1]) == data(2, nbytes)
        assert await tier.read([c], nbytes, host(empty(1, nbytes))) == [False]
        await tier.remove([a])
        assert await tier.probe([a]) == [] and len(await tier.probe([b])) == 1
    # Keys are what the codec documents: prefix, namespace token, hex block key.
    stored = sorted(raw_client(redis_server).scan_iter(match=l3_prefix + "*"))
    assert stored == [f"{l3_prefix}2:{same_key.hex()}".encode()]


async def test_namespace_tokens_let_daemons_with_other_ids_meet(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    """Two tiers (two daemons) numbering one tenant differently share it through its token;
    tenants with different tokens still do not meet."""
    nbytes = 4096
    key = ref(3).key
    names_a = {1: "tenant-a", 2: "tenant-b"}
    names_b = {5: "tenant-a", 6: "tenant-c"}
    opts = options(redis_server, l3_prefix)
    async with (
        opened(opts, namespace_token=names_a.__getitem__) as tier_a,
        opened(opts, namespace_token=names_b.__getitem__) as tier_b,
    ):
        await tier_a.write(
            [BlockRef(1, key), BlockRef(2, key)], nbytes, host([data(1, nbytes), data(2, nbytes)])
        )
        dest = empty(1, nbytes)
        assert await tier_b.read([BlockRef(5, key)], nbytes, host(dest)) == [True]
        assert bytes(dest[0]) == data(1, nbytes)
        assert await tier_b.probe([BlockRef(6, key)]) == []


# ------------------------------------------------------------ expiry, size, budget


async def test_every_block_carries_the_ttl(redis_server: RedisServer, l3_prefix: str) -> None:
    namer = KeyNamer(l3_prefix)
    r = raw_client(redis_server)
    async with opened(options(redis_server, l3_prefix, ttl_s=120)) as tier:
        await tier.write([ref(1)], 4096, host([data(1, 4096)]))
    assert 110_000 < r.pttl(namer.key(1, ref(1).key)) <= 120_000
    async with opened(options(redis_server, l3_prefix, ttl_s=0)) as tier:
        await tier.write([ref(2)], 4096, host([data(2, 4096)]))
    assert r.pttl(namer.key(1, ref(2).key)) == -1  # no expiry


async def test_values_over_the_size_limit_are_refused(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    async with opened(options(redis_server, l3_prefix, max_value_bytes=8192)) as tier:
        blocks = [ref(1), ref(2)]
        assert await tier.write(blocks, 8192, host([data(1, 8192), data(2, 8192)])) == [
            False,
            False,
        ]
        assert tier.stats().counters["write_too_large"] == 2
        assert await tier.probe(blocks) == []
        # The header fits with a smaller block.
        assert await tier.write(blocks[:1], 8192 - HEADER_BYTES, host([data(1, 8192)])) == [True]


async def test_writes_beyond_the_budget_are_dropped_not_queued(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    now = [100.0]
    nbytes = 16 << 10
    value = HEADER_BYTES + nbytes
    # Burst: one second of budget, at least one largest value (64 KiB): 3 values fit.
    opts = options(redis_server, l3_prefix, write_bytes_s=40_000, max_value_bytes=64 << 10)
    async with opened(opts, clock=lambda: now[0]) as tier:
        blocks = [ref(i) for i in range(6)]
        src = host([data(i, nbytes) for i in range(6)])
        assert await tier.write(blocks, nbytes, src) == [True] * 3 + [False] * 3
        assert tier.stats().counters["write_dropped_budget"] == 3
        assert len(await tier.probe(blocks)) == 3
        # 65,536 - 3 values leaves 16,288 bytes; half a second adds 20,000: two more values.
        now[0] += 0.5
        assert await tier.write(blocks[3:], nbytes, src) == [True, True, False]
        assert tier.stats().counters["write_dropped_budget"] == 4
        now[0] += 10.0  # refills to the burst, not beyond
        assert await tier.write(blocks, nbytes, src) == [True] * 3 + [False] * 3
        assert tier.stats().gauges["write_budget_bytes"] == 65536 - 3 * value


# ---------------------------------------------------------------------- failures


async def test_a_killed_server_fails_fast_then_comes_back_empty(
    fresh_redis: RedisServer, l3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    nbytes = 64 << 10
    chain = [ref(i) for i in range(16)]
    src = host([data(i, nbytes) for i in range(16)])
    caplog.set_level(logging.INFO, logger="kvtier.tiers.remote.tier")
    async with opened(options(fresh_redis, l3_prefix)) as tier:
        assert await tier.write(chain, nbytes, src) == [True] * 16
        fresh_redis.kill()
        t0 = time.monotonic()
        # Misses that say nothing of the blocks (None), not absent ones (False).
        assert await tier.read(chain, nbytes, host(empty(16, nbytes))) == [None] * 16
        assert time.monotonic() - t0 < OP_TIMEOUT_S + SLACK_S
        assert tier.stats().counters["read_errors"] == 16
        health = tier.health()
        assert health.state is Health.DOWN and "onnect" in health.detail
        # While down, every verb answers at once without the network, and says so.
        for _ in range(20):
            t0 = time.monotonic()
            assert await tier.probe(chain) == []
            assert await tier.write(chain[:2], nbytes, src) == [False, False]
            assert await tier.read(chain[:2], nbytes, host(empty(2, nbytes))) == [None] * 2
            await tier.remove(chain[:1])
            assert time.monotonic() - t0 < SLACK_S
            await asyncio.sleep(0.01)
        c = tier.stats().counters
        assert c["probe_skipped_down"] >= 1 and c["write_skipped_down"] >= 2
        assert c["remove_skipped_down"] >= 1 and c["down_transitions"] == 1
        assert c["read_skipped_down"] == 40 and c["read_errors"] == 16
        assert tier.stats().gauges["up"] == 0.0

        fresh_redis.start()  # same port, nothing persisted: an empty server
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK)
        assert await tier.probe(chain) == []  # a cold tier
        # The store answered: absent (False), as forgotten by the daemon.
        assert await tier.read(chain[:2], nbytes, host(empty(2, nbytes))) == [False] * 2
        assert await tier.write(chain, nbytes, src) == [True] * 16
        dest = empty(16, nbytes)
        assert await tier.read(chain, nbytes, host(dest)) == [True] * 16
        assert [bytes(d) for d in dest] == [data(i, nbytes) for i in range(16)]
        c = tier.stats().counters
        assert c["reconnects"] == 1 and c["reconnect_attempts"] >= 1
    # One line per change of state, however many calls failed in between.
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    recovered = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert len(recovered) == 1


async def test_a_hung_server_costs_one_op_timeout(fresh_redis: RedisServer, l3_prefix: str) -> None:
    nbytes = 4096
    blocks = [ref(i) for i in range(4)]
    async with opened(options(fresh_redis, l3_prefix, op_timeout_s=OP_TIMEOUT_S)) as tier:
        await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(4)]))
        fresh_redis.pause()
        try:
            t0 = time.monotonic()
            outcomes = await asyncio.gather(
                tier.read(blocks, nbytes, host(empty(4, nbytes))),
                tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(4)])),
                tier.read(blocks, nbytes, host(empty(4, nbytes))),
            )
            assert time.monotonic() - t0 < OP_TIMEOUT_S + SLACK_S
            # The reads say nothing of the blocks (None): still there once it answers.
            assert outcomes == [[None] * 4, [False] * 4, [None] * 4]
            assert tier.health().state is Health.DOWN
            assert tier.stats().counters["timeouts"] >= 1
            assert tier.stats().counters["read_errors"] == 8
        finally:
            fresh_redis.resume()
        await wait_for("L3 to come back", lambda: tier.health().state is Health.OK)
        dest = empty(4, nbytes)
        assert await tier.read(blocks, nbytes, host(dest)) == [True] * 4


async def test_regression_a_removal_sent_to_a_hung_server_came_back_once_it_answered(
    fresh_redis: RedisServer, l3_prefix: str
) -> None:
    """A remove that timed out against a hung store was dropped: once the store answered
    again, the blocks were still there and the next probe found them (a Delete undone). The
    removal is sent again at the reconnection."""
    nbytes = 4096
    blocks = [ref(i) for i in range(4)]
    raw = raw_client(fresh_redis)
    names = KeyNamer(l3_prefix)
    async with opened(options(fresh_redis, l3_prefix, op_timeout_s=OP_TIMEOUT_S)) as tier:
        assert (
            await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(4)]))
            == [True] * 4
        )
        fresh_redis.pause()
        try:
            await tier.remove(blocks[:2])
            assert tier.health().state is Health.DOWN
            assert tier.stats().gauges["removals_unconfirmed"] == 2
        finally:
            fresh_redis.resume()
        await wait_for(
            "the removals to be sent again",
            lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
        )
        assert tier.health().state is Health.OK
        assert raw.exists(*(names.key(b.ns, b.key) for b in blocks[:2])) == 0
        assert await tier.probe(blocks) == []
        assert await tier.probe(blocks[2:]) == [nbytes, nbytes]
        assert tier.stats().counters["remove_retried"] == 2


async def test_regression_a_resend_meeting_a_just_lost_master_counted_what_it_did_not_send(
    fresh_redis: RedisServer, l3_prefix: str
) -> None:
    """A resend of remembered removals whose keys' master was lost as its pipeline was
    filled (injected: the server's name marked lost there, as a cluster's master that timed
    out the call ahead is) sends them nothing, and they stay remembered; ``remove_retried``
    counted them all the same. It counts the keys a resend sends, once they are sent."""
    nbytes = 4096
    blocks = [ref(i) for i in range(4)]
    async with opened(options(fresh_redis, l3_prefix, op_timeout_s=OP_TIMEOUT_S)) as tier:
        assert (
            await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(4)]))
            == [True] * 4
        )
        hold_for_lost = tier._hold_for_lost
        landed: list[bool] = []

        def lost_as_filled(keys: list[bytes], *, first: bool) -> Any:
            if not first and not landed:
                landed.append(True)
                tier._lost = {"": "injected"}  # a single server's name (``_servers_of``)
            return hold_for_lost(keys, first=first)

        tier._hold_for_lost = lost_as_filled  # type: ignore[method-assign]
        fresh_redis.pause()
        try:
            await tier.remove(blocks[:2])
            assert tier.stats().gauges["removals_unconfirmed"] == 2
        finally:
            fresh_redis.resume()
        await wait_for("the resend to end", lambda: landed and tier._resending is None)
        stats = tier.stats()
        assert stats.counters["remove_retried"] == 0, stats.counters
        assert stats.gauges["removals_unconfirmed"] == 2
        tier._lost = {}  # found back
        tier._resend_removals()
        await wait_for(
            "the removals to be sent again",
            lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
        )
        assert tier.stats().counters["remove_retried"] == 2
        assert await tier.probe(blocks[:2]) == []


async def test_a_removal_the_store_refused_is_absent_until_sent_again_or_written_again(
    fresh_redis: RedisServer, l3_prefix: str
) -> None:
    """UNLINK refused per key (an ACL here): the blocks stay in the store, but probes and
    reads answer them absent; writing one again ends its removal; the rest goes with the
    next removal the store accepts."""
    nbytes = 4096
    blocks = [ref(i) for i in range(4)]
    src = host([data(i, nbytes) for i in range(4)])
    raw = raw_client(fresh_redis)
    names = KeyNamer(l3_prefix)
    stored = [names.key(b.ns, b.key) for b in blocks]
    async with opened(options(fresh_redis, l3_prefix)) as tier:
        assert await tier.write(blocks, nbytes, src) == [True] * 4
        raw.execute_command("ACL", "SETUSER", "default", "-unlink")
        try:
            await tier.remove(blocks[:2])
            assert tier.health().state is Health.OK
            assert tier.stats().counters["remove_errors"] == 2
            assert raw.exists(*stored[:2]) == 2  # still there
            assert await tier.probe(blocks) == []
            assert await tier.probe(blocks[1:]) == []
            assert await tier.read(blocks, nbytes, host(empty(4, nbytes))) == [
                False,
                False,
                True,
                True,
            ]
            # Stored again: no longer removed.
            assert await tier.write(blocks[1:2], nbytes, host([data(1, nbytes)])) == [True]
            assert await tier.probe(blocks[1:]) == [nbytes] * 3
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
        await tier.remove([ref(99)])  # accepted: the one left is sent again
        await wait_for(
            "the removal to be sent again",
            lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
        )
        assert raw.exists(stored[0]) == 0 and raw.exists(*stored[1:]) == 3
        assert await tier.probe(blocks[1:]) == [nbytes] * 3


async def test_regression_resent_removals_logged_under_the_request_that_started_them(
    fresh_redis: RedisServer, l3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a removal the store accepts sends again the removals it had refused, in a
    task that took the context of the request whose removal went through; the lines of that
    resend (removals of earlier requests) carried its ids. The resend is the daemon's own
    and names none."""
    nbytes = 4096
    blocks = [ref(i) for i in range(2)]
    raw = raw_client(fresh_redis)
    names = KeyNamer(l3_prefix)
    async with opened(options(fresh_redis, l3_prefix)) as tier:
        assert await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(2)])) == [
            True,
            True,
        ]
        raw.execute_command("ACL", "SETUSER", "default", "-unlink")
        try:
            with logs.request_context("req-a", "s-a", 1):
                await tier.remove(blocks)
            assert tier.stats().counters["remove_errors"] == 2
            # The next removal is accepted, the resent ones refused again (their keys only):
            # the resend logs their errors.
            only = names.key(ref(99).ns, ref(99).key).decode()
            raw.execute_command("ACL", "SETUSER", "default", "+unlink", "resetkeys", f"~{only}")
            caplog.handler.addFilter(logs.RequestContextFilter())
            with caplog.at_level(logging.DEBUG, logger="kvtier.tiers.remote.tier"):
                with logs.request_context("req-b", "s-b", 2):
                    await tier.remove([ref(99)])
                await wait_for(
                    "the refused removals to be sent again",
                    lambda: tier.stats().counters["remove_errors"] == 4,
                )
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "resetkeys", "~*", "+unlink")
    resent = [r for r in caplog.records if "L3 command failed" in r.getMessage()]
    assert len(resent) == 2
    assert {(r.request_id, r.session_id, r.pool_id) for r in resent} == {("", "", 0)}


async def test_regression_a_cancelled_removals_resend_logged_under_its_request(
    fresh_redis: RedisServer, l3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a removal cancelled before its reply keeps its keys as ones the store did
    not confirm and starts their resend from its ``except CancelledError``, inside the
    cancelled request's context; the resend's lines (removals of any earlier request too)
    carried that request's ids. The resend is the daemon's own and names none."""
    nbytes = 4096
    blocks = [ref(i) for i in range(2)]
    raw = raw_client(fresh_redis)
    async with opened(options(fresh_redis, l3_prefix)) as tier:
        assert await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(2)])) == [
            True,
            True,
        ]
        held = await _hold_small_ops(tier)
        caplog.handler.addFilter(logs.RequestContextFilter())
        try:
            with caplog.at_level(logging.DEBUG, logger="kvtier.tiers.remote.tier"):
                with logs.request_context("req-a", "s-a", 1):
                    removing = asyncio.create_task(tier.remove(blocks))
                for _ in range(10):
                    await asyncio.sleep(0)
                assert not removing.done()
                removing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await removing
                # The store refuses the resend: each key's error is a line of it.
                raw.execute_command("ACL", "SETUSER", "default", "-unlink")
                for _ in range(held):
                    tier._small_ops.release()
                await wait_for(
                    "the cancelled removal to be sent again",
                    lambda: tier.stats().counters["remove_errors"] == 2,
                )
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
    resent = [r for r in caplog.records if "L3 command failed" in r.getMessage()]
    assert len(resent) == 2
    assert {(r.request_id, r.session_id, r.pool_id) for r in resent} == {("", "", 0)}


async def test_regression_removals_the_store_had_not_confirmed_were_forgotten_by_a_restart(
    fresh_redis: RedisServer, l3_prefix: str, tmp_path: Path
) -> None:
    """Unconfirmed removals lived in memory only: a tier started again found the blocks in
    the store and answered them present. Kept in a journal (the disk tier's index), the next
    tier answers them absent and sends them again; one confirmed or written again leaves the
    journal, and one past its expiry is dropped from it at the start (the store has expired
    its value: a value found under the key then is a later write's)."""
    nbytes = 4096
    blocks = [ref(i) for i in range(4)]
    raw = raw_client(fresh_redis)
    names = KeyNamer(l3_prefix)
    stored = [names.key(b.ns, b.key) for b in blocks]
    opts = options(fresh_redis, l3_prefix, ttl_s=100)
    wall = [1_000_000.0]
    with DiskTier(tmp_path / "l2", 32 << 20, 1 << 20, file_bytes=8 << 20) as disk:
        try:
            async with opened(opts, wall_clock=lambda: wall[0]) as tier:
                await tier.keep_removals_in(disk)
                src = host([data(i, nbytes) for i in range(4)])
                assert await tier.write(blocks, nbytes, src) == [True] * 4
                raw.execute_command("ACL", "SETUSER", "default", "-unlink")
                await tier.remove(blocks[:3])
                # Recorded before remove returned, each until its value's expiry.
                assert sorted(disk.removals()) == sorted((k, 1_000_100.0) for k in stored[:3])
            assert raw.exists(*stored) == 4
            disk.record_removals([(stored[3], 999_999.0)], [])  # expired before this start
            wall[0] = 1_000_050.0
            async with opened(opts, wall_clock=lambda: wall[0]) as tier:
                await tier.keep_removals_in(disk)
                assert await tier.probe_each(blocks) == [PROBE_ABSENT] * 3 + [nbytes]
                assert await tier.write(blocks[2:3], nbytes, host([data(2, nbytes)])) == [True]
                assert sorted(disk.removals()) == sorted((k, 1_000_100.0) for k in stored[:2])
                raw.execute_command("ACL", "SETUSER", "default", "+unlink")
                await tier.remove([ref(99)])  # accepted: the ones left are sent again
                await wait_for(
                    "the removals to be sent again",
                    lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
                )
                assert raw.exists(*stored[:2]) == 0 and raw.exists(*stored[2:]) == 2
                await wait_for("the journal's drops", lambda: disk.removals() == [])
                assert tier.stats().counters["remove_unrecorded"] == 0
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")


async def test_removals_an_unreachable_store_could_not_take_are_recorded_before_remove_returns(
    fresh_redis: RedisServer, l3_prefix: str, tmp_path: Path
) -> None:
    """A removal the store could not be sent (it went away during the call) and one made
    while the tier is down are both in the journal once ``remove`` returns."""
    names = KeyNamer(l3_prefix)
    blocks = [ref(i) for i in range(2)]
    with DiskTier(tmp_path / "l2", 32 << 20, 1 << 20, file_bytes=8 << 20) as disk:
        async with opened(options(fresh_redis, l3_prefix)) as tier:
            await tier.keep_removals_in(disk)
            fresh_redis.kill()
            await tier.remove(blocks[:1])
            assert tier.health().state is Health.DOWN
            await tier.remove(blocks[1:])
            c = tier.stats().counters
            assert c["remove_skipped_down"] == 1 and c["remove_unrecorded"] == 0
            assert sorted(k for k, _ in disk.removals()) == sorted(
                names.key(b.ns, b.key) for b in blocks
            )


def _journal_keys(path: Path) -> list[bytes]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return [bytes(k) for (k,) in db.execute("SELECT key FROM l3_removals")]


async def _hold_small_ops(tier: RemoteTier) -> int:
    """Take every connection removals may use (acquiring a free semaphore does not yield);
    returns how many were taken."""
    held = 0
    while not tier._small_ops.locked():
        await tier._small_ops.acquire()
        held += 1
    return held


@pytest.mark.parametrize("how", ["cancelled", "closed"])
async def test_regression_a_removal_cancelled_or_closed_before_its_reply_came_back_at_restart(
    fresh_redis: RedisServer, l3_prefix: str, tmp_path: Path, how: str
) -> None:
    """A removal waiting for its connection (or its replies) that was cancelled, or whose
    tier closed meanwhile (a Delete outliving the daemon's drain, cancelled at its exit),
    was neither confirmed nor remembered: the block stayed in the store, was found by the
    next lookup and, the journal not having it, after a restart. Such a removal is kept as
    one the store did not confirm, in memory and in the journal, and sent again."""
    nbytes = 4096
    blocks = [ref(0)]
    stored = KeyNamer(l3_prefix).key(blocks[0].ns, blocks[0].key)
    path = tmp_path / "removals.sqlite3"
    opts = options(fresh_redis, l3_prefix, ttl_s=100, removals_file=str(path))
    raw = raw_client(fresh_redis)
    try:
        async with opened(opts) as tier:
            assert await tier.write(blocks, nbytes, host([data(0, nbytes)])) == [True]
            held = await _hold_small_ops(tier)
            removing = asyncio.create_task(tier.remove(blocks))
            for _ in range(10):
                await asyncio.sleep(0)
            assert not removing.done()
            if how == "cancelled":
                removing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await removing
                # The store refuses the removal sent again: it stays remembered.
                raw.execute_command("ACL", "SETUSER", "default", "-unlink")
                for _ in range(held):
                    tier._small_ops.release()
                await wait_for("the journal's record", lambda: _journal_keys(path) == [stored])
                await wait_for("the resend to end", lambda: tier._resending is None)
                assert await tier.probe_each(blocks) == [PROBE_ABSENT]
                assert tier.stats().gauges["removals_unconfirmed"] == 1
        if how == "closed":
            removing.cancel()  # as the event loop's end does
            with pytest.raises(asyncio.CancelledError):
                await removing
        assert raw.exists(stored) == 1
        assert _journal_keys(path) == [stored]
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")
        async with opened(opts) as tier:
            assert await tier.probe_each(blocks) == [PROBE_ABSENT]
            await wait_for(
                "the removal to be sent again",
                lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
            )
            assert raw.exists(stored) == 0
    finally:
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")


async def test_regression_a_removal_confirmed_while_the_tier_closed_was_sent_again_at_restart(
    fresh_redis: RedisServer,
    l3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A removal still waiting at ``close`` is recorded as one the store did not confirm;
    when the store confirmed it while the close waited for that record, its drop from the
    journal was begun after the close had chosen what to wait for, and the journal was
    closed under it ("update failed: closed"). The entry stayed: the restart sent its
    UNLINK again and deleted the value written under the key since (by another node). The
    close waits for every journal update begun before it lets the journal go."""
    nbytes = 4096
    blocks = [ref(0)]
    stored = KeyNamer(l3_prefix).key(blocks[0].ns, blocks[0].key)
    path = tmp_path / "removals.sqlite3"
    opts = options(fresh_redis, l3_prefix, ttl_s=100, removals_file=str(path))
    raw = raw_client(fresh_redis)
    adding, release_add = threading.Event(), threading.Event()
    record = journal_module.RemovalFile.record_removals

    def held_journal(self, added, dropped):  # the journal's thread
        if any(k == stored for k, _ in added):
            adding.set()
            release_add.wait(30)  # the close waits for this record meanwhile
        elif stored in dropped:
            time.sleep(0.3)  # a slow disk: the drop ends after the close went on
        return record(self, added, dropped)

    monkeypatch.setattr(journal_module.RemovalFile, "record_removals", held_journal)
    tier = RemoteTier(opts)
    await tier.start()
    try:
        assert await tier.write(blocks, nbytes, host([data(0, nbytes)])) == [True]
        held = await _hold_small_ops(tier)
        removing = asyncio.ensure_future(tier.remove(blocks))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not removing.done()
        closing = asyncio.ensure_future(tier.close())
        await wait_for("the close's record of the removal", adding.is_set)
        for _ in range(held):
            tier._small_ops.release()
        await removing  # the store confirmed it: its drop is begun
        assert raw.exists(stored) == 0
        release_add.set()
        await closing
        await wait_for("the journal's updates to end", lambda: not tier._journaling)
        assert "update failed" not in caplog.text
        assert _journal_keys(path) == []
        raw.set(stored, b"another node's value")
        async with opened(opts) as restarted:
            assert restarted.stats().gauges["removals_unconfirmed"] == 0
        assert raw.get(stored) == b"another node's value"
    finally:
        release_add.set()
        await tier.close()  # if the test ended before it closed


async def test_regression_a_journal_drop_that_failed_deleted_the_block_written_again_at_restart(
    fresh_redis: RedisServer,
    l3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A removal the store confirmed was to leave the journal; when that drop failed (here
    another process held the file's lock past the busy timeout) the entry stayed, and
    nothing tried again: once the key was written again, the next start answered it absent
    and deleted the new value from the store. A drop that fails goes with the next update,
    and a write of such a key waits for it before its block is sent."""
    monkeypatch.setattr(journal_module, "_BUSY_TIMEOUT_S", 0.1)
    nbytes = 4096
    blocks = [ref(0)]
    stored = KeyNamer(l3_prefix).key(blocks[0].ns, blocks[0].key)
    path = tmp_path / "removals.sqlite3"
    opts = options(fresh_redis, l3_prefix, ttl_s=100, removals_file=str(path))
    raw = raw_client(fresh_redis)
    try:
        async with opened(opts) as tier:
            assert await tier.write(blocks, nbytes, host([data(0, nbytes)])) == [True]
            raw.execute_command("ACL", "SETUSER", "default", "-unlink")
            await tier.remove(blocks)  # refused: in the journal
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
            shell = sqlite3.connect(path, isolation_level=None)
            shell.execute("BEGIN IMMEDIATE")  # an operator's shell holds the file
            try:
                await tier.remove([ref(99)])  # accepted: the one left is sent again
                await wait_for(
                    "the removal to be confirmed",
                    lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
                )
                await wait_for("its drop to fail", lambda: "update failed" in caplog.text)
            finally:
                shell.execute("ROLLBACK")
                shell.close()
            assert raw.exists(stored) == 0
            assert await tier.write(blocks, nbytes, host([data(0, nbytes)])) == [True]
            with contextlib.closing(sqlite3.connect(path)) as db:  # dropped before it was sent
                assert db.execute("SELECT COUNT(*) FROM l3_removals").fetchone() == (0,)
        assert raw.exists(stored) == 1
        async with opened(opts) as tier:
            assert await tier.probe_each(blocks) == [nbytes]
            assert tier.stats().gauges["removals_unconfirmed"] == 0
        assert raw.exists(stored) == 1
    finally:
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")


async def test_regression_keys_whose_journal_drops_failed_grew_without_bound(
    fresh_redis: RedisServer,
    l3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the journal's drops keep failing, the keys waiting to be dropped were kept
    without bound. They are kept within the bound on remembered removals: the oldest beyond
    are no longer tried, counted and logged (their entries may delete a value written again
    since at the restart), and the newest are dropped once the journal takes updates."""
    monkeypatch.setattr(journal_module, "_BUSY_TIMEOUT_S", 0.1)
    monkeypatch.setattr(tier_module, "_UNDROPPED_MAX", 2)
    nbytes = 4096
    blocks = [ref(i) for i in range(4)]
    names = KeyNamer(l3_prefix)
    stored = [names.key(b.ns, b.key) for b in blocks]
    path = tmp_path / "removals.sqlite3"
    opts = options(fresh_redis, l3_prefix, ttl_s=100, removals_file=str(path))
    raw = raw_client(fresh_redis)
    try:
        async with opened(opts) as tier:
            src = host([data(i, nbytes) for i in range(4)])
            assert await tier.write(blocks, nbytes, src) == [True] * 4
            raw.execute_command("ACL", "SETUSER", "default", "-unlink")
            for pair in (blocks[:2], blocks[2:]):  # refused: in the journal, two at a time
                await tier.remove(pair)
            assert sorted(_journal_keys(path)) == sorted(stored)
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
            shell = sqlite3.connect(path, isolation_level=None)
            shell.execute("BEGIN IMMEDIATE")  # an operator's shell holds the file
            try:
                await tier.remove([ref(99)])  # accepted: the four are sent again
                await wait_for(
                    "the removals to be confirmed",
                    lambda: tier.stats().gauges["removals_unconfirmed"] == 0,
                )
                await wait_for("the drops to fail", lambda: not tier._journaling)
                assert raw.exists(*stored) == 0
                assert len(tier._undropped) == 2
                assert tier.stats().counters["remove_drops_forgotten"] == 2
                assert "the oldest are no longer tried" in caplog.text
            finally:
                shell.execute("ROLLBACK")
                shell.close()
        # The close dropped those still tried; the others' entries stay.
        assert len(_journal_keys(path)) == 2
    finally:
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")


async def test_regression_the_stop_said_removals_whose_record_failed_were_kept_for_the_restart(
    fresh_redis: RedisServer,
    l3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The close logged every removal the store had not confirmed as kept for the restart,
    also those the journal failed to record (counted in ``remove_unrecorded``), which the
    restart does not know of. It says how many are kept and how many are not."""
    monkeypatch.setattr(journal_module, "_BUSY_TIMEOUT_S", 0.1)
    caplog.set_level(logging.INFO, logger=tier_module.__name__)
    nbytes = 4096
    blocks = [ref(i) for i in range(3)]
    path = tmp_path / "removals.sqlite3"
    opts = options(fresh_redis, l3_prefix, ttl_s=100, removals_file=str(path))
    raw = raw_client(fresh_redis)
    try:
        async with opened(opts) as tier:
            src = host([data(i, nbytes) for i in range(3)])
            assert await tier.write(blocks, nbytes, src) == [True] * 3
            raw.execute_command("ACL", "SETUSER", "default", "-unlink")
            shell = sqlite3.connect(path, isolation_level=None)
            shell.execute("BEGIN IMMEDIATE")  # an operator's shell holds the file
            try:
                await tier.remove(blocks[:2])  # refused, and not recorded
            finally:
                shell.execute("ROLLBACK")
                shell.close()
            await tier.remove(blocks[2:])  # refused, and recorded
            c = tier.stats().counters
            assert c["remove_unrecorded"] == 2
            assert tier.stats().gauges["removals_unconfirmed"] == 3
            caplog.clear()
        assert len(_journal_keys(path)) == 1
        closing = [r.getMessage() for r in caplog.records if "kept for the restart" in r.message]
        assert closing == [
            "L3: 1 removals not yet confirmed by the store are kept for the restart; 2 more "
            "are not, their record failed or did not end (remove_unrecorded): their blocks "
            "may be found again after the restart, until their expiry"
        ]
    finally:
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")


async def test_regression_a_delete_s_keys_held_for_a_lost_master_were_recorded_again_at_close(
    fresh_redis: RedisServer, l3_prefix: str, tmp_path: Path
) -> None:
    """A Delete whose pipeline, as it was filled, held some keys for a master lost by then
    (injected: the server marked lost there, the first half of the keys served) recorded
    those in the journal at once, and a close while its UNLINKs were on their way recorded
    them again, as UNLINKs unconfirmed. They are recorded once; the others at the close."""
    nbytes = 4096
    blocks = [ref(i) for i in range(4)]
    journal_path = str(tmp_path / "removals.sqlite3")
    # Its UNLINKs wait this long at the paused store: the close comes meanwhile.
    opts = options(fresh_redis, l3_prefix, ttl_s=100, removals_file=journal_path, op_timeout_s=2)
    async with opened(opts) as tier:
        assert (
            await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(4)]))
            == [True] * 4
        )
        keys = [tier._names.key(b.ns, b.key) for b in blocks]
        recorded: list[bytes] = []
        journal = tier._journal
        assert journal is not None
        record_removals = journal.record_removals

        def spied(added: list[tuple[bytes, float | None]], gone: list[bytes]) -> bool:
            recorded.extend(k for k, _ in added)
            return record_removals(added, gone)

        journal.record_removals = spied  # type: ignore[method-assign]
        hold_for_lost = tier._hold_for_lost
        firsts: list[bool] = []

        def lost_as_filled(keys: list[bytes], *, first: bool) -> Any:
            firsts.append(first)
            if len(firsts) == 2:  # remove()'s own, then its pipeline's fill
                tier._lost = {"": "injected"}
                tier._served = lambda keys: [0, 1]  # type: ignore[method-assign]
            return hold_for_lost(keys, first=first)

        tier._hold_for_lost = lost_as_filled  # type: ignore[method-assign]
        fresh_redis.pause()
        try:
            removing = asyncio.create_task(tier.remove(blocks))
            await wait_for("the pipeline's fill", lambda: len(firsts) == 2)
            await tier.close()
            await removing
        finally:
            fresh_redis.resume()
    assert sorted(recorded) == sorted(keys), recorded


async def test_regression_a_write_did_not_wait_for_its_keys_journal_drop_under_way(
    fresh_redis: RedisServer,
    l3_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A removal the store confirmed leaves the journal in the background; a write of the key
    made while that drop waited its turn sent its block at once, so that a restart before the
    drop ran found the entry and deleted the new value. A write waits for the drops of its
    keys begun before it (a loaded machine made tests/tiers/test_remote.py's test of a failed
    drop fail once this way)."""
    nbytes = 4096
    blocks = [ref(0)]
    stored = KeyNamer(l3_prefix).key(blocks[0].ns, blocks[0].key)
    opts = options(
        fresh_redis, l3_prefix, ttl_s=100, removals_file=str(tmp_path / "removals.sqlite3")
    )
    raw = raw_client(fresh_redis)
    held, release = threading.Event(), threading.Event()
    record = journal_module.RemovalFile.record_removals

    def slow_drop(self, added, dropped):  # the journal's thread, busy with the drop
        if stored in dropped:
            held.set()
            release.wait(30)
        return record(self, added, dropped)

    monkeypatch.setattr(journal_module.RemovalFile, "record_removals", slow_drop)
    try:
        async with opened(opts) as tier:
            assert await tier.write(blocks, nbytes, host([data(0, nbytes)])) == [True]
            raw.execute_command("ACL", "SETUSER", "default", "-unlink")
            await tier.remove(blocks)  # refused: in the journal
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
            await tier.remove([ref(99)])  # accepted: the one left is sent again
            await wait_for("its drop to be under way", held.is_set)
            assert raw.exists(stored) == 0
            writing = asyncio.ensure_future(tier.write(blocks, nbytes, host([data(1, nbytes)])))
            await asyncio.sleep(0.3)
            assert raw.exists(stored) == 0  # not sent while the entry is in the journal
            release.set()
            assert await writing == [True]
            assert raw.exists(stored) == 1
        async with opened(opts) as tier:  # a start finds nothing to send again
            assert await tier.probe_each(blocks) == [nbytes]
        assert raw.exists(stored) == 1
    finally:
        release.set()
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")


async def test_regression_two_tiers_shared_one_removals_file(
    fresh_redis: RedisServer, l3_prefix: str, tmp_path: Path
) -> None:
    """Two daemons given one ``removals_file`` (one config for two, or a new daemon started
    before the old one had stopped) both used it: the second took up the first's removals
    and kept them in memory while the first wrote a key again and dropped its entry, so the
    second then sent that key's UNLINK and deleted the value written again. The file is
    held by one tier at a time: the second does not start, and starts once the first has
    closed."""
    nbytes = 4096
    blocks = [ref(0)]
    stored = KeyNamer(l3_prefix).key(blocks[0].ns, blocks[0].key)
    opts = options(fresh_redis, l3_prefix, removals_file=str(tmp_path / "removals.sqlite3"))
    raw = raw_client(fresh_redis)
    try:
        async with opened(opts) as first:
            assert await first.write(blocks, nbytes, host([data(0, nbytes)])) == [True]
            raw.execute_command("ACL", "SETUSER", "default", "-unlink")
            await first.remove(blocks)  # refused: in the file
            second = RemoteTier(opts)
            with pytest.raises(TierUnavailable, match=r"removals_file .* in use"):
                await second.start()
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
            assert await first.write(blocks, nbytes, host([data(0, nbytes)])) == [True]
            await first.remove([ref(99)])
            assert raw.exists(stored) == 1
        async with opened(opts) as again:
            assert await again.probe_each(blocks) == [nbytes]
    finally:
        raw.execute_command("ACL", "SETUSER", "default", "+unlink")


async def test_a_removals_file_that_cannot_be_opened_stops_the_start(
    redis_server: RedisServer, l3_prefix: str, tmp_path: Path
) -> None:
    path = tmp_path / "no such folder" / "removals.sqlite3"
    tier = RemoteTier(options(redis_server, l3_prefix, removals_file=str(path)))
    with pytest.raises(TierUnavailable, match=r"removals_file .*no such folder"):
        await tier.start()


async def test_regression_a_resent_removal_deleted_the_block_written_while_it_waited(
    fresh_redis: RedisServer, l3_prefix: str
) -> None:
    """A removal sent again waits for a connection of its own; a write of the same key made
    meanwhile ends the removal and stores the block, but the UNLINK chosen before it was
    still sent once a connection freed, deleting the block just written (reported stored).
    A resend sends only the removals still remembered when it gets its connection."""
    nbytes = 4096
    block = ref(0)
    raw = raw_client(fresh_redis)
    stored = KeyNamer(l3_prefix).key(block.ns, block.key)
    async with opened(options(fresh_redis, l3_prefix)) as tier:
        assert await tier.write([block], nbytes, host([data(0, nbytes)])) == [True]
        raw.execute_command("ACL", "SETUSER", "default", "-unlink")
        try:
            await tier.remove([block])
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
        assert tier.stats().gauges["removals_unconfirmed"] == 1
        await tier.remove([ref(99)])  # accepted: the resend of the first one starts
        # Every connection for removals busy: the resend waits for one (acquiring a free
        # semaphore does not yield, so the resend has not run yet).
        small = tier._small_ops
        held = 0
        while not small.locked():
            await small.acquire()
            held += 1
        for _ in range(10):
            await asyncio.sleep(0)
        assert await tier.write([block], nbytes, host([data(0, nbytes)])) == [True]
        for _ in range(held):
            small.release()
        await wait_for("the resend to end", lambda: tier._resending is None)
        assert raw.exists(stored) == 1
        assert await tier.probe([block]) == [nbytes]


@pytest.mark.parametrize("refused", [False, True], ids=["accepted", "refused"])
async def test_regression_a_removal_deleted_or_hid_the_block_written_while_it_waited(
    fresh_redis: RedisServer, l3_prefix: str, refused: bool
) -> None:
    """A removal waits for a connection of its own; a write of the same key made meanwhile
    stores the block again, but the UNLINK was still sent once a connection freed, deleting
    the block just written (reported stored), and one the store refused was remembered:
    the block answered absent and its resend deleted it. A removal sends, and remembers,
    only the keys no write stored again since it began."""
    nbytes = 4096
    block = ref(0)
    raw = raw_client(fresh_redis)
    stored = KeyNamer(l3_prefix).key(block.ns, block.key)
    async with opened(options(fresh_redis, l3_prefix)) as tier:
        assert await tier.write([block], nbytes, host([data(0, nbytes)])) == [True]
        if refused:
            raw.execute_command("ACL", "SETUSER", "default", "-unlink")
        try:
            # Every connection for removals busy: the removal waits for one.
            small = tier._small_ops
            held = 0
            while not small.locked():
                await small.acquire()
                held += 1
            removing = asyncio.create_task(tier.remove([block]))
            for _ in range(10):
                await asyncio.sleep(0)
            assert not removing.done()
            assert await tier.write([block], nbytes, host([data(0, nbytes)])) == [True]
            for _ in range(held):
                small.release()
            await removing
        finally:
            raw.execute_command("ACL", "SETUSER", "default", "+unlink")
        assert tier.stats().gauges["removals_unconfirmed"] == 0
        assert await tier.probe([block]) == [nbytes]
        await tier.remove([ref(99)])  # accepted: any remembered removal is sent again
        await wait_for("the resend to end", lambda: tier._resending is None)
        assert raw.exists(stored) == 1
        assert await tier.probe([block]) == [nbytes]


class _HoldingProxy:
    """A TCP relay to a redis-server that can hold back what the next connection opened
    through it sends (its set-up: CLIENT SETINFO, and what follows) until ``release``: a
    connection slow to open, while the connections opened before and after it go through."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._hold_next = False
        self._gate = asyncio.Event()
        self.held = b""  # what the held connection sent before its release
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> _HoldingProxy:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def hold_next(self) -> None:
        self._hold_next = True

    def release(self) -> None:
        self._gate.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        self._tasks.add(relay)  # cancelled at the exit, held or not
        relay.add_done_callback(self._tasks.discard)
        held, self._hold_next = self._hold_next, False
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port)
        self._writers += [writer, up_writer]
        if held:
            while not self._gate.is_set():
                got = asyncio.ensure_future(reader.read(65536))
                gate = asyncio.ensure_future(self._gate.wait())
                await asyncio.wait({got, gate}, return_when=asyncio.FIRST_COMPLETED)
                gate.cancel()
                if got.done():
                    self.held += got.result()
                else:
                    got.cancel()
            up_writer.write(self.held)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await src.read(65536):
                dst.write(chunk)
                await dst.drain()
        dst.close()


async def test_regression_a_removal_whose_connection_was_opening_deleted_the_block_written_meanwhile(
    fresh_redis: RedisServer, l3_prefix: str
) -> None:
    """A removal fixes the keys it sends once it may use a connection, before redis-py takes
    one from the pool; one the store had closed (its idle timeout, a restart) is opened again
    first. A write of the same key made meanwhile went out at once on another connection and
    stored the block (reported stored); the UNLINK then reached the store and deleted it."""
    nbytes = 4096
    block = ref(0)
    raw = raw_client(fresh_redis)
    stored = KeyNamer(l3_prefix).key(block.ns, block.key)
    async with _HoldingProxy(fresh_redis.port) as proxy:
        opts = options(fresh_redis, l3_prefix, urls=(proxy.url,))
        async with opened(opts) as tier:
            assert await tier.write([block], nbytes, host([data(0, nbytes)])) == [True]
            # The store closes the tier's connections; the removal's, opened again, is slow.
            raw.client_kill_filter(_type="normal", skipme=True)
            await wait_for(
                "the connections to close", lambda: len(raw.client_list()) == 1
            )  # the raw client
            proxy.hold_next()
            removing = asyncio.create_task(tier.remove([block]))
            await wait_for("the removal's connection to open", lambda: proxy.held != b"")
            writing = asyncio.create_task(tier.write([block], nbytes, host([data(0, nbytes)])))
            # Sent at once, it ends well within this; held back until the UNLINK ends, not.
            # Either way the removal's connection then opens.
            await asyncio.wait({writing}, timeout=2.0)
            proxy.release()
            await removing
            assert await writing == [True]
            assert b"UNLINK" not in proxy.held  # held in its set-up, not sent
            assert raw.exists(stored) == 1
            assert await tier.probe([block]) == [nbytes]


async def test_regression_a_write_behind_an_unreachable_removal_waited_for_its_journal_record(
    fresh_redis: RedisServer, l3_prefix: str, tmp_path: Path
) -> None:
    """A write of a key waits for an UNLINK of it already on its way, which the op timeout
    bounds; it was let go only once that removal had also recorded its other keys (the
    store gone: kept to send again) in the journal, which a busy journal (its file locked
    by another process) holds up to its busy timeout, 30 s. Let go as the UNLINK ends."""
    nbytes = 4096
    blocks = [ref(0), ref(1)]
    path = tmp_path / "removals.sqlite3"
    raw = raw_client(fresh_redis)
    async with _HoldingProxy(fresh_redis.port) as proxy:
        opts = options(
            fresh_redis,
            l3_prefix,
            urls=(proxy.url,),
            op_timeout_s=2.0,  # ample for the write to begin behind the UNLINK
            removals_file=str(path),
        )
        async with opened(opts) as tier:
            src = host([data(0, nbytes), data(1, nbytes)])
            assert await tier.write(blocks, nbytes, src) == [True, True]
            # The removal's connection, opened again, is held until the op timeout.
            raw.client_kill_filter(_type="normal", skipme=True)
            await wait_for("the connections to close", lambda: len(raw.client_list()) == 1)
            proxy.hold_next()
            busy = sqlite3.connect(path, isolation_level=None)
            try:
                busy.execute("BEGIN IMMEDIATE")  # another writer holds the journal
                removing = asyncio.create_task(tier.remove(blocks))
                await wait_for("the removal's connection to open", lambda: proxy.held != b"")
                assert tier._unlinking  # the UNLINK's keys are fixed; it has not ended
                writing = asyncio.create_task(
                    tier.write(blocks[:1], nbytes, host([data(0, nbytes)]))
                )
                await asyncio.wait({writing}, timeout=2.0 + 10 * SLACK_S)
                assert writing.done(), "the write waited for the removal's journal record"
                assert not removing.done()  # its record waits for the journal still
            finally:
                busy.execute("ROLLBACK")
                busy.close()
                proxy.release()
            await removing
            await writing


@pytest.mark.parametrize("kind", EVENT_LOOPS)
def test_regression_a_timed_out_write_sent_buffers_it_had_handed_back(
    fresh_redis: RedisServer, l3_prefix: str, kind: str
) -> None:
    """uvloop's transports keep a reference to what they have not sent yet (asyncio's own
    copies it): a write that timed out against a hung store handed its buffers back (L1
    slots, staging buffers) while its connection, closed gracefully, still held them, and
    once the store read again their new bytes were stored under the old keys and headers. A
    failed write aborts the connections that took its bodies: what the store gets is each
    block as it was, or nothing."""
    nbytes = 8 << 20  # far more than the socket buffers take while the store is hung
    blocks = [ref(i) for i in range(4)]
    orig = [data(i, nbytes) for i in range(4)]
    raw = raw_client(fresh_redis)

    def others() -> set[str]:
        return {c["id"] for c in raw.client_list()} - {str(raw.client_id())}

    async def run() -> None:
        async with opened(options(fresh_redis, l3_prefix, op_timeout_s=OP_TIMEOUT_S)) as tier:
            assert await tier.write([ref(99)], 4096, host([data(99, 4096)])) == [True]
            before = others()  # the tier's connections, the write's among them
            src = [bytearray(b) for b in orig]
            fresh_redis.pause()
            try:
                assert await tier.write(blocks, nbytes, host(src)) == [False] * 4
                for buf in src:
                    buf[:] = bytes(nbytes)  # the caller's again, and rewritten
            finally:
                fresh_redis.resume()
            await wait_for("the write's connection to end", lambda: not before & others())

    loops.run(run(), kind)
    namer = KeyNamer(l3_prefix)
    for i, block in enumerate(blocks):
        key = namer.key(block.ns, block.key)
        assert raw.get(key) in (None, header(nbytes, checksum(orig[i]), key) + orig[i]), i


async def test_an_unreachable_store_at_start_is_not_fatal(tmp_path: Path, l3_prefix: str) -> None:
    # The tier is given the port before its server starts: held by this process meanwhile
    # (refusing connections), lest another server take it.
    with held_port() as port:
        server = RedisServer(tmp_path / "late", port=port)
        async with opened(options(server, l3_prefix)) as tier:
            assert tier.health().state is Health.DOWN
            assert await tier.probe([ref(1)]) == []
            server.start()
            try:
                await wait_for("L3 to come up", lambda: tier.health().state is Health.OK)
                assert await tier.write([ref(1)], 4096, host([data(1, 4096)])) == [True]
            finally:
                server.stop()


async def test_out_of_memory_pauses_writes_not_reads(tmp_path: Path, l3_prefix: str) -> None:
    nbytes = 1 << 20
    with RedisServer(tmp_path / "small", maxmemory_bytes=6 << 20) as server:
        async with opened(
            options(server, l3_prefix, backoff_initial_s=30.0, backoff_max_s=60.0)
        ) as tier:
            blocks = [ref(i) for i in range(12)]
            stored = await tier.write(blocks, nbytes, host([data(i, nbytes) for i in range(12)]))
            assert any(stored) and not all(stored)
            c = tier.stats().counters
            assert c["write_no_space"] == stored.count(False)
            health = tier.health()
            assert health.state is Health.DEGRADED_NOSPACE and not health.accepts_writes
            # Writes pause (no network); reads go on.
            assert await tier.write(blocks[:1], nbytes, host([data(0, nbytes)])) == [False]
            assert tier.stats().counters["write_skipped_down"] == 1
            first = stored.index(True)
            dest = empty(1, nbytes)
            assert await tier.read(blocks[first : first + 1], nbytes, host(dest)) == [True]
            assert bytes(dest[0]) == data(first, nbytes)


async def test_a_write_that_started_before_out_of_memory_does_not_resume_writes(
    tmp_path: Path, l3_prefix: str
) -> None:
    """Regression: a write sent before another write's out-of-memory refusal, whose reply
    was taken in after it, ended the pause at once (its success was read as room come back),
    so the backoff never held while earlier writes were still in flight. A write sent after
    the backoff still ends it."""
    nbytes = 4096
    now = [1000.0]
    with RedisServer(tmp_path / "small", maxmemory_bytes=64 << 20) as server:
        async with opened(
            options(server, l3_prefix, backoff_initial_s=30.0, backoff_max_s=60.0),
            clock=lambda: now[0],
        ) as tier:
            real = tier._pipeline
            arrived, release = asyncio.Event(), asyncio.Event()

            async def hold_first_reply(*args: Any) -> list[Any]:
                replies = await real(*args)
                if not arrived.is_set():  # the store took this write; its reply waits
                    arrived.set()
                    await release.wait()
                return replies

            tier._pipeline = hold_first_reply  # type: ignore[method-assign]
            early = asyncio.create_task(tier.write([ref(1)], nbytes, host([data(1, nbytes)])))
            await arrived.wait()
            with raw_client(server) as raw:
                raw.config_set("maxmemory", 1)
            assert await tier.write([ref(2)], nbytes, host([data(2, nbytes)])) == [False]
            assert tier.health().state is Health.DEGRADED_NOSPACE
            release.set()
            assert await early == [True]
            assert tier.health().state is Health.DEGRADED_NOSPACE
            assert await tier.write([ref(3)], nbytes, host([data(3, nbytes)])) == [False]
            assert tier.stats().counters["write_skipped_down"] == 1
            with raw_client(server) as raw:
                raw.config_set("maxmemory", 64 << 20)
            now[0] += 60.0
            assert await tier.write([ref(4)], nbytes, host([data(4, nbytes)])) == [True]
            assert tier.health().state is Health.OK


async def test_regression_blocks_declined_at_send_time_kept_their_write_budget(
    tmp_path: Path, l3_prefix: str
) -> None:
    """A write whose server paused for lack of memory while it waited for a connection
    declines its blocks unsent, and gives back the write budget it took for them: they
    were never sent. It kept it, so a full store's backoff also ate into the budget of the
    writes after it."""
    nbytes = 16 << 10
    value = HEADER_BYTES + nbytes
    now = [1000.0]  # the budget refills by nothing meanwhile
    with RedisServer(tmp_path / "small", maxmemory_bytes=64 << 20) as server:
        # One connection for bulk calls (a pool of 2, the other kept for probes): the second
        # write waits for the first's, which the store refuses, pausing the writes.
        opts = options(
            server,
            l3_prefix,
            pool_size=2,
            write_bytes_s=40_000,
            max_value_bytes=64 << 10,
            backoff_initial_s=30.0,
            backoff_max_s=60.0,
        )
        async with opened(opts, clock=lambda: now[0]) as tier:
            with raw_client(server) as raw:
                raw.config_set("maxmemory", 1)
            first = asyncio.create_task(tier.write([ref(1)], nbytes, host([data(1, nbytes)])))
            second = asyncio.create_task(
                tier.write([ref(2), ref(3)], nbytes, host([data(2, nbytes), data(3, nbytes)]))
            )
            assert await first == [False]
            assert await second == [False, False]
            c = tier.stats().counters
            assert (c["write_no_space"], c["write_skipped_down"]) == (1, 2)
            assert tier.stats().gauges["write_budget_bytes"] == 65536 - value


async def test_writes_look_up_no_server_while_none_is_paused(
    tmp_path: Path, l3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-server checks of a write (which server each key goes to, is it paused) cost
    about half a microsecond a block: a write makes them only while some server is paused
    (or a cluster master lost), and one refused for lack of memory still starts the pause.
    Every write made them."""
    nbytes = 4096
    with RedisServer(tmp_path / "small", maxmemory_bytes=64 << 20) as server:
        async with opened(options(server, l3_prefix)) as tier:
            lookups = ServerLookups(tier, monkeypatch)
            blocks = [ref(i) for i in range(8)]
            src = host([data(i, nbytes) for i in range(8)])
            assert await tier.write(blocks, nbytes, src) == [True] * 8
            assert lookups.keys == 0
            with raw_client(server) as raw:
                raw.config_set("maxmemory", 1)
            assert await tier.write(blocks, nbytes, src) == [False] * 8
            assert tier.health().state is Health.DEGRADED_NOSPACE
            assert await tier.write(blocks, nbytes, src) == [False] * 8
            assert tier.stats().counters["write_skipped_down"] == 8


class _CountedWaits:
    """A tier's connection share that counts the calls that had to wait for a connection."""

    def __init__(self, share: asyncio.Semaphore) -> None:
        self.share = share
        self.waited = 0

    async def __aenter__(self) -> None:
        if self.share.locked():
            self.waited += 1
        await self.share.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.share.release()


async def test_writes_waiting_for_a_connection_when_out_of_memory_begins_are_not_sent(
    tmp_path: Path, l3_prefix: str
) -> None:
    """Regression: writes admitted before an out-of-memory pause began, still waiting for a
    connection when it did, were sent anyway; each was refused and each refusal doubled the
    backoff. Once a connection is free they are checked against the pause (skipped, no
    network), the backoff stays at its first step, and a write after it ends the pause."""
    nbytes = 4096
    now = [1000.0]
    with RedisServer(tmp_path / "small", maxmemory_bytes=64 << 20) as server:
        # pool_size 2: one connection for writes, so the second and third wait for the first.
        opts = options(server, l3_prefix, pool_size=2, backoff_initial_s=30.0, backoff_max_s=1000.0)
        async with opened(opts, clock=lambda: now[0]) as tier:
            tier._bulk_ops = _CountedWaits(tier._bulk_ops)  # type: ignore[assignment]
            with raw_client(server) as raw:
                raw.config_set("maxmemory", 1)
            writes = [tier.write([ref(i)], nbytes, host([data(i, nbytes)])) for i in range(3)]
            assert await asyncio.gather(*writes) == [[False]] * 3
            assert tier._bulk_ops.waited == 2
            c = tier.stats().counters
            assert (c["write_no_space"], c["write_skipped_down"]) == (1, 2)
            assert tier.health().state is Health.DEGRADED_NOSPACE
            assert tier.stats().gauges["retry_in_s"] <= 30.0  # one refusal's backoff
            with raw_client(server) as raw:
                raw.config_set("maxmemory", 64 << 20)
            now[0] += 30.0
            assert await tier.write([ref(3)], nbytes, host([data(3, nbytes)])) == [True]
            assert tier.health().state is Health.OK


async def test_writes_in_flight_when_out_of_memory_begins_back_off_once(
    tmp_path: Path, l3_prefix: str
) -> None:
    """Regression: of writes sent together before the store ran out of memory, the first
    refusal began the pause and each later one doubled its backoff, as if it were a retry
    refused after the backoff. Only a write sent during the pause backs it off further."""
    nbytes = 4096
    now = [1000.0]
    with RedisServer(tmp_path / "small", maxmemory_bytes=64 << 20) as server:
        opts = options(server, l3_prefix, backoff_initial_s=30.0, backoff_max_s=1000.0)
        async with opened(opts, clock=lambda: now[0]) as tier:
            with raw_client(server) as raw:
                raw.config_set("maxmemory", 1)
            writes = [tier.write([ref(i)], nbytes, host([data(i, nbytes)])) for i in range(3)]
            assert await asyncio.gather(*writes) == [[False]] * 3
            assert tier.stats().counters["write_no_space"] == 3
            assert tier.stats().gauges["retry_in_s"] <= 30.0  # one refusal's backoff
            now[0] += 30.0
            assert await tier.write([ref(3)], nbytes, host([data(3, nbytes)])) == [False]
            assert tier.stats().gauges["retry_in_s"] > 30.0  # a retry refused: backed off


# ------------------------------------------------------------------- credentials


async def test_password_comes_from_a_file(tmp_path: Path, l3_prefix: str) -> None:
    secret = tmp_path / "l3.password"
    secret.write_text("s3cret-Pw\n")
    secret.chmod(0o600)
    wrong = tmp_path / "wrong.password"
    wrong.write_text("nope\n")
    with RedisServer(tmp_path / "auth", password="s3cret-Pw") as server:
        opts = options(server, l3_prefix, password_file=str(secret))
        assert "s3cret" not in repr(opts)
        async with opened(opts) as tier:
            assert await tier.write([ref(1)], 4096, host([data(1, 4096)])) == [True]
            assert len(await tier.probe([ref(1)])) == 1
        with pytest.raises(TierUnavailable, match="credentials"):
            async with opened(options(server, l3_prefix, password_file=str(wrong))):
                pass
        with pytest.raises(TierUnavailable, match="credentials"):
            async with opened(options(server, l3_prefix)):
                pass
    with pytest.raises(TierUnavailable, match="password_file"):
        RemoteTier(options(server, l3_prefix, password_file=str(tmp_path / "absent")))


# ---------------------------------------------------------------------- the rest


async def test_every_outcome_has_a_counter(redis_server: RedisServer, l3_prefix: str) -> None:
    async with opened(options(redis_server, l3_prefix)) as tier:
        stats = tier.stats()
    assert set(stats.counters) == set(COUNTERS)
    assert stats.health.state is Health.OK


async def test_bad_options_are_refused_at_construction(l3_prefix: str) -> None:
    for bad in (
        RemoteOptions(urls=("http://x:1",)),
        RemoteOptions(urls=("redis://user:pw@x:1",)),
        RemoteOptions(urls=("redis://a:1", "redis://b:1")),  # two servers in single mode
        RemoteOptions(key_prefix="{tag}"),
        RemoteOptions(mode="sentinel"),
    ):
        with pytest.raises(TierUnavailable):
            RemoteTier(bad)


async def test_tls_round_trip_and_an_untrusted_server(tmp_path: Path, l3_prefix: str) -> None:
    files = make_tls_files(tmp_path / "pki")
    other_ca = make_tls_files(tmp_path / "other", name="other-ca").ca_cert
    with RedisServer(tmp_path / "tls", tls=files) as server:
        assert server.url.startswith("rediss://")
        async with opened(options(server, l3_prefix, tls_ca_file=str(files.ca_cert))) as tier:
            assert tier.health().state is Health.OK
            src = [data(i, 65536) for i in range(4)]
            blocks = [ref(i) for i in range(4)]
            assert await tier.write(blocks, 65536, host(src)) == [True] * 4
            dest = empty(4, 65536)
            assert await tier.read(blocks, 65536, host(dest)) == [True] * 4
            assert [bytes(d) for d in dest] == src
        # A server whose certificate the configured CA did not sign is never talked to.
        async with opened(options(server, l3_prefix, tls_ca_file=str(other_ca))) as tier:
            health = tier.health()
            assert health.state is Health.DOWN and "certificate" in health.detail.lower()
            assert await tier.probe(blocks) == []


def test_regression_namespace_names_chosen_by_clients_grew_the_key_cache_without_bound():
    namer = KeyNamer("kvtier:")
    for ns in range(20_000):  # a client looking up under ever new namespace names
        assert namer.key(ns, b"\x01" * 32).startswith(f"kvtier:{ns}:".encode())
    assert len(namer._cache) <= 4096


def test_a_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A test run that crashes leaves no redis-server behind (parent-death signal, set
    without running Python between fork and exec)."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvtier.bench.redis_proc import RedisServer\n"
        "server = RedisServer(Path(sys.argv[1]))\n"
        "server.start()\n"
        "print(server.proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    os.kill(pid, 0)  # running
    owner.kill()
    owner.wait()

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

    deadline = time.monotonic() + 10
    while not gone():
        assert time.monotonic() < deadline, "redis-server outlived the process that started it"
        time.sleep(0.05)


async def test_regression_a_tier_without_a_write_rate_showed_a_negative_budget_gauge(
    redis_server: RedisServer, l3_prefix: str
) -> None:
    """Without tiers.l3.write_bytes_s there is no budget: its gauge was -1, a negative gauge
    on the metrics (kvtier_tier_gauge) that no figure of bytes can be. It is absent then."""
    async with opened(options(redis_server, l3_prefix)) as tier:
        gauges = tier.stats().gauges
        assert "write_budget_bytes" not in gauges
        assert all(v >= 0 for v in gauges.values()), gauges
