"""The heat policy: ranking by decayed heat, the chain rule, segments, id reuse, cost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import kvtier.daemon.policy.heat as heat_module
from kvtier.daemon.policy.heat import HeatPolicy
from kvtier.daemon.policy.memento import SEQ_MOD


def order_of(policy: HeatPolicy, n: int | None = None) -> list[int]:
    v = policy.victims(n or len(policy), 1e9, None)
    assert v is not None
    return v.tolist()


def test_a_chain_is_eaten_from_its_leaf() -> None:
    policy = HeatPolicy(capacity_blocks=10)
    for bid in range(4):  # one request: 0 <- 1 <- 2 <- 3, all at once
        policy.insert(bid, 1.0, bid - 1)
    assert order_of(policy) == [3, 2, 1, 0]


def test_a_parent_is_never_colder_than_its_child() -> None:
    policy = HeatPolicy(capacity_blocks=10, half_life_s=10.0)
    policy.insert(0, 0.0)
    policy.insert(1, 0.0, parent=0)
    policy.insert(2, 0.0, parent=1)
    policy.insert(7, 5.0)  # an unrelated block, hotter than the chain's own heat
    for t in (10.0, 11.0, 12.0):
        policy.touch(2, t)  # only the leaf is read (say, by a lookup of its key alone)
    assert policy.effective_key(0) >= policy.effective_key(1) >= policy.effective_key(2)
    # The unrelated block is now the coldest; then the chain, leaf first.
    assert order_of(policy) == [7, 2, 1, 0]


def test_decayed_heat_outranks_one_recent_access() -> None:
    policy = HeatPolicy(capacity_blocks=10, half_life_s=60.0, protection_halvings=10)
    policy.insert(1, 0.0)
    for t in range(1, 6):
        policy.touch(1, float(t))  # heat about 6 at t=5
    policy.insert(2, 0.0)
    policy.touch(2, 30.0)  # heat about 1.7 at t=30, more recent
    assert order_of(policy, 1) == [2]
    # With a short half-life the past is worth little and recency wins.
    short = HeatPolicy(capacity_blocks=10, half_life_s=1.0)
    short.insert(1, 0.0)
    for t in range(1, 6):
        short.touch(1, float(t))
    short.insert(2, 0.0)
    short.touch(2, 30.0)
    assert order_of(short, 1) == [1]


def test_first_timers_go_before_blocks_seen_again() -> None:
    policy = HeatPolicy(capacity_blocks=4)
    for bid in range(4):
        policy.insert(bid, float(bid))
    policy.touch(0, 4.0)  # 0 moves to protected
    # Probation (1, 2, 3) is above its target (0), so it is emptied first, coldest first.
    assert order_of(policy) == [1, 2, 3, 0]


def test_a_protected_parent_waits_for_its_child_in_probation() -> None:
    policy = HeatPolicy(capacity_blocks=8, memory_factor=0.0)
    policy.insert(0, 0.0)
    policy.touch(0, 1.0)  # protected
    policy.insert(1, 1.0, parent=0)  # the chain's new block: probation
    policy.insert(5, 1.5)
    policy.remove(5)
    policy.insert(5, 2.0)  # back from probation's shadow: p = 1, and 5 is protected
    assert policy.stats().target_probation == 1 and policy.stats().probation == 1
    # Probation is not above its target, so ARC's rule would take protected's coldest,
    # block 0; but 0 is the parent of a resident block, which goes first.
    assert order_of(policy, 1) == [1]


def test_protecting_a_child_protects_its_ancestors() -> None:
    policy = HeatPolicy(capacity_blocks=8)
    for bid in range(3):
        policy.insert(bid, 0.0, bid - 1)
    policy.touch(2, 1.0)  # only the leaf is seen again
    assert policy.stats().protected == 3 and policy.stats().probation == 0


def test_a_block_evicted_from_probation_coming_back_grows_probation() -> None:
    policy = HeatPolicy(capacity_blocks=4, memory_factor=0.0)
    for bid in range(4):
        policy.insert(bid, float(bid))
    assert policy.stats().target_probation == 0
    policy.remove(1)
    policy.insert(1, 10.0)  # back from probation's shadow
    assert policy.stats().target_probation == 1
    assert policy.stats().protected == 1  # a returning block is protected


def test_ghost_hints_are_pure() -> None:
    policy = HeatPolicy(capacity_blocks=4, memory_factor=0.0)
    for bid in range(4):
        policy.insert(bid, float(bid))
    policy.remove(0)
    policy.insert(9, 5.0)
    before = replace(policy.stats(), buffer_rebuilds=0)
    policy.victims(1, 6.0, None, incoming=(0,))
    policy.victims(2, 6.0, lambda b: b >= 0, incoming=(0, 5))
    assert replace(policy.stats(), buffer_rebuilds=0) == before


def test_a_reused_parent_id_is_not_followed() -> None:
    policy = HeatPolicy(capacity_blocks=10, half_life_s=10.0)
    policy.insert(1, 0.0)
    policy.insert(2, 0.0, parent=1)
    policy.remove(1)
    policy.forget(1)
    policy.insert(1, 0.5)  # the id now names an unrelated block
    key = policy.effective_key(1)
    for t in (50.0, 60.0):
        policy.touch(2, t)
    assert policy.effective_key(1) == key
    # And the same for a parent that left and came back under its own id: the old child
    # link is dead too (the parent is newer than the child).
    policy.insert(3, 0.0)
    policy.insert(4, 0.0, parent=3)
    policy.remove(3)
    policy.insert(3, 1.0)
    key = policy.effective_key(3)
    policy.touch(4, 90.0)
    assert policy.effective_key(3) == key


def test_forget_drops_history() -> None:
    policy = HeatPolicy(capacity_blocks=2, memory_factor=100.0)
    policy.insert(5, 0.0)
    policy.touch(5, 1.0)
    policy.remove(5)
    policy.forget(5)
    policy.insert(5, 2.0)
    # Starts cold, in probation, heat 1.
    assert policy.stats().probation == 1
    assert float(policy.heat.heat[5]) == 1.0


def _lift(policy: HeatPolicy, eff: np.ndarray, owed: dict[int, float]) -> None:
    """Pay ``owed`` into ``eff`` by brute force: each raise lifts every live ancestor."""
    for child, key in owed.items():
        assert child in policy and key <= policy._eff[child]
        while True:
            parent = int(policy._parent[child])
            if parent < 0 or parent not in policy or policy._ins[parent] > policy._ins[child]:
                break
            eff[parent] = max(eff[parent], key)
            child = parent


def true_keys(policy: HeatPolicy) -> np.ndarray:
    """The effective keys with every owed raise paid. Checks on the way that a block whose
    stored key lags behind the raises kept in ``_owed`` ranks above its cutoff, where no
    buffer entry can stand for it (``_owed_new`` may break that until ``victims`` sorts it
    out)."""
    eff = policy._eff.copy()
    _lift(policy, eff, policy._owed)
    b1, b2 = policy._bufs[1].bound, policy._bufs[2].bound
    for bid in np.flatnonzero(eff != policy._eff).tolist():
        cutoff = b2 if policy._seg[bid] == 2 else max(b1, b2)
        assert policy._eff[bid] > cutoff, (bid, policy._eff[bid], eff[bid], cutoff)
    _lift(policy, eff, policy._owed_new)
    return eff


def _brute_force(policy: HeatPolicy, seg: int, eff: np.ndarray) -> list[int]:
    ids = np.flatnonzero(policy._seg[: policy._size] == seg)
    order = np.lexsort((ids, -policy._depth[ids], eff[ids]))
    return ids[order].tolist()


def test_candidate_buffers_match_a_full_sort_under_random_operations() -> None:
    rng = np.random.default_rng(7)
    policy = HeatPolicy(capacity_blocks=300, half_life_s=5.0)
    resident: list[int] = []
    now = 0.0
    for step in range(6000):
        now += float(rng.exponential(0.05))
        op = rng.random()
        if op < 0.45 or not resident:
            bid = int(rng.integers(0, 600))
            if bid in policy:
                continue
            parent = int(rng.choice(resident)) if resident and rng.random() < 0.7 else -1
            policy.insert(bid, now, parent)
            resident.append(bid)
        elif op < 0.8:
            policy.touch(int(rng.choice(resident)), now)
        else:
            v = policy.victims(int(rng.integers(1, 4)), now, None) if len(resident) > 3 else None
            for bid in [] if v is None else v.tolist():
                policy.remove(bid)
                resident.remove(bid)
                if rng.random() < 0.3:
                    policy.forget(bid)
        if step % 50 == 0 and resident:
            # The chain rule: a linked parent ranks at least as high as its child.
            eff = true_keys(policy)
            for child in resident:
                parent = int(policy._parent[child])
                if parent >= 0 and parent in policy and policy._ins[parent] < policy._ins[child]:
                    assert eff[parent] >= eff[child]
                    assert policy._seg[parent] >= policy._seg[child]
            for seg in (1, 2):
                expect = _brute_force(policy, seg, eff)
                only = np.zeros(policy._size, dtype=bool)
                only[expect] = True
                got = (
                    policy.victims(len(expect), now, lambda b, only=only: only[b])
                    if expect
                    else None
                )
                assert (got.tolist() if got is not None else []) == expect
            # The replayer's fast path agrees with the general one.
            fast = policy.victims(1, now, None)
            slow = policy.victims(1, now, lambda b: np.ones(len(b), dtype=bool))
            assert fast.tolist() == slow.tolist()


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        HeatPolicy(capacity_blocks=0)
    with pytest.raises(ValueError):
        HeatPolicy(half_life_s=0)


def test_regression_a_complete_candidate_buffer_kept_every_consumed_entry():
    """Found by the soak (the daemon's memory grew with every block L1 evicted): a segment
    small enough for its candidate buffer to cover it whole is never rebuilt, and the
    buffer's consumed head (entries of blocks long evicted) was never dropped."""
    policy = HeatPolicy(capacity_blocks=128)
    free = list(range(1024))[::-1]
    live: list[int] = []
    now = 0.0
    for _ in range(2000):
        now += 0.01
        if len(live) >= 64:
            victims = policy.victims(8, now, lambda b: np.ones(len(b), dtype=bool))
            assert victims is not None
            for bid in victims.tolist():
                policy.remove(bid)
                policy.forget(bid)
                live.remove(bid)
                free.append(bid)
        parent = -1
        for _ in range(8):
            bid = free.pop()
            policy.insert(bid, now, parent)
            live.append(bid)
            parent = bid
    assert all(len(buf.entries) <= 4 * 64 + len(live) for buf in policy._bufs)
    assert sorted(policy.order().tolist()) == sorted(live)


def test_regression_a_reused_id_was_a_victim_twice_under_a_mask():
    """An id forgotten and inserted again at the same time and depth gets the key of its old
    buffer entry, which becomes current again beside the new one: a scan under a mask (or
    hints) checked both in one batch and handed the block out twice."""
    policy = HeatPolicy()
    for bid in range(5):
        policy.insert(bid, 0.0)
    assert policy.victims(1, 0.0, None).tolist() == [0]  # the buffer is built
    policy.remove(3)
    policy.forget(3)
    policy.insert(3, 0.0)
    every = policy.victims(5, 0.0, lambda b: np.ones(len(b), dtype=bool))
    assert every is not None and sorted(every.tolist()) == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------ 32-bit counts


def _churn(policies: list[HeatPolicy], steps: int, seed: int) -> None:
    """The same random traffic for each of ``policies`` (chains, returns past and within
    the shadows and the memory window, batched touches, forgotten ids); their victims must
    agree at every step."""
    rng = np.random.default_rng(seed)
    now = 0.0
    for step in range(steps):
        now += float(rng.exponential(0.5))
        bid = int(rng.integers(0, 160))
        if bid in policies[0]:
            for p in policies:
                p.touch(bid, now)
            continue
        if len(policies[0]) >= 40:
            outs = [p.victim(now, bid) for p in policies]
            assert len(set(outs)) == 1, step
            forget = rng.random() < 0.1
            for p in policies:
                p.remove(outs[0])
                if forget:
                    p.forget(outs[0])
        parent = bid - 1 if bid % 8 and bid - 1 in policies[0] else -1
        for p in policies:
            p.insert(bid, now, parent)
        if step % 97 == 0:
            chain = np.asarray([b for b in range(160) if b in policies[0]][:24], dtype=np.int64)
            for p in policies:
                p.touch_many(chain, now)
    for p in policies[1:]:
        assert p.order().tolist() == policies[0].order().tolist()
        assert (p._count, p._p) == (policies[0]._count, policies[0]._p)


def test_counts_kept_in_32_bits_decide_as_from_zero_across_their_wraps() -> None:
    """Per-row counts are uint32 (``_seen`` and ``_gseq`` residues, ``_ins`` numbers): a
    policy whose access, eviction and insertion counts start just below their wraps (the
    residues' modulus, ``_ins``'s renumbering, an ``_age_out`` due) decides as one from 0."""
    plain = HeatPolicy(capacity_blocks=40)
    shifted = HeatPolicy(capacity_blocks=40)
    shifted._accesses = 5 * heat_module._AGE_OUT_EVERY - 700
    shifted._age_out_at = shifted._accesses + 300
    shifted._evictions = [0, SEQ_MOD - 150, 3 * SEQ_MOD - 90]
    shifted._inserts = heat_module._INS_LIMIT - 500
    _churn([plain, shifted], 3000, seed=5)
    assert shifted._inserts < 3000  # renumbered
    assert shifted._evictions[1] > SEQ_MOD and shifted._evictions[2] > 3 * SEQ_MOD


def _age_past_the_residues(policy: HeatPolicy) -> None:
    """Accesses and probation evictions past the 32-bit residues' modulus by 2 (a residue of
    the start would read back as 2), as traffic would bring them: never more than an
    ``_age_out``'s interval at a time, block 1 touched in between."""
    left = SEQ_MOD + 1
    while left:
        jump = min(left, heat_module._AGE_OUT_EVERY // 2)
        policy._accesses += jump
        policy._evictions[1] += jump
        left -= jump
        policy.touch(1, 1.0)


def test_an_access_older_than_the_residues_reach_is_forgotten_not_read_as_recent() -> None:
    """A last access (or an eviction) over ``SEQ_MOD`` counts ago would read back, modulo,
    as a recent one; ``_age_out`` forgets it long before: such a block returns in
    probation, and its shadow moves nothing, as with exact counts."""
    policy = HeatPolicy(capacity_blocks=4)
    policy.insert(0, 0.0)
    policy.insert(1, 0.0)
    policy.remove(0)  # a probation ghost, seen at access 1
    p_before = policy._p
    _age_past_the_residues(policy)
    policy.insert(0, 2.0)
    assert policy._p == p_before  # not a shadow hit
    assert policy.stats().probation == 1  # not seen lately


def test_a_kept_history_older_than_the_residues_reach_is_forgotten_not_read_as_recent() -> None:
    """As above, with the block's history kept at a memento slot meanwhile (the table
    dropped its row): the kept residues age as the rows' do, so when its key returns the
    block comes back in probation and its shadow moves nothing."""
    policy = HeatPolicy(capacity_blocks=4)
    policy.insert(0, 0.0)
    policy.insert(1, 0.0)
    policy.remove(0)  # a probation ghost, seen at access 1
    policy.remember(0, 0)
    policy.forget(0)
    p_before = policy._p
    _age_past_the_residues(policy)
    policy.revive(0, 0)
    policy.insert(0, 2.0)
    assert policy._p == p_before  # not a shadow hit
    assert policy.stats().probation == 1  # not seen lately
