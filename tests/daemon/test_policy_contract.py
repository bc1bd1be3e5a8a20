"""The eviction-policy contract, run against every registered policy."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from heat_state import assert_same_state

from kvtier.daemon.errors import ConfigError
from kvtier.daemon.policy import registry
from kvtier.daemon.policy.base import DECLINED, NO_VICTIM, InsertEach
from kvtier.daemon.policy.hints import Hinted
from kvtier.daemon.policy.lru import LRUPolicy
from kvtier.daemon.policy.registry import make_policy, policy_names, register_policy


def build(name: str, capacity: int = 8):
    # opt needs the future; give it a fixed one (farther for larger ids).
    return make_policy(name, capacity_blocks=capacity, next_use=lambda b: float(b))


@pytest.fixture(params=policy_names())
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def fill(policy, n: int) -> None:
    for bid in range(n):
        policy.insert(bid, float(bid), bid - 1 if bid % 3 else -1)


def test_registry_knows_the_builtin_policies() -> None:
    assert {"heat", "lru", "arc", "opt", "density"} <= set(policy_names())
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_regression_a_plugin_policy_without_the_owed_work_members_was_built(monkeypatch) -> None:
    """``on_owed`` and ``work`` were optional until the space called them on every policy
    (d2c96ec): a policy registered as written before (here lru's body without
    ``OwesNoWork``) was built, and the daemon would fail only once another tier's policy
    owed work, in ``work()`` between requests. It is refused as it is built, the members
    named; a policy with the whole protocol is built as before."""
    monkeypatch.setattr(registry, "_ADDED", {})
    body = {k: v for k, v in vars(LRUPolicy).items() if k not in ("__dict__", "__weakref__")}
    register_policy("old-lru", type("OldLRU", (InsertEach, Hinted), body))
    register_policy("new-lru", LRUPolicy)
    with pytest.raises(ConfigError, match=r"policy 'old-lru' lacks on_owed, work of the Evic"):
        make_policy("old-lru")
    assert isinstance(make_policy("new-lru"), LRUPolicy)


# kvtierd with a plugin policy registered as written before on_owed and work were members.
_ENTRY_WITH_AN_OLD_PLUGIN = """
import sys
from kvtier.daemon.main import main
from kvtier.daemon.policy.base import InsertEach
from kvtier.daemon.policy.hints import Hinted
from kvtier.daemon.policy.lru import LRUPolicy
from kvtier.daemon.policy.registry import register_policy

body = {k: v for k, v in vars(LRUPolicy).items() if k not in ("__dict__", "__weakref__")}
register_policy("old-lru", type("OldLRU", (InsertEach, Hinted), body))
sys.exit(main(sys.argv[1:]))
"""


def test_regression_a_daemon_given_a_policy_lacking_members_ended_in_a_traceback(tmp_path):
    """make_policy's refusal of such a policy (above) came out of kvtierd's start as a
    TypeError's traceback, exit status 1 (a start that may pass when tried again): it is the
    config error it is, told in one line with status 2, as an unknown policy name is."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _ENTRY_WITH_AN_OLD_PLUGIN,
            *("--set", f"server.socket={tmp_path / 'd.sock'}"),
            *("--set", "tiers.l1.capacity_bytes=64MiB"),
            *("--set", "policy.name=old-lru"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "config error: policy 'old-lru' lacks on_owed, work of the" in r.stderr, r.stderr


def test_unknown_parameters_are_ignored(name: str) -> None:
    policy = make_policy(name, capacity_blocks=4, next_use=lambda b: 0.0, colour="blue")
    policy.insert(1, 0.0)
    assert 1 in policy and len(policy) == 1


def test_victims_is_atomic_when_too_few_are_evictable(name: str) -> None:
    policy = build(name)
    fill(policy, 6)
    only_two = lambda bids: bids < 2  # noqa: E731
    assert policy.victims(3, 10.0, only_two) is None
    assert policy.victims(7, 10.0, None) is None
    # Nothing changed: the same question gets the same answer, and all blocks are there.
    first = policy.victims(2, 10.0, only_two)
    assert first is not None and sorted(first.tolist()) == [0, 1]
    assert np.array_equal(policy.victims(2, 10.0, only_two), first)
    assert len(policy) == 6 and all(b in policy for b in range(6))


def test_victims_changes_no_later_decision(name: str) -> None:
    a, b = build(name, 4), build(name, 4)
    for p in (a, b):
        fill(p, 4)
    a.victims(3, 5.0, lambda bids: bids % 2 == 0)
    a.victims(1, 5.0, None, incoming=(9,))
    for p in (a, b):
        p.touch(2, 6.0)
        v = p.victims(1, 7.0, None, incoming=(10,))
        assert v is not None
        p.remove(int(v[0]))
        p.insert(10, 7.0)
    assert a.victims(3, 8.0, None).tolist() == b.victims(3, 8.0, None).tolist()


def test_victims_respects_the_mask(name: str) -> None:
    policy = build(name)
    fill(policy, 8)
    odd = policy.victims(4, 10.0, lambda bids: bids % 2 == 1)
    assert odd is not None and sorted(odd.tolist()) == [1, 3, 5, 7]
    assert len(policy.victims(0, 10.0, None)) == 0


def test_remove_unknown_raises_and_forget_unknown_is_quiet(name: str) -> None:
    policy = build(name)
    fill(policy, 2)
    with pytest.raises(KeyError):
        policy.remove(5)
    policy.forget(5)
    policy.forget(10**6)
    policy.remove(1)
    assert 1 not in policy and len(policy) == 1


def test_ids_can_be_reused(name: str) -> None:
    policy = build(name, 4)
    fill(policy, 4)
    policy.remove(2)
    policy.forget(2)
    policy.insert(2, 20.0, parent=3)
    assert 2 in policy and len(policy) == 4
    v = policy.victims(4, 21.0, None)
    assert v is not None and sorted(v.tolist()) == [0, 1, 2, 3]
    assert not math.isnan(float(v[0]))


@pytest.mark.parametrize("name", ["heat", "lru", "arc", "density"])
def test_store_like_use_with_reused_ids_and_protection(name: str) -> None:
    """The live store's pattern: batches of chained puts, eviction of a deficit under the
    guard's mask, ids freed (LIFO) and reused, forget() on free."""
    from kvtier.daemon.policy.guard import EvictionGuard

    rng = np.random.default_rng(5)
    capacity = 64
    policy = make_policy(name)  # the store passes no parameters
    guard = EvictionGuard(protect_s=1.0)
    last = np.full(1024, -np.inf)
    pins = np.zeros(1024, dtype=np.int32)
    inflight = np.zeros(1024, dtype=np.int16)
    free = list(range(1023, -1, -1))
    resident: set[int] = set()
    now = 0.0
    for _ in range(400):
        now += float(rng.exponential(0.2))
        pins[:] = 0
        if resident:
            pinned = rng.choice(sorted(resident), size=min(3, len(resident)), replace=False)
            pins[pinned] = 1
        batch = int(rng.integers(1, 12))
        deficit = len(resident) + batch - capacity
        if deficit > 0:
            mask = guard.evictable_fn(now, last, pins, inflight)
            victims = policy.victims(deficit, now, mask)
            if victims is None:
                ok = [b for b in resident if mask(np.array([b]))[0]]
                assert len(ok) < deficit
                continue
            got = victims.tolist()
            assert len(set(got)) == deficit and set(got) <= resident
            assert mask(victims).all()
            for bid in got:
                policy.remove(bid)
                policy.forget(bid)
                resident.discard(bid)
                free.append(bid)
        parent = -1
        for _ in range(batch):
            bid = free.pop()
            policy.insert(bid, now, parent)
            last[bid] = now
            resident.add(bid)
            parent = bid
        for bid in rng.choice(sorted(resident), size=min(5, len(resident)), replace=False):
            policy.touch(int(bid), now)
            last[bid] = now
        assert len(policy) == len(resident)


def test_touch_many_is_all_or_nothing(name: str) -> None:
    a, b = build(name), build(name)
    for p in (a, b):
        fill(p, 6)
        p.remove(4)
    with pytest.raises(KeyError) as info:
        a.touch_many(np.array([0, 1, 4, 2, 99]), 7.0)
    assert info.value.args == (4,)  # the first unknown id, in order
    a.touch_many(np.array([], dtype=np.int64), 7.0)
    assert a.victims(5, 8.0, None).tolist() == b.victims(5, 8.0, None).tolist()


def test_every_policy_takes_the_owed_work_hook(name: str) -> None:
    """The store sets every policy's ``on_owed`` and calls its ``work`` (see "Owed work" in
    ``kvtier.daemon.policy.base``); it found both by ``hasattr``/``getattr``, as heat's
    alone. A policy owing nothing answers ``work`` False and never calls the hook."""
    policy, called = build(name), []
    assert policy.on_owed is None  # nobody asks until the owner sets it
    policy.on_owed = lambda: called.append(1)
    fill(policy, 6)
    policy.touch_many(np.array([0, 1, 2, 3, 4, 5]), 7.0)
    assert policy.work() is False and not called
    assert policy.victims(2, 8.0, None) is not None


def test_insert_many_equals_inserting_in_order(name: str) -> None:
    """A batch of new blocks (a chain, a second chain under a resident parent, one block
    coming back) leaves the policy deciding as a loop of ``insert`` would."""
    a, b = build(name), build(name)
    for p in (a, b):
        fill(p, 6)
        p.remove(2)
    ids = np.array([*range(10, 40), 2, *range(40, 60)], dtype=np.int64)
    parents = np.array([-1, *range(10, 39), 5, 2, *range(40, 59)], dtype=np.int64)
    a.insert_many(ids, 9.0, parents)
    for bid, parent in zip(ids.tolist(), parents.tolist(), strict=True):
        b.insert(bid, 9.0, parent)
    assert len(a) == len(b) == 56
    for k in (1, 7, 28, 56):
        assert a.victims(k, 10.0, None).tolist() == b.victims(k, 10.0, None).tolist()


def _state(policy: object) -> object:
    """Everything a policy decides with, for the policies without numpy state."""
    names = ("_order", "_t1", "_t2", "_b1", "_b2", "_p", "_ghosted", "_high_water", "_next")
    return {
        n: list(v) if hasattr(v, "move_to_end") else v
        for n in names
        if (v := getattr(policy, n, None)) is not None
    }


@pytest.mark.parametrize("name", ["lru", "arc", "opt", "density"])
def test_touch_many_equals_touch_in_order(name: str) -> None:
    """Random inserts, removes, forgets and touch batches (chains, repeats, any order);
    after each step the same state and the same victims as a loop of touch."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        vec, ref = build(name, 16), build(name, 16)
        resident: list[int] = []
        now = 0.0
        for _ in range(200):
            now += float(rng.exponential(1.0))
            op = rng.random()
            if op < 0.35 or len(resident) < 2:
                bid = int(rng.integers(0, 40))
                if bid not in ref:
                    if len(resident) >= 16:
                        v = ref.victims(1, now, None, incoming=(bid,))
                        assert v is not None
                        assert vec.victims(1, now, None, incoming=(bid,)).tolist() == v.tolist()
                        for p in (vec, ref):
                            p.remove(int(v[0]))
                        resident.remove(int(v[0]))
                    for p in (vec, ref):
                        p.insert(bid, now, bid - 1)
                    resident.append(bid)
            elif op < 0.45:
                bid = resident.pop(int(rng.integers(0, len(resident))))
                for p in (vec, ref):
                    p.remove(bid)
                    p.forget(bid)
            else:
                repeats = bool(rng.random() < 0.3)
                size = int(rng.integers(0, (2 if repeats else 1) * len(resident) + 1))
                batch = rng.choice(resident, size=size, replace=repeats)
                if rng.random() < 0.3:
                    batch = np.sort(batch)  # a chain, root first
                vec.touch_many(batch, now)
                for bid in batch.tolist():
                    ref.touch(bid, now)
            assert _state(vec) == _state(ref)
            mask = lambda b: b % 3 != 1  # noqa: E731
            for k in (1, len(resident) // 2, len(resident)):
                for m in (None, mask):
                    x, y = vec.victims(k, now, m), ref.victims(k, now, m)
                    assert (x is None and y is None) or x.tolist() == y.tolist()


def test_hints_protect_exactly_until_their_deadline(name: str) -> None:
    """A hinted block is never proposed while ``now <= until``, whatever its rank; it may be
    once the deadline has passed. A hint given before the block arrives holds once it does;
    ``forget`` drops it with the id."""
    policy = build(name)
    for bid in range(6):  # no chains: what a hint does to a block's ancestors is the policy's
        policy.insert(bid, float(bid))
    everything = policy.victims(6, 10.0, None)
    assert everything is not None
    hinted = [int(everything[0]), int(everything[3])]
    policy.hint(np.array([*hinted, 40]), 20.0, 10.0)
    for now in (10.0, 15.0, 20.0):
        got = policy.victims(4, now, None)
        assert got is not None and not set(got.tolist()) & set(hinted), now
        assert policy.victims(5, now, None) is None
    later = math.nextafter(20.0, math.inf)
    assert sorted(policy.victims(6, later, None).tolist()) == list(range(6))
    # Not resident when hinted: protected once inserted, until the deadline.
    policy.remove(int(everything[1]))
    policy.insert(40, 12.0, -1)
    got = policy.victims(3, 19.0, None)
    assert got is not None and not set(got.tolist()) & {*hinted, 40}
    assert policy.victims(4, 19.0, None) is None
    assert 40 in policy.victims(6, 21.0, None).tolist()
    # A later hint keeps the later deadline.
    policy.hint(np.array([hinted[0]]), 30.0, 21.0)
    policy.hint(np.array([hinted[0]]), 25.0, 21.0)
    assert hinted[0] not in policy.victims(5, 28.0, None).tolist()
    # forget drops the hint with the id: the next block on it is not protected.
    policy.remove(40)
    policy.forget(40)
    policy.hint(np.array([40]), 50.0, 30.0)
    policy.forget(40)
    policy.insert(40, 31.0, -1)
    assert 40 in policy.victims(6, 32.0, None).tolist()


def test_unhinted_masks_exactly_the_blocks_hints_protect(name: str) -> None:
    """``unhinted(mask, now)`` (for the store's segment reclaim, which frees blocks without
    asking ``victims``) refuses a block while a hint protects it, and then defers to
    ``mask``."""
    policy = build(name)
    for bid in range(6):
        policy.insert(bid, float(bid))
    ids = np.arange(6)
    assert policy.unhinted(lambda b: np.ones(len(b), bool), 10.0)(ids).all()
    policy.hint(np.array([1, 4]), 20.0, 10.0)
    odd_only = policy.unhinted(lambda b: np.asarray(b) % 2 == 1, 15.0)
    assert odd_only(ids).tolist() == [False, False, False, True, False, True]
    later = policy.unhinted(lambda b: np.ones(len(b), bool), math.nextafter(20.0, math.inf))
    assert later(ids).all()


@pytest.mark.parametrize("name", ["heat", "density"])
def test_one_victim_answers_as_victims_does(name: str) -> None:
    """``victim(now, incoming)`` (the replayer's per-miss call; the other policies are asked
    through ``victims``) names the block ``victims(1, now, None, (incoming,))`` would, -1 for
    None, through misses, returning ghosts, reuse of ids, and a live hint."""
    rng = np.random.default_rng(7)
    a, b = build(name, capacity=32), build(name, capacity=32)
    one = a.victim
    resident: list[int] = []
    now = 0.0
    for step in range(3000):
        now += float(rng.exponential(0.5))
        if step == 1500:
            for p in (a, b):
                p.hint(np.array(resident[:4], dtype=np.int64), now + 20.0, now)
        bid = int(rng.integers(0, 120))
        if bid in resident:
            a.touch(bid, now)
            b.touch(bid, now)
            continue
        parent = bid - 1 if bid % 4 and bid - 1 in resident else -1
        if len(resident) >= 32:
            got = one(now, bid)
            found = b.victims(1, now, None, (bid,))
            assert got == (-1 if found is None else int(found[0])), step
            if got < 0:
                continue
            for p in (a, b):
                p.remove(got)
                if step % 5 == 0:
                    p.forget(got)  # the id may be reused for another block
            resident.remove(got)
        for p in (a, b):
            p.insert(bid, now, parent)
        resident.append(bid)
    assert len(a) == len(b) == 32


@pytest.mark.parametrize("name", ["heat", "density"])
def test_replace_answers_and_acts_as_its_steps(name: str) -> None:
    """``replace(bid, parent, now)`` (a full tier's miss in one call) returns what
    ``victim``, then the policy's own ``admits`` where it has one, would decide (the victim,
    ``NO_VICTIM`` or ``DECLINED``) and leaves the policy as ``remove`` plus ``insert``, or
    ``note_miss``, would: through declines, returning ghosts, reuse of ids, chains, live
    hints (one on every block) and density tables rebuilt along the way."""
    rng = np.random.default_rng(11)
    a, b = build(name, capacity=32), build(name, capacity=32)
    admits = getattr(b, "admits", None)
    note_miss = getattr(b, "note_miss", lambda *_: None)
    resident: list[int] = []
    outcomes: set[int] = set()
    now = 0.0
    for step in range(4000):
        now += float(rng.exponential(0.5))
        if step in (2000, 3000):
            # At 3000 every resident block, for a while: no victim at all.
            hinted = resident[:6] if step == 2000 else resident
            for p in (a, b):
                p.hint(np.array(hinted, dtype=np.int64), now + 30.0, now)
        # A hot set seen again and again, moving on every 1,000 steps, and a wider scan:
        # both of heat's segments fill, its target moves both ways, protection runs out.
        hot = 40 * (step // 1000)
        bid = hot + int(rng.integers(0, 40)) if rng.random() < 0.6 else int(rng.integers(0, 300))
        if bid in resident:
            a.touch(bid, now)
            b.touch(bid, now)
            continue
        parent = bid - 1 if bid % 4 and bid - 1 in resident else -1
        if len(resident) < 32:
            for p in (a, b):
                p.insert(bid, now, parent)
            resident.append(bid)
            continue
        got = a.replace(bid, parent, now)
        out = b.victim(now, bid)
        if out < 0:
            note_miss(bid, parent, now)
            want = NO_VICTIM
        elif admits is not None and not admits(bid, parent, out, now):
            note_miss(bid, parent, now)
            want = DECLINED
        else:
            b.remove(out)
            b.insert(bid, now, parent)
            want = out
        assert got == want, step
        outcomes.add(min(got, 0))
        if got >= 0:
            resident.remove(got)
            resident.append(bid)
            if step % 7 == 0:
                for p in (a, b):
                    p.forget(got)  # the id may be reused for another block
    # Every kind of answer was exercised.
    assert outcomes == ({0, NO_VICTIM, DECLINED} if admits is not None else {0, NO_VICTIM})
    assert len(a) == len(b) == 32
    assert a.victims(32, now, None).tolist() == b.victims(32, now, None).tolist()
    if name == "heat":
        assert_same_state(a, b)
    else:
        assert np.array_equal(a.table, b.table)
