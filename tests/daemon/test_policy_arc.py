from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvtier.daemon.policy.arc import ARCPolicy


def evict_one(policy: ARCPolicy, incoming: int, now: float = 0.0) -> int:
    v = policy.victims(1, now, None, incoming=(incoming,))
    assert v is not None
    policy.remove(int(v[0]))
    return int(v[0])


def test_a_second_access_moves_a_block_to_t2_and_protects_it() -> None:
    arc = ARCPolicy(capacity_blocks=3)
    for b in (1, 2, 3):
        arc.insert(b, 0.0)
    arc.touch(1, 1.0)
    s = arc.stats()
    assert (s.t1, s.t2) == (2, 1)
    # p = 0 and T1 is not empty: T1's LRU block goes, not the older-but-reused 1.
    assert evict_one(arc, 4) == 2


def test_a_ghost_hit_in_b1_grows_t1_target() -> None:
    arc = ARCPolicy(capacity_blocks=2)
    arc.insert(1, 0.0)
    arc.insert(2, 0.0)
    arc.touch(2, 0.0)  # T1 = [1], T2 = [2]
    assert evict_one(arc, 3) == 1  # T1 above p = 0: 1 -> B1
    arc.insert(3, 0.0)
    assert arc.stats().b1 == 1
    # Making room for 1, a B1 ghost: p is adapted first (to 1), so T1 (size 1) is not above
    # it and T2's LRU block goes.
    assert evict_one(arc, 1) == 2
    arc.insert(1, 0.0)  # B1 hit: p grows by max(|B2| / |B1|, 1) = 1, 1 enters T2
    s = arc.stats()
    assert s.target_t1 == 1.0 and (s.t1, s.t2, s.b1, s.b2) == (1, 1, 0, 1) and 1 in arc


def test_victims_skip_blocks_that_may_not_go() -> None:
    arc = ARCPolicy(capacity_blocks=4)
    for b in range(4):
        arc.insert(b, 0.0)
    v = arc.victims(2, 0.0, lambda bids: bids >= 2)
    assert v is not None and v.tolist() == [2, 3]
    assert arc.victims(3, 0.0, lambda bids: bids >= 2) is None
    assert len(arc) == 4


def test_ghost_lists_stay_bounded_by_capacity() -> None:
    arc = ARCPolicy(capacity_blocks=8)
    rng = np.random.default_rng(3)
    for b in rng.integers(0, 100, size=2000).tolist():
        if b in arc:
            arc.touch(b, 0.0)
            continue
        if len(arc) >= 8:
            evict_one(arc, b)
        arc.insert(b, 0.0)
        s = arc.stats()
        assert s.t1 + s.t2 <= 8 and s.b1 + s.b2 <= 8 and 0 <= s.target_t1 <= 8


def test_forget_drops_a_ghost() -> None:
    arc = ARCPolicy(capacity_blocks=2)
    arc.insert(1, 0.0)
    arc.remove(1)
    arc.forget(1)
    arc.insert(1, 0.0)  # a new block on a reused id: no ghost hit
    assert arc.stats().t1 == 1 and arc.stats().target_t1 == 0


def reference_arc(trace: list[int], c: int) -> int:
    """Megiddo & Modha's ARC(c) as printed in the paper; returns hits."""
    t1: OrderedDict[int, None] = OrderedDict()
    t2: OrderedDict[int, None] = OrderedDict()
    b1: OrderedDict[int, None] = OrderedDict()
    b2: OrderedDict[int, None] = OrderedDict()
    p = 0.0
    hits = 0

    def replace(x: int) -> None:
        if t1 and (len(t1) > p or (x in b2 and len(t1) == p)):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    for x in trace:
        if x in t1 or x in t2:
            hits += 1
            t1.pop(x, None)
            t2[x] = None
            t2.move_to_end(x)
        elif x in b1:
            p = min(c, p + max(len(b2) / len(b1), 1))
            replace(x)
            del b1[x]
            t2[x] = None
        elif x in b2:
            p = max(0, p - max(len(b1) / len(b2), 1))
            replace(x)
            del b2[x]
            t2[x] = None
        else:
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    replace(x)
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                    b2.popitem(last=False)
                replace(x)
            t1[x] = None
    return hits


def test_matches_the_paper_on_a_random_trace() -> None:
    rng = np.random.default_rng(11)
    # A mix of a hot set and a scan, so that p moves both ways.
    trace = [
        int(rng.integers(0, 20)) if rng.random() < 0.6 else int(rng.integers(20, 400))
        for _ in range(5000)
    ]
    for c in (5, 16, 40):
        arc = ARCPolicy(capacity_blocks=c)
        hits = 0
        for x in trace:
            if x in arc:
                hits += 1
                arc.touch(x, 0.0)
                continue
            if len(arc) >= c:
                evict_one(arc, x)
            arc.insert(x, 0.0)
        assert hits == reference_arc(trace, c)
