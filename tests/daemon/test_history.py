"""The daemon's history of dropped blocks (``BlockTable`` mementos and the policies'
``remember``/``revive``/``expire``) against the replayer's model of it (``kvtier replay
--forget-dropped``): ids that never change, and ``forget`` delayed until ``history_factor``
times the blocks held were dropped after a block. Both must decide alike, victim for victim,
or the replayer's figures would not be the daemon's."""

from __future__ import annotations

import os
import random
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.bench.policy_memory import history_bytes, wire_history
from kvtier.daemon import table as table_module
from kvtier.daemon.policy import density as density_module
from kvtier.daemon.policy.memento import SEQ_MOD, seq_ages, seq_back, seq_keep
from kvtier.daemon.policy.registry import make_policy
from kvtier.daemon.table import READY, BlockTable, keys_to_words

_BASE = 16  # MIN_HISTORY_BASE for these tests, so that a short run forgets too


def _requests(seed: int, n: int) -> list[list[int]]:
    """Chains of key numbers: conversations that grow by a block or two a turn and return
    after a while, and one-off chains."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    fresh = iter(range(10**9))
    out = []
    for _ in range(n):
        if convs and rng.random() < 0.7:
            chain = rng.choice(convs)
            chain += [next(fresh) for _ in range(rng.randint(1, 2))]
        else:
            chain = [next(fresh) for _ in range(rng.randint(1, 5))]
            if rng.random() < 0.5:
                convs.append(chain)
        out.append(list(chain))
    return out


class _Model:
    """The replayer's way: a block's id is its key number, for good."""

    def __init__(self, policy: str, capacity: int, factor: float) -> None:
        self.policy = make_policy(policy, capacity_blocks=capacity)
        self.factor = factor
        self.history: OrderedDict[int, None] = OrderedDict()
        self.live = 0

    def access(self, key: int, parent: int, now: float, capacity: int) -> int:
        p = self.policy
        if key in p:
            p.touch(key, now)
            return -1
        self.live += 1  # the daemon adds the row before it makes room
        self.history.pop(key, None)
        victim = -1
        if len(p) >= capacity:
            victim = int(p.victims(1, now, None, (key,))[0])
            p.remove(victim)
            self.live -= 1
            self.history[victim] = None
            limit = int(self.factor * max(self.live, _BASE))
            while len(self.history) > limit:
                p.forget(self.history.popitem(last=False)[0])
        p.insert(key, now, parent if parent in p else -1)
        return victim


class _Daemon:
    """The daemon's way: rows of a block table, reused; history kept by mementos."""

    def __init__(self, policy: str, capacity: int, factor: float) -> None:
        self.policy = make_policy(policy, capacity_blocks=capacity)
        self.table = BlockTable(1, initial_capacity=16)
        self.table.history_factor = factor
        wire_history(self.table, self.policy)
        self.keys: dict[int, bytes] = {}
        self.key_of: dict[int, int] = {}  # row -> key number

    def held(self, key: int, now: float) -> tuple[np.ndarray, int]:
        """The key's words, and its row touched if it is held (-1: not held)."""
        words = keys_to_words([self.keys.setdefault(key, os.urandom(32))])
        bid = int(self.table.lookup(0, words)[0])
        if bid >= 0:
            self.policy.touch(bid, now)
        return words, bid

    def row_of(self, key: int) -> int:
        """The row of a key seen before (-1: none, or never seen)."""
        if key not in self.keys:
            return -1
        return int(self.table.lookup(0, keys_to_words([self.keys[key]]))[0])

    def access(self, key: int, parent: int, now: float, capacity: int) -> int:
        p, table = self.policy, self.table
        words, bid = self.held(key, now)
        if bid >= 0:
            return -1
        bid = table.add(0, words[0], 4096)
        table.state[bid] = READY
        self.key_of[bid] = key
        victim = -1
        if len(p) >= capacity:
            row = int(p.victims(1, now, None, (bid,))[0])
            victim = self.key_of.pop(row)
            p.remove(row)
            table.remove(row)
        p.insert(bid, now, self.row_of(parent))
        return victim


def _agree(model: _Model, daemon: _Daemon, key: int, parent: int, now: float, capacity: int) -> int:
    """One access to both; the victim each evicted for it must be the same (returned)."""
    want = model.access(key, parent, now, capacity)
    assert daemon.access(key, parent, now, capacity) == want
    return want


@pytest.mark.parametrize("policy", ["heat", "density", "arc"])
@pytest.mark.parametrize("factor", [2.0, 0.5, 0.0])
def test_the_daemons_history_decides_as_the_replayers_model(monkeypatch, policy, factor):
    monkeypatch.setattr(table_module, "MIN_HISTORY_BASE", _BASE)
    capacity = 24
    model, daemon = _Model(policy, capacity, factor), _Daemon(policy, capacity, factor)
    rng = random.Random(5)
    now = 0.0
    evictions = 0
    for chain in _requests(7, 700):
        for i, key in enumerate(chain):
            now += rng.uniform(0.01, 2.0)  # distinct times (equal ones: the ties test)
            parent = chain[i - 1] if i else -1
            want = _agree(model, daemon, key, parent, now, capacity)
            evictions += want >= 0
    assert evictions > 1000
    assert daemon.table.history_rows == len(model.history)
    if policy == "density":  # the learned statistics too
        assert list(daemon.policy.model.hits) == list(model.policy.model.hits)
        assert list(daemon.policy.model.ends) == list(model.policy.model.ends)
    else:  # heat: segments, p; arc: list sizes (its ghosts), p
        assert daemon.policy.stats() == model.policy.stats()


@pytest.mark.parametrize("policy", ["heat", "density"])
@pytest.mark.parametrize("factor", [2.0, 0.0])
def test_ties_of_same_time_requests_break_alike_in_daemon_and_model(monkeypatch, policy, factor):
    """Every block of a request is stored at the request's time, and requests share a
    millisecond, so equal keys are common (the shared Mooncake trace). Ties went to the lower
    id: the replayer's ids are first-seen order, the daemon's reused rows, so the two evicted
    different blocks (density: 4,779 hits in the daemon against the model's 5,361 at 1% of
    that trace). Both now break ties by insertion order, which both know."""
    monkeypatch.setattr(table_module, "MIN_HISTORY_BASE", _BASE)
    capacity = 24
    model, daemon = _Model(policy, capacity, factor), _Daemon(policy, capacity, factor)
    rng = random.Random(9)
    now = 0.0
    evictions = 0
    for chain in _requests(11, 400):
        if rng.random() < 0.6:
            now += rng.uniform(0.01, 2.0)  # else: the same time as the request before
        for i, key in enumerate(chain):
            parent = chain[i - 1] if i else -1
            want = _agree(model, daemon, key, parent, now, capacity)
            evictions += want >= 0
    assert evictions > 300


def _compacting(
    monkeypatch: pytest.MonkeyPatch, policy: str, capacity: int
) -> tuple[_Model, _Daemon, list[np.ndarray]]:
    """A model and a daemon with a history of 16x the blocks held, whose table compacts its
    mementos from 16 slots on; the list collects each compaction's renumbering."""
    monkeypatch.setattr(table_module, "MIN_HISTORY_BASE", _BASE)
    monkeypatch.setattr(table_module, "MIN_COMPACT_SLOTS", 16)
    model, daemon = _Model(policy, capacity, 16.0), _Daemon(policy, capacity, 16.0)
    compactions: list[np.ndarray] = []
    daemon.table.on_renumber.append(compactions.append)
    return model, daemon, compactions


@pytest.mark.parametrize("policy", ["heat", "density", "arc"])
def test_history_compacted_as_it_shrinks_decides_as_the_replayers_model(monkeypatch, policy):
    """Mementos renumbered to give back memory (``Mementos.compact``, the policies'
    ``renumber``) keep every history where it was: a history cut from 16 to 0.5 times the
    blocks held (so the table compacts) decides as the model still."""
    capacity = 24
    model, daemon, compactions = _compacting(monkeypatch, policy, capacity)
    rng = random.Random(6)
    now = 0.0
    for n, chain in enumerate(_requests(8, 700)):
        if n == 350:
            model.factor = daemon.table.history_factor = 0.5
        for i, key in enumerate(chain):
            now += rng.uniform(0.01, 2.0)
            parent = chain[i - 1] if i else -1
            _agree(model, daemon, key, parent, now, capacity)
    assert compactions and len(daemon.table.mementos.arrays()[0]) < 4 * capacity
    if policy != "arc":  # the policy's per-slot arrays came back with the table's
        assert len(daemon.policy._kept) < 4 * capacity
    assert daemon.table.history_rows == len(model.history)
    if policy == "density":
        assert list(daemon.policy.model.hits) == list(model.policy.model.hits)
        assert list(daemon.policy.model.ends) == list(model.policy.model.ends)
    else:
        assert daemon.policy.stats() == model.policy.stats()


@pytest.mark.parametrize("policy", ["heat", "density", "arc", "lru"])
def test_hinted_history_through_swinging_factors_decides_as_the_replayers_model(
    monkeypatch, policy
):
    """The history factor swings every few requests (so the table compacts its mementos
    again and again) while some resident blocks are hinted and then deleted: the daemon,
    which keeps a deleted block's history (ARC's ghost, density's open life, heat's
    segment) by memento slot, renumbered at each compaction, decides as the model that
    keeps it by key."""

    def _delete(model: _Model, key: int) -> None:
        model.policy.remove(key)
        model.live -= 1
        model.history.pop(key, None)
        model.history[key] = None
        limit = int(model.factor * max(model.live, _BASE))
        while len(model.history) > limit:
            model.policy.forget(model.history.popitem(last=False)[0])

    capacity = 24
    model, daemon, compactions = _compacting(monkeypatch, policy, capacity)
    rng = random.Random(9)
    now = 0.0
    for n, chain in enumerate(_requests(9, 600)):
        if n % 25 == 0:
            model.factor = daemon.table.history_factor = rng.choice([0.25, 0.5, 1, 4, 8, 16])
        for i, key in enumerate(chain):
            now += rng.uniform(0.01, 2.0)
            parent = chain[i - 1] if i else -1
            _agree(model, daemon, key, parent, now, capacity)
            if rng.random() < 0.04:  # a hint on a resident block, which is often deleted
                held = rng.choice(list(daemon.key_of.values()))
                until = now + rng.uniform(1.0, 100.0)
                row = daemon.row_of(held)
                model.policy.hint(np.array([held]), until, now)
                daemon.policy.hint(np.array([row]), until, now)
                if rng.random() < 0.5 and held not in chain:
                    _delete(model, held)
                    daemon.key_of.pop(row)
                    daemon.policy.remove(row)
                    daemon.table.remove(row)
    assert len(compactions) > 3
    assert daemon.table.history_rows == len(model.history)
    if policy == "density":
        assert list(daemon.policy.model.hits) == list(model.policy.model.hits)
        assert list(daemon.policy.model.ends) == list(model.policy.model.ends)
    elif policy != "lru":
        assert daemon.policy.stats() == model.policy.stats()


@pytest.mark.parametrize("policy", ["heat", "density", "arc", "lru"])
def test_a_dropped_blocks_hint_comes_back_through_a_compaction(monkeypatch, policy):
    """Hints of dropped blocks are kept by memento slot (``HintTable``, density's own): a
    compaction between the drop and the return renumbers them with the slots, so each
    returning block gets its own hint back."""
    monkeypatch.setattr(table_module, "MIN_HISTORY_BASE", 8)
    monkeypatch.setattr(table_module, "MIN_COMPACT_SLOTS", 16)
    p = make_policy(policy, capacity_blocks=1000)
    table = BlockTable(1, initial_capacity=16)
    table.history_factor = 100.0
    wire_history(table, p)
    keys = [os.urandom(32) for _ in range(400)]
    rows = table.add_many(0, keys_to_words(keys), 4096).tolist()
    for i, bid in enumerate(rows):
        p.insert(bid, float(i))
    deadlines = [1e9 + i for i in range(5)]
    for bid, until in zip(rows[-5:], deadlines, strict=True):
        p.hint(np.array([bid]), until, 500.0)
    for bid in rows:
        p.remove(bid)
        table.remove(bid)
    compactions = []
    table.on_renumber.append(compactions.append)
    table.history_factor = 1.0  # the newest 8 stay: the table compacts at the next drop
    bid = table.add(0, keys_to_words([os.urandom(32)])[0], 4096)
    p.insert(bid, 600.0)
    p.remove(bid)
    table.remove(bid)
    assert compactions and table.history_rows == 8
    back = table.add_many(0, keys_to_words(keys[-5:][::-1]), 4096).tolist()
    hints = p._hints if policy != "density" else None
    got = [hints.until(b) if hints else float(p._until[b]) for b in back]
    assert got == deadlines[::-1]


@pytest.mark.slow  # measures allocations under tracemalloc, ~7 s: `make test-slow`
def test_a_remembered_block_costs_a_few_tens_of_bytes():
    """Issue 13 bounds ghost and statistics memory at 128 bytes per resident block all in;
    at the default history factor (2) that leaves 64 per remembered block. Measured as the
    bench does (``history_bytes``), growth by doubling included."""
    blocks = 4096
    for policy in ("heat", "density"):
        extra, remembered = history_bytes(policy, blocks)
        assert remembered == 2 * blocks
        assert extra / remembered < 64, policy
        assert extra / blocks < 128, policy


def test_revived_history_is_the_dropped_blocks_own():
    """heat: a block dropped and stored again keeps its heat and returns to the protected
    segment (it was seen lately); density: its access count and open life (a reuse)."""
    for name in ("heat", "density"):
        policy = make_policy(name, capacity_blocks=4)
        table = BlockTable(1, initial_capacity=16)
        table.history_factor = 2.0
        wire_history(table, policy)
        key = keys_to_words([os.urandom(32)])[0]
        bid = table.add(0, key, 4096)
        policy.insert(bid, 1.0)
        policy.touch(bid, 2.0)
        policy.remove(bid)
        table.remove(bid)
        for other in range(3):  # the row goes to other keys meanwhile
            policy.insert(table.add(0, keys_to_words([os.urandom(32)])[0], 4096), 3.0 + other)
        again = table.add(0, key, 4096)
        assert again != bid
        if name == "heat":
            assert policy.heat.heat[again] == pytest.approx(2.0, rel=0.1)
            policy.insert(again, 2.5)
            assert policy.stats().protected == 1
        else:
            signals = policy.describe(again)
            assert signals.count == 2 and signals.open_life and not signals.resident
            hits = sum(policy.model.hits)
            policy.insert(again, 10.0)
            assert sum(policy.model.hits) == hits + 1  # its open life ended in a reuse
            assert policy.describe(again).count == 3
        assert np.all(table.resolve_many(np.array([table.ref(again)])) == again)


@pytest.mark.parametrize("name", ["heat", "density", "arc", "lru"])
def test_a_dropped_blocks_hint_holds_when_it_returns(name):
    """A hint names a block, not a row: one dropped while hinted and stored again before the
    deadline is protected as a block that was never dropped is (the replayer's ids never
    change, so its hints stay), under every policy, not only those that keep other
    history."""
    policy = make_policy(name, capacity_blocks=4)
    table = BlockTable(1, initial_capacity=16)
    table.history_factor = 2.0
    wire_history(table, policy)
    key = keys_to_words([os.urandom(32)])[0]
    bid = table.add(0, key, 4096)
    policy.insert(bid, 1.0)
    policy.hint(np.array([bid]), 100.0, 1.0)
    policy.remove(bid)
    table.remove(bid)
    again = table.add(0, key, 4096)
    policy.insert(again, 2.0)
    others = [table.add(0, keys_to_words([os.urandom(32)])[0], 4096) for _ in range(3)]
    for i, other in enumerate(others):
        policy.insert(other, 3.0 + i)
    for i, other in enumerate(others):
        policy.touch(other, 6.0 + i)
    assert policy.victims(1, 200.0, None).tolist() == [again]  # the coldest, unhinted
    assert again not in policy.victims(3, 10.0, None).tolist()
    assert policy.victims(4, 10.0, None) is None
    # A memento forgotten takes its hint with it: the key's next row is not protected.
    table.history_factor = 0.0
    policy.remove(again)
    policy.hint(np.array([again]), 100.0, 10.0)
    table.remove(again)
    fresh = table.add(0, key, 4096)
    policy.insert(fresh, 11.0)
    assert fresh in policy.victims(4, 12.0, None).tolist()


class _DecliningModel(_Model):
    """``_Model`` where the policy's own admission (density's) may decline a block: the
    replayer's ``note_miss``, and the block's history kept as a dropped block's (the daemon's
    put added a row for it and abandoned it)."""

    def access(self, key: int, parent: int, now: float, capacity: int) -> int:
        p = self.policy
        if key not in p and len(p) >= capacity:
            par = parent if parent in p else -1
            victim = int(p.victims(1, now, None, (key,))[0])
            if not p.admits(key, par, victim, now):
                p.note_miss(key, par, now)
                self.history.pop(key, None)
                if self.factor <= 0:
                    p.forget(key)
                    return -2
                self.history[key] = None
                limit = int(self.factor * max(self.live, _BASE))
                while len(self.history) > limit:
                    p.forget(self.history.popitem(last=False)[0])
                return -2
        return super().access(key, parent, now, capacity)


class _DecliningDaemon(_Daemon):
    """``_Daemon`` where the policy's own admission may decline a block: the store's put adds
    its row, asks, tells the policy of the miss and abandons the row."""

    def access(self, key: int, parent: int, now: float, capacity: int) -> int:
        p, table = self.policy, self.table
        words, bid = self.held(key, now)
        if bid >= 0:
            return -1
        prow = self.row_of(parent)
        prow = prow if prow in p else -1
        bid = table.add(0, words[0], 4096)
        table.state[bid] = READY
        victim = -1
        if len(p) >= capacity:
            row = int(p.victims(1, now, None, (bid,))[0])
            if not p.admits(bid, prow, row, now):
                p.note_miss(bid, prow, now)
                table.remove(bid)
                return -2
            victim = self.key_of.pop(row)
            p.remove(row)
            table.remove(row)
        self.key_of[bid] = key
        p.insert(bid, now, prow)
        return victim


@pytest.mark.parametrize("factor", [2.0, 0.5, 0.0])
def test_a_declined_blocks_history_is_kept_as_a_dropped_ones(monkeypatch, factor):
    """density's own admission declines blocks; the daemon remembers a declined block's key
    (its row was added, then abandoned) and the replayer models the same
    (``tests/sim/test_engine.py``): both decide alike, statistics included."""
    monkeypatch.setattr(table_module, "MIN_HISTORY_BASE", _BASE)
    capacity = 24
    model = _DecliningModel("density", capacity, factor)
    daemon = _DecliningDaemon("density", capacity, factor)
    rng = random.Random(5)
    now = 0.0
    declines = 0
    for chain in _requests(7, 700):
        for i, key in enumerate(chain):
            now += rng.uniform(0.01, 2.0)
            parent = chain[i - 1] if i else -1
            want = _agree(model, daemon, key, parent, now, capacity)
            declines += want == -2
    assert declines > 100
    assert daemon.table.history_rows == len(model.history)
    assert list(daemon.policy.model.hits) == list(model.policy.model.hits)
    assert list(daemon.policy.model.ends) == list(model.policy.model.ends)


def test_sequence_numbers_kept_in_half_width_read_back_exact_past_the_wrap():
    """Mementos keep a policy's sequence numbers as uint32 residues (``seq_keep``): read
    back against the count of the day, they are exact for any age below ``SEQ_MOD``,
    wherever the count stands, 0 staying free for "none"."""
    for count in (0, 5, SEQ_MOD - 1, SEQ_MOD, SEQ_MOD + 1, 2**40 + 7):
        for age in (0, 1, 12345, SEQ_MOD - 1):
            if age > count:
                continue
            kept = seq_keep(count - age)
            assert 0 < kept < 2**32
            assert seq_back(kept, count) == count - age
            assert seq_ages(np.array([kept], dtype=np.uint32), count).tolist() == [age]


def test_a_revived_heat_block_is_seen_lately_past_four_billion_accesses():
    """heat keeps a dropped block's last access number in 32 bits: with the policy's count
    past 2**32 it still reads back as seen lately (the block returns protected)."""
    policy = make_policy("heat", capacity_blocks=4)
    policy._accesses = 3 * 2**32 + 5
    table = BlockTable(1, initial_capacity=16)
    table.history_factor = 2.0
    wire_history(table, policy)
    key = keys_to_words([os.urandom(32)])[0]
    bid = table.add(0, key, 4096)
    policy.insert(bid, 1.0)
    policy.remove(bid)
    table.remove(bid)
    again = table.add(0, key, 4096)
    policy.insert(again, 2.0)
    assert policy.stats().protected == 1


_KEPT_FIELDS = ("_last", "_cls", "_turn", "_heat", "_depth", "_cnt", "_state")


def _row(policy, bid: int) -> tuple:
    """A density row's kept history, the eviction count only while a ghost."""
    values = tuple(getattr(policy, name + "_v")[bid] for name in _KEPT_FIELDS)
    ghost = policy._state_v[bid] == density_module._GHOST
    return (*values, policy._evseq_v[bid] if ghost else 0)


@settings(
    max_examples=30,
    deadline=None,
    # The one fixture sets the same values for every example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 40),  # key
            st.sampled_from([None, 0.0, 0.5, 1.0, 4.0, 16.0]),  # a new history factor
            st.sampled_from([None, "depth", "cnt", "both", "at"]),  # capped values poked
        ),
        min_size=150,
        max_size=400,
    )
)
def test_density_history_through_caps_and_compactions_is_the_models(monkeypatch, steps):
    """Hypothesis drives the daemon's density history (table mementos, ``remember`` /
    ``revive`` / ``expire`` / ``renumber``, compacting from 16 slots) and the replayer's model
    (ids for good, ``forget`` oldest first) through accesses, swinging history factors and
    depths and counts at or past the kept fields' caps (``_KEPT_CAPPED``): every decision
    agrees, every returning row's history is the model's, and the values kept past the caps
    are only those of held mementos."""
    monkeypatch.setattr(table_module, "MIN_HISTORY_BASE", _BASE)
    monkeypatch.setattr(table_module, "MIN_COMPACT_SLOTS", 16)
    capacity = 6
    model, daemon = _Model("density", capacity, 2.0), _Daemon("density", capacity, 2.0)
    caps = density_module._KEPT_CAPPED
    now = 0.0
    for key, factor, poke in steps:
        if factor is not None:
            model.factor = daemon.table.history_factor = factor
        now += 0.5
        _agree(model, daemon, key, key - 1 if key % 3 else -1, now, capacity)
        bid = daemon.row_of(key)
        assert _row(daemon.policy, bid) == _row(model.policy, key)
        if poke is not None:
            depth = caps["_depth"] + (0 if poke == "at" else 5000)
            count = caps["_cnt"] + (0 if poke == "at" else 700)
            for p, i in ((daemon.policy, bid), (model.policy, key)):
                if poke != "cnt":
                    p._depth_v[i] = depth
                if poke != "depth":
                    p._cnt_v[i] = count
        held = daemon.table.history_rows
        assert held == len(model.history)
        mementos = daemon.table.mementos
        held_slots = set(np.flatnonzero(mementos.arrays()[0][: mementos._top]).tolist())
        for name, cap in caps.items():
            big = daemon.policy._kept_big[name]
            assert set(big) <= held_slots  # none left behind by a slot let go
            past = [k for k in model.history if getattr(model.policy, name + "_v")[k] >= cap]
            assert len(big) == len(past)
    assert list(daemon.policy.model.ends) == list(model.policy.model.ends)
    assert list(daemon.policy.model.hits) == list(model.policy.model.hits)
