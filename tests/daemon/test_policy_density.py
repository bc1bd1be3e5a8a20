"""The hit-density policy: every signal, the statistics (censoring included), the density
table, the chain rule, admission, hints, and the candidate buffer against a brute-force
order."""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np
import pytest
from density_training import roots_come_back

from kvtier.daemon.policy.base import DECLINED, NO_VICTIM
from kvtier.daemon.policy.density import (
    _CLOSED,
    _GHOST,
    _KEPT_CAPPED,
    AGE_BUCKETS,
    CLASSES,
    Classifier,
    DensityPolicy,
    ReuseModel,
    age_bucket,
    age_buckets,
    bucket_widths,
    heat_decays,
)
from kvtier.daemon.policy.memento import SEQ_MOD
from kvtier.daemon.policy.registry import make_policy

# ------------------------------------------------------------------ age buckets


def test_age_buckets_double_every_two_buckets() -> None:
    assert [age_bucket(a) for a in (0.0, 0.99, 1.0, 1.41, 1.42, 2.0, 3.9, 4.0)] == [
        0,
        0,
        1,
        1,
        2,
        3,
        4,
        5,
    ]
    assert age_bucket(1e12) == AGE_BUCKETS - 1
    ages = np.random.default_rng(0).exponential(50.0, size=2000)
    ages[:10] = 0.0
    assert age_buckets(ages).tolist() == [age_bucket(a) for a in ages]
    widths = bucket_widths()
    assert len(widths) == AGE_BUCKETS and widths[0] == 1.0 and (widths > 0).all()


# ---------------------------------------------------------------------- classes


def test_classes_by_count_gap_depth_and_turn() -> None:
    c = Classifier()
    by_count = [c(n, 0, 0, 0) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 1000)]
    assert len(set(by_count)) == 6
    assert by_count[2] == by_count[3] and by_count[4] == by_count[5]
    assert by_count[6] == by_count[7] and by_count[8] == by_count[9]
    # The gap since the previous access splits classes from the second access on.
    assert c(1, 3, 0, 0) == c(1, 20, 0, 0)
    assert len({c(2, g, 0, 0) for g in (0, 5, 11, 17, 27)}) == 4
    assert len({c(1, 0, d, 0) for d in (0, 1, 7, 8, 100)}) == 3
    assert len({c(1, 0, 0, t) for t in (0, 1, 2, 4, 5, 200)}) == 4
    every = {
        c(n, g, d, t)
        for n in (1, 2, 3, 5, 9, 17)
        for g in (0, 5, 11, 17)
        for d in (0, 1, 8)
        for t in (0, 1, 2, 5)
    }
    assert len(every) == CLASSES and max(every) == CLASSES - 1


def test_a_signal_left_out_pools_its_classes() -> None:
    c = Classifier(["count", "turn"])
    assert c(3, 0, 0, 2) == c(3, 0, 9, 2) == c(3, 20, 9, 2)
    assert c(3, 0, 0, 2) != c(3, 0, 0, 0)
    with pytest.raises(ValueError, match="unknown signal"):
        Classifier(["count", "colour"])
    policy = make_policy("density", signals="count")
    assert isinstance(policy, DensityPolicy)


def test_depth_and_turn_come_from_the_parent() -> None:
    p = DensityPolicy(capacity_blocks=100)
    # One request stores a chain: depths 0, 1, 2, one turn (the parents are new).
    for bid, parent in ((0, -1), (1, 0), (2, 1)):
        p.insert(bid, 0.0, parent)
    assert [p.describe(b).depth for b in (0, 1, 2)] == [0, 1, 2]
    assert [p.describe(b).turn for b in (0, 1, 2)] == [0, 0, 0]
    # The next turn reads the chain again, then grows it: its blocks are one turn later.
    p.touch_many(np.array([0, 1, 2]), 30.0)
    p.insert(3, 30.0, 2)
    p.insert(4, 30.0, 3)
    assert [(p.describe(b).depth, p.describe(b).turn) for b in (3, 4)] == [(3, 1), (4, 1)]
    # A block whose parent the policy never saw starts a chain.
    p.insert(10, 31.0, 77)
    assert (p.describe(10).depth, p.describe(10).turn) == (0, 0)
    assert p.describe(0).count == 2 and p.describe(4).count == 1
    # Depth and turn stay with the block; a later access only counts.
    p.touch(4, 40.0)
    assert (p.describe(4).depth, p.describe(4).turn, p.describe(4).count) == (4, 1, 2)


# --------------------------------------------------------------------- lives


def index(p: DensityPolicy, cls: int, age_s: float) -> int:
    return cls * AGE_BUCKETS + age_bucket(age_s)


def test_a_reuse_is_recorded_at_its_age_in_the_lives_class() -> None:
    p = DensityPolicy(capacity_blocks=10)
    p.insert(1, 0.0)
    cls = p.describe(1).cls
    p.touch(1, 10.0)
    assert p.model.hits[index(p, cls, 10.0)] == 1.0
    assert p.model.ends[index(p, cls, 10.0)] == 1.0
    assert sum(p.model.hits) == 1
    assert p.describe(1).cls != cls  # the second access starts a life of another class


def test_a_ghost_reuse_counts_and_forget_censors() -> None:
    p = DensityPolicy(capacity_blocks=10)
    p.insert(1, 0.0)
    p.insert(2, 0.0)
    c1, c2 = p.describe(1).cls, p.describe(2).cls
    p.remove(1)
    p.remove(2)
    p.insert(1, 20.0)  # back after 20 s away: a reuse at 20 s
    assert p.model.hits[index(p, c1, 20.0)] == 1.0
    p.touch(1, 25.0)
    p.forget(2)  # never reused: censored at its age (25 s), not a reuse
    assert p.model.hits[index(p, c2, 25.0)] == 0.0
    assert p.model.ends[index(p, c2, 25.0)] == 1.0
    with pytest.raises(KeyError):
        p.describe(2)  # nothing known of the id any more


def test_note_miss_is_an_access_of_a_block_the_tier_does_not_keep() -> None:
    p = DensityPolicy(capacity_blocks=10)
    p.note_miss(5, -1, 0.0)
    cls = p.describe(5).cls
    p.note_miss(5, -1, 6.0)
    assert p.model.hits[index(p, cls, 6.0)] == 1.0
    assert 5 not in p and p.describe(5).count == 2
    p.insert(5, 9.0)
    assert 5 in p and p.describe(5).count == 3


def test_expired_ghosts_are_censored_at_their_age() -> None:
    p = DensityPolicy(capacity_blocks=2, ghost_factor=1.0, period=8)
    p.insert(0, 0.0)
    cls = p.describe(0).cls
    p.remove(0)
    for bid in range(1, 4):  # three more evictions: block 0's ghost is past the window
        p.insert(bid, 1.0)
        p.remove(bid)
    assert p.stats().ghosts == 4
    for t in range(8):
        p.note_miss(100 + t, -1, 5.0)  # accesses that reach the next table
    # Blocks 0 and 1 (evictions 1 and 2 of 4, a window of 2) closed at 5 s and 4 s of
    # age, one bucket; counted once each, then aged once by decay.
    assert p.model.totals()[1].reshape(-1)[index(p, cls, 5.0)] == pytest.approx(2 * 0.9)
    assert p.describe(0).count == 1  # what is known of it stays; only its life closed
    assert p.stats().ghosts < 4 + 8


# ------------------------------------------------------------------- statistics


def test_open_lives_are_at_risk_not_misses() -> None:
    """Kaplan-Meier: of 20 lives of a class, 10 were reused at bucket 5 and 10 are still
    open at bucket 10. The hazard at 5 is 10/20; counting the open ones as lives that ended
    unused at bucket 0 would have made it 10/10."""
    model = ReuseModel(prior=0.0, decay=1.0, smooth=0)
    hits = np.zeros((CLASSES, AGE_BUCKETS))
    ends = np.zeros((CLASSES, AGE_BUCKETS))
    hits[3, 5] = ends[3, 5] = 10
    open_lives = np.zeros((CLASSES, AGE_BUCKETS))
    open_lives[3, 10] = 10
    hazard = model.hazard(hits, ends, open_lives)
    assert hazard[3, 5] == pytest.approx(0.5)
    assert hazard[3, 0] == 0 and hazard[3, 10] == 0
    ends[3, 0] += 10
    assert model.hazard(hits, ends, np.zeros_like(open_lives))[3, 5] == pytest.approx(1.0)


def test_a_class_without_evidence_takes_its_groups_hazard() -> None:
    model = ReuseModel(prior=4.0, decay=1.0, smooth=0)
    hits = np.zeros((CLASSES, AGE_BUCKETS))
    ends = np.zeros((CLASSES, AGE_BUCKETS))
    c = Classifier()
    seen, unseen, other = c(9, 0, 0, 0), c(9, 0, 8, 3), c(1, 0, 0, 0)
    hits[seen, 2] = ends[seen, 2] = 50
    ends[other, 0] = 50
    hazard = model.hazard(hits, ends, np.zeros_like(hits))
    assert hazard[unseen, 2] > 0.5  # the same access count: smoothed towards the seen class
    assert hazard[other, 0] < 0.1  # its own evidence: 50 lives, none reused


def test_density_favours_reused_classes_and_young_blocks_of_short_reuse() -> None:
    model = ReuseModel(prior=1.0, decay=1.0, smooth=0)
    hits = np.zeros((CLASSES, AGE_BUCKETS))
    ends = np.zeros((CLASSES, AGE_BUCKETS))
    hot, dead = 10, 20
    hits[hot, 3] = ends[hot, 3] = 80
    ends[hot, 12] = 20
    ends[dead, 12] = 100
    model.past_hits, model.past_ends = hits, ends
    table = model.table(np.zeros((CLASSES, AGE_BUCKETS)))
    assert table[hot, 0] > 10 * table[dead, 0]
    assert table[hot, 0] > table[hot, 8]  # past its usual reuse age, it is worth less


def test_a_late_hump_makes_waiting_blocks_worth_more() -> None:
    """Reuses only around bucket 12 (a think time): a block that has waited to bucket 10
    is closer to its reuse than a new one, so it ranks higher; past the hump, lower."""
    model = ReuseModel(prior=0.0, decay=1.0, smooth=0)
    hits = np.zeros((CLASSES, AGE_BUCKETS))
    ends = np.zeros((CLASSES, AGE_BUCKETS))
    hits[7, 12] = ends[7, 12] = 50
    ends[7, 20] = 50
    model.past_hits, model.past_ends = hits, ends
    table = model.table(np.zeros((CLASSES, AGE_BUCKETS)))
    assert table[7, 10] > table[7, 0] > table[7, 16]


def test_the_counts_age_by_decay() -> None:
    model = ReuseModel(prior=0.0, decay=0.5)
    model.hits[7] = model.ends[7] = 8
    model.table(np.zeros((CLASSES, AGE_BUCKETS)))
    hits, ends = model.totals()
    assert hits[0, 7] == ends[0, 7] == 4.0
    assert model.hits[7] == 0  # folded into the history


@pytest.mark.parametrize(("capacity", "period"), [(1000, 2048), (4096, 4096)])
def test_a_warm_full_tier_builds_a_table_every_tier_full_of_accesses(
    capacity: int, period: int
) -> None:
    """Past the young policy's tables (256 accesses, then doubling), one every ``capacity``
    accesses, at least 2,048 apart."""
    p = DensityPolicy(capacity_blocks=capacity)
    due: list[int] = []
    for bid in range(6 * period + capacity):
        tables = p._tables
        now = bid / 1000  # many accesses per quantum: few buffer rebuilds
        if len(p) < capacity:
            p.insert(bid, now)
        else:
            p.replace(bid, -1, now)  # evicts, or declines: either is a decision
        if p._tables > tables:
            due.append(bid + 1)
    young = [a for a in due if a <= period]
    assert young == [a for a in (256, 512, 1024, 2048, 4096) if a <= period]
    gaps = np.diff(due[len(young) - 1 :])
    assert len(gaps) >= 5 and (gaps == period).all()


# ---------------------------------------------------------------- the ranking


def test_older_blocks_of_one_class_go_first_without_statistics() -> None:
    p = DensityPolicy(capacity_blocks=10)
    for bid in range(5):
        p.insert(bid, float(bid))
    assert p.victims(5, 10.0, None).tolist() == [0, 1, 2, 3, 4]


def test_a_parent_goes_after_its_children() -> None:
    p = DensityPolicy(capacity_blocks=10)
    p.insert(0, 0.0)  # the parent is the oldest
    p.insert(1, 5.0, 0)
    p.insert(2, 6.0, 1)
    p.insert(3, 7.0)
    assert p.victims(1, 8.0, None).tolist() == [2]
    assert p.victims(4, 8.0, None).tolist() == [2, 1, 0, 3]
    # A child the caller keeps (pinned) does not pin its chain.
    kept = lambda bids: bids != 2  # noqa: E731
    assert p.victims(2, 8.0, kept).tolist() == [1, 0]
    p.remove(2)
    assert p.victims(1, 8.0, None).tolist() == [1]


def test_trained_density_keeps_the_hot_class() -> None:
    """Blocks read every few seconds and one-off blocks: once the statistics have seen
    both, a one-off block goes before a hot block that was read longer ago."""
    rng = np.random.default_rng(1)
    p = DensityPolicy(capacity_blocks=64, period=256)
    hot = list(range(8))
    for b in hot:
        p.insert(b, 0.0)
    one_off = 1000
    now = 0.0
    for _ in range(400):
        now += 0.5
        b = int(rng.choice(hot))
        p.touch(b, now)
        if len(p) >= 64:
            victim = p.victims(1, now, None)
            assert victim is not None
            p.remove(int(victim[0]))
        p.insert(one_off, now)
        one_off += 1
    stale = min(hot, key=lambda b: p.describe(b).last)
    fresh = one_off - 1
    assert p.density(stale, now) > p.density(fresh, now)
    assert set(p.victims(len(p) - len(hot), now, None).tolist()).isdisjoint(hot)


# ------------------------------------------------------------- the block's own heat


def test_heat_decays_halve_at_a_half_life_and_fall_with_the_gap() -> None:
    decays = heat_decays(1 / 100)  # a half-life of 100 quanta
    assert (np.diff(decays) < 0).all() and 0.99 < decays[0] < 1.0
    at_half_life = decays[age_bucket(100.0)]
    assert 0.4 < at_half_life < 0.6
    assert decays[-1] < 1e-20


def test_heat_is_the_decayed_access_count_and_forget_resets_it() -> None:
    p = DensityPolicy(capacity_blocks=10, own_half_life_s=100.0)
    decays = heat_decays(1 / 100)
    p.insert(1, 0.0)
    assert p.describe(1).heat == 1.0
    p.touch(1, 0.5)
    want = np.float32(1.0 * decays[0] + 1.0)
    assert p.describe(1).heat == want
    p.touch(1, 100.5)  # a half-life later: about half of it is left, plus this access
    want = np.float32(float(want) * decays[age_bucket(100.0)] + 1.0)
    assert p.describe(1).heat == want and 1.8 < want < 2.2
    p.remove(1)
    p.note_miss(1, -1, 101.0)  # an access the tier did not keep still counts
    assert p.describe(1).heat > want
    p.forget(1)
    p.insert(1, 102.0)
    assert p.describe(1).heat == 1.0


def test_without_own_weight_the_heat_stays_one() -> None:
    p = DensityPolicy(capacity_blocks=10, own_weight=False)
    p.insert(1, 0.0)
    for t in (0.1, 0.2, 0.3):
        p.touch(1, t)
    assert p.describe(1).heat == 1.0


def test_of_two_blocks_of_one_class_and_age_the_hotter_ranks_above() -> None:
    """Two hot blocks of one class, last read at the same time: the one read more often of
    late has the higher heat, a density higher by the square root of the ratio, and goes
    after the other."""
    p, hot, now = trained_policy()
    a, b = hot[0], hot[1]
    for dt in (0.01, 0.02, 0.03):
        p.touch(a, now + dt)
    p.touch(b, now + 0.03)
    now += 0.03
    sa, sb = p.describe(a), p.describe(b)
    assert sa.cls == sb.cls and sa.last == sb.last and sa.heat > sb.heat
    ratio = p.density(a, now) / p.density(b, now)
    assert ratio == pytest.approx(math.sqrt(sa.heat / sb.heat))
    only = lambda bids: np.isin(bids, [a, b])  # noqa: E731
    assert p.victims(2, now, only).tolist() == [b, a]
    # Ranked by the class alone (no own weight), the two are level.
    q, hot, now = trained_policy(own_weight=False)
    for dt in (0.01, 0.02, 0.03):
        q.touch(a, now + dt)
    q.touch(b, now + 0.03)
    assert q.density(a, now + 0.03) == q.density(b, now + 0.03)


# ------------------------------------------------------------------- admission


def trained_policy(**params: object) -> tuple[DensityPolicy, list[int], float]:
    """A policy that learned that blocks seen many times come back within seconds and
    blocks seen once never do; full, its hot blocks resident."""
    p = DensityPolicy(capacity_blocks=32, period=128, **params)
    hot = list(range(16))
    now = 0.0
    for b in hot:
        p.insert(b, now)
    next_id = 100
    for step in range(600):
        now += 0.25
        p.touch(hot[step % len(hot)], now)
        if len(p) >= 32:
            p.remove(int(p.victims(1, now, None)[0]))
        p.insert(next_id, now)
        next_id += 1
    return p, hot, now


def test_admission_declines_a_block_colder_than_the_victim() -> None:
    p, hot, now = trained_policy()
    victim = hot[0]
    assert not p.admits(5000, -1, victim, now)  # a new block: seen once, never back
    warm = DensityPolicy(capacity_blocks=32, period=128, admission=False)
    warm.insert(1, 0.0)
    assert warm.admits(5000, -1, 1, 1.0)


def test_admission_takes_a_block_warmer_than_the_victim() -> None:
    p, hot, now = trained_policy()
    fresh = max(b for b in range(100, 1000) if b in p)
    assert p.admits(hot[1], -1, fresh, now + 0.25) or p.density(fresh, now) > 0
    # A block read as often as the hot ones, away for a moment, beats a one-off block.
    p.remove(hot[1])
    assert p.admits(hot[1], -1, fresh, now + 0.25)


def test_admission_follows_hints() -> None:
    p, hot, now = trained_policy()
    assert not p.admits(5000, -1, hot[0], now)
    p.hint(np.array([5000]), now + 10.0, now)
    assert p.admits(5000, -1, hot[0], now)  # hinted: the engine reads it soon


def test_admits_many_asks_a_new_chain_with_the_lineage_it_will_have() -> None:
    """A Put's new chain is asked before any of it is in the policy: each block is asked as
    it would be once the blocks before it were accessed (a sequential copy that notes each
    one says the same), so the blocks under a new root are deep, not roots."""

    def taught() -> DensityPolicy:
        p = DensityPolicy(capacity_blocks=64)
        roots_come_back(p, 1000, 0.0)
        p.insert(1, 0.0)  # the victim: a root, just stored
        p.hint(np.array([5]), 10.0, 0.0)
        return p

    p = taught()
    chain, parents = [2, 3, 4, 5], [-1, 2, 3, 4]
    answers = p.admits_many(chain, parents, 1, 0.0)
    assert answers == [True, False, False, True]  # the root, two deep blocks, a hinted one
    # Asked one by one, the unseen parents would make every block a root.
    assert [p.admits(b, par, 1, 0.0) for b, par in zip(chain, parents, strict=True)] == [True] * 4
    sequential = taught()
    expected = []
    for b, par in zip(chain, parents, strict=True):
        expected.append(sequential.admits(b, par, 1, 0.0))
        sequential.note_miss(b, par, 0.0)
    assert expected == answers and sequential.stats().tables == p.stats().tables
    # A block the policy knows is asked with its own history, whatever its parent.
    p.note_miss(7, -1, -3.0)
    p.note_miss(7, -1, -2.0)
    assert p.admits_many([6, 7], [-1, 6], 1, 0.0)[1] == p.admits(7, -1, 1, 0.0)
    off = DensityPolicy(capacity_blocks=64, admission=False)
    off.insert(1, 0.0)
    assert off.admits_many([2, 3], [-1, 2], 1, 0.0) == [True, True]


# ----------------------------------------------------------------------- hints


def test_hints_hold_exactly_until_their_deadline() -> None:
    p = DensityPolicy(capacity_blocks=8)
    for bid in range(4):
        p.insert(bid, float(bid))
    p.hint(np.array([0, 9]), 10.0, 4.0)  # 9 is not resident yet
    assert p.victims(1, 5.0, None).tolist() == [1]
    assert p.victims(1, 10.0, None).tolist() == [1]
    assert p.victims(1, math.nextafter(10.0, math.inf), None).tolist() == [0]
    p.insert(9, 10.0)
    assert p.victims(3, 10.0, None).tolist() == [1, 2, 3]
    assert p.victims(4, 10.0, None) is None
    assert p.victims(5, 10.5, None).tolist() == [0, 1, 2, 3, 9]
    p.remove(9)
    p.forget(9)
    p.insert(9, 10.0)
    assert p.victims(4, 10.0, None).tolist() == [1, 2, 3, 9]  # the id names another block


def test_a_hinted_block_holds_its_ancestors() -> None:
    # The engine reads a hinted block's whole prefix: its parent stays too, unlike a block
    # the caller's mask keeps, which does not pin its chain.
    p = DensityPolicy(capacity_blocks=8)
    p.insert(0, 0.0)
    p.insert(1, 1.0, 0)
    p.insert(2, 2.0)
    p.hint(np.array([1]), 10.0, 3.0)
    assert p.victims(1, 4.0, None).tolist() == [2]
    assert p.victims(2, 4.0, None) is None
    assert p.victims(3, 11.0, None).tolist() == [1, 0, 2]  # past the deadline


def test_a_hint_during_a_quantum_removes_the_block_from_the_buffer() -> None:
    p = DensityPolicy(capacity_blocks=8)
    for bid in range(4):
        p.insert(bid, float(bid))
    assert p.victims(1, 5.0, None).tolist() == [0]  # the buffer of this quantum is built
    p.hint(np.array([0, 1]), 20.0, 5.2)
    assert p.victims(2, 5.4, None).tolist() == [2, 3]
    assert p.victims(3, 5.4, None) is None
    assert p.victims(4, 20.5, None).tolist() == [0, 1, 2, 3]


def test_hinted_blocks_at_the_head_are_parked_not_walked_again() -> None:
    """Blocks hinted until a deadline within the buffer's quantum stay in the buffer (a
    later one takes them out): at its cold end each eviction walked them again. Met at the
    head they are parked until their deadline, and then come back in their place (the
    coldest go first); one hinted again meanwhile waits for its new deadline."""
    p = DensityPolicy(capacity_blocks=256)  # a quantum of 1 s
    for bid in range(200):
        p.insert(bid, float(bid) * 1e-3)
    assert p.victims(1, 1.0, None).tolist() == [0]  # the buffer of quantum [1, 2) is built
    p.remove(0)
    p.hint(np.arange(1, 51), 1.9, 1.0)  # the 50 coldest left, until within the quantum
    taken = []
    for k in range(20):
        got = p.victims(1, 1.0 + k * 1e-3, None)
        assert got is not None and int(got[0]) > 50
        taken.append(int(got[0]))
        p.remove(int(got[0]))
        if k == 0:
            assert len(p._parked) == 50  # every hinted entry met once, on the first call
    assert taken == list(range(51, 71))
    assert len(p._parked) == 50  # not walked (nor parked) again
    p.hint(np.arange(1, 6), 1.99, 1.5)  # renewed, still within the quantum
    got = p.victims(5, 1.95, None)
    assert got is not None and got.tolist() == [6, 7, 8, 9, 10]  # past 1.9, back first
    got = p.victims(6, 1.995, None)
    assert got is not None and got.tolist() == [1, 2, 3, 4, 5, 6]


def test_the_one_victim_path_with_live_hints_chooses_as_the_general_one() -> None:
    """``victims(1, now, None)`` with a hint live takes the buffer's first unhinted leaf
    (``_first_unhinted``); a twin asked the same through the general path (a mask that lets
    everything go) must choose the same victims over a run of inserts, hints and evictions
    with time moving on."""
    rng = np.random.default_rng(7)
    fast, general = (DensityPolicy(capacity_blocks=120) for _ in range(2))
    everything = lambda bids: np.ones(len(bids), dtype=bool)  # noqa: E731
    nxt, now, parents = 0, 0.0, {}
    for step in range(3000):
        now += float(rng.choice([0.0, 0.01, 0.3, 1.7]))
        if len(fast) < 100 or rng.random() < 0.5:
            parent = int(rng.integers(0, nxt)) if nxt and rng.random() < 0.6 else -1
            parent = parent if parent in fast else -1
            for p in (fast, general):
                p.insert(nxt, now, parent)
            parents[nxt] = parent
            nxt += 1
        if rng.random() < 0.2 and len(fast):
            bids = rng.integers(max(0, nxt - 150), nxt, size=int(rng.integers(1, 12)))
            until = now + float(rng.choice([0.0, 0.2, 0.9, 3.0, 30.0]))
            for p in (fast, general):
                p.hint(bids, until, now)
        if len(fast) > 80:
            got = fast.victims(1, now, None)
            want = general.victims(1, now, everything)
            assert (got is None) == (want is None), step
            if got is not None:
                assert got.tolist() == want.tolist(), step
                for p in (fast, general):
                    p.remove(int(got[0]))


# ------------------------------------------------------- exact against brute force


class Mirror:
    """What the test knows of the policy's state, to order blocks the slow way."""

    def __init__(self) -> None:
        self.resident: dict[int, int] = {}  # bid -> insertion number
        self.parent: dict[int, int] = {}
        self.until: dict[int, float] = {}
        self.inserts = 0

    def link(self, b: int) -> int:
        p = self.parent.get(b, -1)
        if p in self.resident and self.resident[p] < self.resident[b]:
            return p
        return -1


def brute_force(p: DensityPolicy, m: Mirror, n: int, now: float, mask) -> list[int] | None:
    def key(b: int) -> tuple[float, float, int, int]:
        # Ties: the block inserted first (the policy's insertion numbers run as the mirror's).
        return (p.density(b, now), p.describe(b).last, -p.describe(b).depth, m.resident[b])

    kids: dict[int, int] = {}
    for b in m.resident:
        if (parent := m.link(b)) >= 0:
            kids[parent] = kids.get(parent, 0) + 1
    heap = [(key(b), b) for b in m.resident if kids.get(b, 0) == 0]
    heapq.heapify(heap)
    seen: set[int] = set()
    released: dict[int, int] = {}
    chosen: list[int] = []
    while len(chosen) < n and heap:
        k, b = heapq.heappop(heap)
        if b in seen:
            continue
        seen.add(b)
        if m.until.get(b, -math.inf) >= now:
            continue
        if mask is None or mask(np.array([b]))[0]:
            chosen.append(b)
        parent = m.link(b)
        if parent >= 0:
            released[parent] = released.get(parent, kids[parent]) - 1
            if released[parent] == 0 and parent not in seen:
                heapq.heappush(heap, (max(key(parent), k), parent))
    return chosen if len(chosen) == n else None


@pytest.mark.parametrize("seed", range(6))
def test_victims_equal_a_brute_force_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = DensityPolicy(capacity_blocks=24, period=40, ghost_factor=2.0)
    m = Mirror()
    now = 0.0
    for _ in range(700):
        now += float(rng.exponential(0.4))
        op = rng.random()
        if op < 0.45:
            b = int(rng.integers(0, 60))
            if b in m.resident:
                continue
            parent = int(rng.choice(list(m.resident))) if m.resident and rng.random() < 0.7 else -1
            if len(m.resident) >= 24:
                v = p.victims(1, now, None, (b,))
                if v is None:
                    continue
                p.remove(int(v[0]))
                del m.resident[int(v[0])]
            p.insert(b, now, parent)
            m.inserts += 1
            m.resident[b] = m.inserts
            m.parent[b] = parent
        elif op < 0.75 and m.resident:
            batch = rng.choice(list(m.resident), size=int(rng.integers(1, 4)))
            p.touch_many(batch, now)
        elif op < 0.82 and m.resident:
            b = int(rng.choice(list(m.resident)))
            p.remove(b)
            del m.resident[b]
            if rng.random() < 0.5:
                p.forget(b)
                m.until.pop(b, None)
        elif op < 0.87:
            ids = rng.integers(0, 60, size=3)
            until = now + float(rng.exponential(3.0))
            p.hint(ids, until, now)
            for b in ids.tolist():
                m.until[b] = max(m.until.get(b, -math.inf), until)
        elif op < 0.9:
            p.note_miss(int(rng.integers(60, 90)), -1, now)
        else:
            pinned = np.unique(rng.choice(60, size=5))

            def mask(bids: np.ndarray, pinned: np.ndarray = pinned) -> np.ndarray:
                return ~np.isin(bids, pinned)

            for n in (1, 2, 5, len(m.resident)):
                for mk in (None, mask):
                    got = p.victims(n, now, mk)
                    want = brute_force(p, m, n, now, mk)
                    assert (got is None and want is None) or got.tolist() == want, (n, now)
    # The order was not just recency: the statistics had something to say.
    stats = p.stats()
    assert stats.tables > 10 and stats.buffer_rebuilds > 50
    assert len({p.density(b, now) for b in m.resident}) > 1


# ----------------------------------------------------------------------- memory


def test_per_block_memory_is_bounded() -> None:
    assert DensityPolicy().bytes_per_block <= 64


@pytest.mark.parametrize("seed", range(3))
def test_touch_many_equals_a_loop_of_touch(seed: int) -> None:
    """Large batches (vectorised, split where a table falls due) leave exactly the state
    and statistics a loop of ``touch`` does."""
    rng = np.random.default_rng(seed)
    vec, ref = (DensityPolicy(capacity_blocks=300, period=97) for _ in range(2))
    now = 0.0
    for bid in range(300):
        for p in (vec, ref):
            p.insert(bid, now, bid - 1 if bid % 10 else -1)
        now += 0.05
    for _ in range(60):
        now += float(rng.exponential(2.0))
        batch = rng.choice(300, size=int(rng.integers(16, 200)), replace=False)
        vec.touch_many(batch, now)
        for b in batch.tolist():
            ref.touch(b, now)
        if rng.random() < 0.3:
            for p in (vec, ref):
                v = p.victims(3, now, None)
                assert v is not None
                for b in v.tolist():
                    p.remove(b)
                    p.insert(b, now, -1)
        assert vec.model.hits == ref.model.hits and vec.model.ends == ref.model.ends
        assert np.array_equal(vec.model.past_hits, ref.model.past_hits)
        for name in ("_cls", "_cnt", "_last", "_stamp", "_state", "_kids", "_heat"):
            assert np.array_equal(getattr(vec, name), getattr(ref, name)), name
        assert vec.victims(50, now, None).tolist() == ref.victims(50, now, None).tolist()
    assert vec.stats().tables > 5


@pytest.mark.parametrize("hinting", [False, True], ids=["", "hints"])
@pytest.mark.parametrize("seed", range(3))
def test_replace_equals_its_steps_through_growth_long_gaps_and_a_spent_buffer(
    seed: int, hinting: bool
) -> None:
    """``replace`` (written out for the replayer) leaves exactly the state the steps it
    stands for do, where the contract test does not reach: ids past the per-id arrays (they
    grow), ages past the last bucket, a buffer used up within one quantum (many misses per
    quantum), and a victim that is the incoming block's parent. ``hinting``: a queue's hints
    all along (some blocks, resident or not, for a few seconds), as a replay with a queue
    window gives: the victims are then the first leaves no hint protects, hinted incoming
    blocks are admitted, and the hinted leaves met are parked and put back."""
    rng = np.random.default_rng(seed)
    params = {"capacity_blocks": 300, "quantum_s": 100.0, "period": 600, "initial_ids": 8}
    fused, steps = DensityPolicy(**params), DensityPolicy(**params)
    resident: set[int] = set()
    now = 0.0
    outcomes: set[int] = set()
    prev = -1
    parked = False
    for step in range(6000):
        now += float(rng.exponential(0.3)) if rng.random() > 0.002 else 1e7
        if hinting and step % 10 == 0:
            hinted = rng.integers(0, 400 + step // 3, size=8)
            until = now + float(rng.exponential(5.0))
            for p in (fused, steps):
                p.hint(hinted, until, now)
        bid = int(rng.integers(0, 400 + step // 3))
        if bid in resident:
            fused.touch(bid, now)
            steps.touch(bid, now)
            continue
        # Chains: often the block before, which may well be the victim.
        parent = prev if prev in resident and rng.random() < 0.5 else -1
        prev = bid
        if len(resident) < 300:
            for p in (fused, steps):
                p.insert(bid, now, parent)
            resident.add(bid)
            continue
        got = fused.replace(bid, parent, now)
        parked = parked or bool(fused._parked)
        out = steps.victim(now, bid)
        if out < 0:
            steps.note_miss(bid, parent, now)
            want = NO_VICTIM
        elif not steps.admits(bid, parent, out, now):
            steps.note_miss(bid, parent, now)
            want = DECLINED
        else:
            steps.remove(out)
            steps.insert(bid, now, parent)
            want = out
        assert got == want, step
        outcomes.add(got if got < 0 else int(got == parent))
        if got >= 0:
            resident.discard(got)
            resident.add(bid)
    assert outcomes == {DECLINED, 0, 1}  # declines, and victims that were and were not the parent
    assert fused.stats() == steps.stats()
    assert fused.stats().buffer_rebuilds > 20
    assert fused.model.hits == steps.model.hits and fused.model.ends == steps.model.ends
    for name in (
        "_state",
        "_last",
        "_cls",
        "_cnt",
        "_depth",
        "_turn",
        "_parent",
        "_kids",
        "_ins",
        "_evseq",
        "_stamp",
        "_until",
        "_heat",
    ):
        assert np.array_equal(getattr(fused, name), getattr(steps, name)), name
    assert np.array_equal(fused.table, steps.table)
    assert (fused._buf, fused._cur, fused._bound) == (steps._buf, steps._cur, steps._bound)
    assert fused._parked == steps._parked
    assert parked == hinting  # the hinted path ran, parking leaves it met
    # Past the hints' deadlines every block may go again.
    later = now + 1e3 if hinting else now
    assert fused.victims(300, later, None).tolist() == steps.victims(300, later, None).tolist()


def _densities_by_definition(hazard: np.ndarray, min_horizon: int) -> list[float]:
    """For each age bucket i, the best over horizon ends j + 1 (j >= i + min_horizon - 1, or
    the last bucket) of (S_i - S_{j+1}) / (held from i to j + 1), 0 where nothing is held;
    horizons too near count 0."""
    widths = bucket_widths()
    survival, occupancy = [1.0], [0.0]
    for x in range(AGE_BUCKETS):
        survival.append(survival[-1] * (1.0 - hazard[x]))
        occupancy.append(occupancy[-1] + survival[x] * widths[x] * (1.0 - hazard[x] / 2.0))
    out = []
    for i in range(AGE_BUCKETS):
        best = -math.inf
        for j in range(AGE_BUCKETS):
            held = occupancy[j + 1] - occupancy[i]
            horizon = j >= i + min_horizon - 1 or j == AGE_BUCKETS - 1
            ratio = (survival[i] - survival[j + 1]) / held if horizon and held > 0 else 0.0
            best = max(best, ratio)
        out.append(best)
    return out


@pytest.mark.parametrize("min_horizon", [1, 3])
def test_table_rows_are_the_table_and_densities_by_definition(min_horizon: int) -> None:
    """``table_rows``: the table, and its rows as lists (what the per-access path reads);
    each class's row is the best reuse chance per block-time over its horizons, from its
    hazards (a class without lives of its own: its group's)."""
    rng = np.random.default_rng(5)
    model = ReuseModel(prior=2.0, decay=1.0, smooth=1, min_horizon=min_horizon)
    hits = rng.poisson(0.5, size=(CLASSES, AGE_BUCKETS)).astype(np.float64)
    ends = hits + rng.poisson(1.0, size=hits.shape)
    hits[::3] = ends[::3] = 0  # classes without lives of their own
    open_lives = np.zeros_like(hits)
    open_lives[1::5, 20] = 4
    model.past_hits, model.past_ends = hits, ends
    hazard = model.hazard(hits, ends, open_lives)
    table, rows = model.table_rows(open_lives)
    assert rows == table.tolist()
    for cls in (0, 1, 2, 3, 121, CLASSES - 2, CLASSES - 1):
        want = _densities_by_definition(hazard[cls], min_horizon)
        assert table[cls].tolist() == pytest.approx(want, rel=1e-9, abs=1e-15), cls
    assert len({tuple(r) for r in rows}) > 50  # the classes differ


def test_counts_kept_in_32_bits_decide_as_from_zero_across_their_wraps() -> None:
    """Per-id counts are uint32 (stamps modulo 2**32, ``_evseq`` residues, ``_ins``
    numbers renumbered before they overflow): a policy whose stamp, eviction and insertion
    counts start just below their wraps decides as one from 0, hints (which give ``_until``
    an array of its own) included."""
    params = {"capacity_blocks": 60, "quantum_s": 1.0, "period": 150, "ghost_factor": 2.0}
    plain, shifted = DensityPolicy(**params), DensityPolicy(**params)
    shifted._seq = (1 << 32) - 300
    shifted._evictions = SEQ_MOD - 200
    shifted._inserts = (1 << 32) - 1 - 400
    assert not shifted._until.flags.writeable  # no hint yet: no array
    rng = np.random.default_rng(3)
    now = 0.0
    resident: set[int] = set()
    for step in range(5000):
        now += float(rng.exponential(0.2))
        bid = int(rng.integers(0, 200))
        if step % 500 == 250:
            held = np.asarray(sorted(resident)[:5], dtype=np.int64)
            for p in (plain, shifted):
                p.hint(held, now + 3.0, now)
        if bid in resident:
            for p in (plain, shifted):
                p.touch(bid, now)
            continue
        parent = bid - 1 if bid % 6 and bid - 1 in resident else -1
        if len(resident) < 60:
            for p in (plain, shifted):
                p.insert(bid, now, parent)
            resident.add(bid)
            continue
        got = [p.replace(bid, parent, now) for p in (plain, shifted)]
        assert got[0] == got[1], step
        if got[0] >= 0:
            resident.discard(got[0])
            resident.add(bid)
    assert np.array_equal(plain.table, shifted.table)
    # The renumbering drops the buffer (its entries carry the old numbers): one rebuild more.
    rebuilds = shifted.stats().buffer_rebuilds
    assert rebuilds == plain.stats().buffer_rebuilds + 1
    assert plain.stats() == dataclasses.replace(shifted.stats(), buffer_rebuilds=rebuilds - 1)
    assert shifted._seq < 10_000 and shifted._inserts < 5000  # both came round
    assert shifted._evictions > SEQ_MOD and plain.stats().tables > 10
    assert shifted._until.flags.writeable


def rarely_hit_policy(**params: object) -> tuple[DensityPolicy, float]:
    """A full tier of 32 blocks whose accesses are mostly new blocks: one access in 25
    reads a block again, a hit ratio of 4%."""
    p = DensityPolicy(capacity_blocks=32, period=128, **params)
    now = 0.0
    for bid in range(1000):
        now += 0.25
        if bid % 25 == 0 and bid in p:
            p.touch(bid, now)
        else:
            p.replace(bid, -1, now) if len(p) >= 32 else p.insert(bid, now)
        if bid % 25 == 24 and bid - 1 in p:
            p.touch(bid - 1, now)
    return p, now


@pytest.mark.parametrize("below", [0.085, 0.0])
def test_a_rarely_hit_tier_weighs_the_heat_itself(below: float) -> None:
    """Below ``full_heat_below`` hits per access (decayed over the tables), a block's own
    weight is its heat, not the square root: two blocks of one class and age rank by the
    ratio of their heats. With the threshold at 0 the square root stays."""
    p, now = rarely_hit_policy(full_heat_below=below)
    x, y = 5000, 5001
    p.insert(x, now)
    p.insert(y, now)
    for dt in (0.01, 0.03):
        p.touch(x, now + dt)
    for dt in (0.01, 0.02, 0.03):
        p.touch(y, now + dt)
    now += 0.03
    sx, sy = p.describe(x), p.describe(y)
    assert sx.cls == sy.cls and sx.last == sy.last and sy.heat > sx.heat
    assert p.density(x, now) > 0
    ratio = p.density(y, now) / p.density(x, now)
    assert ratio == pytest.approx(sy.heat / sx.heat if below else math.sqrt(sy.heat / sx.heat))


def test_regression_kept_depths_and_counts_past_their_caps_came_back_cut():
    """A dropped block's depth and access count are kept in narrow arrays
    (``_KEPT_CAPPED``); a value at or past the cap is kept beside them by slot, so it comes
    back whole, through a renumbering too; an expired slot drops it. The state is not kept:
    a ghost's open life comes back open, a closed one closed."""
    policy = DensityPolicy(capacity_blocks=16)
    deep, many = _KEPT_CAPPED["_depth"], _KEPT_CAPPED["_cnt"]
    cases = ((70_000, 300), (deep, many), (12, 3))
    for bid, (depth, count) in enumerate(cases):
        policy.insert(bid, 1.0, -1)
        policy._depth_v[bid], policy._cnt_v[bid] = depth, count
        policy.remove(bid)
        if bid == 2:
            policy.forget(bid)  # a closed life: forgotten, then dropped
        policy.remember(bid, 10 + bid)
        policy.forget(bid)
    policy.renumber(np.array([10, 11, 12]))  # new slot i: old slot 10 + i
    for slot, (depth, count) in enumerate(cases):
        bid = 5 + slot
        policy.revive(slot, bid)
        if slot == 2:  # forgotten before it was dropped: a forgotten row's values
            assert (policy._depth_v[bid], policy._cnt_v[bid]) == (0, 0)
            assert policy._state_v[bid] == _CLOSED
        else:
            assert (policy._depth_v[bid], policy._cnt_v[bid]) == (depth, count)
            assert policy._state_v[bid] == _GHOST
    policy.insert(8, 2.0, -1)
    policy._depth_v[8] = 80_000
    policy.remove(8)
    policy.remember(8, 3)
    policy.expire(3)
    assert not any(policy._kept_big.values())
