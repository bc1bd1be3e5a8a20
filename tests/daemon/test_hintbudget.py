"""The hint budget: what one owner's hints may protect at once (kvtier.daemon.hintbudget)."""

from __future__ import annotations

import math

import numpy as np

from kvtier.daemon.hintbudget import HintBudget


def admit(budget, bids, owner=1, nbytes=10, until=100.0, now=0.0):
    bids = np.asarray(bids, dtype=np.int64)
    owners = np.full(len(bids), owner)
    sizes = np.full(len(bids), nbytes) if np.isscalar(nbytes) else np.asarray(nbytes)
    return budget.admit(bids, owners, sizes, until, now).tolist()


def test_the_blocks_first_named_are_protected_up_to_the_budget():
    budget = HintBudget(limit_bytes=35)
    assert admit(budget, [5, 6, 7, 8]) == [True, True, True, False]
    assert budget.charged(1, 0.0) == 30
    # A prefix only: a small block after one that did not fit is not taken either.
    assert admit(budget, [9, 10], nbytes=[10, 1]) == [False, False]
    assert admit(budget, [11], nbytes=5) == [True]
    assert budget.charged(1, 0.0) == 35


def test_a_renewed_hint_costs_nothing_and_moves_the_deadline():
    budget = HintBudget(limit_bytes=20)
    assert admit(budget, [1, 2], until=10.0) == [True, True]
    for t in range(1, 50):  # renewed every second, each time to 10 s ahead
        assert admit(budget, [1, 2], until=t + 10.0, now=float(t)) == [True, True]
        assert budget.charged(1, float(t)) == 20
    assert len(budget._heap) == 2  # one entry per charged block, however often renewed
    assert budget.charged(1, 58.9) == 20
    assert budget.charged(1, 59.0) == 20  # protected up to its deadline, so charged
    past = math.nextafter(59.0, math.inf)
    assert budget.charged(1, past) == 0  # the last deadline passed: charge gone
    assert admit(budget, [3, 4], now=past) == [True, True]


def test_a_later_shorter_hint_keeps_the_longer_deadline():
    budget = HintBudget(limit_bytes=10)
    admit(budget, [1], until=50.0)
    admit(budget, [1], until=5.0, now=1.0)
    assert budget.charged(1, 20.0) == 10
    assert admit(budget, [2], now=20.0) == [False]


def test_owners_have_budgets_of_their_own():
    budget = HintBudget(limit_bytes=10)
    assert admit(budget, [1], owner=1) == [True]
    assert admit(budget, [2], owner=1) == [False]
    assert admit(budget, [2], owner=3) == [True]
    mixed = budget.admit(np.array([4, 5]), np.array([1, 4]), np.array([10, 10]), 100.0, 0.0)
    assert mixed.tolist() == [False, True]
    assert [budget.charged(o, 0.0) for o in (1, 2, 3, 4)] == [10, 0, 10, 10]


def test_a_block_named_twice_counts_once():
    budget = HintBudget(limit_bytes=20)
    assert admit(budget, [7, 7, 8, 7]) == [True, True, True, True]
    assert budget.charged(1, 0.0) == 20
    assert admit(budget, [9, 9]) == [False, False]


def test_a_zero_budget_protects_nothing_and_an_empty_hint_is_nothing():
    budget = HintBudget(limit_bytes=0)
    assert admit(budget, [1, 2]) == [False, False]
    assert admit(budget, []) == []
    assert budget.charged(1, 0.0) == 0 and budget.charged(99, 0.0) == 0


def test_a_dropped_blocks_charge_stays_with_its_owner_not_its_id():
    """A block the store dropped while charged, its id reused for another owner's block: that
    block was taken as already protected, at no charge to its owner, and each of its hints
    kept the first owner charged past its own deadline."""
    budget = HintBudget(limit_bytes=10)
    assert admit(budget, [3], owner=1, until=30.0) == [True]
    budget.forget(3)  # dropped; id 3 now holds owner 2's block
    assert budget.charged(1, 1.0) == 10  # until its deadline, as before
    for t in range(1, 100, 20):  # owner 2 hints its block again and again
        assert admit(budget, [3], owner=2, until=t + 30.0, now=float(t)) == [True]
        assert budget.charged(2, float(t)) == 10
    assert budget.charged(1, 30.5) == 0  # the first owner's deadline passed
    assert admit(budget, [4], owner=2, now=90.0) == [False]  # owner 2's budget is spent
    assert budget.charged(2, 200.0) == 0
    budget.forget(3)  # dropping an uncharged block changes nothing
    budget.forget(10**6)
    assert [budget.charged(o, 200.0) for o in (1, 2)] == [0, 0]


def test_a_block_is_charged_exactly_while_its_hint_protects_it():
    """A policy's hint protects a block while ``now <= until`` (the contract suite's
    ``test_hints_protect_exactly_until_their_deadline``); the budget freed the charge at
    ``now == until``, so at that instant the owner's new hints were charged on top of blocks
    still protected: two 10-byte blocks protected at once on a 10-byte budget."""
    budget = HintBudget(limit_bytes=10)
    assert admit(budget, [1], until=10.0) == [True]
    assert budget.charged(1, 10.0) == 10
    assert admit(budget, [2], until=20.0, now=10.0) == [False]
    assert admit(budget, [1], until=20.0, now=10.0) == [True]  # a renewal at the deadline
    assert budget.charged(1, 20.0) == 10
    assert budget.charged(1, math.nextafter(20.0, math.inf)) == 0
    budget.forget(1)
    assert admit(budget, [1], until=30.0, now=25.0) == [True]
    budget.forget(1)  # a dropped block's charge also runs up to its deadline
    assert budget.charged(1, 30.0) == 10
    assert budget.charged(1, math.nextafter(30.0, math.inf)) == 0


def test_every_owners_charges_together_stay_within_the_total():
    """Two owners at half the tier each protected all of it between them; the total bounds
    them together, first come, first served, and frees as deadlines pass."""
    budget = HintBudget(limit_bytes=50, total_limit_bytes=80)
    assert admit(budget, [1, 2, 3, 4, 5], owner=1) == [True] * 5
    assert admit(budget, [6, 7, 8, 9, 10], owner=2) == [True, True, True, False, False]
    assert budget.charged_total(0.0) == 80
    assert admit(budget, [11], owner=3) == [False]  # under its own share, over the total
    # One call naming two owners' blocks (a chain stored by two tenants in a shared
    # namespace): the total goes in the order named, the chain's head first.
    late = HintBudget(limit_bytes=50, total_limit_bytes=30)
    mixed = late.admit(np.array([1, 2, 3, 4]), np.array([2, 2, 1, 1]), np.full(4, 10), 5.0, 0.0)
    assert mixed.tolist() == [True, True, True, False]
    assert late.charged(1, 0.0) == 10 and late.charged(2, 0.0) == 20
    # Each owner's own share still applies first.
    shares = HintBudget(limit_bytes=10, total_limit_bytes=30)
    mixed = shares.admit(np.array([5, 6, 7]), np.array([1, 1, 2]), np.full(3, 10), 5.0, 0.0)
    assert mixed.tolist() == [True, False, True]
    # Past the deadlines, room again.
    assert late.charged_total(6.0) == 0
    assert admit(late, [9, 10, 11, 12], owner=2, now=6.0) == [True, True, True, False]


def test_without_a_total_each_owner_has_its_share():
    budget = HintBudget(limit_bytes=50)
    for owner in (1, 2, 3):
        assert admit(budget, [10 * owner + i for i in range(5)], owner=owner) == [True] * 5
    assert budget.charged_total(0.0) == 150


def pin(budget, bids, owner=1, nbytes=10, now=0.0):
    bids = np.asarray(bids, dtype=np.int64)
    return budget.pin(bids, np.full(len(bids), owner), np.full(len(bids), nbytes), now)


def test_pins_and_hints_share_the_budget_each_block_charged_once():
    budget = HintBudget(limit_bytes=30)
    assert pin(budget, [1, 2])
    assert budget.charged(1, 0.0) == 20
    assert pin(budget, [1])  # pinned again (another lease): no new charge
    assert admit(budget, [2, 3, 4], until=10.0) == [True, True, False]  # 2 is pinned already
    assert budget.charged(1, 0.0) == 30
    assert not pin(budget, [4, 1])  # all or nothing: 4 does not fit, 1 gets no pin either
    assert budget.pins(3).tolist() == [0, 2, 1]
    budget.unpin(np.array([1]), 1.0)
    budget.unpin(np.array([1, 2]), 1.0)
    assert budget.charged(1, 1.0) == 20  # 1 is free; 2 and 3 keep their hint to 10 s
    past = math.nextafter(10.0, math.inf)
    assert budget.charged(1, past) == 0


def test_a_pinned_block_stays_charged_past_its_hints_deadline_until_unpinned():
    budget = HintBudget(limit_bytes=10)
    assert admit(budget, [1], until=5.0) == [True]
    assert pin(budget, [1], now=1.0)
    assert budget.charged(1, 20.0) == 10  # the hint expired, the pin holds it
    assert not pin(budget, [2], now=20.0)
    budget.unpin(np.array([1]), 20.0)
    assert budget.charged(1, 20.0) == 0
    assert pin(budget, [2], now=20.0)


def test_pins_count_against_the_total_of_every_owner():
    budget = HintBudget(limit_bytes=30, total_limit_bytes=40)
    assert pin(budget, [1, 2, 3], owner=1)
    assert not pin(budget, [4, 5], owner=2)  # its own 30 would take them; the total not
    assert pin(budget, [4], owner=2)
    assert admit(budget, [6], owner=2) == [False]
    assert budget.charged_total(0.0) == 40


def test_a_pin_of_several_owners_blocks_fits_each_owners_budget_or_pins_nothing():
    budget = HintBudget(limit_bytes=20)
    assert pin(budget, [1, 2], owner=1)
    mixed = np.array([3, 4]), np.array([2, 1]), np.array([10, 10])
    assert not budget.pin(*mixed, 0.0)  # owner 1 is full: owner 2's block is not pinned either
    assert budget.pins(5).tolist() == [0, 1, 1, 0, 0]
    budget.unpin(np.array([1, 2]), 0.0)
    assert budget.pin(*mixed, 0.0)
    assert [budget.charged(o, 0.0) for o in (1, 2)] == [10, 10]
    budget.unpin(np.array([3, 4]), 0.0)
    assert budget.charged_total(0.0) == 0
