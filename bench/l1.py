"""``kvtier bench l1``: put/get bandwidth through a real daemon, and Lookup latency.

Blocks are 2 MiB in vLLM's per-layer layout (32 layers, K and V, 32 KiB chunks), moved in
batches of 64 per RPC between a client's shared-memory pool and the daemon's L1 arena. The
baseline is a plain single-threaded numpy copy of the same number of bytes, timed in the same
run. Lookup latency is the round trip of one Lookup of 1,024 present keys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from kvtier.bench.launcher import bench_daemon
from kvtier.client import Client, PoolLayout, SharedMemoryPool

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16  # 32 KiB chunks, 2 MiB blocks


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def timed_memcpy(src: np.ndarray, dst: np.ndarray) -> float:
    t = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t


def main(argv: list[str], *, as_json: bool) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench l1")
    p.add_argument("--batch", type=int, default=64, help="blocks per Put/Get")
    p.add_argument("--rounds", type=int, default=21, help="timed RPCs per direction")
    p.add_argument("--lookups", type=int, default=300, help="timed Lookup calls")
    p.add_argument("--lookup-keys", type=int, default=1024)
    args = p.parse_args(argv)

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
        f"blocks of {block >> 20} MiB ({LAYERS} layers x K,V x {layout.layers[0].chunk_bytes >> 10} KiB), "
        f"batches of {args.batch}, L1 {l1_bytes >> 20} MiB"
    )

    with (
        bench_daemon(f"tiers.l1.capacity_bytes={l1_bytes}", "policy.protect_s=0") as daemon,
        Client(daemon.address) as client,
        SharedMemoryPool.for_layout(layout) as shm,
    ):
        shm.array()[:] = np.random.default_rng(0).integers(
            0, 256, layout.extent_bytes, dtype=np.uint8
        )
        pool = client.register_pool(shm, layout)
        page_ids = list(range(args.batch))

        def fresh_keys(n: int) -> list[bytes]:
            return [os.urandom(32) for _ in range(n)]

        for _ in range(2):  # warm the daemon's mapping of the pool and its code paths
            keys = fresh_keys(args.batch)
            client.put(pool.pool_id, keys, page_ids)
            client.get(pool.pool_id, keys, page_ids)
            client.delete(keys)

        # The baseline is timed inside every round, next to the RPCs, so that both see the
        # same machine (a shared VM's speed drifts by tens of percent between minutes).
        src = np.ones(batch_bytes, dtype=np.uint8)
        dst = np.zeros(batch_bytes, dtype=np.uint8)
        timed_memcpy(src, dst)
        put_s, get_s, copy_s = [], [], []
        for _ in range(args.rounds):
            copy_s.append(timed_memcpy(src, dst))
            keys = fresh_keys(args.batch)
            t = time.perf_counter()
            res = client.put(pool.pool_id, keys, page_ids)
            put_s.append(time.perf_counter() - t)
            assert res.stored == args.batch, res
            t = time.perf_counter()
            got = client.get(pool.pool_id, keys, page_ids)
            get_s.append(time.perf_counter() - t)
            assert got.prefix_len == args.batch, got
            client.delete(keys)

        # Lookup latency: 1,024 present keys (small blocks would do; reuse the pool's pages).
        lk = fresh_keys(args.lookup_keys)
        for start in range(0, len(lk), args.batch):
            chunk = lk[start : start + args.batch]
            client.put(pool.pool_id, chunk, page_ids[: len(chunk)])
        lookup_s = []
        for _ in range(args.lookups):
            t = time.perf_counter()
            found = client.lookup(lk)
            lookup_s.append(time.perf_counter() - t)
        assert found.prefix_len == len(lk), found.prefix_len

    memcpy = _median_gbps(batch_bytes, copy_s)
    put = _median_gbps(batch_bytes, put_s)
    get = _median_gbps(batch_bytes, get_s)
    lookup_ms = np.asarray(lookup_s) * 1e3
    figures = {
        "block_bytes": block,
        "batch_blocks": args.batch,
        "put_gbps": round(put, 3),
        "get_gbps": round(get, 3),
        "memcpy_gbps": round(memcpy, 3),
        "put_ratio": round(put / memcpy, 3),
        "get_ratio": round(get / memcpy, 3),
        "lookup_keys": args.lookup_keys,
        "lookup_p50_ms": round(float(np.percentile(lookup_ms, 50)), 3),
        "lookup_p99_ms": round(float(np.percentile(lookup_ms, 99)), 3),
    }
    print(f"put     {put:6.2f} GB/s  ({figures['put_ratio']:.2f}x memcpy)")
    print(f"get     {get:6.2f} GB/s  ({figures['get_ratio']:.2f}x memcpy)")
    print(f"memcpy  {memcpy:6.2f} GB/s  (numpy, one thread, {batch_bytes >> 20} MiB)")
    print(
        f"lookup  p50 {figures['lookup_p50_ms']:.3f} ms  p99 {figures['lookup_p99_ms']:.3f} ms  "
        f"({args.lookup_keys} keys)"
    )
    if as_json:
        print(json.dumps(figures))
    return 0
