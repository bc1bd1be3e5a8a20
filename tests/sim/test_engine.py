"""The simulation engine: the tier stack's semantics step by step, against independent
models, and the published figures of the shipped trace (and of the public trace when it is
beside the checkout)."""

from __future__ import annotations

import math
import os
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.daemon.policy.density import DensityPolicy
from kvtier.sim import tracegen
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.engine import StackConfig, _Engine, replay, sweep_capacities
from kvtier.sim.trace import Trace, load_trace, trace_from_requests

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "sim" / "traces" / "chat.jsonl"
# The public trace lives in the shared folder beside the checkout; KVTIER_TRACES points
# elsewhere when the checkout is not in its usual place. Its checks run only where it is.
SHARED = Path(os.environ.get("KVTIER_TRACES", REPO.parent / "shared" / "traces"))
MOONCAKE = SHARED / "mooncake_synthetic_trace.jsonl"

PERCENTS = (1, 2, 5, 10, 20)
# Hit ratios (%) at PERCENTS of the trace's unique blocks (either semantics: the same
# caches); README's tables.
FIGURES: dict[tuple[str, str], dict[str, tuple[float, ...]]] = {
    ("chat.jsonl", "all"): {
        "lru": (10.70, 14.97, 19.59, 24.68, 29.32),
        "arc": (17.89, 18.89, 22.69, 26.29, 30.49),
        "opt": (24.98, 29.27, 33.14, 33.14, 33.14),
    },
    ("chat.jsonl", "full"): {
        "lru": (11.80, 16.53, 21.45, 26.92, 31.97),
        "arc": (19.25, 20.13, 24.43, 28.28, 32.75),
        "opt": (26.65, 31.23, 35.36, 35.36, 35.36),
    },
    # Published before the tier stack (shared/traces/README.md): must not move.
    ("mooncake_synthetic_trace.jsonl", "all"): {
        "lru": (3.80, 7.77, 15.65, 26.23, 39.30),
        "arc": (4.18, 8.22, 16.35, 26.27, 40.28),
        "opt": (18.54, 26.13, 39.56, 50.63, 60.80),
    },
    ("mooncake_synthetic_trace.jsonl", "full"): {
        "lru": (4.07, 8.14, 16.68, 27.92, 41.85),
        "arc": (4.49, 8.76, 17.22, 27.42, 42.33),
        "opt": (19.15, 26.98, 40.85, 52.25, 62.71),
    },
}
# The public trace (outside the repository) takes seconds per sweep: `make test-slow`.
TRACES = [SHIPPED] + (
    [pytest.param(MOONCAKE, marks=pytest.mark.slow, id=MOONCAKE.name)] if MOONCAKE.exists() else []
)


def requests(*chains: list[int]) -> list[dict[str, object]]:
    return [{"timestamp": 1000 * i, "hash_ids": ids} for i, ids in enumerate(chains)]


def reference_lru_hits(chains: list[list[int]], capacity: int) -> int:
    """A plain single-tier LRU, independent of the package."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in chains:
        missing = [b for b in ids if b not in cache]
        hits += len(ids) - len(missing)
        for b in ids:
            if b in cache and b not in missing:
                cache.move_to_end(b)
        for b in missing:
            if b not in cache:
                if len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[b] = None
    return hits


def reference_inclusive_lru(
    chains: list[list[int]], l1: int, l2: int, write_through: bool = False
) -> tuple[int, int, int]:
    """Two inclusive LRU tiers, independent of the package: (L1 hits, L2 hits, L2 writes).

    Arrival: hits touch every tier holding the block; then L2-only hits are promoted (L2
    copy kept; not when the demotion of an earlier promotion dropped it from L2 meanwhile);
    then missing blocks are stored into L1. A block leaving L1 without an L2
    copy is written to L2; write-through writes every new block to L2 as well."""
    t1: OrderedDict[int, None] = OrderedDict()
    t2: OrderedDict[int, None] = OrderedDict()
    hits1 = hits2 = writes = 0

    def put2(b: int) -> None:
        nonlocal writes
        if len(t2) >= l2:
            t2.popitem(last=False)
        t2[b] = None
        writes += 1

    def put1(b: int) -> None:
        if len(t1) >= l1:
            victim, _ = t1.popitem(last=False)
            if victim not in t2:
                put2(victim)
        t1[b] = None

    for ids in chains:
        missing, promote = [], []
        for b in ids:
            if b in t1:
                hits1 += 1
                t1.move_to_end(b)
                if b in t2:
                    t2.move_to_end(b)
            elif b in t2:
                hits2 += 1
                t2.move_to_end(b)
                promote.append(b)
            else:
                missing.append(b)
        for b in promote:
            if b not in t1 and b in t2:  # an earlier promotion's demotion may have dropped it
                put1(b)
        for b in missing:
            if b in t1 or b in t2:
                continue
            put1(b)
            if write_through and b not in t2:
                put2(b)
    return hits1, hits2, writes


def reference_belady_hits(chains: list[list[int]], capacity: int) -> int:
    """Belady with bypass, one tier, independent of the package: a missing block evicts the
    resident whose next use is farthest, or is not stored when its own is farther still.
    A block's next use is the first access after its last one in the current request."""
    flat = [b for ids in chains for b in ids]
    after: list[float] = [math.inf] * len(flat)
    seen: dict[int, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        after[pos] = seen.get(flat[pos], math.inf)
        seen[flat[pos]] = pos
    next_use: dict[int, float] = {}
    cache: set[int] = set()
    hits = pos = 0
    for ids in chains:
        for k, b in enumerate(ids):
            next_use[b] = after[pos + k]
        pos += len(ids)
        missing = [b for b in ids if b not in cache]
        hits += len(ids) - len(missing)
        for b in missing:
            if b in cache:
                continue
            if len(cache) >= capacity:
                farthest = max(cache, key=next_use.__getitem__)
                if next_use[b] > next_use[farthest]:
                    continue
                cache.discard(farthest)
            cache.add(b)
    return hits


BLOCK_TOKENS = 4


def random_requests(seed: int, n: int = 250) -> list[dict[str, Any]]:
    """Requests as traces from elsewhere have them: shared prefixes of huge and negative
    ids, repeats inside a request, partial last blocks, requests without input_length,
    empty ones, and equal, float and out-of-order timestamps."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(-(2**63), 2**64) for _ in range(rng.randint(1, 6))] for _ in range(8)
    ]
    out: list[dict[str, Any]] = []
    t = 0.0
    for _ in range(n):
        ids = rng.choice(prefixes)[: rng.randint(0, 6)] + [
            rng.randrange(60) for _ in range(rng.randint(0, 5))
        ]
        if ids and rng.random() < 0.1:
            ids.append(rng.choice(ids))
        t += rng.choice([0, 0, 0.5, 5, 250, 3000])
        r: dict[str, Any] = {
            "timestamp": t - rng.randrange(5000) if rng.random() < 0.1 else t,
            "hash_ids": ids,
        }
        if rng.random() < 0.9:
            partial = rng.randrange(1, BLOCK_TOKENS) if ids and rng.random() < 0.5 else 0
            r["input_length"] = len(ids) * BLOCK_TOKENS - partial
        out.append(r)
    return out


def cacheable_chains(reqs: list[dict[str, Any]], semantics: str) -> list[list[int]]:
    """Each request's ids as a cache sees them: under ``full`` without a partial last block."""
    chains = []
    for r in reqs:
        ids = list(r["hash_ids"])
        tokens = r.get("input_length")
        if semantics == "full" and tokens is not None and tokens % BLOCK_TOKENS:
            ids = ids[:-1]
        chains.append(ids)
    return chains


def chat(seed: int, duration_s: float = 300.0) -> Trace:
    return trace_from_requests(tracegen.scenario("chat", seed=seed, duration_s=duration_s))


# ------------------------------------------------------------------ one tier


def test_lru_equals_a_plain_lru() -> None:
    reqs = tracegen.scenario("chat", seed=3, duration_s=300.0)
    chains = [list(r["hash_ids"]) for r in reqs]
    # Repeats within a request, too.
    chains += [[5, 6, 5, 7, 6], [7, 5, 9, 9]]
    trace = trace_from_requests(requests(*chains))
    for capacity in (1, 7, 100, 1000, 5000):
        result = replay(trace, "lru", capacity)
        assert result.hits == reference_lru_hits(chains, capacity), capacity


def test_opt_on_a_hand_checked_trace() -> None:
    # a b c a b d a with room for 2 (positions 0..6). Belady with bypass:
    # a, b fill; c is next used never, later than a (3) and b (4): bypassed;
    # a, b hit; d (never again) ties with b (never again): b goes; a hits. 3 hits.
    trace = trace_from_requests(requests([1], [2], [3], [1], [2], [4], [1]))
    result = replay(trace, "opt", 2)
    assert result.hits == 3 and result.declined == {"l1:later": 1}
    assert replay(trace, "lru", 2).hits == 0


def test_hits_prefix_hits_and_request_order() -> None:
    trace = trace_from_requests(requests([1, 2, 3], [1, 4, 3], [1, 2, 3]))
    r = replay(trace, "lru", 10)
    # Request 2: 1 and 3 hit, 4 misses: prefix run is 1. Request 3: 1, 2, 3 hit.
    assert (r.hits, r.prefix_hits) == (5, 4)
    assert r.tier_hits == {"l1": 5}
    assert r.hits_per_request.tolist() == [0, 2, 3]


def test_admission_can_decline() -> None:
    trace = trace_from_requests(requests([1], [2], [1], [3], [1]))
    r = replay(trace, "lru", 1, admission="second_hit")
    assert r.declined.get("l1:first_seen", 0) >= 2
    assert r.hits == 1


@pytest.mark.parametrize("semantics", ["full", "all"])
def test_lru_and_opt_equal_independent_models_on_random_traces(semantics: str) -> None:
    """What traces from elsewhere hold (see ``random_requests``), against plain models: LRU,
    Belady with bypass, and two inclusive LRU tiers, over sizes from 1 block to all."""
    for seed in range(4):
        reqs = random_requests(seed)
        trace = trace_from_requests(reqs, block_tokens=BLOCK_TOKENS)
        chains = cacheable_chains(reqs, semantics)
        for cap in (1, 2, 3, 5, 13, 40, 200):
            lru = replay(trace, "lru", cap, semantics=semantics)
            assert lru.accesses == sum(map(len, chains))
            assert lru.hits == reference_lru_hits(chains, cap), (seed, cap)
            opt = replay(trace, "opt", cap, semantics=semantics)
            assert opt.hits == reference_belady_hits(chains, cap), (seed, cap)
            assert lru.hits <= opt.hits
        for l1, l2 in ((1, 1), (2, 3), (3, 2), (5, 20), (20, 5)):
            two = replay(trace, "lru", l1, l2, semantics=semantics)
            hits1, hits2, _ = reference_inclusive_lru(chains, l1, l2)
            assert two.tier_hits == {"l1": hits1, "l2": hits2}, (seed, l1, l2)


def test_a_larger_l1_never_gives_lru_fewer_hits() -> None:
    """LRU's inclusion property, one tier and with an L2 of a fixed size behind it."""
    trace = trace_from_requests(random_requests(7), block_tokens=BLOCK_TOKENS)
    for l2 in (0, 3, 10):
        hits = [replay(trace, "lru", l1, l2).hits for l1 in range(1, 40)]
        assert hits == sorted(hits), l2


@pytest.mark.parametrize("policy", ["lru", "arc", "heat", "density", "opt"])
def test_a_replay_is_deterministic_and_its_counts_add_up(policy: str) -> None:
    trace = trace_from_requests(random_requests(11), block_tokens=BLOCK_TOKENS)
    setups: list[dict[str, Any]] = [
        {},
        {"l2_blocks": 6, "stack": StackConfig(protect_s=2.0, queue_window_s=3.0)},
        {"cluster": ClusterConfig(nodes=3, route="random", route_seed=4, l3_blocks=10)},
    ]
    for kwargs in setups:
        runs = []
        for _ in range(2):
            r = replay(trace, policy, 5, **kwargs)
            figures = r.as_dict()
            del figures["accesses_per_s"]
            runs.append((figures, r.hits_per_request.tolist()))
            assert 0 <= r.prefix_hits <= r.hits <= r.accesses
            assert 0 <= r.hit_ratio <= 1 and 0 <= r.prefix_hit_ratio <= 1
            assert sum(r.tier_hits.values()) == r.hits == int(r.hits_per_request.sum())
            assert all(0 <= n.hits <= n.accesses for n in r.per_node)
        assert runs[0] == runs[1], kwargs


@pytest.mark.parametrize("path", TRACES, ids=lambda p: getattr(p, "name", str(p)))
@pytest.mark.parametrize("semantics", ["all", "full"])
def test_published_figures(path: Path, semantics: str) -> None:
    """LRU, ARC and OPT, one tier, no protection: the README's tables, to the hundredth."""
    trace = load_trace(path)
    caps = sweep_capacities(trace.unique_blocks, PERCENTS)
    trace = trace.cacheable(semantics)
    figures = {
        name: tuple(
            round(100 * replay(trace, name, cap, semantics=semantics).hit_ratio, 2) for cap in caps
        )
        for name in ("lru", "arc", "opt")
    }
    assert figures == FIGURES[(path.name, semantics)]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: getattr(p, "name", str(p)))
def test_heat_and_density_beat_lru_at_five_percent(path: Path) -> None:
    trace = load_trace(path)
    cap = sweep_capacities(trace.unique_blocks, [5])[0]
    ratios = {name: replay(trace, name, cap).hit_ratio for name in ("heat", "density", "lru")}
    assert ratios["heat"] > ratios["lru"] and ratios["density"] > ratios["lru"], ratios


def test_the_public_trace_capacities_are_as_published() -> None:
    if not MOONCAKE.exists():
        # The shipped trace stands in: the rule (round half to even) is the same.
        assert sweep_capacities(43924, PERCENTS) == [439, 878, 2196, 4392, 8785]
        return
    trace = load_trace(MOONCAKE)
    assert sweep_capacities(trace.unique_blocks, PERCENTS) == [439, 878, 2196, 4392, 8785]


# -------------------------------------------------------- partial last blocks


def test_partial_last_blocks_are_not_cacheable_under_full_semantics() -> None:
    # Request 2 repeats request 1's blocks; both end in a partial block (id 3, then 4).
    reqs = [
        {"timestamp": 0, "input_length": 1100, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 1100, "hash_ids": [1, 2, 4]},
        {"timestamp": 2000, "input_length": 1024, "hash_ids": [1, 2]},
    ]
    trace = trace_from_requests(reqs)
    full = replay(trace, "lru", 10)
    old = replay(trace, "lru", 10, semantics="all")
    assert (full.accesses, full.hits) == (6, 4)
    assert (old.accesses, old.hits) == (8, 4)
    assert full.semantics == "full" and old.semantics == "all"
    # Never stored: a one-block cache keeps block 2, not the partial block after it.
    assert replay(trace, "lru", 1).hits == 2


# ------------------------------------------------------------- two tiers


@pytest.mark.parametrize(("l1", "l2"), [(1, 1), (3, 2), (20, 50), (100, 400), (500, 100)])
def test_two_inclusive_lru_tiers_equal_an_independent_model(l1: int, l2: int) -> None:
    reqs = tracegen.scenario("chat", seed=4, duration_s=200.0)
    chains = [list(r["hash_ids"]) for r in reqs]
    trace = trace_from_requests(requests(*chains))
    r = replay(trace, "lru", l1, l2)
    hits1, hits2, writes = reference_inclusive_lru(chains, l1, l2)
    assert r.tier_hits == {"l1": hits1, "l2": hits2}
    assert r.l2_writes == writes == r.demotions


def test_write_through_equals_an_independent_model() -> None:
    reqs = tracegen.scenario("chat", seed=5, duration_s=200.0)
    chains = [list(r["hash_ids"]) for r in reqs]
    trace = trace_from_requests(requests(*chains))
    r = replay(trace, "lru", 30, 300, stack=StackConfig(write_policy="write_through"))
    hits1, hits2, writes = reference_inclusive_lru(chains, 30, 300, write_through=True)
    assert (r.tier_hits["l1"], r.tier_hits["l2"], r.l2_writes) == (hits1, hits2, writes)


def test_two_tiers_keep_copies_in_both() -> None:
    trace = trace_from_requests(requests([1], [2], [3], [1], [1, 2, 3]))
    r = replay(trace, "lru", 1, 2)
    # [1] [2]: 1 leaves L1 and is written to L2. [3]: 2 likewise, L2 = {1, 2}.
    # [1]: an L2 hit, promoted (its L2 copy stays); 3 leaves L1 and, having no L2 copy,
    # is written to L2, which drops 2 (L2 = {1, 3}). [1, 2, 3]: 1 is an L1 hit (also in
    # L2), 2 is a miss, 3 an L2 hit.
    assert r.tier_hits == {"l1": 1, "l2": 2}
    assert r.hits == 3 and r.promotions == 2
    assert r.demotions == r.l2_writes


def test_a_promotion_whose_l2_copy_went_meanwhile_is_not_made() -> None:
    # L1 of 3, L2 of 2. [1 2 3 4 5]: 1 and 2 leave L1 for L2. [1 2 1]: three L2 hits; 1 is
    # promoted and pushes 3 out of L1 into L2, which drops its least recent entry, 2 (1 was
    # touched after it); 2, read at arrival, has no copy left to promote. [4]: an L1 hit.
    chains = [[1, 2, 3, 4, 5], [1, 2, 1], [4]]
    r = replay(trace_from_requests(requests(*chains)), "lru", 3, 2)
    assert r.tier_hits == {"l1": 1, "l2": 3} and r.promotions == 1
    assert reference_inclusive_lru(chains, 3, 2)[:2] == (1, 3)


def test_a_block_leaving_l1_with_an_l2_copy_is_not_written_again() -> None:
    # write_through puts every block on L2 at once; leaving L1 then writes nothing.
    trace = trace_from_requests(requests([1], [2], [3], [4]))
    r = replay(trace, "lru", 1, 10, stack=StackConfig(write_policy="write_through"))
    assert (r.l2_writes, r.demotions) == (4, 0)
    back = replay(trace, "lru", 1, 10)
    assert (back.l2_writes, back.demotions) == (3, 3)


def test_selective_writes_on_the_access_the_admission_admits() -> None:
    # second_hit admits a block on its second access: block 1's second access writes it to
    # L2 while it is still in L1; 2 and 3 are seen once and never reach L2.
    trace = trace_from_requests(requests([1], [1], [2], [3], [1]))
    r = replay(
        trace, "lru", 1, 10, l2_admission="second_hit", stack=StackConfig(write_policy="selective")
    )
    assert r.l2_writes == 1
    assert r.tier_hits == {"l1": 1, "l2": 1}
    assert r.declined.get("l2:first_seen", 0) >= 2


# ------------------------------------------------------------ protection


def test_protection_rejects_when_every_block_is_protected() -> None:
    # One slot. Block 1 is written at 0 s; with 2 s of protection block 2 (at 1 s) cannot
    # take its place, block 3 (at 3 s) can.
    reqs = [
        {"timestamp": 0, "hash_ids": [1]},
        {"timestamp": 1000, "hash_ids": [2]},
        {"timestamp": 3000, "hash_ids": [3]},
        {"timestamp": 3500, "hash_ids": [1]},
    ]
    trace = trace_from_requests(reqs)
    r = replay(trace, "lru", 1, stack=StackConfig(protect_s=2.0))
    assert r.declined == {"l1:protected": 2}  # block 2, then block 1 again at 3.5 s
    assert r.hits == 0 and r.evictions == {"l1": 1}
    assert replay(trace, "lru", 1).declined == {}


def test_protection_costs_hits_and_protect_zero_is_the_plain_replay() -> None:
    trace = chat(6, 200.0)
    cap = sweep_capacities(trace.cacheable().unique_blocks, [2])[0]
    plain = replay(trace, "heat", cap)
    zero = replay(trace, "heat", cap, stack=StackConfig(protect_s=0.0, l1_watermarks=None))
    protected = replay(trace, "heat", cap, stack=StackConfig(protect_s=30.0))
    assert zero.hits == plain.hits
    assert protected.declined.get("l1:protected", 0) > 0
    assert protected.hits < plain.hits


# ------------------------------------------------------------------ hints


def test_queue_hints_keep_the_blocks_of_a_queued_request() -> None:
    # One slot. Block 1 at 0 s, block 2 at 1 s, block 1 again at 5 s. LRU drops 1 for 2;
    # with a 10 s queue the engine announced the request at 5 s from -5 s on, so block 1
    # stays protected until it arrives and block 2 is not kept.
    trace = trace_from_requests(
        [
            {"timestamp": 0, "hash_ids": [1]},
            {"timestamp": 1000, "hash_ids": [2]},
            {"timestamp": 5000, "hash_ids": [1]},
        ]
    )
    assert replay(trace, "lru", 1).hits == 0
    for policy in ("lru", "arc", "heat", "density"):
        hinted = replay(trace, policy, 1, stack=StackConfig(queue_window_s=10.0))
        assert hinted.hits == 1, policy
        assert hinted.declined == {"l1:protected": 1}, policy
        assert hinted.hinted == 3
    # A 3 s queue announces it at 2 s: too late, block 2 already took the slot.
    assert replay(trace, "lru", 1, stack=StackConfig(queue_window_s=3.0)).hits == 0


def test_hints_prefetch_blocks_held_only_on_l2() -> None:
    # L1 of 1, L2 of 10. Block 1 leaves L1 for L2 when 2 arrives; the request at 10 s is
    # hinted at 5 s, which promotes 1 back to L1 ahead of it: an L1 hit.
    trace = trace_from_requests(
        [
            {"timestamp": 0, "hash_ids": [1]},
            {"timestamp": 1000, "hash_ids": [2]},
            {"timestamp": 10000, "hash_ids": [1]},
        ]
    )
    plain = replay(trace, "lru", 1, 10)
    assert plain.tier_hits == {"l1": 0, "l2": 1}
    hinted = replay(trace, "lru", 1, 10, stack=StackConfig(queue_window_s=5.0))
    assert hinted.tier_hits == {"l1": 1, "l2": 0}
    assert hinted.prefetches == 1


def test_queue_hints_raise_the_hit_ratio_on_chat() -> None:
    trace = chat(7, 300.0)
    cap = sweep_capacities(trace.cacheable().unique_blocks, [1])[0]
    for policy in ("lru", "density"):
        plain = replay(trace, policy, cap).hit_ratio
        hinted = replay(trace, policy, cap, stack=StackConfig(queue_window_s=30.0)).hit_ratio
        assert hinted > plain, policy


@pytest.mark.parametrize("policy", ["heat", "density", "lru", "arc"])
def test_one_tier_with_queue_hints_replays_as_the_tier_stack(policy: str, monkeypatch) -> None:
    # One tier with queue hints takes the one-tier path (``_run_one_tier``); the same replay
    # through the general tier stack (``steps``) must give every figure alike, the blocks
    # declined for want of a victim ("protected") included. A tier of 1% with a 30 s queue
    # declines many.
    trace = chat(8, 300.0)
    stack = StackConfig(queue_window_s=30.0)
    results = []
    for general in (False, True):
        if general:
            monkeypatch.setattr(_Engine, "_run_one_tier", lambda e: [None for _ in e.steps()])
        for cap in sweep_capacities(trace.cacheable().unique_blocks, [1, 5]):
            r = replay(trace, policy, cap, stack=stack)
            figures = r.as_dict()
            del figures["accesses_per_s"]
            results.append((figures, r.hits_per_request.tolist()))
    assert results[:2] == results[2:]
    assert results[0][0]["declined"].get("l1:protected", 0) > 0


# ------------------------------------------------------ forgetting, watermarks


def test_forget_dropped_erases_what_policies_remember_past_the_daemons_history() -> None:
    # ARC remembers evicted ids in its ghost lists. The daemon keeps a dropped block's row
    # (its history) until history_factor times the blocks held were dropped after it, then
    # forgets it; with no history it forgets at once. On a trace with returns, the ghosts make
    # a difference.
    trace = chat(8, 300.0)
    cap = sweep_capacities(trace.cacheable().unique_blocks, [2])[0]
    stable = replay(trace, "arc", cap)
    at_once = StackConfig(forget_dropped=True, history_factor=0.0)
    assert replay(trace, "arc", cap, stack=at_once).hits != stable.hits
    # A history longer than all the trace's drops forgets nothing.
    assert trace.unique_blocks < 64 * 1024
    long = StackConfig(forget_dropped=True, history_factor=64.0)
    assert replay(trace, "arc", cap, stack=long).hits == stable.hits
    assert replay(trace, "heat", cap, stack=long).hits == replay(trace, "heat", cap).hits
    # LRU keeps no history: nothing changes.
    assert replay(trace, "lru", cap).hits == replay(trace, "lru", cap, stack=at_once).hits


def test_forget_dropped_remembers_a_block_stored_nowhere_as_a_dropped_one(monkeypatch) -> None:
    # A put the top tier declines (density's own admission, or no victim) still adds a row in
    # the daemon, which abandons it: its key is remembered like a dropped block's (note_miss
    # recorded the access) and forgotten at the history bound, at once with a factor of 0.
    forgotten: list[int] = []
    forget = DensityPolicy.forget

    def recording_forget(self: DensityPolicy, bid: int) -> None:
        forgotten.append(bid)
        forget(self, bid)

    nowhere: list[tuple[int, int]] = []  # (block, forgets by the time it was stored nowhere)
    store = _Engine._store

    def recording_store(self: _Engine, b: int, parent: int) -> None:
        store(self, b, parent)
        if not self.copies[b]:
            nowhere.append((b, len(forgotten)))

    monkeypatch.setattr(DensityPolicy, "forget", recording_forget)
    monkeypatch.setattr(_Engine, "_store", recording_store)
    trace = chat(8, 300.0)
    cap = sweep_capacities(trace.cacheable().unique_blocks, [2])[0]
    replay(trace, "density", cap, stack=StackConfig(forget_dropped=True, history_factor=0.0))
    assert len(nowhere) > 10
    assert all(n > 0 and forgotten[n - 1] == b for b, n in nowhere)


def test_watermarks_empty_l1_down_to_the_low_mark() -> None:
    trace = trace_from_requests(requests(list(range(10)), list(range(10, 20))))
    r = replay(trace, "lru", 10, stack=StackConfig(l1_watermarks=(0.8, 0.5)))
    # Each request fills L1 to 10 (above 8), then it is emptied to 5.
    assert r.evictions == {"l1": 5 + 10}
    again = replay(
        trace_from_requests(requests(list(range(10)), [5, 6, 7, 8, 9])),
        "lru",
        10,
        stack=StackConfig(l1_watermarks=(0.8, 0.5)),
    )
    assert again.hits == 5  # the five most recent blocks stayed


def test_regression_watermarks_dropped_l1_blocks_l2_had_no_room_for() -> None:
    """Regression: above L1's high watermark, a victim L2 had no room for (every block
    there protected) left the store though L1 had room for it, as the daemon's balancer did;
    both keep it now. Blocks 0-1 go to L2 at 10 s and are read back at 13 s (protected in L2,
    promoted: L1 full); at 14 s blocks 2-6, cold victims then, are all hits."""
    trace = trace_from_requests(
        [
            {"timestamp": 0, "hash_ids": [0, 1]},
            {"timestamp": 10_000, "hash_ids": list(range(2, 10))},
            {"timestamp": 13_000, "hash_ids": [0, 1]},
            {"timestamp": 14_000, "hash_ids": [2, 3, 4, 5, 6]},
        ]
    )
    r = replay(
        trace,
        "lru",
        10,
        2,
        l2_admission="always",
        stack=StackConfig(protect_s=2.5, l1_watermarks=(0.8, 0.5)),
    )
    assert r.hits == 2 + 5
    assert r.evictions["l1"] == 2 and r.demotions == 2


def test_regression_watermarks_kept_l1_blocks_l2_declined_with_l2_full() -> None:
    """Regression: above L1's high watermark, a victim L2's admission declines (second_hit:
    seen once) leaves the store, L2 full or not, as the daemon's demotion asks admission
    before room; the replayer asked for room first and kept such a victim (and ended the
    pass) wherever L2 was full of protected blocks. L2 is full of protected blocks (the reads
    at 9.5 s and 11.6 s renew them) when the 11.6 s request puts L1 back above its high mark
    (its blocks 20-29 out of their protection by then); blocks 21-25, which L2 sees for the
    first time, leave (five more first_seen), and their read at 11.7 s is all misses."""
    requests = [
        {"timestamp": 0, "hash_ids": [0, 1]},
        {"timestamp": 3000, "hash_ids": list(range(10, 20))},
        {"timestamp": 6000, "hash_ids": [0, 1]},
        {"timestamp": 9000, "hash_ids": list(range(20, 30))},
        {"timestamp": 9500, "hash_ids": [0, 1]},
        {"timestamp": 11_600, "hash_ids": [0]},
    ]
    stack = StackConfig(protect_s=2.5, l1_watermarks=(0.8, 0.5))
    before = replay(
        trace_from_requests(requests), "lru", 10, 2, l2_admission="second_hit", stack=stack
    )
    assert before.declined["l2:protected"] == 1  # L2 is full of protected blocks
    after = replay(
        trace_from_requests([*requests, {"timestamp": 11_700, "hash_ids": [21, 22, 23, 24, 25]}]),
        "lru",
        10,
        2,
        l2_admission="second_hit",
        stack=stack,
    )
    assert after.hits == before.hits
    assert before.declined["l2:first_seen"] == 12 + 5


def test_regression_the_watermark_pass_ended_at_a_victim_l2_had_no_room_for() -> None:
    """Regression: above L1's high watermark, the replayer's pass ended at the first victim
    L2 admits but has no room for (it stays), while the daemon's balancer takes all the
    victims it asked its policy for, keeping those and letting the others go. At 7 s block
    2 (seen twice; L2 full of blocks 0-1, protected until 7.1 s) stays and blocks 3-8 (seen
    once, declined by second_hit) leave: block 3 read at 7.05 s is a miss, as in the
    daemon, and block 2 a hit."""
    requests = [
        {"timestamp": 0, "hash_ids": [0, 1]},
        {"timestamp": 500, "hash_ids": [0, 1]},
        {"timestamp": 3900, "hash_ids": [2]},
        {"timestamp": 4000, "hash_ids": list(range(2, 9))},  # 0-1 go down to L2
        {"timestamp": 4600, "hash_ids": [0, 1]},  # promoted back, L2's copies kept
        {"timestamp": 7000, "hash_ids": [30, 31]},
    ]
    stack = StackConfig(protect_s=2.5, l1_watermarks=(0.5, 0.25))

    def run(extra: list[dict[str, Any]]) -> Any:
        trace = trace_from_requests([*requests, *extra])
        return replay(trace, "lru", 12, 2, l2_admission="second_hit", stack=stack)

    before = run([])
    assert before.declined == {"l2:first_seen": 6}
    assert before.evictions["l1"] == 2 + 6
    after = run([{"timestamp": 7050, "hash_ids": [3, 2]}])
    assert after.hits == before.hits + 1  # 2 stayed in L1; 3 is gone


def test_regression_a_kept_victim_was_passed_over_past_balance_retry_s() -> None:
    """Regression: each pass that kept victims set the wait of every victim kept before it
    too, as the daemon's balancer did, so the first kept, the coldest, were passed over as
    long as each pass within BALANCE_RETRY_S kept others. At 7 s block 2 (seen twice; L2
    full of blocks 0-1, protected until 8 s) stays and waits until 8 s; at 7.5 s block 10
    (seen twice) stays and waits until 8.5 s; at 8.2 s L2 has room and block 2 goes down to
    it (not block 0 out of L1, warmer): read at 8.3 s it is an L2 hit, not an L1 one."""
    requests = [
        {"timestamp": 0, "hash_ids": [0, 1]},
        {"timestamp": 500, "hash_ids": [0, 1]},
        {"timestamp": 3900, "hash_ids": [2, 3]},
        {"timestamp": 4000, "hash_ids": [2, 4, 5, 6]},  # 0-1 go down to L2
        {"timestamp": 4600, "hash_ids": [10, 11]},
        {"timestamp": 4700, "hash_ids": [10]},
        {"timestamp": 5500, "hash_ids": [0, 1]},  # promoted back, L2's copies kept
        {"timestamp": 7000, "hash_ids": [20]},  # 2 stays, 3-6 leave
        {"timestamp": 7500, "hash_ids": [21]},  # 10 stays, 11 leaves
        {"timestamp": 8200, "hash_ids": [20]},  # one victim
        {"timestamp": 8300, "hash_ids": [2]},
    ]
    # L1: 10 blocks, above 5 a pass takes it down to 5.
    stack = StackConfig(protect_s=2.5, l1_watermarks=(0.55, 0.5))
    trace = trace_from_requests(requests)
    result = replay(trace, "lru", 10, 2, l2_admission="second_hit", stack=stack)
    assert result.declined == {"l2:first_seen": 4 + 1}
    assert result.hits_per_request[-1] == 1
    assert result.tier_hits["l2"] == 2 + 1  # 0-1 at 5.5 s, 2 at 8.3 s


@pytest.mark.parametrize(
    "kwargs",
    [
        {"write_policy": "nope"},
        {"protect_s": -1.0},
        {"queue_window_s": float("nan")},
        {"l1_watermarks": (0.5, 0.9)},
    ],
)
def test_bad_stack_configs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        StackConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_sizes_are_refused() -> None:
    trace = trace_from_requests(requests([1]))
    with pytest.raises(ValueError, match="l1_blocks"):
        replay(trace, "lru", 0)
    with pytest.raises(ValueError, match="l2_blocks"):
        replay(trace, "lru", 1, -1)
    with pytest.raises(ValueError, match="unknown policy"):
        replay(trace, "nope", 1)


def test_results_per_request_add_up() -> None:
    trace = chat(9, 120.0)
    r = replay(trace, "heat", 200, 400)
    assert int(np.sum(r.hits_per_request)) == r.hits == sum(r.tier_hits.values())
    assert r.prefix_hits <= r.hits <= r.accesses
