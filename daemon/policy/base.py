"""The eviction-policy plug point.

A policy orders the blocks resident in one tier and proposes victims. It is pure decision
code: it never touches bytes or I/O, and it takes ``now`` as an argument instead of reading a
clock, so the daemon and the offline trace replayer run the very same objects.

Whether a block *may* go (pinned by a lease, in flight, inside its protection period, of the
wrong slot size) is not the policy's business: the caller passes an ``evictable`` mask
function and the policy only ranks. ``victims`` is atomic: it proposes exactly ``n`` blocks or
none, and changes nothing; the caller then ``remove``s the ones it actually evicted.

Hints (``hint``): the engine names blocks it will read by a deadline (its waiting queue);
``victims`` proposes none of them until the deadline has passed, on top of the caller's mask.
Every policy implements it with ``kvtier.daemon.policy.hints.HintTable``, so the rule is the
same everywhere; its ``Hinted`` mixin's ``unhinted(mask, now)`` gives the rule to the store's
segment reclaim, which frees a whole segment without asking ``victims``.

Own admission (optional, ``density`` has one): ``admits(bid, parent, victim, now)`` says
whether a block missing from the tier is worth more than the would-be ``victim``,
``admits_many(bids, parents, victim, now)`` the same for a batch in order (a parent earlier in
the batch counts as accessed), and ``note_miss(bid, parent, now)`` records an access the tier
did not keep. The replayer asks ``admits`` for L1; the daemon asks ``admits_many`` for its top
tier whenever a block would have to evict to get in, and calls ``note_miss``.

One victim as an id (optional, ``heat`` and ``density`` have one): ``victim(now, incoming)``
answers as ``victims(1, now, None, (incoming,))`` would, with -1 for None. The replayer asks it
once per miss; other policies are asked through ``victims``.

A full tier's miss in one call (optional, ``heat`` and ``density`` have one):
``replace(bid, parent, now)``
takes ``victim(now, bid)``; with no victim it calls ``note_miss`` and returns ``NO_VICTIM``;
if its own ``admits`` declines ``bid`` against that victim, ``note_miss`` and ``DECLINED``;
else it removes the victim, inserts ``bid`` and returns the victim. The replayer calls it
instead of those steps, one call where they were four.

Owed work: a policy may leave part of an access's bookkeeping owed, to bound the work of one
call (``heat`` does; ``OwesNoWork`` gives the others the two members). ``work()`` does a
bounded part and returns whether some remains; ``on_owed``, None unless the owner sets it,
is called when some becomes owed where none was. The daemon sets it and then calls ``work``
between requests, so that a request asks nothing of a policy owing none; a policy must decide
alike whether ``work`` was called or not.

Block ids are rows of the store's index and are reused once a block is forgotten. A policy
must therefore never trust a link (a ``parent``) or a remembered history across a reuse; see
``forget``.

Kept history (optional, ``heat``, ``density`` and ``arc`` have one): the store frees a dropped block's
row at once and remembers its key by a memento slot a while (``BlockTable``, History).
``remember(bid, slot)`` saves the history of ``bid`` at ``slot`` just before ``forget(bid)``,
``revive(slot, bid)`` writes it into the new row of the same key stored again, and
``expire(slot)`` drops it, and ``renumber(order)`` moves what is kept when the table
compacts its slots (see ``kvtier.daemon.policy.memento``). Every policy keeps a dropped
block's hint so (``Hinted``; ``lru`` has no other history to keep).

Constructor parameters: every policy is built by ``make_policy(name, **params)`` and must
accept and ignore parameters it does not use, so that one parameter set serves all of them.
The shared names are ``capacity_blocks`` (the tier's size in blocks, or None where unknown)
and ``half_life_s`` (the heat half-life).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

NO_VICTIM = -1  # ``replace``: no block may go
DECLINED = -2  # ``replace``: the policy's own admission declined the incoming block

EvictableFn = Callable[[np.ndarray], np.ndarray]
"""Maps an int64 array of block ids to a bool array: may each block be evicted now?"""


class EvictionPolicy(Protocol):
    on_owed: Callable[[], None] | None
    """Called when work becomes owed where none was (see "Owed work"); None: nobody asks."""

    def insert(self, bid: int, now: float, parent: int = -1) -> None:
        """A block became resident in this tier; ``parent`` is its chain predecessor or -1.

        The parent need not be resident (or even known); a policy only follows the link while
        the parent stays resident under the same identity.
        """

    def insert_many(self, bids: np.ndarray, now: float, parents: np.ndarray) -> None:
        """``insert`` each block of ``bids`` in order, ``parents[i]`` the parent of
        ``bids[i]``: the same state as the loop, in one call, which a policy may vectorise
        (the blocks a Put stored, a batch moved into this tier)."""

    def touch(self, bid: int, now: float) -> None:
        """A resident block was read or written again."""

    def touch_many(self, bids: np.ndarray, now: float) -> None:
        """Touch each block of ``bids`` in order: the same state as ``touch`` per block
        (repeats included), in one call, which a policy may vectorise.

        All or nothing: if any id is not resident, raises KeyError for the first such id in
        order before changing anything (a loop of ``touch`` would have applied the ones
        before it).
        """

    def remove(self, bid: int) -> None:
        """A block left this tier (evicted, demoted, deleted). Unknown ids raise KeyError."""

    def victims(
        self,
        n: int,
        now: float,
        evictable: EvictableFn | None,
        incoming: Sequence[int] = (),
    ) -> np.ndarray | None:
        """Exactly ``n`` evictable resident blocks, coldest first, or None if fewer exist.

        ``evictable`` None means every resident block may go. ``incoming`` optionally names
        the blocks the room is being made for; adaptive policies (ARC) learn from it which
        list to shrink, others ignore it. Never changes the policy's state.
        """

    def forget(self, bid: int) -> None:
        """The id no longer names the block it named (its index row was freed and may be
        reused): drop any history kept for it, and its hint. A no-op for ids the policy does
        not know."""

    def remember(self, bid: int, slot: int) -> None:
        """``bid`` was dropped and ``forget`` follows: keep what makes up its history (its
        hint at least) at memento ``slot`` (``kvtier.daemon.policy.memento``)."""

    def revive(self, slot: int, bid: int) -> None:
        """The history kept at ``slot`` becomes that of ``bid``, a new row of its key."""

    def expire(self, slot: int) -> None:
        """The table forgot the key of ``slot``: drop what was kept there."""

    def renumber(self, order: np.ndarray) -> None:
        """The table renumbered its memento slots to give back memory (``Mementos.compact``):
        what was kept at slot ``order[i]`` is now at slot ``i``, and no other slot is held."""

    def hint(self, bids: np.ndarray, until: float, now: float) -> None:
        """The engine will read ``bids`` by ``until``: ``victims`` proposes none of them
        while its ``now <= until``. Ids need not be resident yet (the hint holds for a block
        inserted before the deadline); a block hinted twice keeps the later deadline."""

    def work(self) -> bool:
        """Do a bounded part of the work owed (see "Owed work"); whether some remains."""

    def __len__(self) -> int: ...

    def __contains__(self, bid: object) -> bool: ...


class InsertEach:
    """``insert_many`` as the loop of ``insert`` it stands for, for policies without a
    faster way."""

    def insert_many(self, bids: np.ndarray, now: float, parents: np.ndarray) -> None:
        insert = self.insert  # type: ignore[attr-defined]
        ids = np.asarray(bids, dtype=np.int64).reshape(-1).tolist()
        pars = np.asarray(parents, dtype=np.int64).reshape(-1).tolist()
        for bid, parent in zip(ids, pars, strict=True):
            insert(bid, now, parent)


class OwesNoWork:
    """The owed-work members for a policy whose every call does all its work."""

    on_owed: Callable[[], None] | None = None

    def work(self) -> bool:
        return False
