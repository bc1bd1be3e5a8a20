"""Bytes per block of the daemon's metadata at a million blocks: the block table (the key
index and every per-block array the store keeps), the heat table, and each eviction policy's
own structures.

    kvtier bench policy_memory [--blocks 1000000] [--json]
    python -m kvtier.bench.policy_memory [--blocks 1000000] [--json]

Block table and heat table are numpy arrays, so their size is exact (``nbytes`` of every array,
over the live blocks). A policy is measured with ``tracemalloc`` while it is filled with
``blocks`` resident blocks in chains of 32 and then asked for a victim (so the heat and
density policies' candidate buffers exist), which counts its Python objects too; the
``_hinted`` figures add one hint covering every block (the hint deadlines are per id).
The density policy's statistics (its ghosts are per-id entries, its tables fixed in size)
are part of its figure. Takes a minute or two.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc

import numpy as np

from kvtier.daemon.heat import HeatTable
from kvtier.daemon.policy.registry import make_policy
from kvtier.daemon.table import BlockTable

_CHAIN = 32


def table_bytes(blocks: int, num_tiers: int) -> int:
    """The block table for ``num_tiers`` tiers (the first, a host tier, keeps no checksum)."""
    table = BlockTable(num_tiers, initial_capacity=blocks)
    words = np.random.default_rng(0).integers(0, 2**63, size=(blocks, 4), dtype=np.int64)
    table.add_many(np.zeros(blocks), words.view(np.uint64), np.full(blocks, 4096))
    return table.stats().nbytes


def heat_bytes(blocks: int) -> int:
    table = HeatTable(600.0, blocks)
    return table.heat.nbytes + table.last_access.nbytes


def policy_bytes(name: str, blocks: int, hinted: bool = False) -> int:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    policy = make_policy(name, capacity_blocks=blocks, initial_ids=blocks)
    for bid in range(blocks):
        policy.insert(bid, bid * 1e-3, bid - 1 if bid % _CHAIN else -1)
    now = blocks * 1e-3
    if hinted:
        policy.hint(np.arange(blocks), now + 1.0, now)
    policy.victims(1, now + 2.0, None)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del policy
    return used


def main(argv: list[str] | None = None, *, as_json: bool = False) -> int:
    p = argparse.ArgumentParser(
        prog="kvtier bench policy_memory", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.json = args.json or as_json
    n = args.blocks
    start = time.perf_counter()
    out: dict[str, float] = {}
    # One tier (L1), two (L1 + L2), and the design's maximum of four.
    for tiers in (1, 2, 4):
        out[f"index_{tiers}_tier_B"] = table_bytes(n, tiers) / n
    out["heat_table_B"] = heat_bytes(n) / n
    for tiers in (1, 2, 4):
        out[f"index_{tiers}_tier_plus_heat_B"] = out[f"index_{tiers}_tier_B"] + out["heat_table_B"]
    for name in ("heat", "density", "lru", "arc"):
        out[f"policy_{name}_B"] = policy_bytes(name, n) / n
        out[f"policy_{name}_hinted_B"] = policy_bytes(name, n, hinted=True) / n
    print(f"bytes per block at {n:,} blocks")
    for key, value in out.items():
        print(f"  {key:<32} {value:8.1f}")
    print(f"  ({time.perf_counter() - start:.0f} s)")
    if args.json:
        print(json.dumps({"blocks": n, **{k: round(v, 1) for k, v in out.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
