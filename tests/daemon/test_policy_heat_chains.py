"""The heat policy's chain rule at the cost of O(n) per chain: owed raises.

A key that rises above its parent's is owed to the ancestors rather than raised up the chain
at once (see the module docstring of ``kvtier.daemon.policy.heat``). These tests pin the cost
(chain walks counted in ``HeatPolicy.chain_steps``, not timed) and that the decisions stay
exactly those of the eager policy it replaced, kept frozen in ``heat_reference``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from heat_reference import EagerHeatPolicy
from heat_state import Policy, assert_same_decisions, mask_fn

import kvtier.daemon.policy.heat as heat_module
from kvtier.daemon.policy.heat import HeatPolicy

# ------------------------------------------------------------------------------- cost


def chain_block_by_block(policy: Policy, n: int) -> float:
    """A conversation stored one block at a time during decode: each block a little later
    than its parent, so each child's key is above every ancestor's. Returns the time."""
    now = 0.0
    for bid in range(n):
        now += 0.001
        policy.insert(bid, now, bid - 1)
    return now


class CountingEager(EagerHeatPolicy):
    """The eager reference, counting the ancestors its walks raise (each is noted)."""

    raised = 0

    def _note_key(self, bid: int, seg: int, key: float, depth: int) -> None:
        self.raised += 1
        super()._note_key(bid, seg, key, depth)


@pytest.mark.slow  # long chains touched from the root, ~4 s: `make test-slow`
@pytest.mark.parametrize("how", ["loop of touch", "touch_many"])
def test_regression_quadratic_chain_touches(how: str) -> None:
    """Inserting a 1,024-block chain block by block, then touching it root first (a Lookup),
    walked every ancestor on every step: O(n^2), ~150 ms per Lookup in the daemon. Now each
    phase, paying what it owes included, looks at O(n) ancestors."""
    n = 1024
    policy, eager = HeatPolicy(), CountingEager()
    now = chain_block_by_block(policy, n)
    chain_block_by_block(eager, n)
    inserting = policy.chain_steps
    assert inserting <= 4 * n
    assert eager.raised >= n * (n - 1) // 2  # the bug, pinned on the reference
    eager.raised = 0

    chain = np.arange(n, dtype=np.int64)
    for lookup in range(3):
        now += 1.0
        before = policy.chain_steps
        if how == "touch_many":
            policy.touch_many(chain, now)
            eager.touch_many(chain, now)
        else:
            for bid in chain.tolist():
                policy.touch(bid, now)
                eager.touch(bid, now)
        policy.victims(1, now, None)  # pays what victims could see
        policy.effective_key(0)  # pays the rest
        assert policy.chain_steps - before <= 4 * n, lookup
        assert eager.raised >= n * (n - 1) // 2  # every child hotter than its parent
        eager.raised = 0
    assert_same_decisions(policy, eager, now, 0)


def test_inserting_a_chain_under_eviction_stays_linear() -> None:
    """The steady state of a full tier: each new block of the conversation evicts one. The
    raise each new leaf owes stays hidden from ``victims`` (its ancestors rank far above the
    buffers' bounds) until the next buffer rebuild pays them all, walking the chain once:
    O(1) per block amortised (a chain is at most the capacity; a rebuild comes at most every
    64 evictions), against the eager walk to the root on every insert."""
    n, cap = 2048, 512
    policy, eager = HeatPolicy(capacity_blocks=cap), EagerHeatPolicy(capacity_blocks=cap)
    now = 0.0
    for bid in range(cap):  # old single-block traffic fills the tier
        now += 0.001
        for p in (policy, eager):
            p.insert(10_000 + bid, now)
    before = policy.chain_steps
    for bid in range(n):
        now += 0.001
        gone = [p.victims(1, now, None, (bid,)) for p in (policy, eager)]
        assert gone[0] is not None and gone[1] is not None
        assert gone[0].tolist() == gone[1].tolist()
        for p in (policy, eager):
            p.remove(int(gone[0][0]))
            p.insert(bid, now, bid - 1)
    assert policy.chain_steps - before <= 8 * n  # 4.4 n here; the eager walks: 255 n
    assert_same_decisions(policy, eager, now, 1)


# --------------------------------------------------------------------- equivalence


def draw_chain(policy: Policy, leaf: int) -> list[int]:
    """``leaf`` and its live ancestors, root first."""
    out = [leaf]
    while True:
        parent = int(policy._parent[out[-1]])
        if parent < 0 or parent not in policy or parent in out:
            return out[::-1]
        if policy._ins[parent] > policy._ins[out[-1]]:
            return out[::-1]
        out.append(parent)


def spy_on_leaving(policy: HeatPolicy, seen: Counter[str]) -> None:
    """Count which way ``remove`` kept the owed raises right, to prove the test gets there."""
    leaving = policy._owed_leaving

    def counting(bid: int, seg: int) -> None:
        if policy._eff[bid] > policy._cutoffs()[seg]:
            seen["removal pays all"] += 1
        elif bid in policy._owed:
            seen["removal hands a raise up"] += 1
        leaving(bid, seg)

    policy._owed_leaving = counting  # type: ignore[method-assign]


def drive(seed: int, steps: int, seen: Counter[str], *, large: bool = False) -> None:
    """Random operations on the policy and on the eager reference, decisions compared after
    every one. ``large``: segments of hundreds of blocks, whose buffers stop covering them,
    so that owed raises stay hidden; small ones are covered whole and pay at ``victims``."""
    rng = np.random.default_rng(seed)
    capacities = [None, 400, 1500] if large else [None, 8, 24, 64]
    params = dict(
        half_life_s=float(rng.choice([0.5, 5.0, 30.0])),
        capacity_blocks=capacities[int(rng.integers(0, len(capacities)))],
        memory_factor=float(rng.choice([0.0, 0.5, 5.0])),
        protection_halvings=float(rng.choice([0.5, 3.0])),
        initial_ids=int(rng.choice([4, 64])),
    )
    new, old = HeatPolicy(**params), EagerHeatPolicy(**params)  # type: ignore[arg-type]
    spy_on_leaving(new, seen)
    universe = 1600 if large else int(rng.choice([40, 120, 300]))
    longest = 80 if large else 20
    resident: list[int] = []
    now = 0.0
    for step in range(steps):
        r = rng.random()
        if r < 0.3:
            pass
        elif r < 0.9:
            now += float(rng.exponential(params["half_life_s"] * rng.choice([0.001, 0.1, 3.0])))
        else:
            now -= float(rng.uniform(0, 2))  # the heat table's clock-step-back rule
        op = rng.random()
        both: tuple[Policy, ...] = (new, old)
        if op < 0.25 or len(resident) < 3:
            # A chain grown block by block, each a little later (every child hotter), off a
            # resident block or a new root; now and then an evicting put before each block.
            parent = int(rng.choice(resident)) if resident and rng.random() < 0.7 else -1
            evicting = rng.random() < 0.3
            for _ in range(int(rng.integers(1, longest))):
                bid = int(rng.integers(0, universe))
                if bid in old:
                    continue
                if evicting and len(old) > 4:
                    gone = [p.victims(1, now, None, (bid,)) for p in both]
                    assert gone[0] is not None and gone[1] is not None
                    assert gone[0].tolist() == gone[1].tolist()
                    victim = int(gone[0][0])
                    for p in both:
                        p.remove(victim)
                    resident.remove(victim)
                    if victim == parent:
                        parent = -1
                for p in both:
                    p.insert(bid, now, parent)
                resident.append(bid)
                parent = bid
                now += float(rng.choice([0.0, 0.001]))
            seen["chain"] += 1
        elif op < 0.5:
            chain = draw_chain(old, int(rng.choice(resident)))
            kind = rng.integers(0, 4)
            batch = chain if kind < 2 else chain[::-1] if kind == 2 else chain[: len(chain) // 2]
            if rng.random() < 0.5:
                for p in both:
                    p.touch_many(np.asarray(batch, dtype=np.int64), now)
                seen["touch_many"] += 1
            else:
                for bid in batch:
                    for p in both:
                        p.touch(bid, now)
                seen["loop of touch"] += 1
        elif op < 0.6:
            size = int(rng.integers(1, len(resident) + 1))
            batch = rng.choice(resident, size=size, replace=rng.random() < 0.3).tolist()
            for p in both:
                p.touch_many(np.asarray(batch, dtype=np.int64), now)
        elif op < 0.75:
            # An eviction as the store does it, or the removal of any block (which may have
            # a raise owed through it).
            if rng.random() < 0.5:
                k = int(rng.integers(1, 5))
                mask = mask_fn(step) if rng.random() < 0.5 else None
                gone = [p.victims(k, now, mask) for p in both]
                assert (gone[0] is None) == (gone[1] is None)
                ids = [] if gone[1] is None else gone[1].tolist()
                assert gone[0] is None or gone[0].tolist() == ids
            else:
                ids = [int(rng.choice(resident))]
                seen["any block removed"] += 1
            for bid in ids:
                for p in both:
                    p.remove(bid)
                resident.remove(bid)
                if rng.random() < 0.4:
                    for p in both:
                        p.forget(bid)
        elif op < 0.8:
            bid = int(rng.integers(0, universe))
            for p in both:
                p.forget(bid)
        elif op < 0.85:
            bid = int(rng.choice(resident))
            for p in both:
                p.insert(bid, now)  # of a resident block: a touch
        else:
            bid = int(rng.choice(resident))
            for p in both:
                p.touch(bid, now)
        seen["owed new"] += bool(new._owed_new)
        seen["owed hidden"] += bool(new._owed)
        assert_same_decisions(new, old, now, step)


@pytest.mark.slow  # 30 random workloads against the eager reference: `make test-slow`
def test_decisions_equal_the_eager_policy() -> None:
    seen: Counter[str] = Counter()
    for seed in range(24):
        drive(seed, 120, seen)
    for seed in range(4):
        drive(100 + seed, 120, seen, large=True)
    for what in ("chain", "touch_many", "loop of touch", "any block removed", "owed hidden"):
        assert seen[what] >= 20, seen
    assert seen["removal pays all"] >= 5 and seen["removal hands a raise up"] >= 5, seen


def hidden_raise_setup() -> tuple[HeatPolicy, EagerHeatPolicy]:
    """Both policies with a protected chain 0..19 (read at t=1.5) above 300 cold protected
    blocks (t=0), and buffers built, whose bounds lie among the cold blocks."""
    new, old = HeatPolicy(), EagerHeatPolicy()
    for p in (new, old):
        for bid in range(1000, 1300):
            p.insert(bid, 0.0)
        p.touch_many(np.arange(1000, 1300), 0.0)
        for bid in range(20):
            p.insert(bid, 1.0, bid - 1)
        p.touch_many(np.arange(20), 1.5)
        p.victims(1, 2.0, None)  # builds the buffers
    assert new._bufs[2].bound < new._eff[0]
    return new, old


def test_removing_a_block_a_raise_passes_through() -> None:
    """A block in the middle of a chain whose hot leaf owes its ancestors a raise (kept
    hidden: the chain ranks far above the buffers' bounds) leaves: the ancestors above it
    must still get the raise, as the eager walk gave it before the block left."""
    new, old = hidden_raise_setup()
    for p in (new, old):
        for _ in range(3):
            p.touch(19, 5.0)  # the leaf gets hot
    new.victims(1, 5.0, None)
    assert new._owed == {19: new._eff[19]} and not new._owed_new
    assert new._eff[18] < new._eff[19]  # hidden
    for p in (new, old):
        p.remove(10)
    assert not new._owed  # it might lag, so everything owed was paid
    assert_same_decisions(new, old, 5.0, 2)
    for bid in range(10):
        assert new.effective_key(bid) == old.effective_key(bid)


def test_evicting_a_block_that_owes_hands_the_raise_to_its_parent() -> None:
    """A new leaf in probation, the coldest there (the deepest of equal keys) but hotter
    than its protected parent, owes the parent a raise; evicted, it hands the raise on."""
    new, old = hidden_raise_setup()
    for p in (new, old):
        for bid in range(2000, 2100):
            p.insert(bid, 50.0)  # probation
        p.victims(1, 50.0, None)  # builds probation's buffer
        p.insert(20, 50.0, 19)  # probation, owes 19 and up (its key passed theirs)
    new.victims(1, 50.0, None)
    assert new._owed == {20: new._eff[20]}
    gone = [p.victims(1, 50.0, None) for p in (new, old)]
    assert gone[0] is not None and gone[1] is not None
    assert gone[0].tolist() == gone[1].tolist() == [20]
    for p in (new, old):
        p.remove(20)
    assert new._owed == {19: new._eff[19]} and new._eff[19] == old._eff[19]
    assert_same_decisions(new, old, 50.0, 3)


def test_owed_raises_stay_bounded_without_victims(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier that never fills never calls ``victims``: what it owes is still sorted out and
    paid in bounded batches, and stays O(1) per block."""
    monkeypatch.setattr(heat_module, "_OWED_LIMIT", 100)
    policy, eager = HeatPolicy(), EagerHeatPolicy()
    now = 0.0
    for root in range(0, 3000, 300):  # ten chains, grown block by block
        for bid in range(root, root + 300):
            now += 0.001
            for p in (policy, eager):
                p.insert(bid, now, bid - 1 if bid > root else -1)
            assert len(policy._owed_new) <= 101 and len(policy._owed) <= 101
    # Per block: its own walk, its sorting out, its own step when paid; per payment (one
    # per 100 blocks): one walk up the chain being grown.
    assert policy.chain_steps <= 3 * 3000 + (3000 // 100) * 300
    assert_same_decisions(policy, eager, now, 4)
