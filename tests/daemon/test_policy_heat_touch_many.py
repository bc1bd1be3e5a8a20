"""``HeatPolicy.touch_many`` against the scalar loop it replaces.

Two policies get the same random operations; one takes each touch batch through
``touch_many``, the other through ``for b in batch: touch(b, now)``. After every operation
their whole state must be identical (every per-id array, the heat table, counters, ``p``, the
candidate buffers entry for entry, the owed raises) and so must their answers to ``victims``. The batches are
drawn to reach every path of ``touch_many``: chains root first (the common case), children
before parents, repeats, probation and protected blocks, keys at or below a buffer's bound,
dead parent links, and the empty batch. Coverage counters make sure the paths were reached.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from heat_state import assert_same_state, mask_fn

import kvtier.daemon.policy.heat as heat_module
from kvtier.daemon.policy.heat import HeatPolicy


def assert_same_victims(vec: HeatPolicy, ref: HeatPolicy, now: float, salt: int) -> None:
    n = len(ref)
    for k in sorted({1, 2, 5, n // 2, n, n + 1}):
        for mask in (None, mask_fn(salt)):
            a, b = vec.victims(k, now, mask), ref.victims(k, now, mask)
            assert (a is None) == (b is None), (k, mask)
            if a is not None and b is not None:
                assert a.tolist() == b.tolist(), (k, mask)
    assert_same_state(vec, ref)  # victims() rebuilt the same buffers in both


class Spy:
    """Counts the rare paths ``touch_many`` took, to prove the test reaches them."""

    def __init__(self, policy: HeatPolicy, seen: Counter[str]) -> None:
        self.seen = seen
        rekey, plan = policy._rekey, policy._plan

        def counting_rekey(bid: int, key: float) -> int:
            changed = rekey(bid, key)
            self.seen["scalar step"] += 1
            self.seen["scalar step that re-plans"] += changed > 0
            return changed

        def counting_plan(*args: object) -> heat_module._Plan:
            out = plan(*args)  # type: ignore[arg-type]
            self.seen["plan"] += 1
            self.seen["bulk leaves probation"] += int(out.leaves.sum())
            self.seen["bulk unlinks a dead parent"] += (
                int(out.unlinks.sum()) if out.unlinks is not None else 0
            )
            self.seen["bulk raises"] += int((out.acts & ~out.leaves).sum())
            self.seen["bulk owes its parent"] += int(out.owes.sum()) if out.owes is not None else 0
            self.seen["bulk no-op"] += int((out.bulk & ~out.acts).sum())
            self.seen["at or below the bound"] += int(
                (~out.bulk & (out.new_eff <= policy._bufs[2].bound)).sum()
            )
            return out

        policy._rekey = counting_rekey  # type: ignore[method-assign]
        policy._plan = counting_plan  # type: ignore[method-assign]


def chain_of(policy: HeatPolicy, leaf: int) -> list[int]:
    """``leaf`` and its resident ancestors, root first (what a Lookup touches)."""
    out = [leaf]
    while True:
        parent = int(policy._parent[out[-1]])
        if parent < 0 or parent not in policy or parent in out:
            return out[::-1]
        if policy._ins[parent] > policy._ins[out[-1]]:
            return out[::-1]
        out.append(parent)


def draw_batch(rng: np.random.Generator, policy: HeatPolicy, resident: list[int]) -> list[int]:
    kind = rng.integers(0, 9)
    if kind == 8 or not resident:
        return []
    leaf = int(rng.choice(resident))
    if kind <= 2:  # a Lookup: one chain, root first (the common case)
        batch = chain_of(policy, leaf)
    elif kind == 3:  # several chains one after the other, possibly overlapping
        batch = []
        for _ in range(int(rng.integers(2, 4))):
            batch += [b for b in chain_of(policy, int(rng.choice(resident))) if b not in batch]
    elif kind == 4:  # children before parents
        batch = chain_of(policy, leaf)[::-1]
    elif kind == 5:  # any blocks in any order
        size = int(rng.integers(1, len(resident) + 1))
        batch = rng.choice(resident, size=size, replace=False).tolist()
    elif kind == 6:  # repeats
        batch = rng.choice(resident, size=int(rng.integers(2, 20))).tolist()
        batch += chain_of(policy, leaf)
    else:  # a prefix of a chain, a few times over
        chain = chain_of(policy, leaf)
        batch = chain[: int(rng.integers(1, len(chain) + 1))]
    return [int(b) for b in batch]


def drive(seed: int, steps: int, seen: Counter[str], *, large: bool = False) -> None:
    """``large``: segments of hundreds of blocks, whose candidate buffers stop covering
    them (small ones are covered whole, which sends every touch down the scalar path)."""
    rng = np.random.default_rng(seed)
    capacities = [None, 500, 2000] if large else [None, 8, 24, 64]
    params = dict(
        half_life_s=float(rng.choice([0.5, 5.0, 30.0, 1000.0])),
        capacity_blocks=capacities[int(rng.integers(0, len(capacities)))],
        memory_factor=float(rng.choice([0.0, 0.5, 5.0])),
        protection_halvings=float(rng.choice([0.5, 3.0])),
        initial_ids=int(rng.choice([4, 64])),
    )
    vec, ref = HeatPolicy(**params), HeatPolicy(**params)  # type: ignore[arg-type]
    Spy(vec, seen)
    universe = 2000 if large else int(rng.choice([24, 96, 300]))
    longest = 60 if large else 8
    resident: list[int] = []
    now = 0.0
    for step in range(steps):
        op = rng.random()
        # Time: mostly forwards, in steps small or large against the half-life, sometimes
        # back (the heat table's clock-step-back rule).
        r = rng.random()
        if r < 0.3:
            pass
        elif r < 0.9:
            now += float(rng.exponential(params["half_life_s"] * rng.choice([0.01, 0.3, 3.0])))
        else:
            now -= float(rng.uniform(0, 2))
        if op < 0.3 or len(resident) < 3:
            # A chain of new blocks hanging off a resident block, or a new root.
            parent = int(rng.choice(resident)) if resident and rng.random() < 0.7 else -1
            if rng.random() < 0.1:
                parent = int(rng.integers(0, universe))  # maybe not resident
            for _ in range(int(rng.integers(1, longest))):
                bid = int(rng.integers(0, universe))
                if bid in ref:
                    continue
                vec.insert(bid, now, parent)
                ref.insert(bid, now, parent)
                resident.append(bid)
                parent = bid
        elif op < 0.7:
            batch = draw_batch(rng, ref, resident)
            seen["batch"] += 1
            seen["empty batch"] += not batch
            seen["batch with repeats"] += len(set(batch)) < len(batch)
            vec.touch_many(np.asarray(batch, dtype=np.int64), now)
            for bid in batch:
                ref.touch(bid, now)
        elif op < 0.8:
            if rng.random() < 0.5:
                # An eviction as the store does it: victims, then remove (and forget).
                k = int(rng.integers(1, 4))
                incoming = (int(rng.integers(0, universe)),) if rng.random() < 0.5 else ()
                mask = mask_fn(step) if rng.random() < 0.5 else None
                gone = ref.victims(k, now, mask, incoming)
                assert np.array_equal(vec.victims(k, now, mask, incoming), gone) or (
                    gone is None and vec.victims(k, now, mask, incoming) is None
                )
                gone_ids = [] if gone is None else gone.tolist()
            else:
                gone_ids = [int(rng.choice(resident))]
            for bid in gone_ids:
                vec.remove(bid)
                ref.remove(bid)
                resident.remove(bid)
                if rng.random() < 0.4:
                    vec.forget(bid)
                    ref.forget(bid)
        elif op < 0.85:
            bid = int(rng.integers(0, universe))
            vec.forget(bid)
            ref.forget(bid)
        elif op < 0.9 and resident:
            bid = int(rng.choice(resident))  # insert of a resident block is a touch
            vec.insert(bid, now)
            ref.insert(bid, now)
        else:
            assert_same_victims(vec, ref, now, step)
            continue
        assert_same_state(vec, ref)
    assert_same_victims(vec, ref, now, 0)


@pytest.fixture(params=["as shipped", "always vectorised"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "always vectorised":
        # Reach the bulk path for small and irregular batches too, and re-plan without limit.
        monkeypatch.setattr(heat_module, "_VECTOR_MIN", 1)
        monkeypatch.setattr(heat_module, "_DENSE_ODD", 10**9)
        monkeypatch.setattr(heat_module, "_MAX_PLANS", 10**9)
    return str(request.param)


@pytest.mark.slow  # long random workloads in two modes, ~9 s: `make test-slow`
def test_touch_many_equals_the_scalar_loop(mode: str) -> None:
    seen: Counter[str] = Counter()
    for seed in range(60):
        drive(seed, 150, seen)
    for seed in range(8):
        drive(100 + seed, 150, seen, large=True)
    assert seen["empty batch"] and seen["batch with repeats"]
    if mode == "always vectorised":
        for path in (
            "scalar step",
            "scalar step that re-plans",
            "bulk leaves probation",
            "bulk unlinks a dead parent",
            "bulk raises",
            "bulk owes its parent",
            "bulk no-op",
            "at or below the bound",
        ):
            assert seen[path] >= 5, (path, seen)
    else:
        assert seen["plan"] >= 50, seen


def test_long_chains_root_first() -> None:
    """The daemon's case: long chains, looked up again and again, partly grown since."""
    seen: Counter[str] = Counter()
    for seed in range(5):
        rng = np.random.default_rng(1000 + seed)
        vec, ref = HeatPolicy(half_life_s=30.0), HeatPolicy(half_life_s=30.0)
        Spy(vec, seen)
        now, parent, chain = 0.0, -1, []
        for round_ in range(30):
            now += float(rng.exponential(2.0))
            grow = int(rng.integers(0, 40)) if round_ else 300
            for _ in range(grow):  # the conversation grows: new blocks in probation
                bid = len(chain)
                for p in (vec, ref):
                    p.insert(bid, now, parent)
                chain.append(bid)
                parent = bid
            now += float(rng.exponential(2.0))
            prefix = chain[: int(rng.integers(len(chain) // 2, len(chain) + 1))]
            vec.touch_many(np.asarray(prefix), now)
            for bid in prefix:
                ref.touch(bid, now)
            assert_same_state(vec, ref)
        assert_same_victims(vec, ref, now, seed)
    assert seen["bulk raises"] > 1000 and seen["bulk leaves probation"] > 100, seen


def test_a_hotter_child_raises_its_parent_touched_before_it() -> None:
    """Parent first, then a child with the higher key: the scalar loop raises the parent to
    the child's key (and on up the chain); so must the batch."""
    vec, ref = HeatPolicy(half_life_s=10.0), HeatPolicy(half_life_s=10.0)
    for p in (vec, ref):
        for bid in range(12):
            p.insert(bid, 0.0, bid - 1)
        for _ in range(5):  # the leaves get hot on their own
            for bid in range(8, 12):
                p.touch(bid, 1.0)
    batch = np.arange(12)
    vec.touch_many(batch, 2.0)
    for bid in batch.tolist():
        ref.touch(bid, 2.0)
    assert_same_state(vec, ref)
    assert vec.effective_key(0) == vec.effective_key(11) > vec.heat.log_key(0)


def test_a_hotter_child_touched_first_raises_the_parents_after_it() -> None:
    """Leaf first: its propagation raises the ancestors that the batch touches next above
    their own new keys, so those touches change nothing; planned from the state before the
    leaf's step, they would lower the ancestors' keys."""
    vec, ref = HeatPolicy(half_life_s=10.0), HeatPolicy(half_life_s=10.0)
    for p in (vec, ref):
        for bid in range(200):
            p.insert(bid, 0.0, bid - 1)
        p.touch_many(np.arange(200), 0.5)  # all protected
        for _ in range(5):
            p.touch(199, 1.0)  # the leaf gets hot on its own
    # At t=30 each ancestor's own key has passed the leaf's key of t=1 (its effective key
    # so far), but not the leaf's new one.
    batch = np.arange(200)[::-1]
    vec.touch_many(batch, 30.0)
    for bid in batch.tolist():
        ref.touch(bid, 30.0)
    assert_same_state(vec, ref)
    assert vec.effective_key(0) == vec.effective_key(199) > vec.heat.log_key(0)


def test_a_child_promotes_its_parent_in_probation() -> None:
    """A parent back in probation with a high key of its own (heat outlives residency) is
    still moved to protected by its child's touch."""
    vec, ref = HeatPolicy(memory_factor=0.0), HeatPolicy(memory_factor=0.0)
    for p in (vec, ref):
        p.insert(0, 0.0)
        for _ in range(10):
            p.touch(0, 0.0)  # hot
        p.remove(0)
        for bid in range(1, 10):  # push 0 out of protected's shadow
            p.insert(bid, 1.0)
            p.touch(bid, 1.0)
            p.remove(bid)
        p.insert(0, 1.0)  # probation, with a key above its coming children's
        for bid in range(100, 120):
            p.insert(bid, 1.0, 0 if bid == 100 else bid - 1)
    assert vec._seg[0] == 1 and vec._seg[119] == 1
    batch = np.arange(100, 120)  # the chain below 0, whose key beats the new ones
    vec.touch_many(batch, 1.0)
    for bid in batch.tolist():
        ref.touch(bid, 1.0)
    assert_same_state(vec, ref)
    assert vec._seg[0] == 2


def test_a_key_equal_to_the_bound_enters_the_buffer() -> None:
    """Blocks with one history share their key; when it is the protected buffer's bound,
    blocks reaching it must be noted (the bound is inclusive)."""
    vec, ref = HeatPolicy(memory_factor=0.0), HeatPolicy(memory_factor=0.0)
    for p in (vec, ref):
        for bid in range(200):
            p.insert(bid, 0.0)
        p.touch_many(np.arange(100), 1.0)  # protected, all with one key
        p.victims(1, 1.0, None)  # rebuilds protected's buffer: its bound is that key
    assert vec._bufs[2].bound == vec.effective_key(0)
    vec.touch_many(np.arange(100, 200), 1.0)
    for bid in range(100, 200):
        ref.touch(bid, 1.0)
    assert_same_state(vec, ref)
    assert len(vec._bufs[2].entries) == 200


def test_unknown_ids_raise_before_anything_changes() -> None:
    vec, ref = HeatPolicy(), HeatPolicy()
    for p in (vec, ref):
        for bid in range(20):
            p.insert(bid, 0.0, bid - 1)
        p.remove(7)
    for bad in (7, 20, 10**6, -1):
        # A batch for the array path, and a short one for the one-by-one path.
        for batch in (np.array([0, 1, 2, bad, 3, *range(8, 20)]), np.array([0, 1, bad, 3])):
            with pytest.raises(KeyError) as info:
                vec.touch_many(batch, 5.0)
            assert info.value.args == (bad,)
            assert_same_state(vec, ref)
    vec.touch_many(np.array([], dtype=np.int64), 5.0)
    assert_same_state(vec, ref)


def test_keys_are_bit_exact_where_numpy_rounds_differently() -> None:
    """Many distinct heats and ages: each key goes through the C library like
    ``record_one``'s, even where numpy's SIMD ``power``/``log2`` would differ in the last
    bit."""
    rng = np.random.default_rng(3)
    vec, ref = HeatPolicy(half_life_s=7.3), HeatPolicy(half_life_s=7.3)
    ids = np.arange(2000)
    times = np.sort(rng.uniform(0, 50, size=2000))
    for p in (vec, ref):
        for bid, t in zip(ids.tolist(), times.tolist(), strict=True):
            p.insert(bid, t)
            p.touch(bid, t + 0.1)
    vec.touch_many(ids, 60.0)
    for bid in ids.tolist():
        ref.touch(bid, 60.0)
    assert_same_state(vec, ref)
    assert not math.isinf(vec.effective_key(0))


# ------------------------------------------------------------------ insert_many


def _count_paths(policy: HeatPolicy) -> Counter[str]:
    """How many of ``policy``'s ``insert_many`` calls took the bulk path, how many the loop."""
    took: Counter[str] = Counter()
    bulk = policy._insert_in_bulk

    def counting(ids: np.ndarray, pars: np.ndarray, now: float) -> bool:
        done = bulk(ids, pars, now)
        took["bulk" if done else "loop"] += 1
        return done

    policy._insert_in_bulk = counting  # type: ignore[method-assign]
    return took


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("fixed", [None, 300])
def test_insert_many_equals_the_insert_loop(seed: int, fixed: int | None) -> None:
    """Batches as the store inserts them (a Put's new chain, a demoted group) and the ones it
    must leave to the loop (blocks with a ghost, repeats, children before parents, parents
    that get raised): the state after ``insert_many`` is the loop's, bit for bit."""
    rng = np.random.default_rng(seed)
    vec, ref = HeatPolicy(capacity_blocks=fixed), HeatPolicy(capacity_blocks=fixed)
    took = _count_paths(vec)
    resident: list[int] = []
    gone: list[int] = []
    next_id, now = 0, 0.0
    for step in range(160):
        now += float(rng.exponential(2.0))
        op = rng.random()
        if op < 0.55 or len(resident) < 20:
            n = int(rng.integers(1, 60))
            fresh = list(range(next_id, next_id + n))
            next_id += n
            kind = rng.random()
            if kind < 0.15 and gone:  # some blocks come back (ghosts, seen before)
                back = rng.choice(gone, size=min(len(gone), int(rng.integers(1, 6))), replace=False)
                fresh[: len(back)] = [int(b) for b in back]
                for b in back:
                    gone.remove(int(b))
            if kind > 0.95:
                fresh.append(fresh[0])  # a repeat
            parent0 = resident[int(rng.integers(len(resident)))] if resident else -1
            pars = [parent0 if rng.random() < 0.7 else -1, *fresh[:-1]]
            if rng.random() < 0.1:
                pars = pars[::-1]  # children before parents, odd links
            if rng.random() < 0.1 and resident:
                ref.touch(parent0, now)  # a resident parent hotter than its new child
                vec.touch(parent0, now)
            ids = np.asarray(fresh, dtype=np.int64)
            parr = np.asarray(pars, dtype=np.int64)
            vec.insert_many(ids, now, parr)
            for b, p in zip(fresh, pars, strict=True):
                ref.insert(b, now, p)
            resident.extend(b for b in dict.fromkeys(fresh) if b not in resident)
        elif op < 0.8:
            k = int(rng.integers(1, max(2, len(resident) // 3)))
            got, want = vec.victims(k, now, None), ref.victims(k, now, None)
            assert got is not None and want is not None and got.tolist() == want.tolist()
            for b in got.tolist():
                vec.remove(b)
                ref.remove(b)
                resident.remove(b)
                gone.append(b)
        else:
            batch = rng.choice(resident, size=min(len(resident), 8), replace=False)
            for b in batch.tolist():
                vec.touch(b, now)
                ref.touch(b, now)
        assert_same_state(vec, ref)
        if step % 20 == 0:
            assert_same_victims(vec, ref, now, step)
    assert took["bulk"] >= 20 and took["loop"] >= 5, took


@pytest.mark.parametrize("seed", range(4))
def test_insert_many_sets_tree_depths_as_the_loop_does(seed: int) -> None:
    """A batch whose blocks branch (each one's parent any earlier block of the batch, a
    resident block, or none), as a batch of several requests' chains sharing a prefix is:
    the bulk path's depths are the loop's."""
    rng = np.random.default_rng(seed)
    vec, ref = HeatPolicy(), HeatPolicy()
    took = _count_paths(vec)
    for p in (vec, ref):
        for bid in range(10):
            p.insert(bid, 0.0, bid - 1)  # a resident chain, depths 0..9
    ids = np.arange(10, 400, dtype=np.int64)
    pars = np.empty(len(ids), dtype=np.int64)
    for i in range(len(ids)):
        roll = rng.random()
        if roll < 0.02:
            pars[i] = -1
        elif roll < 0.05 or i == 0:
            pars[i] = int(rng.integers(0, 10))
        else:
            pars[i] = ids[int(rng.integers(max(0, i - 4), i))]
    vec.insert_many(ids, 0.0, pars)
    for b, p in zip(ids.tolist(), pars.tolist(), strict=True):
        ref.insert(b, 0.0, p)
    assert took == {"bulk": 1}
    assert vec._depth[ids].tolist() == ref._depth[ids].tolist()
    assert int(vec._depth[ids].max()) > 20  # chains within the batch, many deep
    assert_same_state(vec, ref)
