"""Owed moves: protecting a block moves at most ``_MOVE_BUDGET`` of its ancestors per call.

The first touch of a deep chain's leaf moved every ancestor in probation to protected in one
call (200,000 of them: 0.2 s of the daemon's loop). Now a walk stops past its budget and
owes the rest, which ``work`` makes piecemeal and ``victims`` makes before deciding (see
"Owed moves" in ``kvtier.daemon.policy.heat``). These tests count the ancestors walked per
call (not timed), check the chain rule against links kept by the test itself while moves
are owed, and that the decisions stay the eager reference's.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from heat_reference import EagerHeatPolicy
from heat_state import assert_same_decisions, clone

import kvtier.daemon.policy.heat as heat_module
from kvtier.daemon.policy.heat import HeatPolicy


def put_chain(policy: HeatPolicy | EagerHeatPolicy, n: int, now: float) -> float:
    """A chain of ``n`` blocks stored by Puts of 16 blocks, each Put a little later (the
    reference has no ``insert_many``: its loop of ``insert``)."""
    for lo in range(0, n, 16):
        now += 0.001
        for bid in range(lo, min(lo + 16, n)):
            policy.insert(bid, now, bid - 1)
    return now


def test_regression_first_touch_of_a_deep_chain_walks_a_bounded_number() -> None:
    """Touching the leaf of a 5,000-block chain stored by Puts (all in probation) walked all
    4,999 ancestors in that one call. Now it walks at most the budget, each ``work`` call
    at most a budget more, and once the moves are made the state is the eager one's."""
    n = 5000
    policy, eager = HeatPolicy(), EagerHeatPolicy()
    now = put_chain(policy, n, 0.0)
    put_chain(eager, n, 0.0)
    now += 1.0
    before = policy.chain_steps
    policy.touch(n - 1, now)
    eager.touch(n - 1, now)
    assert policy.chain_steps - before <= n // 4  # the budget and the stop: 1,025 here
    budget = heat_module._MOVE_BUDGET
    assert policy.owes_work
    assert policy.stats().protected <= budget + 1  # the rest still owed
    calls = 0
    while True:
        before = policy.chain_steps
        more = policy.work()
        assert policy.chain_steps - before <= budget + 2, calls
        calls += 1
        if not more:
            break
    assert calls >= (n - 1) // budget
    assert policy.stats().protected == n
    assert_same_decisions(policy, eager, now, 0)


def test_victims_make_the_moves_owed_first() -> None:
    """A ``victims`` call with moves still owed decides as the eager policy does: the chain's
    root, oldest of all, is not taken from probation while its leaf is protected."""
    policy, eager = HeatPolicy(), EagerHeatPolicy()
    for p in (policy, eager):
        for bid in range(5000, 5100):
            p.insert(bid, 1.0)  # one-off blocks, in probation
        put_chain(p, 3000, 0.0)
        p.touch(2999, 2.0)
    assert policy.owes_work
    got, want = policy.victims(3, 3.0, None), eager.victims(3, 3.0, None)
    assert got is not None and want is not None
    assert got.tolist() == want.tolist() and 0 not in got.tolist()
    assert not policy.owes_work
    assert_same_decisions(policy, eager, 3.0, 1)


class Links:
    """The chain links as the test made them (a parent resident at its child's insertion,
    until either leaves): a brute-force account of which blocks have resident children."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self.resident: set[int] = set()

    def insert(self, bid: int, parent: int) -> None:
        if bid in self.resident:
            return  # a touch
        self.resident.add(bid)
        if parent in self.resident:
            self.parent[bid] = parent

    def remove(self, bid: int) -> None:
        self.resident.discard(bid)
        self.parent.pop(bid, None)
        for child in [c for c, p in self.parent.items() if p == bid]:
            del self.parent[child]  # the link died with its parent

    def check(self, victims: list[int]) -> None:
        """No victim has a resident child other than an earlier victim of the same answer:
        an ancestor never goes before its descendant."""
        gone: set[int] = set()
        for bid in victims:
            kids = {c for c, p in self.parent.items() if p == bid and c not in gone}
            assert not kids, (bid, kids, victims)
            gone.add(bid)


def drive(seed: int, steps: int, seen: Counter[str]) -> None:
    rng = np.random.default_rng(seed)
    cap = [None, 64, 200][seed % 3]
    params = dict(half_life_s=float(rng.choice([0.5, 30.0])), capacity_blocks=cap)
    new, old = HeatPolicy(**params), EagerHeatPolicy(**params)  # type: ignore[arg-type]
    links = Links()
    now = 0.0
    for step in range(steps):
        now += float(rng.choice([0.0, 0.001, 0.5]))
        op = rng.random()
        resident = sorted(links.resident)
        if op < 0.3 or len(resident) < 4:
            # A chain off a resident block or a new root, grown block by block, each one
            # maybe evicting first as a full tier does.
            parent = int(rng.choice(resident)) if resident and rng.random() < 0.6 else -1
            evicting = rng.random() < 0.4
            # Every other chain not evicting goes to the policy as one Put does, in one
            # ``insert_many`` (the reference's loop of ``insert`` stands for it).
            batch: list[tuple[int, int]] | None = None if evicting or step % 2 else []
            for _ in range(int(rng.integers(1, 60))):
                bid = int(rng.integers(0, 400))
                if bid in links.resident:
                    continue
                if evicting and len(links.resident) > 8:
                    gone = old.victims(1, now, None, (bid,))
                    assert gone is not None
                    victim = int(gone[0])
                    links.check([victim])
                    old.remove(victim)
                    old.insert(bid, now, parent)
                    if rng.random() < 0.5:
                        assert new.replace(bid, parent, now) == victim  # the replayer's step
                        seen["replace"] += 1
                    else:
                        assert new.victim(now, bid) == victim
                        new.remove(victim)
                        new.insert(bid, now, parent)
                    links.remove(victim)
                    links.insert(bid, parent if parent != victim else -1)
                    parent = bid
                    continue
                for p in (new, old) if batch is None else (old,):
                    p.insert(bid, now, parent)
                if batch is not None:
                    batch.append((bid, parent))
                links.insert(bid, parent)
                parent = bid
            if batch:
                bids, parents = np.asarray(batch, dtype=np.int64).T
                new.insert_many(bids, now, parents)
                seen["insert_many"] += 1
        elif op < 0.55:
            bid = int(rng.choice(resident))  # a leaf or the middle of a chain
            for p in (new, old):
                p.touch(bid, now)
        elif op < 0.65:
            batch = np.asarray(rng.choice(resident, size=min(len(resident), 12)), dtype=np.int64)
            for p in (new, old):
                p.touch_many(batch, now)
        elif op < 0.8:
            new.work()
        elif op < 0.9:
            gone = [p.victims(int(rng.integers(1, 4)), now, None) for p in (new, old)]
            assert (gone[0] is None) == (gone[1] is None)
            for bid in [] if gone[1] is None else gone[1].tolist():
                for p in (new, old):
                    p.remove(bid)
                links.remove(bid)
        else:
            # Any block, or mostly, while moves are owed, the next one an owed walk would
            # move: still in probation here, protected in the reference.
            nxt = [int(new._parent[c]) for c in new._moving if new._parent[c] in links.resident]
            if nxt and rng.random() < 0.7:
                bid = nxt[int(rng.integers(len(nxt)))]
                seen["removed on a walk owed"] += new._seg[bid] == 1  # probation
            else:
                bid = int(rng.choice(resident))
            for p in (new, old):
                p.remove(bid)
            links.remove(bid)
        seen["moves owed"] += new.owes_work
        # Asked of copies, so that the moves stay owed for the steps that follow.
        # (Fewer than 3 resident, as seed 34 has at its first step: victims(3) is None.)
        for k in {min(k, len(links.resident)) for k in (1, 3, len(links.resident))}:
            got = clone(new).victims(k, now, None)
            assert got is not None
            links.check(got.tolist())
        assert_same_decisions(new, old, now, step)


@pytest.mark.slow  # 8 random workloads, checked after every step: `make test-slow`
def test_chain_rule_holds_while_moves_are_owed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random chains (stored block by block or by ``insert_many``), touches of leaves and
    middles, evictions and removals, with a budget of 2 moves per walk, so that moves stay
    owed most of the time: every victim of every answer has no resident child (links kept
    by the test), and the decisions are the eager reference's."""
    monkeypatch.setattr(heat_module, "_MOVE_BUDGET", 2)
    seen: Counter[str] = Counter()
    for seed in range(8):
        drive(seed, 60, seen)
    assert seen["moves owed"] >= 100 and seen["replace"] >= 20, seen
    assert seen["insert_many"] >= 20, seen
    assert seen["removed on a walk owed"] >= 5, seen


@pytest.mark.parametrize("gone", [0, 6])  # the root, a middle block: both on the walk owed
def test_regression_removing_a_block_an_owed_walk_moves_keeps_the_counts(
    monkeypatch: pytest.MonkeyPatch, gone: int
) -> None:
    """``remove`` made the moves owed first, then went on with the segment it had read
    before them: a block those moves took out of probation was removed from probation
    (its count fell below 0, protected kept it, its parent lost a child in probation
    twice and its ghost said probation)."""
    monkeypatch.setattr(heat_module, "_MOVE_BUDGET", 2)
    policy, eager = HeatPolicy(), EagerHeatPolicy()
    for p in (policy, eager):
        now = put_chain(p, 10, 0.0)
        p.touch(9, now + 1.0)  # moves 8 and 7 here, owes the rest
    assert policy.owes_work and policy.stats().probation == 7
    for p in (policy, eager):
        p.remove(gone)
    assert (policy.stats().probation, policy.stats().protected) == (0, 9)
    assert policy._ghost[gone] == eager._ghost[gone] == 2  # protected
    assert_same_decisions(policy, eager, now + 2.0, 2)
