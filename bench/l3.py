"""``kvtier bench l3``: L3 tier bandwidth and chain-probe latency next to plain redis-py.

Starts its own ``redis-server`` (or a 3-master cluster with ``--cluster``; or uses ``--url``)
and measures, in one run, on one server, with the same concurrency on both sides:

- put: ``RemoteTier.write`` of batches of 2 MiB blocks from host buffers (checksum and header
  per block, the bytes sent from the buffer they are in, one pipelined SET per block with the
  TTL), against redis-py's own pipelined SET of values of the same size (prepared in advance:
  no header, no checksum);
- get: ``RemoteTier.read`` into host buffers (pipelined GET, header and checksum verified,
  bytes copied into place; batches of 1 MiB or more on the tier's codec threads), against
  redis-py's pipelined GET of the same values (bytes returned, nothing checked or copied);
- probe: latency of ``RemoteTier.probe`` of a 64-block chain (one pipelined round trip of
  GETRANGE of each header, headers parsed, prefix and sizes computed), against one pipelined
  round trip of 64 GETRANGE of the same bytes through redis-py.

The redis-py side of put and get runs with redis-py's defaults and, separately, with the
tier's client settings (its socket reads and socket timeout, and its connections from
``tiers/remote/wire.py``), so that the tier's own cost shows apart from what they save.

``--concurrency`` workers take batches of ``--batch`` blocks from a shared queue on both
sides. Sides alternate which goes first round by round; figures are medians over rounds
(bandwidth) or over all probes (latency, with p99).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from kvtier.bench import BenchUnavailable
from kvtier.bench.common import scratch_folder
from kvtier.bench.jsonout import JSON_HELP, Emit
from kvtier.bench.redis_proc import RedisClusterProcs, RedisProcError, RedisServer, redis_binaries
from kvtier.tiers.base import BlockRef, HostBuffers, TierUnavailable
from kvtier.tiers.remote.codec import HEADER_BYTES, KeyNamer
from kvtier.tiers.remote.options import RemoteOptions
from kvtier.tiers.remote.tier import SOCKET_READ_BYTES, RemoteTier
from kvtier.tiers.remote.wire import use_tier_connections

MiB = 1 << 20


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtier bench l3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--block-bytes", type=int, default=2 * MiB, help="block size (2 MiB)")
    p.add_argument("--blocks", type=int, default=64, help="blocks in the working set (64)")
    p.add_argument("--batch", type=int, default=4, help="blocks per call (4)")
    p.add_argument("--concurrency", type=int, default=4, help="calls in flight, both sides (4)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (5)")
    p.add_argument("--chain", type=int, default=64, help="blocks in the probed chain (64)")
    p.add_argument("--probes", type=int, default=300, help="probes per side (300)")
    p.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster")
    p.add_argument("--url", default="", help="use this server instead of starting one")
    p.add_argument("--dir", default="", help="where the server's folder goes (a temp dir)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    args = p.parse_args(argv)
    counts = ("block_bytes", "blocks", "batch", "concurrency", "rounds", "chain", "probes")
    if min(getattr(args, c) for c in counts) < 1:
        p.error("counts must be at least 1")
    return args


def _keys(n: int, salt: int) -> list[bytes]:
    return [
        hashlib.blake2b((salt * 1_000_003 + i).to_bytes(8, "little"), digest_size=32).digest()
        for i in range(n)
    ]


async def _spread(
    batches: list[list[int]], workers: int, fn: Callable[[list[int]], Awaitable[None]]
) -> float:
    """Seconds for ``workers`` tasks to run ``fn`` over every batch, taken from one queue."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for b in batches:
        queue.put_nowait(b)

    async def worker() -> None:
        while True:
            try:
                batch = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await fn(batch)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return time.perf_counter() - t0


async def _run(
    args: argparse.Namespace, urls: list[str], say: Callable[[str], None]
) -> dict[str, Any]:
    B, n, batch, workers = args.block_bytes, args.blocks, args.batch, args.concurrency
    pool = max(16, 2 * workers + 4)
    mode = "cluster" if args.cluster else "single"
    opts = RemoteOptions(
        urls=tuple(urls),
        mode=mode,
        key_prefix="bench:tier:",
        ttl_s=600,
        max_value_bytes=max(64 * MiB, B + HEADER_BYTES),
        pool_size=pool,
        op_timeout_s=60.0,
        connect_timeout_s=5.0,
        probe_deadline_ms=10_000.0,
    )
    tier = RemoteTier(opts)
    await tier.start()
    if args.cluster:
        hosts = [u.removeprefix("redis://").split(":") for u in urls]
        raw: Any = RedisCluster(
            startup_nodes=[ClusterNode(h, int(p)) for h, p in hosts], max_connections=pool
        )
    else:
        h, p = urls[0].removeprefix("redis://").split(":")
        raw = aioredis.Redis(host=h, port=int(p), max_connections=pool)
    # The same, with the tier's client settings (RemoteTier._new_client): its socket reads,
    # its socket timeout (redis-py sends through another path with one) and its connections.
    tier_settings: dict[str, Any] = {
        "max_connections": pool,
        "socket_read_size": SOCKET_READ_BYTES,
        "socket_timeout": opts.op_timeout_s,
    }
    if args.cluster:
        same: Any = RedisCluster(
            startup_nodes=[ClusterNode(h, int(p)) for h, p in hosts], **tier_settings
        )
    else:
        same = aioredis.Redis(host=h, port=int(p), **tier_settings)
    use_tier_connections(same)
    try:
        await raw.ping()
        await same.ping()
        arena = np.frombuffer(np.random.default_rng(0).bytes(n * B), dtype=np.uint8)
        src = HostBuffers([arena[i * B : (i + 1) * B].data for i in range(n)])
        dest_arena = np.zeros(n * B, dtype=np.uint8)
        dest = HostBuffers([dest_arena[i * B : (i + 1) * B].data for i in range(n)])
        blocks = [BlockRef(1, k) for k in _keys(n, 1)]
        raw_keys = [b"bench:raw:" + k.hex().encode() for k in _keys(n, 2)]
        # The raw side's values: as many bytes as the tier stores, made once, up front.
        raw_values = [bytes(HEADER_BYTES) + arena[i * B : (i + 1) * B].tobytes() for i in range(n)]
        batches = [list(range(s, min(s + batch, n))) for s in range(0, n, batch)]

        def sub(buf: HostBuffers, idx: list[int]) -> HostBuffers:
            return HostBuffers([buf.views[i] for i in idx])

        def pipe(client: Any = raw) -> Any:
            return client.pipeline() if args.cluster else client.pipeline(transaction=False)

        async def tier_put(idx: list[int]) -> None:
            ok = await tier.write([blocks[i] for i in idx], B, sub(src, idx))
            if not all(ok):
                raise RuntimeError(f"L3 write failed: {tier.health()} {tier.stats().counters}")

        async def raw_put(idx: list[int], client: Any = raw) -> None:
            p = pipe(client)
            for i in idx:
                p.execute_command("SET", raw_keys[i], raw_values[i], "EX", 600)
            await p.execute()

        async def same_put(idx: list[int]) -> None:
            await raw_put(idx, same)

        async def tier_get(idx: list[int]) -> None:
            ok = await tier.read([blocks[i] for i in idx], B, sub(dest, idx))
            if not all(ok):
                raise RuntimeError(f"L3 read missed: {tier.health()} {tier.stats().counters}")

        async def raw_get(idx: list[int], client: Any = raw) -> None:
            p = pipe(client)
            for i in idx:
                p.execute_command("GET", raw_keys[i])
            values = await p.execute()
            if any(v is None for v in values):
                raise RuntimeError("raw GET missed")

        async def same_get(idx: list[int]) -> None:
            await raw_get(idx, same)

        async def paired(
            tier_fn: Callable[[list[int]], Awaitable[None]],
            raw_fn: Callable[[list[int]], Awaitable[None]],
            r: int,
        ) -> tuple[float, float]:
            sides = [(0, tier_fn), (1, raw_fn)]
            spent = [0.0, 0.0]
            for side, fn in sides if r % 2 == 0 else sides[::-1]:
                spent[side] = await _spread(batches, workers, fn)
            return n * B / spent[0] / 1e9, n * B / spent[1] / 1e9

        say(
            f"L3 bench ({mode}, {', '.join(urls)}): {n} blocks of {B / MiB:g} MiB, batches of "
            f"{batch}, {workers} calls in flight on each side"
        )
        await paired(tier_put, raw_put, 0)  # fill, unmeasured
        await _spread(batches, workers, same_put)  # the same side's connections, unmeasured
        keys = ("tp", "rp", "sp", "tg", "rg", "sg")
        res: dict[str, list[float]] = {k: [] for k in keys}

        async def third(fn: Callable[[list[int]], Awaitable[None]]) -> float:
            return n * B / await _spread(batches, workers, fn) / 1e9

        for r in range(args.rounds):
            # The third side takes turns first and last, as the other two alternate.
            sp = await third(same_put) if r % 2 == 0 else 0.0
            tp, rp = await paired(tier_put, raw_put, r)
            sp = sp or await third(same_put)
            sg = await third(same_get) if r % 2 == 0 else 0.0
            tg, rg = await paired(tier_get, raw_get, r)
            sg = sg or await third(same_get)
            for k, v in zip(keys, (tp, rp, sp, tg, rg, sg), strict=True):
                res[k].append(v)
            say(
                f"  round {r + 1}: put tier {tp:.2f} raw {rp:.2f} raw with the tier's client "
                f"{sp:.2f} GB/s | get tier {tg:.2f} raw {rg:.2f} raw with the tier's client "
                f"{sg:.2f} GB/s"
            )
        if not np.array_equal(dest_arena, arena):
            raise RuntimeError("the tier read back different bytes")

        # Probe latency: one chain, present in full, tier and raw interleaved.
        chain = [BlockRef(1, k) for k in _keys(args.chain, 3)]
        small = 4096
        small_src = HostBuffers([memoryview(bytearray(small)) for _ in chain])
        if not all(await tier.write(chain, small, small_src)):
            raise RuntimeError("could not write the probe chain")
        namer = KeyNamer(opts.key_prefix)
        chain_keys = [namer.key(b.ns, b.key) for b in chain]
        tier_us: list[float] = []
        raw_us: list[float] = []
        for i in range(args.probes + 10):
            for side in (0, 1) if i % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                if side == 0:
                    found = await tier.probe(chain)
                    if found != [small] * len(chain):
                        raise RuntimeError(f"probe found {len(found)} of {len(chain)}")
                else:
                    p = pipe()
                    for chain_key in chain_keys:
                        p.execute_command("GETRANGE", chain_key, 0, HEADER_BYTES - 1)
                    await p.execute()
                if i >= 10:  # warm-up
                    (tier_us if side == 0 else raw_us).append((time.perf_counter() - t0) * 1e6)
        med = {k: statistics.median(v) for k, v in res.items()}

        def p99(v: list[float]) -> float:
            return float(np.percentile(v, 99))

        counters = tier.stats().counters
        out = {
            "mode": mode,
            "block_bytes": B,
            "blocks": n,
            "batch": batch,
            "concurrency": workers,
            "rounds": args.rounds,
            "put_gbps": round(med["tp"], 3),
            "raw_set_gbps": round(med["rp"], 3),
            "put_ratio": round(med["tp"] / med["rp"], 3),
            "raw_set_tier_client_gbps": round(med["sp"], 3),
            "put_ratio_tier_client": round(med["tp"] / med["sp"], 3),
            "get_gbps": round(med["tg"], 3),
            "raw_get_gbps": round(med["rg"], 3),
            "get_ratio": round(med["tg"] / med["rg"], 3),
            "socket_read_bytes": SOCKET_READ_BYTES,
            "raw_get_tier_client_gbps": round(med["sg"], 3),
            "get_ratio_tier_client": round(med["tg"] / med["sg"], 3),
            "chain": len(chain),
            "probe_us": round(statistics.median(tier_us), 1),
            "probe_p99_us": round(p99(tier_us), 1),
            "raw_getrange_us": round(statistics.median(raw_us), 1),
            "raw_getrange_p99_us": round(p99(raw_us), 1),
            "probe_ratio": round(statistics.median(raw_us) / statistics.median(tier_us), 3),
            "read_bad_checksum": counters["read_bad_checksum"],
            "probe_late": counters["probe_late"],
        }
        say(
            f"put: tier {out['put_gbps']:.2f} GB/s, redis-py pipelined SET "
            f"{out['raw_set_gbps']:.2f} GB/s, ratio {out['put_ratio']:.2f}; with the tier's "
            f"client settings {out['raw_set_tier_client_gbps']:.2f} GB/s, ratio "
            f"{out['put_ratio_tier_client']:.2f}"
        )
        say(
            f"get: tier {out['get_gbps']:.2f} GB/s, redis-py pipelined GET "
            f"{out['raw_get_gbps']:.2f} GB/s, ratio {out['get_ratio']:.2f}; with the tier's "
            f"client settings {out['raw_get_tier_client_gbps']:.2f} GB/s, ratio "
            f"{out['get_ratio_tier_client']:.2f}"
        )
        say(
            f"probe of a {len(chain)}-block chain: tier {out['probe_us']:.0f} us "
            f"(p99 {out['probe_p99_us']:.0f}), one pipelined round trip of {len(chain)} GETRANGE "
            f"{out['raw_getrange_us']:.0f} us (p99 {out['raw_getrange_p99_us']:.0f}), "
            f"ratio {out['probe_ratio']:.2f}"
        )
        return out
    finally:
        await tier.close()
        for client in (raw, same):
            close = getattr(client, "aclose", None) or client.close
            await close()


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    args = _parse(argv)
    if args.batch < 1 or args.blocks < args.batch or args.concurrency < 1:
        raise SystemExit("need 1 <= --batch <= --blocks and --concurrency >= 1")
    with ExitStack() as stack:
        if args.url:
            urls = [args.url]
        else:
            try:
                redis_binaries()
            except RedisProcError as e:
                # A host without Redis cannot run this benchmark, as one without a GPU cannot
                # run `bench gpu`: say what to install (exit status 2), not a traceback.
                raise BenchUnavailable(
                    f"kvtier bench l3 starts its own Redis server: {e}; or name a running "
                    "one with --url"
                ) from None
            base = scratch_folder(args.dir or None, "bench-l3-")
            stack.callback(shutil.rmtree, base, True)
            # Room for both sides' working sets and the chain, and no eviction.
            if args.cluster:
                cluster = stack.enter_context(RedisClusterProcs(base, masters=3))
                urls = cluster.urls
            else:
                server = stack.enter_context(RedisServer(base))
                urls = [server.url]
        try:
            out = asyncio.run(_run(args, urls, print))
        except (TierUnavailable, RedisConnectionError) as e:
            if not args.url:
                raise  # a server of its own that did not answer: a bug, with its traceback
            raise SystemExit(f"kvtier bench l3: --url {args.url}: {e}") from None
    if emit is not None:
        emit(out)
    return 0
