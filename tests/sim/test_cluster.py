"""A cluster in the replayer: routing rules, the shared L3 store, and N node stacks sharing it,
step by step on hand-made traces (expected counts worked out in the comments) and as coarse
properties of the shipped trace."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest

from kvtier.sim.cluster import MAX_NODES, ROUTES, ClusterConfig, SharedStore, route_requests
from kvtier.sim.engine import ReplayResult, StackConfig, replay, sweep_capacities
from kvtier.sim.trace import Trace, load_trace, trace_from_requests

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "sim" / "traces" / "chat.jsonl"


def timed(*reqs: tuple[float, list[int]]) -> Trace:
    """Requests at the given times (seconds)."""
    return trace_from_requests([{"timestamp": round(1000 * t), "hash_ids": ids} for t, ids in reqs])


def spread(nodes: int, **kwargs: object) -> ClusterConfig:
    """Request i on node i mod ``nodes``: the hand-made traces below say which node serves
    what."""
    return ClusterConfig(nodes=nodes, route="round-robin", **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------- one node


@pytest.mark.slow  # the whole shipped trace twice over, ~3-4 s: `make test-slow`
def test_one_node_without_l3_is_the_replay_of_one_daemon() -> None:
    """The README's lru row of the shipped trace, through a one-node cluster (whose route
    is moot); and the whole result of a two-tier stack with protection and hints."""
    trace = load_trace(SHIPPED)
    caps = sweep_capacities(trace.unique_blocks, (1, 2, 5, 10, 20))
    cluster = ClusterConfig(nodes=1, route="random", l3_blocks=0)
    figures = tuple(
        round(100 * replay(trace, "lru", cap, cluster=cluster).hit_ratio, 2) for cap in caps
    )
    assert figures == (11.80, 16.53, 21.45, 26.92, 31.97)
    stack = StackConfig(protect_s=2.0, queue_window_s=30.0)
    plain = replay(trace, "lru", 121, 1207, stack=stack)
    one = replay(trace, "lru", 121, 1207, stack=stack, cluster=ClusterConfig(nodes=1))
    assert one.as_dict() | {"accesses_per_s": 0} == plain.as_dict() | {"accesses_per_s": 0}
    assert one.hits_per_request.tolist() == plain.hits_per_request.tolist()
    assert one.l3 is None and len(one.per_node) == 1


# ------------------------------------------------------------------ routing


def test_round_robin_and_random_routes() -> None:
    trace = timed(*[(i, [i]) for i in range(10)])
    assert route_requests(trace, spread(3)).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    seeded = [
        route_requests(trace, ClusterConfig(nodes=4, route="random", route_seed=s)).tolist()
        for s in (1, 1, 2)
    ]
    assert seeded[0] == seeded[1] != seeded[2]
    assert set(seeded[0]) <= {0, 1, 2, 3}
    assert route_requests(trace, ClusterConfig(nodes=1, route="random")).tolist() == [0] * 10


def test_prefix_route_keeps_requests_with_one_first_block_on_one_node() -> None:
    """Every turn of a conversation (and every request behind one shared prompt) starts with
    the same block: one node serves them all, and the nodes all get some."""
    trace = load_trace(SHIPPED).cacheable()
    node_of = route_requests(trace, ClusterConfig(nodes=4, route="prefix"))
    first: dict[int, set[int]] = {}
    for r in range(trace.requests):
        blocks = trace.request(r)
        if len(blocks):
            first.setdefault(int(blocks[0]), set()).add(int(node_of[r]))
    assert all(len(nodes) == 1 for nodes in first.values())
    assert set(node_of.tolist()) == {0, 1, 2, 3}


# ------------------------------------------------------------- the L3 store


def test_the_store_evicts_the_least_recently_read_or_written() -> None:
    store = SharedStore(2, ttl_s=0)
    store.write(1, 0.0)
    store.write(2, 1.0)
    assert store.read(1, 2.0)  # 1 is now more recent than 2
    assert store.holds(2, 2.5)  # a probe changes nothing
    store.write(3, 3.0)
    assert (store.holds(1, 3.0), store.holds(2, 3.0), store.holds(3, 3.0)) == (True, False, True)
    assert store.stats().as_dict() == {
        "writes": 3,
        "reads": 1,
        "evictions": 1,
        "expiries": 0,
        "held": 2,
    }


def test_the_store_expires_an_entry_ttl_after_its_last_write() -> None:
    store = SharedStore(10, ttl_s=10.0)
    store.write(1, 0.0)
    store.write(2, 0.0)
    assert store.read(1, 9.0)  # a read does not extend the entry
    assert store.holds(1, 10.0)  # alive through the instant of its expiry, as in Redis
    store.write(2, 10.0)  # a rewrite does: 2 now lives until 20
    assert not store.holds(1, 10.5)
    assert store.holds(2, 20.0) and not store.holds(2, 20.5)
    assert store.stats().expiries == 2 and len(store) == 0
    # Its clock never goes back: a call from a node behind the others changes nothing.
    assert not store.holds(2, 0.0)


# ------------------------------------------------------- nodes sharing an L3


def test_nodes_without_l3_are_independent_replays() -> None:
    trace = load_trace(SHIPPED).cacheable()
    cluster = spread(3)
    r = replay(trace, "heat", 100, 300, cluster=cluster)
    node_of = route_requests(trace, cluster)
    alone = [replay(trace.select(np.flatnonzero(node_of == k)), "heat", 100, 300) for k in range(3)]
    assert [n.hits for n in r.per_node] == [a.hits for a in alone]
    assert [n.tier_hits for n in r.per_node] == [a.tier_hits for a in alone]
    assert r.hits == sum(a.hits for a in alone) == int(r.hits_per_request.sum())
    for k, a in enumerate(alone):
        assert r.hits_per_request[node_of == k].tolist() == a.hits_per_request.tolist()
    assert r.l3 is None and "l3" not in r.tier_hits


def test_l3_serves_what_another_node_computed() -> None:
    # A conversation of three turns, each on another node. Alone, no node sees a block
    # twice; with L3 (every stored block written) turn 2 reads 1, 2 and turn 3 reads 1, 2, 3.
    trace = timed((0, [1, 2]), (1, [1, 2, 3]), (2, [1, 2, 3, 4]))
    assert replay(trace, "lru", 10).tier_hits == {"l1": 5}
    assert replay(trace, "lru", 10, cluster=spread(3)).hits == 0
    r = replay(trace, "lru", 10, cluster=spread(3, l3_blocks=10, l3_admission="always"))
    assert r.tier_hits == {"l1": 0, "l3": 5} and r.misses == 4
    assert r.promotions == 5  # each read is promoted into its node's L1
    assert [n.l3_writes for n in r.per_node] == [2, 1, 1]  # 1, 2; then 3; then 4
    assert r.l3 is not None and (r.l3.writes, r.l3.reads, r.l3.held) == (4, 5, 4)


def test_a_hit_counts_at_the_fastest_tier_of_the_serving_node() -> None:
    # Node 0 computes 1 and writes it; node 1 reads it from L3 (into its L1); then both hit
    # it in their own L1, although L3 still holds it.
    trace = timed((0, [1]), (1, [1]), (2, [1]), (3, [1]))
    r = replay(trace, "lru", 10, cluster=spread(2, l3_blocks=10, l3_admission="always"))
    assert r.tier_hits == {"l1": 2, "l3": 1}
    assert [n.tier_hits for n in r.per_node] == [{"l1": 1, "l3": 0}, {"l1": 1, "l3": 1}]


def test_l3_admission_is_each_nodes_own() -> None:
    # Three nodes. second_hit writes a block its node saw twice: block 1, on node 0's second
    # request (an L1 hit there). Node 2 then reads it from L3. Blocks 2, 3, 9 are seen once,
    # and so is block 1 on its first request: four declines.
    trace = timed((0, [1]), (1, [2]), (2, [3]), (3, [1]), (4, [9]), (5, [1]))
    r = replay(trace, "lru", 10, cluster=spread(3, l3_blocks=10, l3_admission="second_hit"))
    assert r.tier_hits == {"l1": 1, "l3": 1}
    assert r.declined == {"l3:first_seen": 4}
    assert r.l3 is not None and r.l3.writes == 1
    # A block two nodes each saw once is written by neither.
    pair = timed((0, [1, 2]), (1, [1, 2]))
    assert replay(pair, "lru", 10, cluster=spread(2, l3_blocks=10)).tier_hits["l3"] == 0
    always = spread(2, l3_blocks=10, l3_admission="always")
    assert replay(pair, "lru", 10, cluster=always).tier_hits["l3"] == 2


def test_l3_evicts_its_least_recently_used_entry() -> None:
    # Three nodes, L3 of 2. Node 0 writes 1, node 1 writes 2, node 2 reads 1 (now more
    # recent than 2), node 0 writes 3, which evicts 2, not 1: node 1 reads 1 from L3, and
    # node 2 misses 2 and writes it again (evicting 3).
    trace = timed((0, [1]), (1, [2]), (2, [1]), (3, [3]), (4, [1]), (5, [2]))
    r = replay(trace, "lru", 10, cluster=spread(3, l3_blocks=2, l3_admission="always"))
    assert r.hits_per_request.tolist() == [0, 0, 1, 0, 1, 0]
    assert r.l3 is not None
    assert (r.l3.writes, r.l3.reads, r.l3.evictions, r.l3.held) == (4, 2, 2, 2)


def test_l3_entries_expire_and_reads_do_not_extend_them() -> None:
    # Four nodes, one block: written at 0 s by node 0, read at 5 s by node 1; expired at 11 s
    # (a read does not extend it), so node 2 computes it again and writes it; node 3 reads
    # that copy at 20 s.
    trace = timed((0, [1]), (5, [1]), (11, [1]), (20, [1]))
    r = replay(
        trace, "lru", 10, cluster=spread(4, l3_blocks=10, l3_ttl_s=10, l3_admission="always")
    )
    assert r.hits_per_request.tolist() == [0, 1, 0, 1]
    assert r.l3 is not None and (r.l3.writes, r.l3.expiries) == (2, 1)
    forever = spread(4, l3_blocks=10, l3_ttl_s=0, l3_admission="always")
    assert replay(trace, "lru", 10, cluster=forever).tier_hits == {"l1": 0, "l3": 3}


def test_a_node_writes_again_only_what_it_learnt_is_gone() -> None:
    # L1 of 1 per node, L3 of 1. Node 0 writes 1; node 1 writes 2, evicting 1; ... node 0
    # comes back to 1: it thought L3 held it, a read finds it gone, so it computes it and
    # writes it again; node 1 then reads it from L3.
    trace = timed((0, [1]), (1, [2]), (2, [3]), (3, [4]), (4, [1]), (5, [1]))
    r = replay(trace, "lru", 1, cluster=spread(2, l3_blocks=1, l3_admission="always"))
    assert r.hits_per_request.tolist() == [0, 0, 0, 0, 0, 1]
    assert r.l3 is not None and (r.l3.writes, r.l3.evictions) == (5, 4)


def test_a_node_does_not_write_again_what_it_keeps_hitting_in_l1() -> None:
    # Node 0 writes 1 at 0 s and hits it in L1 at 8 s: no write, so the entry expires at
    # 10 s as written and node 1 misses it at 12 s.
    trace = timed((0, [1]), (5, [2]), (8, [1]), (12, [1]))
    r = replay(
        trace, "lru", 10, cluster=spread(2, l3_blocks=10, l3_ttl_s=10, l3_admission="always")
    )
    assert r.hits_per_request.tolist() == [0, 0, 1, 0]
    assert r.tier_hits == {"l1": 1, "l3": 0}


def test_hints_prefetch_from_l3_what_the_node_knows_is_there() -> None:
    # One node, L1 of 1: block 1 is written to L3, then leaves L1 for block 2. A 5 s queue
    # hints the request at 10 s at 5 s, which brings 1 back from L3: an L1 hit.
    trace = timed((0, [1]), (1, [2]), (10, [1]))
    cluster = ClusterConfig(l3_blocks=10, l3_admission="always")
    plain = replay(trace, "lru", 1, cluster=cluster)
    assert plain.tier_hits == {"l1": 0, "l3": 1} and plain.prefetches == 0
    hinted = replay(trace, "lru", 1, stack=StackConfig(queue_window_s=5.0), cluster=cluster)
    assert hinted.tier_hits == {"l1": 1, "l3": 0} and hinted.prefetches == 1
    # Another node's block is found only by a lookup at arrival, as the daemon's prefetch
    # consults its own table.
    other = timed((0, [1]), (10, [1]))
    r = replay(
        other,
        "lru",
        1,
        stack=StackConfig(queue_window_s=5.0),
        cluster=spread(2, l3_blocks=10, l3_admission="always"),
    )
    assert r.tier_hits == {"l1": 0, "l3": 1} and r.prefetches == 0


# -------------------------------------------------------- the shipped trace


# README's cluster table: hit ratios (%) of the shipped trace on 4 nodes, heat, L1 of 2% of
# the unique blocks each, by (route, L3 blocks as % of the unique blocks, admission, TTL s).
CLUSTER_FIGURES: dict[tuple[str, int, str, float], float] = {
    ("prefix", 0, "second_hit", 3600): 28.63,
    ("prefix", 20, "second_hit", 3600): 29.03,
    ("prefix", 20, "always", 3600): 33.36,
    ("prefix", 20, "always", 30): 30.84,
    ("round-robin", 0, "second_hit", 3600): 19.50,
    ("round-robin", 20, "second_hit", 3600): 23.76,
    ("round-robin", 20, "always", 3600): 32.09,
    ("round-robin", 20, "always", 30): 26.66,
}


@functools.cache
def shipped_cluster(route: str, l3_percent: int, admission: str, ttl_s: float) -> ReplayResult:
    trace = load_trace(SHIPPED)
    l1, l3 = sweep_capacities(trace.unique_blocks, [2, l3_percent or 100])
    cluster = ClusterConfig(
        nodes=4,
        route=route,
        l3_blocks=l3 if l3_percent else 0,
        l3_ttl_s=ttl_s,
        l3_admission=admission,
    )
    return replay(trace, "heat", l1, cluster=cluster)


@pytest.mark.slow  # four cluster replays of the shipped trace, ~3 s: `make test-slow`
def test_the_readme_cluster_figures() -> None:
    figures = {key: round(100 * shipped_cluster(*key).hit_ratio, 2) for key in CLUSTER_FIGURES}
    assert figures == CLUSTER_FIGURES
    trace = load_trace(SHIPPED)
    one = replay(trace, "heat", sweep_capacities(trace.unique_blocks, [2])[0])
    assert round(100 * one.hit_ratio, 2) == 22.67
    for route in ROUTES:  # an L3 holding every block, written every block
        assert round(100 * shipped_cluster(route, 100, "always", 0).hit_ratio, 2) == 35.36


def test_spreading_requests_loses_reuse_and_l3_recovers_it() -> None:
    """Without affinity the nodes lose reuse even with four times the memory of one node;
    prefix affinity keeps more; a shared L3 adds L3 hits and leaves L1's as they were; one
    written every stored block lifts round-robin above prefix affinity without L3."""
    trace = load_trace(SHIPPED)
    one = replay(trace, "heat", sweep_capacities(trace.unique_blocks, [2])[0]).hit_ratio
    rr = shipped_cluster("round-robin", 0, "second_hit", 3600)
    prefix = shipped_cluster("prefix", 0, "second_hit", 3600)
    assert rr.hit_ratio < one < prefix.hit_ratio
    for without in (rr, prefix):
        for admission in ("second_hit", "always"):
            with_l3 = shipped_cluster(without.cluster.route, 20, admission, 3600)
            assert with_l3.tier_hits["l3"] > 0
            assert with_l3.tier_hits["l1"] == without.tier_hits["l1"]
            assert with_l3.hit_ratio > without.hit_ratio
    assert shipped_cluster("round-robin", 20, "always", 3600).hit_ratio > prefix.hit_ratio


@pytest.mark.parametrize("route", ROUTES)
def test_an_l3_holding_everything_makes_any_cluster_one_unbounded_cache(route: str) -> None:
    """With every stored block written to an L3 that never drops one, a block is a hit on
    any node exactly when some earlier request stored it: the hits of one node with room
    for every block, whatever the routing (L1 of each node holds a whole request, so every
    block is still there when its request is written behind)."""
    trace = load_trace(SHIPPED).cacheable()
    cap = sweep_capacities(trace.unique_blocks, [2])[0]
    assert cap >= int(np.diff(trace.offsets).max())
    unbounded = replay(trace, "lru", trace.unique_blocks)
    cluster = ClusterConfig(
        nodes=4, route=route, l3_blocks=trace.unique_blocks, l3_ttl_s=0, l3_admission="always"
    )
    r = replay(trace, "lru", cap, cluster=cluster)
    assert r.hits == unbounded.hits
    assert r.l3 is not None and r.l3.evictions == 0
    assert replay(trace, "lru", cap, cluster=ClusterConfig(nodes=4, route=route)).hits < r.hits


@pytest.mark.parametrize(
    "kwargs",
    [
        {"nodes": 0},
        {"nodes": MAX_NODES + 1},
        {"route": "nope"},
        {"route_seed": -1},
        {"l3_blocks": -1},
        {"l3_ttl_s": -1.0},
        {"l3_ttl_s": math.inf},
        {"l3_admission": "belady"},
    ],
)
def test_bad_cluster_configs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ClusterConfig(**kwargs)  # type: ignore[arg-type]
