from __future__ import annotations

import os
import random
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.daemon import table as table_module
from kvtier.daemon.counts import add_at
from kvtier.daemon.policy.memento import Kept, renumbered
from kvtier.daemon.table import (
    MIN_COMPACT_SLOTS,
    MIN_HISTORY_BASE,
    READY,
    BlockTable,
    Mementos,
    keys_to_words,
    slots_for,
)


def _ready(index: BlockTable, ns: int, key: bytes) -> int:
    bid = index.add(ns, keys_to_words([key])[0], 4096)
    index.state[bid] = READY
    return bid


def test_matches_a_dict_through_inserts_removes_and_growth():
    index = BlockTable(initial_capacity=16)
    ref: dict[tuple[int, bytes], int] = {}
    rng = random.Random(0)
    keys = [os.urandom(32) for _ in range(3000)]
    for step in range(12000):
        key, ns = rng.choice(keys), rng.randint(0, 2)
        if (ns, key) in ref and rng.random() < 0.5:
            index.remove(ref.pop((ns, key)))
        elif (ns, key) not in ref:
            ref[(ns, key)] = _ready(index, ns, key)
        if step % 3000 == 0 or step == 11999:
            for n in range(3):
                got = index.lookup(n, keys_to_words(keys))
                assert got.tolist() == [ref.get((n, k), -1) for k in keys]
    assert len(index) == len(ref)
    want: dict[int, int] = {}
    for ns, _ in ref:
        want[ns] = want.get(ns, 0) + 1
    assert index.ns_blocks == want


def test_live_blocks_are_counted_per_namespace_by_every_add_and_remove():
    index = BlockTable(initial_capacity=16)
    words = keys_to_words([os.urandom(32) for _ in range(41)])
    one = index.add(7, words[0], 4096)
    scalar = index.add_many(7, words[1:21], 4096)  # one namespace for the batch
    mixed = index.add_many(np.array([7, 9] * 10, dtype=np.uint64), words[21:41], 4096)
    assert index.ns_blocks == {7: 31, 9: 10}
    for bid in [one, *scalar.tolist(), *mixed[1::2].tolist()]:
        index.remove(bid)
    assert index.ns_blocks == {7: 10}  # an emptied namespace is not listed
    for bid in mixed[::2].tolist():
        index.remove(bid)
    assert index.ns_blocks == {}


def test_namespaces_are_separate():
    index = BlockTable()
    key = os.urandom(32)
    bid = _ready(index, 1, key)
    assert index.lookup(1, keys_to_words([key])).tolist() == [bid]
    assert index.lookup(2, keys_to_words([key])).tolist() == [-1]


def test_blocks_being_written_are_invisible_to_lookup():
    index = BlockTable()
    key = os.urandom(32)
    bid = index.add(0, keys_to_words([key])[0], 4096)
    assert index.lookup(0, keys_to_words([key])).tolist() == [-1]
    assert index.find_any(0, keys_to_words([key])).tolist() == [bid]


def test_in_flight_marks_count_past_int16_and_survive_growth():
    """Overlapping reads of one block each mark it in flight; 40,000 of them (more than an
    int16 holds) must leave it in flight, not wrapped negative and so evictable."""
    index = BlockTable(initial_capacity=16)
    bid = _ready(index, 0, os.urandom(32))
    add_at(index.inflight, np.full(40_000, bid, dtype=np.int64), 1)
    for _ in range(64):  # the per-block arrays are reallocated as the table grows
        _ready(index, 0, os.urandom(32))
    assert int(index.inflight[bid]) == 40_000
    add_at(index.inflight, np.full(40_000, bid, dtype=np.int64), -1)
    assert int(index.inflight[bid]) == 0


def test_ids_are_reused_and_stay_dense():
    index = BlockTable()
    a = _ready(index, 0, os.urandom(32))
    index.remove(a)
    b = _ready(index, 0, os.urandom(32))
    assert b == a
    with pytest.raises(KeyError):
        index.remove(_ready(index, 0, os.urandom(32)) + 1)


def test_colliding_first_words_are_told_apart():
    """Keys equal in their first 8 bytes that land on one probe chain: the full key decides."""
    index = BlockTable()
    mask = np.uint64(len(index._table) - 1)
    prefix = os.urandom(8)
    pool = keys_to_words([prefix + os.urandom(24) for _ in range(200_000)])
    home = index._hash(0, pool) & mask
    same = pool[home == home[0]][:50]
    assert len(same) >= 20
    keys = [w.tobytes() for w in same]
    ids = [_ready(index, 0, k) for k in keys]
    assert index.lookup(0, keys_to_words(keys)).tolist() == ids
    assert index.lookup(0, keys_to_words([prefix + bytes(24)])).tolist() == [-1]


def test_regression_keys_sharing_their_first_word_shared_one_probe_chain():
    """The table hashed a key's first 8 bytes only, so every key a client gave one first word
    went to one probe chain, whatever the salt: with 16,000 such keys a Put took 38 s on the
    event loop (every other client waited as long) and grew quadratically. Every word of a
    key is hashed now: such keys spread over the table like any others."""
    index = BlockTable(initial_capacity=4096)
    prefix = os.urandom(8)
    keys = [prefix + os.urandom(24) for _ in range(2000)]
    ids = [_ready(index, 0, k) for k in keys]
    assert index.lookup(0, keys_to_words(keys)).tolist() == ids
    # The longest run of occupied slots, which a probe may have to walk (the table wraps).
    held = np.concatenate([index._table, index._table]) >= 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], held.astype(np.int8), [0]])))
    assert (edges[1::2] - edges[::2]).max() < 200


def test_probe_chains_longer_than_the_batch_windows_are_followed_to_their_end():
    """Keys that hash to one slot make one long chain: a batch lookup finds each, past
    tombstones, and misses absent keys of the same chain, in every namespace."""
    index = BlockTable(initial_capacity=1024)
    mask = np.uint64(len(index._table) - 1)
    pool = keys_to_words([os.urandom(32) for _ in range(300_000)])
    same = pool[(index._hash(0, pool) & mask) == (index._hash(0, pool[:1]) & mask)]
    assert len(same) >= 60
    present, absent = same[:40], same[40:60]
    ids = []
    for w in present:
        ids.append(index.add(0, w, 4096))
        index.state[ids[-1]] = READY
    assert len(index._table) - 1 == mask  # no rehash: the chain stayed one run of slots
    for gone in (3, 17, 30):
        index.remove(ids[gone])
        ids[gone] = -1
    batch = np.concatenate([present, absent])
    assert index.lookup(0, batch).tolist() == ids + [-1] * 20
    assert index.lookup(0, batch[::-1]).tolist() == (ids + [-1] * 20)[::-1]
    assert index.lookup(1, batch).tolist() == [-1] * 60
    # A few keys left deep in the chain once the others stopped: probed one by one from
    # where the windows ended, the first of them right there.
    few = [*range(9), *range(20, 25)]
    batch = np.concatenate([present[few], absent[:2]])
    assert index.lookup(0, batch).tolist() == [ids[i] for i in few] + [-1, -1]


def test_bad_key_lengths():
    with pytest.raises(ValueError, match="key 1 has 31 bytes"):
        keys_to_words([bytes(32), bytes(31)])
    assert keys_to_words([]).shape == (0, 4)


def test_memory_per_block_is_small():
    index = BlockTable(initial_capacity=50_000)
    words = np.frombuffer(os.urandom(32 * 50_000), dtype=np.uint64).reshape(-1, 4)
    for w in words:
        index.add(0, w, 1)
    assert index.stats().nbytes / len(index) < 128


def test_add_many_matches_add_one_by_one():
    one, many = BlockTable(initial_capacity=16), BlockTable(initial_capacity=16)
    keys = [os.urandom(32) for _ in range(5000)]
    words = keys_to_words(keys)
    for w in words[:100]:
        one.add(3, w, 4096)
        many.add(3, w, 4096)
    one.remove(7)
    many.remove(7)
    for w in words[100:]:
        one.add(3, w, 8192)
    bids = many.add_many(np.full(4900, 3), words[100:], np.full(4900, 8192))
    assert len(set(bids.tolist())) == 4900 and 7 in bids.tolist()
    one.state[one.live_ids()] = READY
    many.state[many.live_ids()] = READY
    got = many.lookup(3, words)
    assert got[7] == -1 and one.lookup(3, words)[7] == -1  # removed from both
    got[7] = 0
    words = words.copy()
    words[7] = many.keys[0]
    assert (many.keys[got] == words).all() and (many.nbytes[got[100:]] == 8192).all()
    assert len(many) == len(one) == 4999


def test_regression_a_single_add_that_grew_the_hash_table_entered_its_block_twice():
    """``add`` rebuilt the hash table from every live row (its own new row among them) and
    then inserted the new block again: two entries for one block. Removing it left the
    second, so ``find_any`` (a put's view) still found the deleted key, in a freed row."""
    table = BlockTable(initial_capacity=16)  # 32 slots: the 17th key rebuilds them
    words = keys_to_words([os.urandom(32) for _ in range(17)])
    bids = [table.add(0, w, 4096) for w in words]
    table.state[bids] = READY
    assert table.find_any(0, words).tolist() == bids
    for bid in bids:
        table.remove(bid)
    assert table.find_any(0, words).tolist() == [-1] * 17
    assert len(table) == 0


def test_a_ref_outlives_the_reuse_of_its_row():
    table = BlockTable()
    bid = _ready(table, 0, os.urandom(32))
    ref = table.ref(bid)
    assert table.resolve(ref) == bid
    forgotten = []
    table.on_free.append(forgotten.append)
    table.remove(bid)
    assert forgotten == [bid]
    again = _ready(table, 0, os.urandom(32))
    assert again == bid  # the row is reused...
    assert table.resolve(ref) == -1  # ...but the old ref does not name the new block
    assert table.resolve(table.ref(again)) == again


def test_batches_of_adds_and_removes_match_a_dict():
    table = BlockTable(initial_capacity=16)
    ref: dict[bytes, int] = {}
    rng = random.Random(1)
    keys = [os.urandom(32) for _ in range(4000)]
    for step in range(300):
        absent = [k for k in rng.sample(keys, 40) if k not in ref]
        absent = list(dict.fromkeys(absent))
        if absent:
            bids = table.add_many(5, keys_to_words(absent), 4096)
            table.state[bids] = READY
            ref.update(zip(absent, bids.tolist(), strict=True))
        for k in rng.sample(sorted(ref, key=lambda x: x), min(len(ref), rng.randint(0, 30))):
            table.remove(ref.pop(k))
        if step % 50 == 0:
            got = table.lookup(5, keys_to_words(keys))
            assert got.tolist() == [ref.get(k, -1) for k in keys]
    assert len(table) == len(ref)


@pytest.mark.parametrize("n", [1, 8, 9, 100])
def test_blocks_being_written_are_absent_to_lookup_at_every_batch_size(n):
    # Batches of up to _SCALAR_TAIL keys take the one-by-one path, larger ones the windows.
    index = BlockTable()
    keys = [os.urandom(32) for _ in range(n)]
    words = keys_to_words(keys)
    bids = [index.add(0, w, 4096) for w in words]
    ready = [i for i in range(n) if i % 2 == 0]
    index.state[[bids[i] for i in ready]] = READY
    want = [bids[i] if i in ready else -1 for i in range(n)]
    assert index.lookup(0, words).tolist() == want
    assert index.find_any(0, words).tolist() == bids  # still found by the writers' view
    assert index.lookup(1, words).tolist() == [-1] * n


def test_block_identities_cover_namespace_and_every_key_word():
    """``identities`` (what admission sketches and the miss and prefetch ledgers key on) tells
    apart the same key in two namespaces and keys differing in any one word; the per-key path
    of small batches and the vectorised one agree, and a block's identity is its key's."""
    table = BlockTable()
    words = keys_to_words([os.urandom(32) for _ in range(40)])
    variants = [words]
    for w in range(4):
        v = words.copy()
        v[:, w] ^= np.uint64(1 << 40)
        variants.append(v)
    ids = [table.identities(ns, v) for v in variants for ns in (0, 1)]
    flat = [i for batch in ids for i in batch]
    assert len(set(flat)) == len(flat) == 400
    small = [i for start in range(0, 40, 8) for i in table.identities(1, words[start : start + 8])]
    assert small == table.identities(1, words)
    bids = np.array([_ready(table, 1, words[i].tobytes()) for i in range(40)])
    assert table.identities_of(bids) == table.identities(1, words)
    assert table.identities_of(bids[:3]) == table.identities(1, words[:3])


class _NotIterable(np.ndarray):
    """Key words that refuse to be iterated: a Python loop over an array ends in an
    IndexError raised and caught inside numpy, dearer than hashing one key."""

    def __iter__(self):
        raise AssertionError("the keys were iterated, not indexed")


@pytest.mark.parametrize("n", [1, 8])
def test_a_small_lookup_reads_its_keys_by_index(n):
    """The per-key path of ``lookup_identified`` and ``identities`` (a single-key Lookup's)
    indexes its keys; iterating them cost a caught IndexError per request."""
    table = BlockTable()
    words = keys_to_words([os.urandom(32) for _ in range(n)])
    _ready(table, 3, words[0].tobytes())
    ids, hashes = table.lookup_identified(3, words.view(_NotIterable))
    assert ids.tolist() == table.lookup(3, words).tolist()
    assert hashes == table.identities(3, words.view(_NotIterable)) == table.identities(3, words)


@pytest.mark.parametrize("n", [1, 8, 9, 100])
def test_a_lookup_hands_back_the_identities_of_its_keys(n):
    """``lookup_identified`` answers ``lookup`` and, from its own probe's hashes, the keys'
    ``identities`` (the miss ledger's keys), on the per-key path and the vectorised one;
    ``identity`` of one key, which ``find_one`` and ``add`` take, is the same."""
    table = BlockTable()
    words = keys_to_words([os.urandom(32) for _ in range(n)])
    for i in range(0, n, 2):
        _ready(table, 3, words[i].tobytes())
    ids, hashes = table.lookup_identified(3, words)
    assert ids.tolist() == table.lookup(3, words).tolist()
    assert table.identities_where(hashes, np.ones(n, dtype=bool)) == table.identities(3, words)
    missing = ids < 0
    assert table.identities_where(hashes, missing) == table.identities(3, words[missing])
    assert [table.identity(3, w) for w in words] == table.identities(3, words)
    assert [table.find_one(3, w, table.identity(3, w)) for w in words] == ids.tolist()
    # Added again with its identity given, a removed key is found at its place (the row is
    # the same only because freed rows are reused last in, first out).
    table.remove(int(ids[0]))
    assert table.add(3, words[0], 4096, identity=table.identity(3, words[0])) == ids[0]
    assert table.find_one(3, words[0]) == ids[0]


def test_depths_count_live_ancestors_whatever_the_rows_order():
    """The flush at stop writes parents first by these depths: rows are reused, so a child
    can sit in a lower row than its parent."""
    index = BlockTable(initial_capacity=16)
    spare = [_ready(index, 0, os.urandom(32)) for _ in range(3)]
    for bid in spare:
        index.remove(bid)  # rows 0-2 free: the next adds reuse them, last freed first
    root = _ready(index, 0, os.urandom(32))
    chain = [root]
    for _ in range(40):  # longer than a few doublings
        child = _ready(index, 0, os.urandom(32))
        index.link(child, chain[-1])
        chain.append(child)
    assert chain[1] < chain[0]  # a child in a lower row than its parent
    alone = _ready(index, 0, os.urandom(32))
    assert index.depths(np.array([*chain, alone])).tolist() == [*range(41), 0]
    # A removed ancestor ends the chain above it: its children count from there.
    index.remove(chain[10])
    assert index.depths(np.array(chain[11:14])).tolist() == [0, 1, 2]
    assert index.depths(np.array(chain[:3])).tolist() == [0, 1, 2]


class _Listener:
    """Records a table's history events; ``kept[slot]`` is the key remembered there."""

    def __init__(self, index: BlockTable) -> None:
        self.index = index
        self.freed: list[int] = []
        self.kept: dict[int, bytes] = {}
        self.revived: list[tuple[bytes, int]] = []  # (key remembered, row revived into)
        self.expired: list[bytes] = []
        index.on_free.append(self.freed.append)
        index.on_remember.append(self.remember)
        index.on_revive.append(self.revive)
        index.on_expire.append(self.expire)
        index.on_renumber.append(self.renumber)
        self.renumbered = 0

    def renumber(self, order: np.ndarray) -> None:
        assert sorted(self.kept) == order.tolist()  # every held slot, and no other
        self.kept = {new: self.kept[old] for new, old in enumerate(order.tolist())}
        self.renumbered += 1

    def remember(self, bid: int, slot: int) -> None:
        assert bid not in self.freed[-1:]  # before the row is freed
        assert slot not in self.kept
        self.kept[slot] = self.index.key_bytes(bid)

    def revive(self, slot: int, bid: int) -> None:
        self.revived.append((self.kept.pop(slot), bid))

    def expire(self, slot: int) -> None:
        self.expired.append(self.kept.pop(slot))


def test_a_removed_key_added_again_gets_its_history_back_while_remembered():
    """The policies keep a block's history by row: a dropped block's row is freed at once
    (after its history was saved at a memento slot), and its key stored again within the
    history gets the saved history written into its new row."""
    index = BlockTable(initial_capacity=16)
    index.history_factor = 1.0
    seen = _Listener(index)
    key = os.urandom(32)
    first = _ready(index, 5, key)
    old = index.ref(first)
    index.remove(first)
    assert index.lookup(5, keys_to_words([key])).tolist() == [-1]  # absent meanwhile
    assert seen.freed == [first] and list(seen.kept.values()) == [key]
    assert index.history_rows == 1
    again = _ready(index, 5, key)
    assert seen.revived == [(key, again)] and index.history_rows == 0
    assert index.resolve(old) == -1  # a ref to the dropped block never names the revived one
    assert index.lookup(5, keys_to_words([key])).tolist() == [again]
    # Another namespace's same key is another block: nothing revived.
    _ready(index, 6, key)
    assert len(seen.revived) == 1
    # add_many revives too, each key's history into its own row.
    batch = [os.urandom(32) for _ in range(40)]
    rows = index.add_many(5, keys_to_words(batch), 4096)
    for bid in rows[::2].tolist():
        index.remove(bid)
    assert index.history_rows == 20
    back = index.add_many(5, keys_to_words([*batch[::2], os.urandom(32)]), 4096)
    assert seen.revived[1:] == list(zip(batch[::2], back[:20].tolist(), strict=True))
    assert index.history_rows == 0 and seen.expired == [] and seen.kept == {}


def test_the_history_keeps_the_latest_removals_and_forgets_the_oldest_first():
    index = BlockTable(initial_capacity=16)
    index.history_factor = 1.0  # at least MIN_HISTORY_BASE removals, however few are live
    seen = _Listener(index)
    keys = [os.urandom(32) for _ in range(MIN_HISTORY_BASE + 3)]
    rows = [_ready(index, 0, k) for k in keys]
    for bid in rows:
        index.remove(bid)
    assert index.history_rows == MIN_HISTORY_BASE
    assert seen.expired == keys[:3]  # the oldest three, each told once
    assert seen.freed == rows  # every row at once
    first = _ready(index, 0, keys[0])
    assert seen.revived == []  # forgotten: nothing to revive
    bid = _ready(index, 0, keys[3])
    assert seen.revived == [(keys[3], bid)]  # the oldest still remembered
    index.remove(bid)  # dropped again: now the newest
    index.remove(first)  # one over the bound: the oldest goes, the revived one stays
    assert seen.expired == [*keys[:3], keys[4]] and index.history_rows == MIN_HISTORY_BASE
    index.history_factor = 0.0
    bid = _ready(index, 0, os.urandom(32))
    index.remove(bid)
    assert seen.freed[-1] == bid and index.history_rows == 0  # none kept, the rest expired
    assert seen.kept == {}


def test_an_identity_shared_by_two_keys_mixes_histories_never_rows(monkeypatch):
    """Mementos are keyed by a 64-bit identity. Two keys of one identity share a memento:
    the later removal's replaces the earlier's and either key takes it, a wrong history for
    one block, while lookups, refs and counts stay right."""
    index = BlockTable(initial_capacity=16)
    index.history_factor = 1.0
    seen = _Listener(index)
    monkeypatch.setattr(index, "_hash_one", lambda ns, words: 7)
    monkeypatch.setattr(index, "_hash", lambda ns, words: np.full(len(words), 7, np.uint64))
    a, b, c = (os.urandom(32) for _ in range(3))
    ra, rb = _ready(index, 0, a), _ready(index, 0, b)
    refs = [index.ref(ra), index.ref(rb)]
    index.remove(ra)
    index.remove(rb)
    assert seen.expired == [a] and list(seen.kept.values()) == [b]
    again = _ready(index, 0, a)
    assert seen.revived == [(b, again)] and index.history_rows == 0
    rc = index.add_many(0, keys_to_words([b, c]), 4096)
    index.state[rc] = READY
    assert len(seen.revived) == 1 and len(index) == 3
    assert index.lookup(0, keys_to_words([a, b, c])).tolist() == [again, *rc.tolist()]
    assert index.resolve_many(np.array(refs)).tolist() == [-1, -1]


def test_mementos_match_an_ordered_dict_through_puts_takes_and_growth():
    rng = random.Random(3)
    m = Mementos()
    ref: OrderedDict[int, int] = OrderedDict()
    for _ in range(30000):
        r = rng.random()
        if r < 0.5 or not ref:
            # A few small identities, so that probe chains meet and wrap.
            ident = rng.getrandbits(64) if rng.random() < 0.9 else rng.getrandbits(6)
            if ident not in ref:
                ref[ident] = m.put(ident)
        elif r < 0.7:
            ident, slot = ref.popitem(last=False)
            assert m.take_oldest() == slot
            m.free(slot)
        elif r < 0.85:
            ident = rng.choice(list(ref))
            slot = m.take(ident)
            assert slot == ref.pop(ident)
            m.free(slot)
        else:
            idents = [*rng.sample(list(ref), min(6, len(ref))), rng.getrandbits(64)]
            got = m.take_many(np.array(idents, dtype=np.uint64)).tolist()
            assert got == [ref.pop(i, -1) for i in idents]
            for slot in got:
                if slot >= 0:
                    m.free(slot)
        assert m.count == len(ref)
    assert [m.take_oldest() for _ in range(len(ref))] == list(ref.values())


_MEMENTO_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "take", "oldest", "many", "compact"]),
        st.integers(0, (1 << 64) - 1),
        st.integers(0, 7),  # below 3: the identity is that (0, the hole's, and 1, its stand-in)
    ),
    max_size=400,
)


@settings(
    max_examples=100,
    deadline=None,
    # The one fixture sets the same value for every example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=_MEMENTO_OPS)
def test_mementos_match_an_ordered_dict_through_compactions(monkeypatch, ops):
    """Hypothesis drives ``Mementos`` through puts, takes (one, oldest, a batch) and
    ``compact`` (asked for, and whenever numbering reaches the arrays' end, as the table
    does), with identities 0 and 1 among them (0 is kept as 1: one identity, as a
    collision). The held slots stay those of an ordered dict in removal order, renumbered
    as ``compact``'s ``order`` says, and the oldest is always taken first."""
    monkeypatch.setattr(table_module, "MIN_COMPACT_SLOTS", 16)
    m = Mementos()
    ref: OrderedDict[int, int] = OrderedDict()  # identity as kept (0 as 1) -> slot
    for op, ident, small in ops:
        if small < 3:
            ident = small
        kept = ident or 1
        if op == "put":
            if kept not in ref:
                ref[kept] = m.put(ident)
        elif op == "take" and ref:
            key = list(ref)[ident % len(ref)]
            # The identity kept as 1 is asked for as 0 too (either finds it).
            assert m.take(0 if key == 1 and small % 2 else key) == ref.pop(key)
            m.free(-1)
        elif op == "oldest" and ref:
            slot = ref.popitem(last=False)[1]
            assert m.take_oldest() == slot
            m.free(slot)
        elif op == "many" and ref:
            idents = list(dict.fromkeys([*list(ref)[: small + 1], ident]))
            got = m.take_many(np.array(idents, dtype=np.uint64)).tolist()
            assert got == [ref.pop(i or 1, -1) for i in idents]
            for slot in got:
                if slot >= 0:
                    m.free(slot)
        elif op == "compact" or m.full():
            order = m.compact()
            if order is not None:
                assert order.tolist() == sorted(ref.values())
                new = {old: i for i, old in enumerate(order.tolist())}
                ref = OrderedDict((k, new[s]) for k, s in ref.items())
                assert len(m.arrays()[0]) == slots_for(len(ref))
        assert m.count == len(ref)
        assert list(ref.values()) == sorted(ref.values())  # numbered in removal order
    assert [m.take_oldest() for _ in range(len(ref))] == list(ref.values())


@pytest.mark.parametrize("batch", [False, True])
def test_regression_an_add_that_raised_after_taking_a_memento_leaked_its_slot(monkeypatch, batch):
    """``add`` and ``add_many`` took a returning key's memento out of the map and the order
    before growing the table: a growth that raised (out of memory) left the slot taken and
    never freed, counted as remembered for good and its history never revived. A
    listener that raises in ``revive`` must not leak the slot either."""
    index = BlockTable(initial_capacity=16)
    index.history_factor = 1.0
    seen = _Listener(index)
    keys = [os.urandom(32) for _ in range(16)]
    rows = [_ready(index, 0, k) for k in keys]
    for bid in rows[:9]:
        index.remove(bid)
    index.add_many(0, keys_to_words([os.urandom(32) for _ in range(9)]), 4096)
    assert index.history_rows == 9 and index.stats().capacity == 16  # full: adds must grow

    def no_memory(capacity: int) -> None:
        raise MemoryError

    grow = index._grow
    monkeypatch.setattr(index, "_grow", no_memory)
    back = keys[:9] if batch else keys[:1]
    with pytest.raises(MemoryError):
        index.add_many(0, keys_to_words(back), 4096) if batch else _ready(index, 0, back[0])
    assert index.history_rows == 9 and seen.revived == []
    monkeypatch.setattr(index, "_grow", grow)
    if batch:
        bids = index.add_many(0, keys_to_words(back), 4096).tolist()
    else:
        bids = [_ready(index, 0, back[0])]
    assert seen.revived == list(zip(back, bids, strict=True))
    assert index.history_rows == 9 - len(back) and len(index) == 16 + len(back)

    def broken(slot: int, bid: int) -> None:
        raise RuntimeError("listener")

    index.on_revive.insert(0, broken)
    remembered = index.history_rows
    index.remove(bids[0])
    with pytest.raises(RuntimeError):
        _ready(index, 0, back[0])
    assert index.history_rows == remembered


def test_memento_memory_comes_back_once_fewer_are_held():
    """A burst of drops grows the memento arrays; once fewer are remembered (here the live
    blocks fall, and the history with them) the table compacts them, renumbering what the
    listeners keep by slot, so a history brought back still revives the right keys. A
    count that wavers about one size afterwards keeps the arrays at their size, renumbered
    once per sixteenth of it put (``slots_for``)."""
    index = BlockTable(initial_capacity=16)
    index.history_factor = 1.0
    seen = _Listener(index)
    keys = [os.urandom(32) for _ in range(6 * MIN_COMPACT_SLOTS)]
    rows = index.add_many(0, keys_to_words(keys), 4096).tolist()
    half = len(rows) // 2
    for bid in rows[:half]:
        index.remove(bid)
    assert index.history_rows == half
    burst = sum(a.nbytes for a in index.mementos.arrays())
    for bid in rows[half:]:
        index.remove(bid)
    assert index.history_rows == MIN_HISTORY_BASE and seen.renumbered
    assert len(index.mementos.arrays()[0]) <= MIN_COMPACT_SLOTS
    assert sum(a.nbytes for a in index.mementos.arrays()) < burst / 4
    assert sorted(seen.kept.values()) == sorted(keys[-MIN_HISTORY_BASE:])
    back = keys[-10:]
    bids = index.add_many(0, keys_to_words(back), 4096).tolist()
    assert seen.revived == list(zip(back, bids, strict=True))
    compactions = seen.renumbered
    held = _ready(index, 0, os.urandom(32))
    seen.freed.clear()  # ``remember`` checks the last row freed was another
    size = len(index.mementos.arrays()[0])
    puts = 3 * MIN_COMPACT_SLOTS
    for _ in range(puts):  # one in, one out: the count stays put
        new = _ready(index, 0, os.urandom(32))
        index.remove(held)
        held = new
        assert len(index.mementos.arrays()[0]) == size
    assert seen.renumbered - compactions <= puts // (MIN_HISTORY_BASE // 16) + 1


def test_regression_a_small_steady_history_renumbered_on_nearly_every_put():
    """A history held near a fixed small size (a small store, or a low
    ``policy.history_factor``) had arrays sized a sixteenth over, at least 64 slots: 63
    held in 64 reached the arrays' end at every put, so every drop renumbered the mementos
    and every listener's arrays. At least 64 spare slots: one renumbering per 64 puts."""
    mementos = Mementos()
    for ident in range(1, 64):
        mementos.put(ident)
    compactions, puts = 0, 640
    for ident in range(64, 64 + puts):
        mementos.free(mementos.take_oldest())
        if mementos.full():
            compactions += mementos.compact() is not None
        mementos.put(ident)
        assert mementos.count == 63
    assert compactions <= puts // 64 + 1


def test_regression_revived_mementos_left_holes_that_grew_the_arrays():
    """Slots are numbered in the order mementos are put and a revived one leaves a hole
    (``Mementos``): keys that keep coming back (dropped and stored again, the count steady)
    leave a hole per return, which ``compact`` gives back once numbering reaches the
    arrays' end, so the arrays stay within a sixteenth of the count (``slots_for``) and the
    listeners' slots follow."""
    index = BlockTable(initial_capacity=16)
    index.history_factor = 1.0
    seen = _Listener(index)
    keys = [os.urandom(32) for _ in range(2 * MIN_HISTORY_BASE)]
    rows = dict(zip(keys, index.add_many(0, keys_to_words(keys), 4096).tolist(), strict=True))
    for key in keys[:MIN_HISTORY_BASE]:
        index.remove(rows.pop(key))
    rng = random.Random(5)
    before = seen.renumbered
    for _ in range(4 * MIN_HISTORY_BASE):
        back = rng.choice([k for k in keys if k not in rows][:64])  # remembered: revived
        rows[back] = _ready(index, 0, back)
        assert seen.revived[-1] == (back, rows[back])
        gone = rng.choice(list(rows))
        seen.freed.clear()  # ``remember`` checks the last row freed was another
        index.remove(rows.pop(gone))
        assert seen.kept[max(seen.kept)] == gone
        assert len(index.mementos.arrays()[0]) <= slots_for(index.history_rows)
    assert seen.renumbered > before


def test_regression_an_identity_of_zero_was_taken_for_a_hole():
    """A taken memento's identity reads 0 (a hole, skipped by ``take_oldest``); a key whose
    identity is 0 is kept as 1, so it is remembered, found and forgotten like any other."""
    m = Mementos()
    zero, seven = m.put(0), m.put(7)
    assert m.take_oldest() == zero
    m.free(zero)
    again = m.put(0)
    assert m.take_many(np.array([0, 5], dtype=np.uint64)).tolist() == [again, -1]
    m.free(again)
    assert m.take_oldest() == seven


def test_regression_a_listener_raising_in_a_batch_revive_leaked_the_batchs_other_slots():
    """``add_many`` takes every returning key's memento, then revives them one by one: a
    listener that raised while reviving the first left the others taken, never freed nor
    revived, counted as remembered for good (and, still marked held, placed back in the map
    at its next resize). Each is revived, and the first error raised after."""
    index = BlockTable(initial_capacity=16)
    index.history_factor = 4.0
    seen = _Listener(index)
    keys = [os.urandom(32) for _ in range(16)]
    for bid in index.add_many(0, keys_to_words(keys), 4096).tolist():
        index.remove(bid)
    assert index.history_rows == 16
    calls = []

    def broken(slot: int, bid: int) -> None:
        calls.append(bid)
        if len(calls) == 1:
            raise RuntimeError("listener")

    index.on_revive.append(broken)
    back = keys[:12]  # past the scalar tail: taken as a batch
    with pytest.raises(RuntimeError):
        index.add_many(0, keys_to_words(back), 4096)
    assert index.history_rows == 4 and len(calls) == 12
    assert [k for k, _ in seen.revived] == back
    assert sorted(seen.kept.values()) == sorted(keys[12:])
    # What is left is remembered as before: each key returns to its own history.
    index.on_revive.remove(broken)
    rest = index.add_many(0, keys_to_words(keys[:11:-1]), 4096).tolist()
    assert seen.revived[12:] == list(zip(keys[:11:-1], rest, strict=True))
    assert index.history_rows == 0 and seen.kept == {}


@pytest.mark.parametrize("seed", range(3))
def test_history_through_compactions_matches_an_ordered_dict(monkeypatch, seed):
    """Random adds (one at a time and in batches), removes and history factors, with
    ``Mementos.compact`` allowed from 64 slots: the keys remembered, revived and expired are
    those of a plain ordered dict kept oldest first, and what a listener keeps by slot (in a
    dict and in a ``Kept`` array, renumbered as the policies do) is the key's own."""
    base = 8
    monkeypatch.setattr(table_module, "MIN_HISTORY_BASE", base)
    monkeypatch.setattr(table_module, "MIN_COMPACT_SLOTS", 64)
    rng = random.Random(seed)
    index = BlockTable(initial_capacity=16)
    index.history_factor = 4.0
    by_slot: dict[int, bytes] = {}
    kept = Kept([("word", np.uint64, 0)])
    revived: list[bytes] = []
    expired: list[bytes] = []
    compactions = 0

    def word(key: bytes) -> int:
        return int.from_bytes(key[:8], "little")

    def remember(bid: int, slot: int) -> None:
        assert slot not in by_slot
        by_slot[slot] = index.key_bytes(bid)
        kept.fit(slot)
        kept.views["word"][slot] = word(by_slot[slot])

    def revive(slot: int, bid: int) -> None:
        key = by_slot.pop(slot)
        assert key == index.key_bytes(bid) and kept.views["word"][slot] == word(key)
        revived.append(key)

    def renumber(order: np.ndarray) -> None:
        nonlocal by_slot, compactions
        assert sorted(by_slot) == order.tolist()
        by_slot = renumbered(by_slot, order)
        kept.renumber(order)
        compactions += 1

    index.on_remember.append(remember)
    index.on_revive.append(revive)
    index.on_expire.append(lambda slot: expired.append(by_slot.pop(slot)))
    index.on_renumber.append(renumber)
    ref: OrderedDict[bytes, None] = OrderedDict()  # remembered keys, oldest first
    live: dict[bytes, int] = {}
    keys = [os.urandom(32) for _ in range(1500)]
    removing = False
    for step in range(5000):
        if step % 300 == 0:  # phases of drops and of adds: the history swells and shrinks
            removing = not removing
        revived.clear()
        expired.clear()
        r = rng.random()
        if r < 0.02:
            index.history_factor = rng.choice([0.0, 0.5, 1.0, 4.0, 16.0])
        elif live and (r < 0.45 or (removing and r < 0.8)):
            key = rng.choice(list(live))
            index.remove(live.pop(key))
            if index.history_factor > 0:
                ref[key] = None
            limit = int(index.history_factor * max(len(live), base))
            gone = [ref.popitem(last=False)[0] for _ in range(len(ref) - max(limit, 0))]
            assert expired == gone
        else:
            batch = [
                k for k in rng.sample(keys, rng.choice([1, rng.randint(2, 80)])) if k not in live
            ]
            if not batch:
                continue
            rows = index.add_many(0, keys_to_words(batch), 4096).tolist()
            live.update(zip(batch, rows, strict=True))
            assert revived == [k for k in batch if k in ref]
            for key in revived:
                del ref[key]
        assert index.history_rows == len(ref) and sorted(by_slot.values()) == sorted(ref)
    assert compactions


def test_regression_a_listener_raising_in_remove_lost_the_row():
    """``remove`` marks the row free, then keeps its history: a ``remember`` listener that
    raised (or an ``expire`` one, for an older memento of the same identity) skipped
    putting the row on the free list and telling ``on_free``, so the row was never reused
    and the policies never heard ``forget`` for it."""
    index = BlockTable(initial_capacity=16)
    index.history_factor = 1.0
    freed: list[int] = []
    index.on_free.append(freed.append)
    bid = _ready(index, 0, os.urandom(32))

    def broken(bid: int, slot: int) -> None:
        raise RuntimeError("listener")

    index.on_remember.append(broken)
    with pytest.raises(RuntimeError):
        index.remove(bid)
    assert freed == [bid]
    assert _ready(index, 0, os.urandom(32)) == bid  # the row is reused
