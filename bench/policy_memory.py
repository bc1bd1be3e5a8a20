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
are part of its figure.

History (``history_<policy>_B``): what remembering dropped blocks costs at the default
``policy.history_factor``, per resident block: a block table and a policy wired as the store
wires them, filled with ``blocks`` resident blocks and then churned (each step drops the oldest
block and stores a new one) until ``history_factor`` times ``blocks`` were dropped, against
the same churn with no history; both measured with ``tracemalloc`` (numpy's arrays included),
so the growth by doubling of whatever the history keeps counts too. ``_per_remembered_B``
divides the same difference by the blocks remembered. Takes a minute or two.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import numpy as np

from kvtier.bench.jsonout import JSON_HELP, Emit
from kvtier.daemon.config import PolicyConfig
from kvtier.daemon.heat import HeatTable
from kvtier.daemon.policy.base import EvictionPolicy
from kvtier.daemon.policy.registry import make_policy
from kvtier.daemon.table import BlockTable

_CHAIN = 32
# The churn of ``history_bytes`` runs in batches of this many blocks.
_CHURN_BATCH = 4096


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
    # Modules a policy imports on first use count nowhere: the first policy measured took
    # its module's size into its per-block figure.
    _filled(name, min(blocks, _CHAIN * 2), hinted)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    policy = _filled(name, blocks, hinted)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del policy
    return used


def _filled(name: str, blocks: int, hinted: bool) -> EvictionPolicy:
    """Policy ``name`` holding ``blocks`` blocks in chains (all hinted with ``hinted``), after
    one eviction choice."""
    policy = make_policy(name, capacity_blocks=blocks, initial_ids=blocks)
    for bid in range(blocks):
        policy.insert(bid, bid * 1e-3, bid - 1 if bid % _CHAIN else -1)
    now = blocks * 1e-3
    if hinted:
        policy.hint(np.arange(blocks), now + 1.0, now)
    policy.victims(1, now + 2.0, None)
    return policy


def history_bytes(name: str, blocks: int) -> tuple[float, int]:
    """Bytes that remembering dropped blocks adds (see the module docstring) and how many
    are remembered, for policy ``name`` with two tiers' block table."""
    factor = PolicyConfig().history_factor
    _churned(name, _CHURN_BATCH, factor)  # modules imported on first use count nowhere
    with_history, remembered = _churned(name, blocks, factor)
    without, _ = _churned(name, blocks, 0.0)
    return with_history - without, remembered


def _churned(name: str, blocks: int, factor: float) -> tuple[int, int]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table = BlockTable(2, initial_capacity=blocks)
    table.history_factor = factor
    policy = make_policy(name, capacity_blocks=blocks, initial_ids=blocks)
    wire_history(table, policy)
    rng = np.random.default_rng(1)
    now = 0.0
    live: list[np.ndarray] = []  # resident rows, oldest first
    held = 0
    total = blocks + int(PolicyConfig().history_factor * blocks)
    stored = 0
    while stored < total:
        n = min(_CHURN_BATCH, total - stored)
        words = rng.integers(0, 2**63, size=(n, 4), dtype=np.int64).view(np.uint64)
        bids = table.add_many(0, words, 4096)
        parents = np.where(np.arange(n) % _CHAIN, np.roll(bids, 1), -1)
        policy.insert_many(bids, now, parents)
        live.append(bids)
        held += n
        stored += n
        now += 1.0
        while held > blocks:  # full: the oldest go, as many as came
            out, live[0] = live[0][: held - blocks], live[0][held - blocks :]
            if not len(live[0]):
                live.pop(0)
            for bid in out.tolist():
                policy.remove(bid)
                table.remove(bid)
            held -= len(out)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    remembered = table.history_rows
    del table, policy, live
    return used, remembered


def wire_history(table: BlockTable, policy: EvictionPolicy) -> None:
    """Hook ``policy`` to ``table`` as the store does (``kvtier.daemon.space``)."""
    table.on_free.append(policy.forget)
    table.on_remember.append(policy.remember)
    table.on_revive.append(policy.revive)
    table.on_expire.append(policy.expire)
    table.on_renumber.append(policy.renumber)


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvtier bench policy_memory", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--history-only", action="store_true", help="measure the history alone")
    args = p.parse_args(argv)
    if args.blocks < 1:
        p.error("--blocks must be at least 1")
    n = args.blocks
    start = time.perf_counter()
    out: dict[str, float] = {}
    for tiers in (1, 2, 4) if not args.history_only else ():
        # One tier (L1), two (L1 + L2), and the design's maximum of four.
        out[f"index_{tiers}_tier_B"] = table_bytes(n, tiers) / n
    if not args.history_only:
        out["heat_table_B"] = heat_bytes(n) / n
        for tiers in (1, 2, 4):
            out[f"index_{tiers}_tier_plus_heat_B"] = (
                out[f"index_{tiers}_tier_B"] + out["heat_table_B"]
            )
        for name in ("heat", "density", "lru", "arc"):
            out[f"policy_{name}_B"] = policy_bytes(name, n) / n
            out[f"policy_{name}_hinted_B"] = policy_bytes(name, n, hinted=True) / n
    for name in ("heat", "density"):
        extra, remembered = history_bytes(name, n)
        out[f"history_{name}_B"] = extra / n
        out[f"history_{name}_per_remembered_B"] = extra / max(remembered, 1)
    print(f"bytes per block at {n:,} blocks")
    for key, value in out.items():
        print(f"  {key:<32} {value:8.1f}")
    print(f"  ({time.perf_counter() - start:.0f} s)")
    if emit is not None:
        emit({"blocks": n, **{k: round(v, 1) for k, v in out.items()}})
    return 0


if __name__ == "__main__":
    import sys

    from kvtier.cli.main import main as kvtier_main

    # Through `kvtier bench`, which reads --json and keeps stdout to the JSON object.
    raise SystemExit(kvtier_main(["bench", "policy_memory", *sys.argv[1:]]))
