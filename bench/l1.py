"""``kvtier bench l1``: Put/Get bandwidth through a real daemon, and Lookup latency.

Blocks are 2 MiB in vLLM's per-layer layout (32 layers, K and V, 32 KiB chunks), moved in
batches of 64 per RPC between a client's shared-memory pool and the daemon's L1 arena.

Baseline: a plain copy of the same number of bytes (one batch, contiguous, between two
pre-faulted buffers) with the same number of threads as the daemon's copies
(``--copy-threads``, passed to the daemon as ``server.copy_threads``): the bytes are split
into that many contiguous parts, each copied by ``numpy.copyto`` on its own thread. One
round is one baseline copy, one Put and one Get of fresh keys; the rounds run back to back so
both sides see the same machine, and every figure is a median over the rounds. A single-thread
copy is timed in the same rounds for reference.

Lookup latency is the round trip of one Lookup of 1,024 present keys, next to the round trip
of the daemon's gRPC health Check on the same socket (the floor of any RPC), alternated.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.bench.common import arg_parser, median, pct_ms, ratio, sig
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import bench_daemon
from kvtier.client import PoolLayout, SharedMemoryPool
from kvtier.daemon.config import ServerConfig

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16  # 32 KiB chunks, 2 MiB blocks
# The most the daemon takes as server.copy_threads.
MAX_COPY_THREADS = next(
    f.metadata["hi"] for f in dataclasses.fields(ServerConfig) if f.name == "copy_threads"
)


class ThreadedCopy:
    """``dst[:] = src`` split into ``threads`` contiguous parts copied in parallel (numpy
    releases the GIL while it copies). Thread-safety: one caller at a time."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def __call__(self, src: np.ndarray, dst: np.ndarray) -> float:
        """Seconds taken."""
        t = time.perf_counter()
        if self._pool is None:
            np.copyto(dst, src)
        else:
            step = -(-len(src) // self.threads)

            def part(lo: int) -> None:
                np.copyto(dst[lo : lo + step], src[lo : lo + step])

            list(self._pool.map(part, range(0, len(src), step)))
        return time.perf_counter() - t

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def _parse(argv: list[str]) -> argparse.Namespace:
    p = arg_parser("l1", __doc__)
    p.add_argument("--batch", type=int, default=64, help="blocks per Put/Get (64)")
    p.add_argument("--rounds", type=int, default=21, help="timed rounds (21)")
    p.add_argument(
        "--copy-threads",
        type=int,
        default=2,
        help="threads of the daemon's copies (server.copy_threads) and of the baseline (2)",
    )
    p.add_argument("--lookups", type=int, default=300, help="timed Lookup calls (300)")
    p.add_argument("--lookup-keys", type=int, default=1024, help="keys per Lookup (1024)")
    return p.parse_args(argv)


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    args = _parse(argv)
    if min(args.batch, args.rounds, args.copy_threads, args.lookups, args.lookup_keys) < 1:
        raise SystemExit("kvtier bench l1: every count must be at least 1")
    if args.copy_threads > MAX_COPY_THREADS:
        # The daemon refuses more (server.copy_threads): its start would fail, a traceback.
        raise SystemExit(f"kvtier bench l1: --copy-threads must be at most {MAX_COPY_THREADS}")

    pages = max(2 * args.batch, args.lookup_keys // 4)
    layout = PoolLayout.vllm(
        num_layers=LAYERS,
        num_pages=pages,
        block_tokens=BLOCK_TOKENS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="float16",
    )
    block = layout.block_bytes
    batch_bytes = args.batch * block
    # Room for one batch and every lookup key, with a margin: nothing is evicted.
    l1_bytes = (2 * args.batch + args.lookup_keys) * block + (256 << 20)
    print(
        f"blocks of {block >> 20} MiB ({LAYERS} layers x K,V x "
        f"{layout.layers[0].chunk_bytes >> 10} KiB), batches of {args.batch}, L1 "
        f"{l1_bytes >> 20} MiB, {args.copy_threads} copy threads (daemon and baseline)"
    )

    copy_n = ThreadedCopy(args.copy_threads)
    copy_1 = ThreadedCopy(1)
    with (
        bench_daemon(
            f"tiers.l1.capacity_bytes={l1_bytes}",
            "policy.protect_s=0",
            f"server.copy_threads={args.copy_threads}",
        ) as daemon,
        daemon.client() as client,
        SharedMemoryPool.for_layout(layout) as shm,
    ):
        shm.array()[:] = np.random.default_rng(0).integers(
            0, 256, layout.extent_bytes, dtype=np.uint8
        )
        pool = client.register_pool(shm, layout)
        page_ids = list(range(args.batch))

        def fresh_keys(n: int) -> list[bytes]:
            return [os.urandom(32) for _ in range(n)]

        src = np.random.default_rng(1).integers(0, 256, batch_bytes, dtype=np.uint8)
        dst = np.ones(batch_bytes, dtype=np.uint8)  # np.ones: every page is faulted in now
        for _ in range(2):  # warm the daemon's mapping of the pool, its code paths, the copies
            keys = fresh_keys(args.batch)
            client.put(pool.pool_id, keys, page_ids)
            client.get(pool.pool_id, keys, page_ids)
            client.delete(keys)
            copy_n(src, dst)
            copy_1(src, dst)

        put_s, get_s, copy_s, copy1_s = [], [], [], []
        for _ in range(args.rounds):
            copy_s.append(copy_n(src, dst))
            keys = fresh_keys(args.batch)
            t = time.perf_counter()
            res = client.put(pool.pool_id, keys, page_ids)
            put_s.append(time.perf_counter() - t)
            if res.stored != args.batch:
                raise RuntimeError(f"the daemon stored {res.stored} of {args.batch} blocks")
            t = time.perf_counter()
            got = client.get(pool.pool_id, keys, page_ids)
            get_s.append(time.perf_counter() - t)
            if got.prefix_len != args.batch:
                raise RuntimeError(f"the daemon loaded {got.prefix_len} of {args.batch} blocks")
            copy1_s.append(copy_1(src, dst))
            client.delete(keys)
        copy_n.close()
        copy_1.close()

        # Lookup latency: present keys (their blocks reuse the pool's pages).
        lk = fresh_keys(args.lookup_keys)
        for start in range(0, len(lk), args.batch):
            chunk = lk[start : start + args.batch]
            client.put(pool.pool_id, chunk, page_ids[: len(chunk)])
        for _ in range(3):
            client.lookup(lk)
            client.health()
        lookup_s, health_s = [], []
        for _ in range(args.lookups):
            t = time.perf_counter()
            found = client.lookup(lk)
            lookup_s.append(time.perf_counter() - t)
            if found.prefix_len != len(lk):
                raise RuntimeError(f"Lookup found {found.prefix_len} of {len(lk)} keys")
            t = time.perf_counter()
            client.health()
            health_s.append(time.perf_counter() - t)

    memcpy = batch_bytes / median(copy_s) / 1e9
    memcpy1 = batch_bytes / median(copy1_s) / 1e9
    put = batch_bytes / median(put_s) / 1e9
    get = batch_bytes / median(get_s) / 1e9
    lookup_p50 = pct_ms(lookup_s, 50)
    health_p50 = pct_ms(health_s, 50)
    figures = {
        "block_bytes": block,
        "batch_blocks": args.batch,
        "rounds": args.rounds,
        "copy_threads": args.copy_threads,
        "put_gbps": sig(put),
        "get_gbps": sig(get),
        "memcpy_gbps": sig(memcpy),
        "memcpy_1thread_gbps": sig(memcpy1),
        "put_ratio": ratio(put, memcpy),
        "get_ratio": ratio(get, memcpy),
        "lookup_keys": args.lookup_keys,
        "lookup_p50_ms": sig(lookup_p50),
        "lookup_p99_ms": sig(pct_ms(lookup_s, 99)),
        "health_p50_ms": sig(health_p50),
        "lookup_vs_health_p50": ratio(lookup_p50, health_p50),
    }
    n = args.copy_threads
    print(f"put     {put:6.2f} GB/s  ({figures['put_ratio']:.2f}x the {n}-thread copy)")
    print(f"get     {get:6.2f} GB/s  ({figures['get_ratio']:.2f}x the {n}-thread copy)")
    print(
        f"copy    {memcpy:6.2f} GB/s  (numpy, {n} thread{'s' if n > 1 else ''}, "
        f"{batch_bytes >> 20} MiB; one thread: {memcpy1:.2f} GB/s)"
    )
    print(
        f"lookup  p50 {lookup_p50:.3f} ms  p99 {figures['lookup_p99_ms']:.3f} ms  "
        f"({args.lookup_keys} keys; {figures['lookup_vs_health_p50']:.2f}x the health "
        f"check's p50 of {health_p50:.3f} ms)"
    )
    print(f"medians of {args.rounds} rounds")
    if emit is not None:
        emit(figures)
    return 0
