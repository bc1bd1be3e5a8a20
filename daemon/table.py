"""The block table: ``(namespace, key) -> block id`` and every per-block field.

Everything lives in numpy arrays (structure of arrays) indexed by block id, so a million
blocks cost tens of bytes each rather than the hundreds a dict of objects would, and a batch
of keys is looked up with a few vectorised probes instead of a Python loop per key. Every
array is grown in one place (``_grow``), so no part of the store keeps a side array that a
new block can outrun.

Fields: key, namespace, owner (tenant), state, size, pins, in-flight marks, per tier column
the slot of its copy (``-1``: none) and that copy's checksum, the chain links (``parent``,
``child``), the last access (the protection clock) and when a key-addressed tier last
confirmed its copy.

Invariants:
- A block id is a row of every array; it is live while ``state[id] != FREE``.
- Every live block has exactly one entry in the hash table and every entry names a live
  block. Freed rows are reused (LIFO), so ids stay dense.
- A row carries a generation that grows each time the row is freed. A *ref* (``ref(bid)``:
  generation and row in one int64) held across an await, in a lease or a chain link, names
  one block for good: ``resolve`` answers -1 once the row holds another block. Policies index
  by row and hear ``forget`` (through ``on_free``) before a row is reused for another key.
- History. A removed block's row is freed at once (``on_free`` before any other key may take
  it), but its key is remembered a while (``history_factor`` times the live blocks, the
  oldest removal forgotten first) by a *memento*: a slot numbered by the table, keyed by the
  key's 64-bit identity. Listeners save the row's history into the slot before the row is
  freed (``on_remember(row, slot)``), write it into the new row when the key is added again
  (``on_revive(slot, row)``) and drop it when the memento is forgotten (``on_expire(slot)``):
  the policies keep a block's history by row (its heat, whether it was seen) and so
  recognise a block that returns after it was dropped. Slots are numbered in removal
  order and not reused; once numbering reaches the arrays' end, or far fewer mementos are
  held than slots were numbered (a burst of drops expired), the table renumbers the held
  ones densely to give the memory of the others back, and listeners move what they keep the
  same way (``on_renumber(order)``). Forgetting at once cost the heat
  policy half its hits at small capacities on the public trace (``kvtier replay
  --forget-dropped --history-factor 0``). A revived block gets a new row and generation like
  any added block, so refs to the dropped one stay dead. Two keys of one identity (a 64-bit
  collision) share a memento: the later removal's replaces the earlier's, and either key
  added again takes it, a wrong history for one block, never a wrong row.
- The hash table is open addressing with linear probing and tombstones, keyed by a secret
  per-process salt and by every word of a key, so clients cannot aim keys at one probe chain.

Not thread-safe: owned by the store, which touches it from one thread.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.tiers.base import BlockRef, BlockRefs

KEY_BYTES = 32
_KEY_WORDS = KEY_BYTES // 8

EMPTY = -1
TOMBSTONE = -2

# Block states.
FREE = 0
WRITING = 1  # slot reserved, bytes being copied in; invisible to lookups
READY = 2

NO_REF = -1
_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1

_MAX_LOAD = 0.5
# A taken memento's identity (``Mementos``); a key whose identity is 0 is kept as 1 (a
# collision, as any two keys of one identity: they share a memento).
_HOLE = 0
_IDENT_OF_ZERO = 1
# A memento map is grown (``map_size``) once more than this fraction of it is taken: linear
# probing's misses, the common probe (a new key added), cost 5 positions on average at two
# thirds full (``map_size``) and 8.5 there.
_MAP_MAX_LOAD = 0.75
_SCALAR_TAIL = 8
# History (see the module docstring) is kept for at least this many removed blocks, however
# few are live.
MIN_HISTORY_BASE = 1024
# Memento arrays shorter than this are never shrunk (``Mementos.compact``).
MIN_COMPACT_SLOTS = 4096
# Probe positions per key that a batch lookup examines in one pass.
_WINDOW = 4
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S33 = np.uint64(33)
_U64_MASK = (1 << 64) - 1
_GOLDEN_INT = int(_GOLDEN)
_M1_INT = int(_M1)
_M2_INT = int(_M2)


def keys_to_words(keys: Sequence[bytes]) -> np.ndarray:
    """Pack 32-byte keys into an ``(n, 4)`` uint64 array. Raises ValueError on a bad length."""
    if not keys:
        return np.empty((0, _KEY_WORDS), dtype=np.uint64)
    if len(keys) == 1 and len(keys[0]) == KEY_BYTES:  # a single-key request: no join, no set
        return np.frombuffer(keys[0], dtype=np.uint64).reshape(1, _KEY_WORDS)
    if set(map(len, keys)) != {KEY_BYTES}:
        i = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise ValueError(f"key {i} has {len(keys[i])} bytes; keys are {KEY_BYTES} bytes")
    return np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(-1, _KEY_WORDS)


@dataclass(frozen=True, slots=True)
class IndexStats:
    blocks: int
    capacity: int
    table_slots: int
    tombstones: int
    nbytes: int


class BlockTable:
    """Key lookup and per-block fields for up to millions of blocks. ``columns`` is the number
    of tiers (one slot column each); ``checksummed[col]`` says whether that tier's copies
    carry a checksum the store must keep (only those columns get one)."""

    def __init__(
        self,
        columns: int = 2,
        initial_capacity: int = 1024,
        checksummed: tuple[bool, ...] | None = None,
        accounted: tuple[bool, ...] | None = None,
        slot_align: tuple[int, ...] | None = None,
    ) -> None:
        self._salt = np.uint64(secrets.randbits(64))
        self._salt_int = int(self._salt)
        self.columns = columns
        flags = checksummed if checksummed is not None else (False,) + (True,) * (columns - 1)
        self._csum_col = np.cumsum(flags) - 1
        self._csum_col[~np.asarray(flags, dtype=bool)] = -1
        # Bytes each owner (tenant) holds in each column whose tier has a capacity to share
        # (``accounted``): kept by set_slots/clear_slots, checked by ``check``.
        self._accounted = np.asarray(accounted if accounted is not None else (True,) * columns)
        self.usage = np.zeros((columns, 16), dtype=np.int64)
        # The same in the slots those copies take (each block rounded up to its column's
        # ``slot_align``): tenants' shares of a tier are of the room they take, which blocks
        # of several sizes fill unequally (``SpaceManager._shares``).
        self._align = np.asarray(slot_align if slot_align is not None else (1,) * columns)
        self.slot_usage = np.zeros((columns, 16), dtype=np.int64)
        self.on_free: list[Callable[[int], None]] = []
        self._count = 0
        self._capacity = 0
        self._free_rows: list[int] = []
        self._next_row = 0
        # Mementos of removed blocks (see History) and their listeners.
        self.history_factor = 0.0
        self.mementos = Mementos()
        self.on_remember: list[Callable[[int, int], None]] = []
        self.on_revive: list[Callable[[int, int], None]] = []
        self.on_expire: list[Callable[[int], None]] = []
        self.on_renumber: list[Callable[[np.ndarray], None]] = []
        # Per-block fields.
        self.keys = np.empty((0, _KEY_WORDS), dtype=np.uint64)
        # Namespace ids are 64-bit hashes of (tenant, namespace name): stable across restarts
        # and across daemons sharing a remote tier.
        self.ns = np.empty(0, dtype=np.uint64)
        # Live blocks per namespace id (only ids with some): whether a namespace still holds
        # anything, without a pass over the rows (the store's namespace limit asks).
        self.ns_blocks: dict[int, int] = {}
        self.state = np.empty(0, dtype=np.uint8)
        self.nbytes = np.empty(0, dtype=np.uint32)
        self.owner = np.empty(0, dtype=np.uint16)
        self.pins = np.empty(0, dtype=np.int32)
        # Copies and moves in flight per block: int32 like pins (int16 wrapped negative after
        # 32,767 overlapping reads, and a block read by that many looked idle).
        self.inflight = np.empty(0, dtype=np.int32)
        self.gen = np.empty(0, dtype=np.uint32)
        # slot[id, col] is the block's slot in the tier of column col, or -1; checksum[id,
        # col] is what that tier returned when it wrote the copy (0 for tiers that do not
        # checksum).
        self.slot = np.empty((0, columns), dtype=np.int32)
        self.checksum = np.empty((0, max(1, int(sum(flags)))), dtype=np.uint64)
        # Chain links: a block's parent as a ref (NO_REF: none), and the row of the latest
        # child stored after it, which counts only while that child's parent ref names this
        # block.
        self.parent = np.empty(0, dtype=np.int64)
        self.child = np.empty(0, dtype=np.int32)
        # Last read or write: the protection period runs from it.
        self.last_access = np.empty(0, dtype=np.float64)
        # When a key-addressed tier last confirmed it holds the block (wrote it, a lookup's
        # probe found it, a read of it succeeded): a block held only there is known for a
        # while from then (``SpaceManager.forget_unconfirmed``), as the tier may drop it.
        self.keyed_seen = np.empty(0, dtype=np.float64)
        # When the block's copy in a key-addressed tier was written there: by this node, or
        # by another for a copy found there of a block not held here (``BlockStore._discover``
        # dates it from the probe, then from the write its expiry tells: ``_date_copies``);
        # set with that copy, meaningless without one. Its expiry runs from its write, which
        # the confirmations above do not renew (``SpaceManager.forget_unconfirmed``).
        self.keyed_since = np.empty(0, dtype=np.float64)
        self._grow(max(16, initial_capacity))
        self._table = np.full(
            _pow2_at_least(int(max(16, initial_capacity) / _MAX_LOAD)), EMPTY, np.int32
        )
        self._tombstones = 0

    # ----------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return self._capacity

    def lookup(self, ns: int, words: np.ndarray) -> np.ndarray:
        """Block ids of ``words`` (``(n, 4)`` uint64) in namespace ``ns``; -1 where absent.

        Blocks still being written count as absent.
        """
        return self._ready(self._find(ns, words)[0])

    def lookup_identified(
        self, ns: int, words: np.ndarray
    ) -> tuple[np.ndarray, list[int] | np.ndarray]:
        """``lookup``, and the ``identities`` of the same keys (a list for a few keys, else a
        uint64 array: ``identities_where`` picks some as a list): the probe hashes every key
        with the very function ``identities`` uses, so a caller that needs both (a lookup
        that classifies its misses) does not hash the keys twice."""
        ids, hashes = self._find(ns, words)
        return self._ready(ids), hashes

    @staticmethod
    def identities_where(hashes: list[int] | np.ndarray, mask: np.ndarray) -> list[int]:
        """The identities of ``lookup_identified`` where ``mask`` is true."""
        if isinstance(hashes, np.ndarray):
            return hashes[mask].tolist()  # type: ignore[no-any-return]
        return [h for h, m in zip(hashes, mask.tolist(), strict=True) if m]

    def _ready(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` with the blocks not READY (being written) as -1, in place."""
        if len(ids) <= _SCALAR_TAIL:
            state = self.state
            for i, bid in enumerate(ids.tolist()):
                if bid >= 0 and state[bid] != READY:
                    ids[i] = -1
            return ids
        present = ids >= 0
        if present.any():
            not_ready = self.state[ids[present]] != READY
            if not_ready.any():
                idx = np.flatnonzero(present)[not_ready]
                ids[idx] = -1
        return ids

    def find_any(self, ns: int, words: np.ndarray) -> np.ndarray:
        """Like lookup, but also returns blocks that are still being written."""
        return self._find(ns, words)[0]

    def find_one(self, ns: int, key: np.ndarray, identity: int | None = None) -> int:
        """``find_any`` of one key's words (``(4,)`` uint64), as an int: no array built.
        ``identity``: the key's, when the caller has it (``identity``), not hashed again."""
        ns = int(ns)
        if identity is None:
            identity = self._hash_one(ns, key)
        return self._probe(ns, key, identity & (len(self._table) - 1))

    def identity(self, ns: int, key: np.ndarray) -> int:
        """``identities`` of one key's words (``(4,)`` uint64): a single-block put hashes its
        key once for its probe, its insertion and the miss ledger."""
        return self._hash_one(int(ns), key)

    def key_bytes(self, bid: int) -> bytes:
        return self.keys[bid].tobytes()

    def block_refs(self, bids: np.ndarray) -> Sequence[BlockRef]:
        """The blocks' identities as tiers address them, ``(ns, key bytes)`` per row: as
        arrays (``BlockRefs``), so a tier that never looks at them costs nothing per block."""
        if len(bids) == 1:  # a single-key request: no array operations
            bid = bids.item(0)
            return [BlockRef(self.ns.item(bid), self.keys[bid].tobytes())]
        bids = np.asarray(bids, dtype=np.int64)
        return BlockRefs(self.ns[bids], self.keys[bids])

    def ref(self, bid: int) -> int:
        """A reference to the block now in row ``bid`` that outlives the row's reuse."""
        return (self.gen.item(bid) << _ROW_BITS) | int(bid)

    def refs(self, bids: np.ndarray, gen: np.ndarray | None = None) -> np.ndarray:
        """``ref`` of each of ``bids``; ``gen``: a copy of the generations made earlier, for
        the blocks the rows held then (the table's now without it)."""
        bids = np.asarray(bids, dtype=np.int64)
        return ((self.gen if gen is None else gen)[bids].astype(np.int64) << _ROW_BITS) | bids

    def resolve(self, ref: int) -> int:
        """The row of the block ``ref`` names, or -1 when that block is gone."""
        if ref < 0:
            return -1
        bid = ref & _ROW_MASK
        if (
            bid >= self._capacity
            or self.state[bid] == FREE
            or int(self.gen[bid]) != ref >> _ROW_BITS
        ):
            return -1
        return bid

    def resolve_many(self, refs: np.ndarray) -> np.ndarray:
        """``resolve`` for many refs (-1 among them: none), vectorised."""
        refs = np.asarray(refs, dtype=np.int64)
        rows = np.where(refs >= 0, refs & _ROW_MASK, 0)
        alive = (refs >= 0) & (self.state[rows] != FREE)
        alive &= self.gen[rows].astype(np.int64) == (refs >> _ROW_BITS)
        return np.where(alive, rows, -1)

    def checksums(self, bids: np.ndarray, col: int) -> np.ndarray:
        c = int(self._csum_col[col])
        if c < 0:
            return np.zeros(len(bids), dtype=np.uint64)
        return self.checksum[bids, c]

    def checksum_of(self, bid: int, col: int) -> int:
        """``checksums`` of one block, as an int."""
        c = int(self._csum_col[col])
        return int(self.checksum[bid, c]) if c >= 0 else 0

    def set_checksums(self, bids: np.ndarray, col: int, values: np.ndarray | int) -> None:
        c = int(self._csum_col[col])
        if c >= 0:
            self.checksum[bids, c] = values

    def link(self, bid: int, parent: int) -> None:
        """Record ``parent`` (a row, or -1) as the chain predecessor of ``bid``."""
        if parent < 0:
            self.parent[bid] = NO_REF
            return
        self.parent[bid] = self.ref(parent)
        self.child[parent] = bid

    def link_many(self, bids: np.ndarray, parents: np.ndarray) -> None:
        """``link`` for many blocks, in order (a parent named twice keeps the later child)."""
        if len(bids) == 1:  # a single-key put: no array operations
            self.link(int(bids[0]), int(parents[0]))
            return
        bids = np.asarray(bids, dtype=np.int64)
        parents = np.asarray(parents, dtype=np.int64)
        linked = parents >= 0
        self.parent[bids] = np.where(linked, self.refs(np.maximum(parents, 0)), NO_REF)
        self.child[parents[linked]] = bids[linked]

    def parent_of(self, bid: int) -> int:
        """The row of ``bid``'s parent while that block lives, else -1."""
        return self.resolve(int(self.parent[bid]))

    def parents_of(self, bids: np.ndarray) -> np.ndarray:
        """``parent_of`` for many blocks, vectorised."""
        return self.resolve_many(self.parent[bids])

    def depths(self, bids: np.ndarray) -> np.ndarray:
        """Each block's depth in its chain: how many live ancestors it has. By pointer
        jumping over every live row (each step doubles how far a row sees up its chain), so
        a table of n rows costs O(n log depth), not a step per ancestor."""
        live = self.live_ids()
        up = np.full(self._next_row, -1, dtype=np.int64)
        up[live] = self.resolve_many(self.parent[live])
        depth = (up >= 0).astype(np.int64)  # the distance from each row to ``up``
        # A parent is committed before its child and a reused row gets a new generation, so
        # chains never loop; the bound only keeps a broken invariant from spinning here.
        for _ in range(64):
            has = np.flatnonzero(up >= 0)
            if len(has) == 0:
                break
            nxt = up[has]
            depth[has] += depth[nxt]
            up[has] = up[nxt]
        return depth[np.asarray(bids, dtype=np.int64)]

    def child_of(self, bid: int) -> int:
        """The row of the latest child stored after ``bid`` while it still names ``bid``."""
        child = int(self.child[bid])
        if child < 0 or self.state[child] == FREE or self.parent[child] != self.ref(bid):
            return -1
        return child

    def set_slots(self, bids: np.ndarray, col: int, slots: np.ndarray | int) -> None:
        """Record copies of ``bids`` (none there yet) in column ``col``."""
        if len(bids) == 1 and not isinstance(slots, np.ndarray):
            # A single-key request's copy, without array operations.
            bid = bids.item(0)
            self.slot[bid, col] = slots
            if self._accounted[col]:
                owner = self.owner.item(bid)
                self._fit_owner(owner)
                nbytes = self.nbytes.item(bid)
                self.usage[col, owner] += nbytes
                align = self._align.item(col)
                self.slot_usage[col, owner] += -(-nbytes // align) * align
            return
        bids = np.asarray(bids, dtype=np.int64)
        self.slot[bids, col] = slots
        if self._accounted[col] and len(bids):
            owners = self.owner[bids]
            self._fit_owner(int(owners.max()))
            nbytes = self.nbytes[bids].astype(np.int64)
            np.add.at(self.usage[col], owners, nbytes)
            np.add.at(self.slot_usage[col], owners, self._slot_bytes(nbytes, col))

    def clear_slots(self, bids: np.ndarray | int, col: int) -> None:
        """Forget the copies of ``bids`` in column ``col`` (a no-op where there is none)."""
        bids = np.atleast_1d(np.asarray(bids, dtype=np.int64))
        held = bids[self.slot[bids, col] >= 0]
        if self._accounted[col] and len(held) == 1:
            # One copy (a single-key eviction or delete): scalars, not two ufunc.at calls.
            bid = held.item(0)
            owner, nbytes = self.owner.item(bid), self.nbytes.item(bid)
            align = self._align.item(col)
            self.usage[col, owner] -= nbytes
            self.slot_usage[col, owner] -= -(-nbytes // align) * align
        elif self._accounted[col] and len(held):
            owners, nbytes = self.owner[held], self.nbytes[held].astype(np.int64)
            np.subtract.at(self.usage[col], owners, nbytes)
            np.subtract.at(self.slot_usage[col], owners, self._slot_bytes(nbytes, col))
        self.slot[held, col] = -1

    def _fit_owner(self, owner: int) -> None:
        if owner >= self.usage.shape[1]:
            grown = np.zeros((self.columns, _pow2_at_least(owner + 1)), dtype=np.int64)
            grown[:, : self.usage.shape[1]] = self.usage
            self.usage = grown
            slots = np.zeros_like(grown)
            slots[:, : self.slot_usage.shape[1]] = self.slot_usage
            self.slot_usage = slots

    def _slot_bytes(self, nbytes: np.ndarray, col: int) -> np.ndarray:
        """The slot bytes blocks of ``nbytes`` take in column ``col``."""
        align = int(self._align[col])
        return -(-nbytes // align) * align

    @property
    def rows(self) -> int:
        """Rows ever taken: every live block id is below it."""
        return self._next_row

    def holders(self, col: int) -> np.ndarray:
        """Ids of the blocks with a copy in column ``col``."""
        return np.flatnonzero(self.slot[: self._next_row, col] >= 0)

    def stats(self) -> IndexStats:
        arrays = (*self._fields(), self._table, *self.mementos.arrays())
        return IndexStats(
            blocks=self._count,
            capacity=self._capacity,
            table_slots=len(self._table),
            tombstones=self._tombstones,
            nbytes=sum(a.nbytes for a in arrays),
        )

    # ---------------------------------------------------------------------- mutation

    def add(
        self,
        ns: int,
        words: np.ndarray,
        nbytes: int,
        owner: int = 0,
        identity: int | None = None,
        inflight: int = 0,
    ) -> int:
        """Create a block in state WRITING and return its id. The key must be absent.
        ``identity``: the key's (``identity``), when the caller has it, not hashed again;
        ``inflight``: the row's in-flight count (a put holding its new block sets 1)."""
        if identity is None:
            identity = self._hash_one(int(ns), words)
        if self._free_rows:
            bid = self._free_rows.pop()
        else:
            if self._next_row == self._capacity:
                self._grow(self._capacity * 2)
            bid = self._next_row
            self._next_row += 1
        self.keys[bid] = words
        self.ns[bid] = ns
        self.owner[bid] = owner
        self.state[bid] = WRITING
        self.nbytes[bid] = nbytes
        self.pins[bid] = 0
        self.inflight[bid] = inflight
        # A row's fill costs less than an assignment to it, which goes through numpy's
        # general indexing.
        self.slot[bid].fill(-1)
        self.checksum[bid].fill(0)
        self.parent[bid] = NO_REF
        self.child[bid] = -1
        self.last_access[bid] = -np.inf
        self.keyed_seen[bid] = -np.inf
        # (``keyed_since`` is set with the copy it dates, and read only where there is one.)
        self._count += 1
        self.ns_blocks[ns] = self.ns_blocks.get(ns, 0) + 1
        if (self._count + self._tombstones) > _MAX_LOAD * len(self._table):
            # Places every live row, this new one included: inserting it again would leave
            # a second entry that outlives its removal.
            self._rehash(_pow2_at_least(int(2 * self._count / _MAX_LOAD)))
        else:
            self._table_insert(ns, words, bid, identity)
        # The memento is taken only once nothing above can raise: a taken one is out of
        # the map and the order, and only ``_revive`` frees its slot.
        if self.mementos.count and (memento := self.mementos.take(identity)) >= 0:
            self._revive(memento, bid)
            self._compact_history()
        return bid

    def add_many(
        self, ns: np.ndarray | int, words: np.ndarray, nbytes: np.ndarray | int, owner: int = 0
    ) -> np.ndarray:
        """Create many blocks in state WRITING at once; returns their ids. The keys must be
        absent and distinct. Vectorised: no Python work per block (a put's new keys, a
        recovery chunk)."""
        n = len(words)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if (
            n <= _SCALAR_TAIL
            and not isinstance(ns, np.ndarray)
            and not isinstance(nbytes, np.ndarray)
        ):
            return np.fromiter(
                (self.add(int(ns), words[i], int(nbytes), owner) for i in range(n)), np.int64, n
            )
        hashed = self._hash(ns, words) if self.mementos.count else None
        fresh = n - min(n, len(self._free_rows))
        while self._next_row + fresh > self._capacity:  # before any row is taken
            self._grow(self._capacity * 2)
        reuse = self._free_rows[-n:][::-1] if self._free_rows else []
        del self._free_rows[len(self._free_rows) - len(reuse) :]
        bids = np.concatenate(
            [
                np.asarray(reuse, dtype=np.int64),
                np.arange(self._next_row, self._next_row + fresh, dtype=np.int64),
            ]
        )
        self._next_row += fresh
        for name, fill in self._FILLS.items():
            if name != "gen":
                getattr(self, name)[bids] = fill
        self.keys[bids] = words
        self.ns[bids] = ns
        self.owner[bids] = owner
        self.state[bids] = WRITING
        self.nbytes[bids] = nbytes
        self._count += n
        if isinstance(ns, np.ndarray):
            names, counts = np.unique(ns, return_counts=True)
            for name, count in zip(names.tolist(), counts.tolist(), strict=True):
                self.ns_blocks[name] = self.ns_blocks.get(name, 0) + count
        else:
            self.ns_blocks[int(ns)] = self.ns_blocks.get(int(ns), 0) + n
        if (self._count + self._tombstones) > _MAX_LOAD * len(self._table):
            self._rehash(_pow2_at_least(int(max(16, 2 * self._count) / _MAX_LOAD)))
        else:
            self._insert_many(bids, hashed)
        if hashed is not None:  # keys added again get their history back (see History)
            # Taken last, as in ``add``: nothing between the take and the revive can raise.
            back = self.mementos.take_many(hashed)
            error: BaseException | None = None
            for i in np.flatnonzero(back >= 0).tolist():
                # Every taken slot is revived (and freed) even when a listener raised for an
                # earlier one: stopping would leave the rest taken for good.
                try:
                    self._revive(int(back[i]), int(bids[i]))
                except BaseException as exc:  # raised once every slot is freed
                    error = error or exc
            if error is not None:
                raise error
            self._compact_history()
        return bids

    def _insert_many(self, ids: np.ndarray, hashed: np.ndarray | None = None) -> None:
        """Place ``ids`` (not in the table yet) by vectorised linear probing; ``hashed``: their
        keys' identities when the caller has them."""
        table = self._table
        mask = np.uint64(len(table) - 1)
        if hashed is None:
            hashed = self._hash(self.ns[ids], self.keys[ids])
        pos = hashed & mask
        while len(ids):
            p = pos.astype(np.int64)
            free = table[p] < 0  # EMPTY or TOMBSTONE
            _, first = np.unique(p[free], return_index=True)
            winners = np.flatnonzero(free)[first]
            self._tombstones -= int(np.count_nonzero(table[p[winners]] == TOMBSTONE))
            table[p[winners]] = ids[winners]
            placed = np.zeros(len(ids), dtype=bool)
            placed[winners] = True
            ids = ids[~placed]
            pos = (pos[~placed] + np.uint64(1)) & mask

    def remove(self, bid: int) -> None:
        """Forget a block: its key becomes absent and its id may be reused."""
        if self.state[bid] == FREE:
            raise KeyError(f"block {bid} is not live")
        ns = int(self.ns[bid])
        ident = self._hash_one(ns, self.keys[bid])  # its place, and its memento's key
        self._table[self._table_position(ident, bid)] = TOMBSTONE
        if (left := self.ns_blocks[ns] - 1) > 0:
            self.ns_blocks[ns] = left
        else:
            del self.ns_blocks[ns]
        self._tombstones += 1
        for col in np.flatnonzero(self.slot[bid] >= 0).tolist():
            self.clear_slots(bid, col)
        self.state[bid] = FREE
        self.gen[bid] += 1
        self._count -= 1
        mementos = self.mementos
        try:
            if self.history_factor > 0:
                older = mementos.take(ident)
                if older >= 0:  # a collision (an add takes its memento back): the later wins
                    self._expire(older)
                slot = mementos.put(ident)
                for remember in self.on_remember:
                    remember(bid, slot)
        finally:  # the row is marked free above: a listener's error must not lose it
            self._free_rows.append(bid)
            for listener in self.on_free:
                listener(bid)
        limit = int(self.history_factor * max(self._count, MIN_HISTORY_BASE))
        while mementos.count > max(limit, 0):
            self._expire(mementos.take_oldest())
        self._compact_history()

    def _revive(self, slot: int, bid: int) -> None:
        try:
            for revive in self.on_revive:
                revive(slot, bid)
        finally:  # a taken slot is freed here or never (a listener's error must not leak it)
            self.mementos.free(slot)

    def _expire(self, slot: int) -> None:
        try:
            for expire in self.on_expire:
                expire(slot)
        finally:
            self.mementos.free(slot)

    def _compact_history(self) -> None:
        """Give back the memory of mementos no longer held (see ``Mementos.compact``); the
        listeners renumber what they keep by slot the same way."""
        order = self.mementos.compact()
        if order is not None:
            for renumber in self.on_renumber:
                renumber(order)

    @property
    def history_rows(self) -> int:
        """Removed blocks remembered for their keys (see History)."""
        return self.mementos.count

    def live_ids(self) -> np.ndarray:
        return np.flatnonzero(self.state[: self._next_row] != FREE)

    # ------------------------------------------------------------------ hash table

    def _hash(self, ns: int | np.ndarray, words: np.ndarray) -> np.ndarray:
        """Salted hash of ``(n, 4)`` key words. Every word goes in, each followed by a full
        mix: keys are the client's bytes, and keys that share some words must not share a
        probe chain (a hash of the first word alone put every key a client gave one first
        word into one chain, whatever the salt)."""
        with np.errstate(over="ignore"):
            h = self._salt ^ (np.asarray(ns, dtype=np.uint64) * _GOLDEN)
            for w in range(_KEY_WORDS):
                h = h ^ words[:, w]
                h ^= h >> _S33
                h *= _M1
                h ^= h >> _S33
                h *= _M2
                h ^= h >> _S33
        return h

    def _hash_one(self, ns: int, words: np.ndarray) -> int:
        """``_hash`` of one key's words in Python integers: a single-key request (the common
        small RPC) pays no numpy call overhead."""
        h = self._salt_int ^ ((ns * _GOLDEN_INT) & _U64_MASK)
        for word in words.tolist():
            h ^= word
            h ^= h >> 33
            h = (h * _M1_INT) & _U64_MASK
            h ^= h >> 33
            h = (h * _M2_INT) & _U64_MASK
            h ^= h >> 33
        return h

    def identities(self, ns: int, words: np.ndarray) -> list[int]:
        """A 64-bit identity of each key of ``words`` (``(n, 4)`` uint64) in namespace ``ns``:
        the salted hash of the namespace and every key word. The bounded memories keyed by
        block (admission sketches, the miss ledger, the prefetch ledger) use it, so a tenant's
        keys meet only its own namespace's entries there (keying on a key's first word let
        one tenant's keys count for another's), and clients cannot aim keys at one counter."""
        if len(words) <= _SCALAR_TAIL:
            # By index: iterating an array ends in an IndexError raised and caught inside
            # numpy, which costs more than hashing a key.
            return [self._hash_one(ns, words[i]) for i in range(len(words))]
        return self._hash(ns, words).tolist()  # type: ignore[no-any-return]

    def identities_of(self, bids: np.ndarray) -> list[int]:
        """``identities`` of the blocks ``bids`` (each in its own namespace)."""
        if len(bids) <= _SCALAR_TAIL:
            return [self._hash_one(int(self.ns[b]), self.keys[b]) for b in bids.tolist()]
        return self._hash(self.ns[bids], self.keys[bids]).tolist()  # type: ignore[no-any-return]

    def _find(self, ns: int, words: np.ndarray) -> tuple[np.ndarray, list[int] | np.ndarray]:
        """(block id of each key or -1, whatever its state; each key's hash, the identity)."""
        n = len(words)
        size = len(self._table)
        if n <= _SCALAR_TAIL:
            result = np.empty(n, dtype=np.int64)
            mask = size - 1
            ns = int(ns)
            hashes = []
            # By index, not by iterating ``words`` (see ``identities``).
            for i in range(n):
                key = words[i]
                h = self._hash_one(ns, key)
                hashes.append(h)
                result[i] = self._probe(ns, key, h & mask)
            return result, hashes
        result = np.full(n, -1, dtype=np.int64)
        mask = size - 1
        hashed = self._hash(ns, words)
        pos = (hashed & np.uint64(mask)).astype(np.int64)
        # Probe positions are examined a window at a time for every key still looking: a key
        # stops at the first slot holding a block of its namespace with its first key word,
        # or at an empty slot. The first window settles nearly every key (the table is at
        # most half full), a wider one the few left; a handful left after that, and a stop
        # whose other key words differ (a 64-bit collision), probe on one by one. Where one
        # slot per round took as many rounds as the longest probe chain of the batch.
        flat_keys = self.keys.reshape(-1)
        todo = np.arange(n)
        checked, width = 0, _WINDOW
        again: list[int] = []
        while len(todo) > _SCALAR_TAIL and checked < size:
            width = min(width, size - checked)
            steps = np.arange(checked, checked + width, dtype=np.int64)
            cand = np.take(self._table, (pos[todo, None] + steps) & mask)
            held = np.maximum(cand, 0)  # EMPTY and TOMBSTONE are negative
            # keys[held, 0]; the offsets in int64, as a row id times 4 may pass 2**31.
            found = np.take(flat_keys, held * np.int64(_KEY_WORDS)) == words[todo, :1]
            found &= cand >= 0
            found &= np.take(self.ns, held) == ns
            stop = found | (cand == EMPTY)
            at = np.argmax(stop, axis=1)
            rows = np.arange(len(todo))
            hits = np.flatnonzero(found[rows, at])
            ids = cand[hits, at[hits]].astype(np.int64)
            have = np.take(self.keys, ids, axis=0)
            want = np.take(words, todo[hits], axis=0)
            same = have[:, 1] == want[:, 1]
            for w in range(2, _KEY_WORDS):
                same &= have[:, w] == want[:, w]
            result[todo[hits[same]]] = ids[same]
            again += todo[hits[~same]].tolist()
            todo = todo[~stop[rows, at]]
            checked += width
            width *= 4
        for i in todo.tolist():
            # Positions below ``checked`` hold neither the key nor an empty slot.
            result[i] = self._probe(ns, words[i], int(pos[i] + checked) & mask)
        for i in again:
            result[i] = self._probe(ns, words[i], int(pos[i]))
        return result, hashed

    def _probe(self, ns: int, key: np.ndarray, pos: int) -> int:
        mask = len(self._table) - 1
        table, keys, spaces = self._table, self.keys, self.ns
        want = key.tobytes()
        for _ in range(len(table)):
            bid = table.item(pos)
            if bid == EMPTY:
                return -1
            if bid >= 0 and spaces.item(bid) == ns and keys[bid].tobytes() == want:
                return bid
            pos = (pos + 1) & mask
        return -1

    def _table_insert(
        self, ns: int, words: np.ndarray, bid: int, identity: int | None = None
    ) -> None:
        mask = len(self._table) - 1
        pos = (self._hash_one(int(ns), words) if identity is None else identity) & mask
        while self._table[pos] >= 0:
            pos = (pos + 1) & mask
        if self._table[pos] == TOMBSTONE:
            self._tombstones -= 1
        self._table[pos] = bid

    def _table_position(self, identity: int, bid: int) -> int:
        """Where the hash table holds ``bid``, whose key's identity (hash) is ``identity``."""
        mask = len(self._table) - 1
        pos = identity & mask
        for _ in range(len(self._table)):
            if self._table[pos] == bid:
                return pos
            if self._table[pos] == EMPTY:
                break
            pos = (pos + 1) & mask
        raise AssertionError(f"block {bid} missing from the hash table")

    def _rehash(self, size: int) -> None:
        """Rebuild the table at ``size`` slots, placing all live blocks in vectorised rounds."""
        table = np.full(size, EMPTY, dtype=np.int32)
        mask = np.uint64(size - 1)
        ids = self.live_ids()
        pos = self._hash(self.ns[ids], self.keys[ids]) & mask
        while len(ids):
            p = pos.astype(np.int64)
            free = table[p] == EMPTY
            # Of several blocks probing one free slot, the first takes it.
            _, first = np.unique(p[free], return_index=True)
            winners = np.flatnonzero(free)[first]
            table[p[winners]] = ids[winners]
            placed = np.zeros(len(ids), dtype=bool)
            placed[winners] = True
            ids = ids[~placed]
            pos = (pos[~placed] + np.uint64(1)) & mask
        self._table = table
        self._tombstones = 0

    _FILLS = {
        "keys": 0,
        "ns": 0,
        "owner": 0,
        "state": FREE,
        "nbytes": 0,
        "pins": 0,
        "inflight": 0,
        "gen": 0,
        "slot": -1,
        "checksum": 0,
        "parent": NO_REF,
        "child": -1,
        "last_access": -np.inf,
        "keyed_seen": -np.inf,
        "keyed_since": -np.inf,
    }

    def _fields(self) -> list[np.ndarray]:
        return [getattr(self, name) for name in self._FILLS]

    def _grow(self, capacity: int) -> None:
        for name, fill in self._FILLS.items():
            a = getattr(self, name)
            out = np.full((capacity, *a.shape[1:]), fill, dtype=a.dtype)
            out[: len(a)] = a
            setattr(self, name, out)
        self._capacity = capacity


class Mementos:
    """The table's mementos (see History): slots keyed by a 64-bit identity, forgotten oldest
    first. Slots are numbered in the order mementos are put, so the removal order is the
    slots' own and needs no links: per slot only its identity (8 bytes; 0 once taken, a
    *hole*) and, in the map from identity to slot (open addressing, linear probing, two thirds
    to three quarters full), 5.3 to 6 more. The oldest is the first slot from ``_head`` on that is no hole.
    Once numbering reaches the arrays' end (or far fewer are held than the arrays' length),
    ``compact`` renumbers the held ones densely in their order, which gives back the holes,
    and sizes the arrays to them plus a sixteenth, 64 at least (``slots_for``): the per-slot arrays (here
    and a listener's) stay within a sixteenth of the held count, at one renumbering per
    sixteenth of it put, each a few vectorised passes.
    """

    __slots__ = ("_head", "_ident", "_map", "_top", "_v", "count")

    def __init__(self) -> None:
        self.count = 0
        self._ident = np.zeros(0, dtype=np.uint64)
        self._map = np.full(16, -1, dtype=np.int32)
        self._head = 0  # the slots below are holes
        self._top = 0  # slots numbered since the last ``compact``
        self._views()

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self._ident, self._map

    def put(self, ident: int) -> int:
        """A new memento for ``ident`` (absent), the newest; returns its slot."""
        ident = ident or _IDENT_OF_ZERO
        if self._top == len(self._ident):
            # Grown in place, holes and all: the table ``compact``s first (``full``).
            self._grow(slots_for(self._top + 1))
        slot = self._top
        self._top += 1
        self._v[0][slot] = ident
        self.count += 1
        if self.count > _MAP_MAX_LOAD * len(self._map):
            self._remap(map_size(self.count))
        else:
            self._place(slot, ident)
        return slot

    def take(self, ident: int) -> int:
        """The slot of ``ident``'s memento, taken out of the map and the order (the caller
        then ``free``s it), or -1 if none."""
        ident = ident or _IDENT_OF_ZERO
        idents, table = self._v
        size = len(table)
        pos = ident % size
        while True:
            slot = table[pos]
            if slot < 0:
                return -1
            if idents[slot] == ident:
                self._unmap(pos)
                idents[slot] = _HOLE
                return slot
            pos = pos + 1 if pos + 1 < size else 0

    def take_many(self, idents: np.ndarray) -> np.ndarray:
        """``take`` for each of ``idents`` (uint64; distinct keys): slots, -1 where none.
        Which are present is found by vectorised probing (a round per probe step; the map is
        at most three quarters full, so a few rounds settle most), then each present one is taken."""
        idents = np.where(idents == _HOLE, np.uint64(_IDENT_OF_ZERO), idents)
        table, known = self._map, self._ident
        size = len(table)
        pos = (idents % np.uint64(size)).astype(np.int64)
        todo = np.arange(len(idents))
        present: list[int] = []
        while len(todo):
            slot = table[pos]
            occupied = slot >= 0
            hit = occupied & (known[np.maximum(slot, 0)] == idents[todo])
            present += todo[hit].tolist()
            going = occupied & ~hit
            todo, pos = todo[going], (pos[going] + 1) % size
        slots = np.full(len(idents), -1, dtype=np.int64)
        for i in present:
            slots[i] = self.take(int(idents[i]))
        return slots

    def take_oldest(self) -> int:
        idents = self._v[0]
        slot = self._head
        while idents[slot] == _HOLE:
            slot += 1
        self._head = slot + 1
        self.take(idents[slot])
        return slot

    def free(self, slot: int) -> None:
        """``slot`` (taken) is done with; it stays a hole until the next ``compact``."""
        self.count -= 1

    def full(self) -> bool:
        """Numbering has reached the arrays' end: the next ``put`` grows them in place
        unless the table ``compact``s first."""
        return self._top == len(self._ident)

    def compact(self) -> np.ndarray | None:
        """When numbering has reached the arrays' end, or the arrays are over twice what
        the held mementos need (and past ``MIN_COMPACT_SLOTS``), renumber the held ones
        ``0 .. count - 1`` in their order and size the arrays to them (``slots_for``), the
        map too if it is over twice their need; returns ``order`` (``order[i]``: the old
        slot of new slot ``i``, ascending; a listener moves what it kept by slot the same
        way), or None when nothing moved."""
        size = len(self._ident)
        full = 0 < self._top == size
        if not full and size <= max(MIN_COMPACT_SLOTS, 2 * slots_for(self.count)):
            return None
        head, top = self._head, self._top
        order = np.flatnonzero(self._ident[head:top] != _HOLE) + head
        n = len(order)
        ident = np.zeros(slots_for(n), dtype=np.uint64)
        ident[:n] = self._ident[order]
        self._ident = ident
        self._head, self._top = 0, n
        if len(self._map) > 2 * map_size(n):
            self._remap(map_size(n))
        else:
            # Positions go by identity, which did not change: only the slots they name do.
            renum = np.zeros(top, dtype=np.int32)
            renum[order] = np.arange(n, dtype=np.int32)
            held = self._map >= 0
            self._map[held] = renum[self._map[held]]
            self._views()
        return order

    def _place(self, slot: int, ident: int) -> None:
        table = self._v[1]
        size = len(table)
        pos = ident % size
        while table[pos] >= 0:
            pos = pos + 1 if pos + 1 < size else 0
        table[pos] = slot

    def _unmap(self, pos: int) -> None:
        """Empty map position ``pos``, shifting back the entries after it that probed past
        it (linear probing's deletion without tombstones)."""
        idents, table = self._v
        size = len(table)
        hole, pos = pos, (pos + 1) % size
        while (slot := table[pos]) >= 0:
            home = idents[slot] % size
            # The entry may fill the hole unless its home lies cyclically in (hole, pos].
            if (pos - home) % size >= (pos - hole) % size:
                table[hole] = slot
                hole = pos
            pos = pos + 1 if pos + 1 < size else 0
        table[hole] = -1

    def _remap(self, size: int) -> None:
        """The map at ``size`` positions, every held slot placed in vectorised rounds."""
        table = np.full(size, -1, dtype=np.int32)
        slots = np.flatnonzero(self._ident[: self._top] != _HOLE)
        pos = (self._ident[slots] % np.uint64(size)).astype(np.int64)
        while len(slots):
            free = table[pos] < 0
            # Of several slots probing one free position, the first takes it.
            _, first = np.unique(pos[free], return_index=True)
            winners = np.flatnonzero(free)[first]
            table[pos[winners]] = slots[winners]
            placed = np.zeros(len(slots), dtype=bool)
            placed[winners] = True
            slots, pos = slots[~placed], (pos[~placed] + 1) % size
        self._map = table
        self._views()

    def _grow(self, size: int) -> None:
        new = np.zeros(size, dtype=np.uint64)
        new[: len(self._ident)] = self._ident
        self._ident = new
        self._views()

    def _views(self) -> None:
        # Scalar steps read and write through memoryviews (Python ints at a fraction of the
        # cost of numpy's scalar indexing), re-taken whenever an array is replaced.
        self._v: tuple[Any, Any] = (self._ident.data, self._map.data)


def map_size(n: int) -> int:
    """Positions of a memento map for ``n`` mementos: two thirds full, grown again past
    ``_MAP_MAX_LOAD`` (5.3 to 6 bytes a memento; half full to 0.6 cost 6.7 to 8, a tenth of
    a held block's history); any size (a position is the identity modulo the size), where a
    power of two left it a quarter to half full, 8 to 16 bytes a memento."""
    return max(16, n + n // 2)


def slots_for(n: int) -> int:
    """Length of a per-slot array that must hold ``n`` slots: a sixteenth more, not double,
    as the history is most of what the table adds per block and a doubled array is up to
    half empty; ``Mementos.compact`` sizes the arrays so at each renumbering, once per
    sixteenth of the held mementos put. At least 64 spare: a small history held near a
    fixed size would otherwise renumber every few puts (63 held in 64 slots: every one)."""
    return n + max(n // 16, 64)


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def repeats(words: np.ndarray) -> np.ndarray:
    """Which keys repeat an earlier key of the same batch."""
    n = len(words)
    dup = np.zeros(n, dtype=bool)
    if n < 2:
        return dup
    if n <= 64:
        raw = words.tobytes()
        seen: set[bytes] = set()
        for i in range(n):
            key = raw[KEY_BYTES * i : KEY_BYTES * (i + 1)]
            if key in seen:
                dup[i] = True
            seen.add(key)
        return dup
    lead = np.sort(words[:, 0])
    if not (lead[1:] == lead[:-1]).any():
        return dup  # distinct first words: distinct keys (the usual batch, one sort)
    _, first = np.unique(words, axis=0, return_index=True)
    dup[:] = True
    dup[first] = False
    return dup
