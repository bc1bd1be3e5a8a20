"""The space manager: where each block's copies live, written once for every tier.

It reserves slots (evicting, demoting to ``below`` or reclaiming whole segments from other
size classes to make room), places copies of blocks into a level (promotion, demotion,
write-through, flush, prefetch and readahead are all ``place``), drops copies, keeps the
tiers under their watermarks, and feeds the policies what happened.

Rules:
- A copy in a level is visible (``table.slot[b, col] >= 0``) only once its bytes are there
  (for a persistent tier: durable and indexed). A block with a pin, a copy in flight or inside
  its protection period is not evicted, but for the last: a put's reservation (``displace``)
  with nowhere else to go evicts the protected blocks of other owners over their share of the
  tier; eviction takes exactly the victims a policy proposed, or none.
- Evicting a block's last copy demotes it first: it is written to the first lower tier that
  takes writes and admits it, else it is dropped; but the balancer's victim that a lower tier
  admitted and did not store stays (``balance``). Evicting a copy that another tier also
  holds loses nothing ("clean"). A caller on a request's path asks for ``clean_only``
  reservations: they never wait for a demotion write, and what they cannot get the request
  does without (a Get then reads the block from the lower tier straight into its pages).
- A tenant's quota on a tier counts its copies there, the slots reserved for its copies
  in flight and the slots of its dropped copies (evicted, deleted, or of a put that failed)
  a persistent tier is still freeing or could not free yet (``quota_held``, kept for every
  tenant, as a reload may set a quota while they are in flight; a free that failed is tried
  again, ``retry_frees``, and the hold ends once it succeeds), so puts racing to the
  quota store no more than it, and the room an eviction makes is taken only once its slots
  are free (a put that found room but no free slot would evict another tenant's block for
  one).
- Policies hear of accesses (``touch``) right after the request is answered, and always
  before the next insert, eviction or drop decision (``apply_touches``). Work a policy owes
  (``work``) gets a turn of the loop at a time while it lasts, from when the policy says it
  owes some (``on_owed``, ``owed_work``); a turn that raises is logged and counted, and the
  work stays owed (``loops.InTurns``).
- A level whose policy has an own admission (``Level.own_admission``: the top tier's, under
  ``density``) is asked before blocks that would have to evict enter it (``admit_own``); a
  block it declines stays where it is, and an access it did not keep is told to its policy
  (``missed``), as the replayer does.
- A block held only in key-addressed tiers is known only for a while after one of them last
  confirmed it (``forget_unconfirmed``): such a tier drops blocks on its own.
- A copy is dropped by the tier that held it (``drop_copies``: eviction, deletion) or found
  gone (``lose_copy``: a failed read, a probe that found it absent; not a read or probe of
  an L3 that did not answer); a row with no copy left is forgotten once nobody holds it.
- A move records its copy only where the destination holds none yet and the row still holds
  the copy it read, or none at all (the bytes read were its last): a row that lost every copy
  while the move ran may have been stored again by a put (``BlockStore._claim_bare``), whose
  copies are the block's (``_SourceCopy``).

Thread-safety: event loop only (see ``daemon/store.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.daemon.counts import add_at
from kvtier.daemon.loops import InTurns
from kvtier.daemon.misses import EVICTED, MissLedger
from kvtier.daemon.policy.prefetch import PrefetchLedger
from kvtier.daemon.stack import Level, TierStack, TokenBucket
from kvtier.daemon.stats import Counters
from kvtier.daemon.table import READY, BlockTable
from kvtier.daemon.transfer import PrefetchExpired, TransferEngine
from kvtier.tiers.base import BlockRef, Health, Priority, TierKind, WriteOutcomes
from kvtier.tiers.executor import Urgency

log = logging.getLogger(__name__)

# How long dropped copies' slots that a persistent tier could not free (its index locked,
# full, or its WAL's checkpoint held up) wait before they are tried again: at first, and at
# most (the wait doubles after each failed try). A successful free of the same tier tries
# them at once. A lasting fault fails each try at once (counted as a remove failure), hence
# the backoff.
FREE_RETRY_S = 1.0
FREE_RETRY_MAX_S = 60.0
# How long the balancer leaves a tier alone after a pass that moved none of its victims down
# (the tier below had no room for any: its blocks protected, pinned or in flight), and passes
# over the victims a pass kept that way while it moves others. They stay, and the next pass
# would pick them again and ask the tier below for room, a scan of it, at every period
# (``mover.balance_interval_s``, 0.1 s by default) until its blocks may go.
BALANCE_RETRY_S = 1.0
# A tier none of whose victims waits (``SpaceManager.balance_kept``): ids, until when.
_NONE_KEPT = (np.zeros(0, dtype=np.int64), np.zeros(0))

EvictableFn = Callable[[np.ndarray], np.ndarray]


@dataclass(slots=True)
class _Unfreed:
    """A persistent tier's slots whose free failed, and the quota holds that end with it."""

    slots: list[int] = field(default_factory=list)
    holds: list[tuple[int, int]] = field(default_factory=list)
    since: float = 0.0  # monotonic time of the first failure
    next_try: float = 0.0
    delay_s: float = FREE_RETRY_S
    retrying: bool = False


class SpaceManager:
    def __init__(
        self,
        table: BlockTable,
        stack: TierStack,
        transfers: TransferEngine,
        counters: Counters,
        prefetches: PrefetchLedger,
        *,
        clock: Callable[[], float],
        started_at: float,
        batch_bytes: int = 64 << 20,
        batch_blocks: int = 4096,
    ) -> None:
        self.table = table
        self.stack = stack
        self.transfers = transfers
        self.counters = counters
        self.prefetches = prefetches
        self._clock = clock
        self.started_at = started_at
        self.batch_bytes = batch_bytes
        self.batch_blocks = batch_blocks
        # (owner, tier kind) -> bytes the owner (a tenant) may hold in that tier.
        self.quotas: dict[tuple[int, TierKind], int] = {}
        # (owner, tier kind) -> bytes of slots reserved whose copies are not yet recorded in
        # the table, and of dropped copies whose slots a persistent tier is still freeing or
        # could not free (``free_held``): they count against the owner's quota until
        # ``end_hold``. Every owner's, with a quota or not: a reload may set one while they
        # are in flight.
        self.quota_held: Counter[tuple[int, TierKind]] = Counter()
        # Owner index -> tenant label, for the quota counters' ``tenant`` label.
        self.owner_labels: dict[int, str] = {0: "default"}
        self._pending_touches: list[tuple[np.ndarray, float]] = []
        self._owed_work = InTurns(self._work_a_turn, "the policies' owed work", counters)
        self.background: set[asyncio.Task[Any]] = set()
        # Why keys are missing, for the lookup miss counts (metrics).
        self.misses = MissLedger()
        # Copies tiers dropped so far (``lose_copy``): a holder of blocks that sees it change
        # may be the last to hold one left with no copy.
        self.copies_lost = 0
        # Refs of the blocks ``lose_copy`` left with no copy in any tier while something held
        # them (a pin, a request), or a put that stored into such a row gave back so
        # (``BlockStore._abandon``), until seen gone or holding a copy again (``bare_rows``):
        # while there are none, a put looks for no such row among its keys.
        self.bare_refs: set[int] = set()
        # While recovery reads the persistent tiers' rows (``BlockStore.recover``): a later
        # row of a key may then replace the copy an earlier row gave its block
        # (``BlockStore._replace_recovered``), so no copy is made from those tiers meanwhile
        # (``_fastest_other``): a promotion kept the replaced row's bytes in L1, served after.
        self.rows_unsettled = False
        # Tier kind -> the slots of a persistent tier whose free failed, tried again later
        # (``retry_frees``) with their quota holds.
        self.unfreed: dict[TierKind, _Unfreed] = {}
        # Tier kind -> the slots of a persistent tier taken from blocks that a read in flight
        # may still read them for (a later recovered row of the key replaced the copy:
        # ``BlockStore._replace_recovered``), each with its block's ref: freed as the last
        # hold on that block ends (``free_read_held``, called wherever an in-flight mark is
        # dropped while this is not empty); their rows go sooner (``free_when_idle``). Freed
        # at once, one could go to another key's put before the read, which, failing its
        # checksum, would quarantine the slot and delete that put's row.
        self.read_held: dict[TierKind, list[tuple[int, int]]] = {}
        # Tier kind -> when the balancer tries a tier again whose last pass moved nothing down
        # (``BALANCE_RETRY_S``).
        self.balance_after: dict[TierKind, float] = {}
        # Tier kind -> (the victims its passes kept, until when each): the passes before then
        # pass over them (``BALANCE_RETRY_S`` from the pass that kept each) and go on with
        # the others.
        self.balance_kept: dict[TierKind, tuple[np.ndarray, np.ndarray]] = {}
        # When ``forget_unconfirmed`` last scanned the table: the next scan is due a quarter
        # of its period later, as the period is then (a SIGHUP may have lowered it).
        self._last_forget = -np.inf
        table.on_free.append(self._forget_in_policies)
        table.on_remember.append(self._remember_in_policies)
        table.on_revive.append(self._revive_in_policies)
        table.on_expire.append(self._expire_in_policies)
        table.on_renumber.append(self._renumber_in_policies)
        for level in stack:
            level.policy.on_owed = self.owed_work

    # ------------------------------------------------------------------ accesses

    def touch(self, bids: np.ndarray, now: float) -> None:
        """Record an access. The protection clock restarts at once; the policies hear of it
        right after the current request is answered (one ``touch_many`` per tier), and in
        any case before the store next inserts, evicts or drops anything."""
        self.table.last_access[bids] = now
        self._pend_touch(bids.copy(), now)

    def touch_one(self, bid: int, now: float) -> None:
        """``touch`` of one block (a single-key Get's), its row indexed as an int."""
        self.table.last_access[bid] = now
        self._pend_touch(np.array([bid], dtype=np.int64), now)

    def _pend_touch(self, bids: np.ndarray, now: float) -> None:
        """The policies hear of this access of ``bids`` (an array kept as it is: no caller
        changes it after) once the current request is answered (``touch``)."""
        self._pending_touches.append((bids, now))
        if len(self._pending_touches) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.apply_touches)
            except RuntimeError:  # no event loop (offline use): apply now
                self.apply_touches()

    def apply_touches(self) -> None:
        pending, self._pending_touches = self._pending_touches, []
        table = self.table
        for bids, now in pending:
            if len(bids) == 1:
                # A single-block request's touch, without array operations (``touch`` of one
                # block is ``touch_many`` of it, by the policy contract).
                bid = int(bids[0])
                if table.state[bid] == READY:
                    for level in self.stack:
                        if not level.keyed and table.slot[bid, level.col] >= 0:
                            level.policy.touch(bid, now)
                    self.record_accesses(bids, now)
                continue
            live = bids[table.state[bids] == READY]
            for level in self.stack:
                if not level.keyed:
                    level.policy.touch_many(live[table.slot[live, level.col] >= 0], now)
            self.record_accesses(live, now)

    def owed_work(self) -> None:
        """A policy began to owe work (its ``on_owed``: the heat policy's moves owed after
        the first touch of a deep chain): give the policies' ``work`` turns of the loop, one
        budget per policy per turn, so that other requests run between them, until none
        owes any. Requests themselves ask nothing. Without a running loop (offline use) it
        stays owed: the policy's next decision does it first."""
        self._owed_work.begin_soon()

    def _work_a_turn(self) -> bool:
        more = False
        for level in self.stack:
            more = level.policy.work() or more
        return more

    def record_accesses(self, bids: np.ndarray, now: float) -> None:
        """Tell lower tiers' admission rules of an access; ``selective`` tiers then take
        the blocks their rule now admits. The blocks' identities are hashed only for a rule
        that records them: under the default (every tier admits all) an access hashes none."""
        words: list[int] | None = None
        for level in self.stack.levels[1:]:
            if not level.admits_all:
                if words is None:
                    words = self.table.identities_of(bids)
                for word in words:
                    level.admission.record(word, now)
            if level.write_policy == "selective":
                self._write_admitted(bids, level, now)

    def after_store(self, bids: np.ndarray, now: float) -> None:
        """New blocks reached the top tier: copy them to ``write_through`` tiers, and to
        ``selective`` ones that admit them."""
        self.record_accesses(bids, now)
        for level in self.stack.levels[1:]:
            if level.write_policy == "write_through" and level.tier.health().accepts_writes:
                self.spawn(self.place(bids, level, Priority.BACKGROUND))

    def _write_admitted(self, bids: np.ndarray, level: Level, now: float) -> None:
        if not level.tier.health().accepts_writes:
            return
        held = bids[(self.table.slot[bids, level.col] < 0) & (self.table.state[bids] == READY)]
        held = np.array(
            [b for b in held.tolist() if not self.transfers.moving(self.table.ref(b), level.kind)],
            dtype=np.int64,
        )
        if len(held):
            admitted = held[self.admit(level, held, now)]
            if len(admitted):
                self.spawn(self.place(admitted, level, Priority.BACKGROUND))

    def admit(
        self, level: Level, bids: np.ndarray, now: float, parents: np.ndarray | None = None
    ) -> np.ndarray:
        """Which of ``bids`` ``level`` lets in, counting each reason: its admission rule,
        then, for those the rule lets in, its policy's own admission (``admit_own``;
        ``parents``: each block's chain predecessor, by default as the table links it)."""
        admit = np.ones(len(bids), dtype=bool)
        if len(bids) == 0 or (level.admits_all and level.own_admission is None):
            return admit
        if not level.admits_all:
            self._admit_by_rule(level, bids, now, admit)
        if level.own_admission is not None:
            ok = np.flatnonzero(admit)
            pars = self.table.parents_of(bids) if parents is None else parents
            admit[ok] = self.admit_own(level, bids[ok], pars[ok], now)
        return admit

    def _admit_by_rule(self, level: Level, bids: np.ndarray, now: float, admit: np.ndarray) -> None:
        """``level``'s admission rule on each of ``bids``, into ``admit``, counting each
        reason."""
        victim_word: int | None = None
        if not level.keyed and not level.slots.allocator.can_allocate(
            int(self.table.nbytes[bids[0]])
        ):
            coldest = level.policy.victims(1, now, self.evictable(level, now))
            if coldest is not None:
                victim_word = self.table.identities_of(coldest[:1])[0]
        for j, word in enumerate(self.table.identities_of(bids)):
            decision = level.admission.decide(word, victim_word, now)
            admit[j] = decision.admit
            self.counters.inc(
                "admission",
                tier=level.label,
                reason=decision.reason,
                admitted="true" if decision.admit else "false",
            )

    def admit_own(
        self,
        level: Level,
        bids: np.ndarray,
        parents: np.ndarray,
        now: float,
        *,
        clean_only: bool = False,
    ) -> np.ndarray:
        """Which of ``bids`` (in chain order, none held by ``level``) ``level``'s policy's own
        admission lets in: those the tier has room for without evicting, and of the rest
        each one its policy finds worth more than the coldest block that making room would
        evict (with ``clean_only``, of those with another copy, as such a reservation
        evicts). All of them when the level has no own admission or nothing is evictable.
        The decisions are counted with the policy's name as their reason."""
        own = level.own_admission
        admit = np.ones(len(bids), dtype=bool)
        if own is None or level.keyed or len(bids) == 0:
            return admit
        nbytes = int(self.table.nbytes[bids[0]])
        alloc = level.slots.allocator
        room = alloc.free_slots(nbytes)
        if room >= len(bids):
            return admit
        self.apply_touches()
        mask = self.evictable(level, now, alloc.slot_bytes_for(nbytes), clean_only)
        coldest = level.policy.victims(1, now, mask)
        if coldest is None:
            return admit
        # The whole batch is asked, so that the blocks past the room take the lineage of
        # those before them; only the answers past the room count.
        answers = own.admits_many(bids.tolist(), parents.tolist(), int(coldest[0]), now)
        admit[room:] = answers[room:]
        taken = int(np.count_nonzero(admit[room:]))
        label = level.label
        self.counters.inc("admission", taken, tier=label, reason=own.reason, admitted="true")
        declined = len(bids) - room - taken
        self.counters.inc("admission", declined, tier=label, reason=own.reason, admitted="false")
        return admit

    def missed(self, level: Level, bids: np.ndarray, parents: np.ndarray, now: float) -> None:
        """``level`` did not keep blocks a request just read or stored (its policy's own
        admission declined them, or it had no room): a policy with an own admission hears of
        each access, in chain order, as the replayer tells it (``note_miss``)."""
        own = level.own_admission
        if own is None or len(bids) == 0:
            return
        self.apply_touches()
        note = own.note_miss
        for bid, parent in zip(bids.tolist(), parents.tolist(), strict=True):
            note(bid, parent, now)

    # ------------------------------------------------------------------ placing

    async def place(
        self,
        bids: np.ndarray,
        dst: Level,
        priority: Priority,
        *,
        clean_only: bool = False,
        deadline: float | None = None,
        prefetch: bool = False,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> np.ndarray:
        """Give each of ``bids`` a copy in ``dst``, copied from the fastest other tier
        holding it; returns which now have one. A block already moving into ``dst`` is waited
        for (until ``deadline``, where there is one: a move still under way then counts as
        not placed, though its own caller may finish it), not moved twice; a caller more
        urgent than that move (a Get behind a prefetch) raises it to its own ``priority`` and
        ``rank``, what of it still waits for a thread and what it has yet to start. Where
        ``dst`` has an own admission (``admit_own``), a block it declines stays where it is;
        one a request reads (not a ``prefetch``) is told to its policy as a miss. ``rank``
        orders the copies, and the demotions that make room for them, among the waiting
        transfers of ``priority`` (higher sooner; see ``Priority``). ``urgency``: the move
        this one is part of (a demotion making room for it), raised with it; by default the
        move's own."""
        table = self.table
        bids = np.asarray(bids, dtype=np.int64)
        if len(bids) == 0:
            return np.zeros(0, dtype=bool)
        want = bids[(table.slot[bids, dst.col] < 0) & (table.state[bids] == READY)]
        if len(want) > 1:
            _, first = np.unique(want, return_index=True)
            want = want[np.sort(first)]  # each once, in the order asked
        if dst.own_admission is not None and len(want):
            want = self._admit_promotions(want, dst, clean_only, prefetch)
        refs = table.refs(want).tolist() if len(want) else []
        if urgency is None and refs and priority > Priority.DEMAND:
            urgency = Urgency(priority, rank)  # demand moves have nothing more urgent
        mine_idx, waits = self.transfers.claim(refs, dst.kind, urgency) if refs else ([], [])
        mine = want[mine_idx]
        if waits:
            self.transfers.hurry(waits, *(urgency.now() if urgency else (priority, rank)))
        if len(mine):
            add_at(table.inflight, mine, 1)
            try:
                await self._place_owned(
                    mine, dst, priority, clean_only, deadline, prefetch, urgency
                )
            finally:
                self.end_in_flight(mine)
                self.transfers.settle([refs[i] for i in mine_idx], dst.kind)
        if waits:
            await self._moved(waits, deadline)
        return table.slot[bids, dst.col] >= 0

    async def _moved(self, waits: list[asyncio.Future[bool]], deadline: float | None) -> None:
        """Wait for the moves of other callers that ``place`` found under way, until
        ``deadline``: the flush at stop that found a durable put's blocks still writing under
        ``tiers.l2.write_bytes_s`` waited for all of them, far past its timeout."""
        if deadline is None:
            await asyncio.gather(*waits, return_exceptions=True)
            return
        # Shielded by asyncio.wait: a move left to run ends on its own, for its own caller.
        await asyncio.wait(waits, timeout=max(0.0, deadline - self._clock()))

    def _admit_promotions(
        self, bids: np.ndarray, dst: Level, clean_only: bool, prefetch: bool
    ) -> np.ndarray:
        """The blocks of ``bids`` ``dst``'s own admission takes; the others stay where they
        are (a read of one is a miss of ``dst``'s policy; a prefetch of one is cancelled)."""
        now = self._clock()
        parents = self.table.parents_of(bids)
        ok = self.admit_own(dst, bids, parents, now, clean_only=clean_only)
        if ok.all():
            return bids
        declined = ~ok
        if prefetch:
            for word in self.table.identities_of(bids[declined]):
                self.prefetches.evict(word, now)
        else:
            self.missed(dst, bids[declined], parents[declined], now)
        return bids[ok]

    async def _place_owned(
        self,
        bids: np.ndarray,
        dst: Level,
        priority: Priority,
        clean_only: bool,
        deadline: float | None,
        prefetch: bool,
        urgency: Urgency | None,
    ) -> np.ndarray:
        table = self.table
        done = np.zeros(len(bids), dtype=bool)
        src_col = self._fastest_other(bids, dst)
        jobs: list[Awaitable[None]] = []
        # Bytes planned against each rate limit on the way (a copy with a deadline only).
        planned: dict[TokenBucket, int] = {}
        for (col, size, owner), idx in _groups(
            src_col, table.nbytes[bids].astype(np.int64), table.owner[bids].astype(np.int64)
        ):
            src = self.stack.levels[col]
            if src.keyed and src.tier.health().state is not Health.OK:
                # The blocks it cannot serve now (``KeyTier.unserved``: down, or a lost
                # master's) are read as misses at once (``KeyTier.read``: None): room made
                # for them would evict blocks for nothing, each time a request asks for them.
                unserved = src.keys.unserved(table.block_refs(bids[idx]))
                if unserved:
                    idx = np.delete(idx, unserved)
                    if len(idx) == 0:
                        continue
            group_bytes, caps = self._budget(src, dst, deadline)
            step = max(1, min(self.batch_blocks, group_bytes // max(size, 1)))
            for start in range(0, len(idx), step):
                part = idx[start : start + step]
                nbytes = len(part) * size
                if any(planned.get(b, 0) + nbytes > cap for b, cap in caps.items()):
                    break  # this group could not start in time, nor could any after it
                for b in caps:
                    planned[b] = planned.get(b, 0) + nbytes
                # Each group's blocks are woken for their waiters as the group ends.
                group_refs = table.refs(bids[part]).tolist()
                self.transfers.regroup(group_refs, dst.kind)
                jobs.append(
                    self._waking(
                        functools.partial(
                            self._copy_group,
                            bids,
                            part,
                            src,
                            dst,
                            size,
                            priority,
                            clean_only,
                            deadline,
                            prefetch,
                            done,
                            owner,
                            urgency,
                        ),
                        group_refs,
                        dst,
                    )
                )
            else:
                continue
            break  # later groups would be written past the hole this one leaves
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, PrefetchExpired):
                raise r
        return done

    async def _waking(
        self, job: Callable[[], Awaitable[None]], refs: list[int], dst: Level
    ) -> None:
        # The copy is made here, not by the caller: a group cancelled before its task starts
        # (its Get cancelled at the gather) would leave a coroutine never awaited. Its refs'
        # waiters are then woken by the claim's settle.
        try:
            await job()
        finally:
            self.transfers.wake(refs, dst.kind)

    def _budget(
        self, src: Level, dst: Level, deadline: float | None
    ) -> tuple[int, dict[TokenBucket, float]]:
        """The most bytes of one copy group from ``src`` into ``dst``, and the most bytes a
        copy may plan against each rate limit on the way (none without a deadline or a
        limit). Groups are ``mover.batch_bytes`` (at most one fdatasync and one index commit
        each on a disk); for a copy with a deadline (the flush at stop, a prefetch) under a
        rate limit, an eighth of what the slowest limit lets through before it: a group
        starts whole or not at all (``TransferEngine._throttle``), and one larger than that
        never started, so a throttled flush wrote nothing although part of it fitted. A
        limit lets through its rate times the time left plus its one-second burst; groups
        past that would expire in the throttle, but they reserved their room first, and in a
        full L2 that evicted persistent blocks for nothing, so they are not made."""
        limited = [b for b in (src.reads, dst.writes) if b.rate > 0]
        if deadline is None or not limited:
            return self.batch_bytes, {}
        left = max(deadline - self._clock(), 0.0)
        group = min(b.rate for b in limited) * left / 8
        return max(1, min(self.batch_bytes, int(group))), {
            b: b.rate * (left + 1.0) for b in limited
        }

    async def _copy_group(
        self,
        bids: np.ndarray,
        part: np.ndarray,
        src: Level,
        dst: Level,
        nbytes: int,
        priority: Priority,
        clean_only: bool,
        deadline: float | None,
        prefetch: bool,
        done: np.ndarray,
        owner: int = 0,
        urgency: Urgency | None = None,
    ) -> None:
        table = self.table
        group = bids[part]
        if dst.keyed:
            slots: list[int] = [0] * len(group)  # a key-addressed copy: present, no slot
        else:
            slots = await self.reserve(
                dst,
                nbytes,
                len(group),
                priority,
                clean_only=clean_only,
                owner=owner,
                urgency=urgency,
            )
            if len(slots) < len(group):
                self.counters.inc("no_room", len(group) - len(slots), tier=dst.label)
                if dst.own_admission is not None and not prefetch:
                    left = group[len(slots) :]
                    self.missed(dst, left, table.parents_of(left), self._clock())
            group, part = group[: len(slots)], part[: len(slots)]
        # The source copy may have gone while we waited for room (a failed read elsewhere):
        # such a block is not copied (its source tier is never asked for slot -1).
        still = table.slot[group, src.col] >= 0
        spare: list[int] = []
        if not still.all():
            if not dst.keyed:
                spare = [s for s, k in zip(slots, still.tolist(), strict=True) if not k]
            slots = [s for s, k in zip(slots, still.tolist(), strict=True) if k]
            group, part = group[still], part[still]
        if len(group) == 0:
            await self.give_back(dst, owner, spare, nbytes)
            return
        refs = table.block_refs(group)
        source = _SourceCopy.of(table, group, src)
        read_from = source.slots.tolist()
        src_failed: list[bool] = [False] * len(group)
        try:
            outcomes, src_failed = await self.transfers.copy(
                src,
                dst,
                read_from,
                slots,
                refs,
                nbytes,
                source.checksums.tolist(),
                priority,
                deadline,
                urgency=urgency,
            )
        except PrefetchExpired:
            outcomes = None
        except BaseException:
            # Cancelled (the copy raises nothing else but PrefetchExpired): the slots go
            # back as the group unwinds; the copy's thread, if it ran, is done with them.
            if not dst.keyed:
                self.give_back_soon(dst, owner, spare + slots, nbytes)
            raise
        now = self._clock()
        n = len(group)
        outs = None if outcomes is None else WriteOutcomes.of(outcomes)
        ok = np.zeros(n, dtype=bool) if outs is None else outs.ok.copy()
        ok &= table.state[group] == READY
        # A row may have lost every copy while this one ran and been stored again (a put into
        # a row held nowhere, ``_claim_bare``): its new copy is here already, or the bytes
        # read are not its newest. The slot goes back.
        ok &= source.current(table, group, dst)
        slot_arr = np.asarray(slots, dtype=np.int64)
        good = group[ok]
        if not dst.keyed:
            # What the copies stored counts in the table's usage from the set_slots below;
            # the other slots stay held until they are free (``give_back``).
            self.end_hold(dst, owner, len(good) * nbytes)
        table.set_slots(good, dst.col, slot_arr[ok])
        if dst.keyed or src.keyed:
            table.keyed_seen[good] = now  # written there, or read from it: there now
        if dst.keyed:
            table.keyed_since[good] = now
        if dst.checksummed and outs is not None and len(good):
            table.set_checksums(good, dst.col, outs.checksums[ok])
        if len(good):
            dst.policy.insert_many(good, now, table.parents_of(good))
        done[part[ok]] = True
        if prefetch:
            for j, word in enumerate(table.identities_of(group)):
                if ok[j]:
                    self.prefetches.complete(word, now)
                else:
                    self.prefetches.evict(word, now)
        failed_slots = [] if dst.keyed else spare + slot_arr[~ok].tolist()
        for j in np.flatnonzero(~ok).tolist():
            if src_failed[j]:
                # The source's read failed verification or found the block absent: that tier
                # dropped it (not when it could not tell: an L3 that did not answer).
                self.lose_copy(int(group[j]), src, read_from[j])
        if failed_slots:
            await self.give_back(dst, owner, failed_slots, nbytes)
        self.counters.inc(
            "copies", int(np.count_nonzero(done[part])), direction=f"{src.label}->{dst.label}"
        )

    def _fastest_other(self, bids: np.ndarray, dst: Level) -> np.ndarray:
        """Per block, the column of the fastest tier other than ``dst`` holding it, or -1; a
        persistent slot tier's copy is none while recovery reads rows (``rows_unsettled``)."""
        out = np.full(len(bids), -1, dtype=np.int64)
        for level in reversed(self.stack.levels):
            if level is dst or (self.rows_unsettled and level.persistent and not level.keyed):
                continue
            out[self.table.slot[bids, level.col] >= 0] = level.col
        return out

    # ---------------------------------------------------------------- reserving

    def evictable(
        self,
        level: Level,
        now: float,
        slot_bytes: int | None = None,
        clean_only: bool = False,
        protected_owner: int | None = None,
    ) -> EvictableFn:
        """Mask function for ``level``'s policy: unpinned, idle, unprotected blocks (of one
        slot size when ``slot_bytes`` is given; with another copy elsewhere when
        ``clean_only``). With ``protected_owner``, only the blocks of that owner and of
        owners within their share of the tier (``_shares``) are kept by their
        protection period (``displace``)."""
        table = self.table
        guard = level.guard
        alloc = None if level.keyed else level.slots.allocator
        # Copies in other slot tiers of this node; a shared remote copy may vanish, so it
        # does not make a local copy clean.
        others = [lv.col for lv in self.stack if lv is not level and not lv.keyed]
        shielded = None
        if protected_owner is not None:
            usage, share = self._shares(level, protected_owner)
            shielded = usage <= share
            shielded[protected_owner] = True

        def mask(bids: np.ndarray) -> np.ndarray:
            last_access = table.last_access[bids]
            if shielded is not None:
                last_access = np.where(shielded[table.owner[bids]], last_access, -np.inf)
            ok = guard.evictable(now, last_access, table.pins[bids], table.inflight[bids])
            ok &= table.state[bids] == READY
            if slot_bytes is not None and alloc is not None:
                ok &= alloc.slot_sizes(table.slot[bids, level.col]) == slot_bytes
            if clean_only:
                ok &= (table.slot[bids][:, others] >= 0).any(axis=1) if others else False
            return ok

        return mask

    def _shares(self, level: Level, owner: int) -> tuple[np.ndarray, float]:
        """The slot bytes each owner's blocks take in ``level`` (at least through ``owner``)
        and an equal share of the tier among the owners holding blocks there (``owner``
        counted): against a put of ``owner`` with nowhere else to go, the blocks of an owner
        holding more than that lose their protection period, ``owner``'s own excepted
        (``displace``). A tenant that keeps more than its share protected by reading it loses
        protection on the excess, not one that keeps its share.

        Both are in the room blocks take, slots (each block rounded up to the slot size), not
        in their bytes: blocks of several sizes fill their slots unequally, and a tenant
        holding half of the slots holds half of the tier whatever its blocks' size. The
        capacity leaves out the part of the filled space that segment tails are (space no
        slot of the segment's size fits into, and no owner's slots count) and the slots the
        tier holds out of use (quarantined), which no owner can hold either."""
        usage = self.table.slot_usage[level.col]
        if owner >= len(usage):
            usage = np.concatenate([usage, np.zeros(owner + 1 - len(usage), usage.dtype)])
        holding = usage > 0
        holding[owner] = True
        alloc = level.slots.allocator
        capacity = float(alloc.capacity_bytes)
        if alloc.filled_bytes:
            capacity *= alloc.used_bytes / alloc.filled_bytes
        capacity -= level.quarantined_bytes
        return usage, capacity / int(np.count_nonzero(holding))

    def _within_share(
        self, level: Level, victims: np.ndarray, now: float, slot_bytes: int, owner: int
    ) -> np.ndarray:
        """``victims`` (a displacing round's) less the protected blocks of each owner past
        those it holds beyond its share (``_shares``): the shares are weighed once a round,
        and a round taking all its victims from one owner over its share took it below."""
        table = self.table
        displaced = ~self.evictable(level, now, slot_bytes)(victims)
        if not displaced.any():
            return victims
        usage, share = self._shares(level, owner)
        keep = ~displaced
        owners = table.owner[victims]
        for over in np.unique(owners[displaced]).tolist():
            theirs = np.flatnonzero(displaced & (owners == over))
            sizes = level.slots.allocator.slot_sizes(table.slot[victims[theirs], level.col])
            # Taken while the owner still holds more than its share, each counted once gone.
            keep[theirs[np.cumsum(sizes) - sizes < usage[over] - share]] = True
        return victims[keep]

    async def reserve(
        self,
        level: Level,
        nbytes: int,
        count: int,
        priority: Priority,
        *,
        clean_only: bool = False,
        owner: int = 0,
        urgency: Urgency | None = None,
        displace: bool = False,
        nowhere_else: bool = False,
    ) -> list[int]:
        """Up to ``count`` free slots of ``level`` for blocks of ``nbytes`` that ``owner``
        (a tenant) will hold: free ones first, then by evicting (or demoting) the policy's
        coldest evictable blocks of that slot size, then by reclaiming whole segments of
        other sizes. A tenant with a quota on the tier that it would pass makes room among
        its own blocks only, and gets no more than fits its quota; the slots count against
        it until the caller has recorded or released their copies and calls ``end_hold``.

        ``displace`` (a put's reservation): where that leaves it short and no slot tier
        below ``level`` takes writes (``_moves_down``: the put has nowhere else to go; a
        disk tier reading its index back hands out no slots), or ``nowhere_else`` (those
        below did not store the blocks: their admission declined them, or they had no
        room either), the blocks inside
        their protection period of other owners over their share (``_shares``) are
        evicted too, coldest first. Protection is renewed
        by every read, a lookup's included, so a tenant that looked its blocks up once every
        ``protect_s`` held as much of the tier as it had filled, however little it used it,
        and every other tenant's put was refused; what one owner may hold against the others
        is what its pins and hints hold, bounded by the hint budget. What a put's
        reservation is short of is not counted in ``full_rejections`` here: a tier below, or
        this one at a second try, may store those blocks yet (the put counts what none
        stored)."""
        self.apply_touches()
        if level.recovering:
            return []
        quota = self.quotas.get((owner, level.kind))
        if quota is not None:
            fits = await self._within_quota(
                level, owner, quota, nbytes, count, priority, clean_only, urgency
            )
            if fits < count and not nowhere_else:
                # Blocks, as the evictions beside them: a put larger than the room its quota
                # leaves is refused the rest as one refused outright is. A put's second try
                # at the top tier (nowhere_else) asks again for blocks its first counted.
                self.counters.inc(
                    "quota_rejections",
                    count - fits,
                    tier=level.label,
                    tenant=self.owner_labels.get(owner, owner),
                )
            count = fits
            if count == 0:
                return []
        # Held before the next await: a put of the tenant reserving meanwhile counts them.
        # Held without a quota too: a reload may set one before the copies are recorded.
        # (get and a store: a Counter's += of a missing key calls its Python __missing__.)
        held_key = (owner, level.kind)
        self.quota_held[held_key] = self.quota_held.get(held_key, 0) + count * nbytes
        slots: list[int] = []
        try:
            await self._take_slots(
                level,
                nbytes,
                count,
                priority,
                clean_only,
                urgency,
                slots,
                displace,
                owner,
                nowhere_else,
            )
        except BaseException:
            # Cancelled while it evicted: the slots it had taken go back (held until free).
            self.give_back_soon(level, owner, slots, nbytes)
            self.end_hold(level, owner, (count - len(slots)) * nbytes)
            raise
        # Nothing to give back when every slot came (a zero count still clears its key).
        if not slots or len(slots) < count:
            self.end_hold(level, owner, (count - len(slots)) * nbytes)
        return slots

    def end_hold(self, level: Level, owner: int, nbytes: int) -> None:
        """Stop counting ``nbytes`` of ``owner``'s reserved slots against its quota on
        ``level``: their copies are recorded in the table, or the slots released."""
        key = (owner, level.kind)
        held = self.quota_held.get(key)
        if held is not None:
            held -= nbytes
            if held > 0:
                self.quota_held[key] = held
            else:
                # pop, not del: a Counter's __delitem__ is a Python method.
                self.quota_held.pop(key)

    async def _take_slots(
        self,
        level: Level,
        nbytes: int,
        count: int,
        priority: Priority,
        clean_only: bool,
        urgency: Urgency | None,
        slots: list[int],
        displace: bool = False,
        owner: int = 0,
        nowhere_else: bool = False,
    ) -> None:
        """Up to ``count`` free slots (``reserve``), into ``slots`` as they are taken: a
        caller cancelled while the slots it is short of are made free (an eviction's
        demotion written) still has those it got, to give back."""
        alloc = level.slots.allocator
        slots += alloc.allocate_many(nbytes, count)
        if len(slots) == count:
            return
        if nowhere_else and not (displace and self._others_over_share(level, owner)):
            return  # the first try made all the room it could without displacing
        slot_bytes = alloc.slot_bytes_for(nbytes)
        if not await self._evict_for(
            level, nbytes, count, priority, clean_only, urgency, slots, slot_bytes, None, displace
        ):
            return
        if (
            displace
            and len(slots) < count
            and self._others_over_share(level, owner)
            and (nowhere_else or not self._moves_down(level))
            and not await self._evict_for(
                level, nbytes, count, priority, clean_only, urgency, slots, slot_bytes, owner, True
            )
        ):
            return
        now = self._clock()
        # A reclaim may free no whole segment (a slot came to be held meanwhile), yet the
        # slots it freed may be of the size: they are taken, and the next segment tried.
        while len(slots) < count:
            dropped = await self._reclaim_segment(
                level, now, priority, clean_only, urgency, slot_bytes, count - len(slots)
            )
            slots += alloc.allocate_many(nbytes, count - len(slots))
            if not dropped:
                break
            now = self._clock()
        if len(slots) < count and not displace:  # a put counts its own (``reserve``)
            self.counters.inc("full_rejections", count - len(slots), tier=level.label)

    def _others_over_share(self, level: Level, owner: int) -> bool:
        """Whether an owner other than ``owner`` holds more than its share of ``level``
        (``_shares``): a displacing pass asks the policy for victims, a scan of the tier,
        which finds none otherwise (a daemon without tenants: every block is owner 0's)."""
        usage, share = self._shares(level, owner)
        over = usage > share
        over[owner] = False
        return bool(over.any())

    async def _evict_for(
        self,
        level: Level,
        nbytes: int,
        count: int,
        priority: Priority,
        clean_only: bool,
        urgency: Urgency | None,
        slots: list[int],
        slot_bytes: int,
        protected_owner: int | None,
        for_put: bool,
    ) -> bool:
        """Evict the coldest evictable blocks of ``slot_bytes`` (``evictable``) into
        ``slots`` until it holds ``count`` or none is left; False where the tier could not
        free its victims' slots (the caller then stops: every further victim would be lost
        for nothing, and the refusal is counted, but ``for_put``'s: the put counts it)."""
        alloc = level.slots.allocator
        now = self._clock()
        # A victim's slot is free once its eviction is done (a disk tier deletes its index row
        # first, on a thread), and a reservation that ran meanwhile may have taken it: the
        # coldest evictable blocks left are then evicted in turn, so that a caller is short
        # only where no block of the size is evictable. Not where the tier could not free
        # the victims' slots (they stay held): every further victim would be lost for nothing.
        # A victim that stayed (pinned, read or taken in flight while it was demoted:
        # ``_evict`` names them, as a victim's row does not tell once a new block may have
        # it) is not picked again by this reservation, which goes on with the others: it
        # ends once a round finds no victim, so each round takes new ones.
        stayed = np.empty(0, dtype=np.int64)
        while len(slots) < count and alloc.stats().size_classes.get(slot_bytes):
            evictable = self.evictable(level, now, slot_bytes, clean_only, protected_owner)
            victims = self._victims(level, count - len(slots), now, _without(evictable, stayed))
            if protected_owner is not None:
                victims = self._within_share(level, victims, now, slot_bytes, protected_owner)
            if len(victims) == 0:
                break
            freed, kept, _ = await self._evict(
                level,
                victims,
                priority,
                clean_only=clean_only,
                urgency=urgency,
                protected_owner=protected_owner,
            )
            slots += alloc.allocate_many(nbytes, count - len(slots))
            if not freed:
                if not for_put:
                    self.counters.inc("full_rejections", count - len(slots), tier=level.label)
                return False  # nor would a segment's blocks free theirs
            stayed = np.r_[stayed, kept]
            now = self._clock()
        return True

    async def _within_quota(
        self,
        level: Level,
        owner: int,
        quota: int,
        nbytes: int,
        count: int,
        priority: Priority,
        clean_only: bool,
        urgency: Urgency | None = None,
    ) -> int:
        """How many of ``count`` blocks fit ``owner``'s quota on ``level`` after evicting
        (or demoting) the owner's own coldest evictable blocks to make room.

        The victims count against the owner until their slots are free (``evict`` holds
        them while a disk tier frees them on a thread), so another put of the owner cannot
        take the room they make. Where the room is still short after an eviction (a victim
        stayed, pinned or read while it was demoted, or the victims were smaller than the
        blocks to come), the owner's coldest evictable blocks left are evicted in turn, as
        ``_take_slots`` does, so that a caller is short only where none of the owner's
        blocks is evictable (a victim that stayed is not picked again)."""
        table = self.table
        table._fit_owner(owner)
        key = (owner, level.kind)
        stayed = np.empty(0, dtype=np.int64)
        while True:
            over = int(table.usage[level.col, owner]) + self.quota_held[key] + count * nbytes
            over -= quota
            if over <= 0:
                break
            now = self._clock()
            base = self.evictable(level, now, clean_only=clean_only)

            def mine(bids: np.ndarray, base: EvictableFn = base) -> np.ndarray:
                return base(bids) & (table.owner[bids] == owner)

            n = min(-(-over // nbytes), len(level.policy))
            victims = self._victims(level, n, now, _without(mine, stayed))
            if len(victims) == 0:
                break
            freed, kept, evicted = await self._evict(
                level, victims, priority, clean_only=clean_only, urgency=urgency
            )
            self.counters.inc(
                "quota_evictions",
                evicted,  # not the victims that stayed
                tier=level.label,
                tenant=self.owner_labels.get(owner, owner),
            )
            if not freed:
                break  # the tier kept the slots: no more to gain
            stayed = np.r_[stayed, kept]
        room = (quota - int(table.usage[level.col, owner]) - self.quota_held[key]) // nbytes
        return max(0, min(count, room))

    def _victims(self, level: Level, n: int, now: float, mask: EvictableFn) -> np.ndarray:
        """Exactly ``n`` victims, or all the evictable blocks there are when fewer."""
        victims = level.policy.victims(n, now, mask)
        if victims is None:
            possible = int(np.count_nonzero(mask(self.table.holders(level.col))))
            victims = level.policy.victims(possible, now, mask) if possible else None
        return np.asarray(victims if victims is not None else [], dtype=np.int64)

    def _droppable(
        self,
        level: Level,
        now: float,
        clean_only: bool = False,
        protected_owner: int | None = None,
    ) -> EvictableFn:
        """``evictable``, less the blocks a live hint protects: for the paths that drop blocks
        without asking the policy's ``victims`` (which leaves hinted blocks by itself)."""
        mask = self.evictable(level, now, clean_only=clean_only, protected_owner=protected_owner)
        unhinted = getattr(level.policy, "unhinted", None)
        return mask if unhinted is None else unhinted(mask, now)

    async def _reclaim_segment(
        self,
        level: Level,
        now: float,
        priority: Priority,
        clean_only: bool,
        urgency: Urgency | None = None,
        slot_bytes: int | None = None,
        need: int | None = None,
    ) -> bool:
        """Free one whole segment: the one whose blocks are all evictable and were least
        recently used, among those whose every slot in use is such a block's where there is
        one. A slot that a copy in progress holds (reserved, not yet recorded) keeps its
        segment taken: such a segment goes only where its slots are of ``slot_bytes`` (the
        size wanted), as evicting its blocks frees no segment. From a segment of that size
        only ``need`` blocks go (as many slots as the caller is short of). True when it dropped
        blocks whose slots the tier freed, whether or not a whole segment came free (a
        reservation takes the freed slots of its size and tries again); False when no
        segment's blocks can all go, every one stayed, or the tier could not free their
        slots."""
        alloc = level.slots.allocator
        holders = self.table.holders(level.col)
        if len(holders) == 0:
            return False
        segs = alloc.segments_of(self.table.slot[holders, level.col])
        ok = self._droppable(level, now, clean_only)(holders)
        order = np.argsort(segs, kind="stable")
        segs_sorted, ok_sorted = segs[order], ok[order]
        starts = np.flatnonzero(np.r_[True, segs_sorted[1:] != segs_sorted[:-1]])
        all_ok = np.logical_and.reduceat(ok_sorted, starts)
        if not all_ok.any():
            return False
        # A segment with a slot that no block holds comes free only once that is given
        # back: it goes last, and only where its slots are of the size wanted.
        first = holders[order][starts]
        whole = np.diff(np.r_[starts, len(order)]) == alloc.segment_used(segs_sorted[starts])
        if slot_bytes is not None:
            size = alloc.slot_sizes(self.table.slot[first, level.col])
            all_ok &= whole | (size == slot_bytes)
            if not all_ok.any():
                return False
        newest = np.maximum.reduceat(self.table.last_access[holders[order]], starts)
        pick = int(np.lexsort((newest, ~whole, ~all_ok))[0])
        seg = int(segs_sorted[starts[pick]])
        victims = holders[segs == seg]
        if slot_bytes is not None and need is not None and size[pick] == slot_bytes:
            # Its freed slots serve the put as they are (no whole segment need come free, and
            # one a copy in progress holds a slot of would not): only as many blocks as the
            # put is short of go, the policy's coldest of them.
            droppable = self._droppable(level, now, clean_only)

            def in_seg(bids: np.ndarray) -> np.ndarray:
                return droppable(bids) & (
                    alloc.segments_of(self.table.slot[bids, level.col]) == seg
                )

            victims = self._victims(level, need, now, in_seg)
        freed, kept, _ = await self._evict(
            level, victims, priority, clean_only=clean_only, urgency=urgency
        )
        self.counters.inc("segment_reclaims", tier=level.label)
        return freed and len(kept) < len(victims)

    # ----------------------------------------------------------------- evicting

    async def evict(
        self,
        level: Level,
        victims: np.ndarray,
        priority: Priority,
        *,
        clean_only: bool = False,
        urgency: Urgency | None = None,
    ) -> bool:
        """Take ``victims`` out of ``level``. A victim whose only copy is here is first
        demoted to the first lower tier that takes it (unless ``clean_only``, whose victims
        all have other copies). False when the tier could not free the victims' slots
        (``release``)."""
        freed, _, _ = await self._evict(
            level, victims, priority, clean_only=clean_only, urgency=urgency
        )
        return freed

    async def _evict(
        self,
        level: Level,
        victims: np.ndarray,
        priority: Priority,
        *,
        clean_only: bool = False,
        urgency: Urgency | None = None,
        protected_owner: int | None = None,
        keep_unplaced: bool = False,
    ) -> tuple[bool, np.ndarray, int]:
        """``evict``, the victims that stayed (pinned, read, touched, hinted or taken
        in flight while they were demoted; with ``protected_owner``, touched counts only for
        that owner's blocks, as in ``evictable``; with ``keep_unplaced``, those a lower tier
        admitted but none stored, ``_demote``), and how many victims it evicted
        (``evictions``: neither those nor any that lost this copy meanwhile). A reservation
        asks this rather than looking at the victims' rows once it is done: a victim left
        with no copy is forgotten and its row freed, and a new block may have it, with a copy
        in ``level``, by then."""
        table = self.table
        victims = np.asarray(victims, dtype=np.int64)
        # Copies in other slot tiers of this node; a shared remote copy may vanish, so it
        # does not make a local copy clean.
        others = [lv.col for lv in self.stack if lv is not level and not lv.keyed]
        only_here = (
            ~(table.slot[victims][:, others] >= 0).any(axis=1)
            if others
            else np.ones(len(victims), bool)
        )
        dirty = victims[only_here]
        kept = victims[:0]
        if len(dirty) and not clean_only:
            add_at(table.inflight, victims, 1)
            try:
                unplaced = await self._demote(level, dirty, priority, urgency)
            finally:
                add_at(table.inflight, victims, -1)
                if self.read_held:
                    self.free_read_held()
            # While the writes ran a request may have pinned, read, touched or hinted a
            # victim: such a block stays (and now has a clean lower copy).
            # A victim may also have lost this copy meanwhile (a failed read drops it).
            here = table.slot[victims, level.col] >= 0
            droppable = self._droppable(level, self._clock(), protected_owner=protected_owner)
            stay = here & ~droppable(victims)
            if keep_unplaced and len(unplaced):
                stay |= here & np.isin(victims, unplaced)
            kept = victims[stay]
            victims = victims[here & ~stay]
        if protected_owner is not None and len(victims):
            self._count_displaced(level, victims)
        # A persistent tier frees the slots on a thread, after the copies stopped counting
        # against their owners' quotas: they are held against them until then, or a put of
        # an owner at its quota would take that room, find no free slot, and evict another
        # tenant's block for one.
        if level.persistent and not level.keyed:
            holds = self.hold_copies(level, victims)
            refs = self.table.block_refs(victims)
            slots = self.drop_copies(victims, level)
            freed = await asyncio.shield(self.free_held(level, slots, holds, refs=refs))
        else:
            freed = await self.release(level, self.drop_copies(victims, level))
        self.counters.inc("evictions", len(victims), tier=level.label)
        return freed, kept, len(victims)

    def _count_displaced(self, level: Level, victims: np.ndarray) -> None:
        """Count, per owner, the ``victims`` of a displacing eviction (``reserve``) still
        inside their protection period: what another tenant's put took of what protection
        would have kept (``displaced_evictions``)."""
        protected = ~self.evictable(level, self._clock())(victims)
        if not protected.any():
            return
        owners, counts = np.unique(self.table.owner[victims[protected]], return_counts=True)
        for owner, n in zip(owners.tolist(), counts.tolist(), strict=True):
            self.counters.inc(
                "displaced_evictions",
                n,
                tier=level.label,
                tenant=self.owner_labels.get(owner, owner),
            )

    def free_held(
        self,
        level: Level,
        slots: list[int],
        holds: list[tuple[int, int]],
        repeats: list[int] | None = None,
        refs: Sequence[BlockRef] | None = None,
    ) -> asyncio.Task[bool]:
        """``release`` of ``slots`` (dropped copies' slots of a persistent tier), then
        ``end_holds`` of ``holds``, as a background task (``spawn``) that a caller awaits
        shielded: cancelled with its caller while it waited for a thread, the slots were
        never freed (taken for good, the tier's rows kept) and the holds ended while nothing
        was free. The holds end only once the tier has freed the slots: where it could not
        (``release`` False, or raised) the slots stay taken, and so does the room they hold
        in their owners' quotas (a put of an owner at its quota would take it, find no free
        slot, and evict another tenant's block for one), until ``retry_frees`` frees them.
        ``repeats``: slots taken out of ``read_held`` (``free_read_held``), rows recovery
        replaced, freed with them and counted as ``recovered_repeats_dropped`` once freed,
        as the others it drops are (``BlockStore._drop_repeated``). ``refs``: the blocks
        that held ``slots`` (one each), so that only a put of one of their keys drops their
        rows before the free (``SlotTier.removing``); without, any put does."""
        # Before the free is tried: a put of one of their keys that commits first drops the
        # rows with its own (``SlotTier.removing``).
        level.slots.removing(slots, refs)
        if repeats:
            # Noted as removing, with their keys, when ``free_when_idle`` kept them: noted
            # again here, unkeyed, a slot whose row its key's commit had deleted since came
            # back for every later commit of any key to delete again.
            slots = [*slots, *repeats]

        async def free() -> bool:
            freed = await self._release_logged(level, slots, "")
            if freed:
                if repeats:
                    self.counters.inc("recovered_repeats_dropped", len(repeats), tier=level.label)
                self.end_holds(level, holds)
                self.retry_frees(level, now=True)
            else:
                self._defer_free(level, slots, holds)
            return freed

        return self.spawn(free())

    async def _release_logged(self, level: Level, slots: list[int], again: str) -> bool:
        """``release``, where an error is logged, counted and taken as not freed."""
        try:
            return await self.release(level, slots)
        except Exception:
            log.exception("%s: freeing %d slots%s failed", level.label, len(slots), again)
            self.counters.inc("background_errors")
            return False

    def _defer_free(self, level: Level, slots: list[int], holds: list[tuple[int, int]]) -> None:
        """Keep slots the tier could not free (and their owners' quota holds) for
        ``retry_frees``; the first of a run is logged."""
        if not slots:
            self.end_holds(level, holds)
            return
        pending = self.unfreed.get(level.kind)
        if pending is None:
            now = time.monotonic()
            pending = self.unfreed[level.kind] = _Unfreed(since=now, next_try=now + FREE_RETRY_S)
            log.warning(
                "%s: %d slots could not be freed (see the tier's health); tried again on "
                "its next successful free and every %g-%gs, their tenants' quota held until then",
                level.label,
                len(slots),
                FREE_RETRY_S,
                FREE_RETRY_MAX_S,
            )
        pending.slots += slots
        pending.holds += holds
        self.counters.inc("frees_deferred", len(slots), tier=level.label)

    def retry_frees(self, level: Level | None = None, *, now: bool = False) -> None:
        """Try again to free the slots a persistent tier could not (``level``'s, or every
        tier's), in the background: those whose wait is over, or all of them with ``now``
        (the tier has just freed others). Freed, their quota holds end; failed again, they
        wait twice as long (up to ``FREE_RETRY_MAX_S``)."""
        levels = [level] if level is not None else list(self.stack)
        clock = time.monotonic()
        for lv in levels:
            pending = self.unfreed.get(lv.kind)
            if pending is None or pending.retrying or not (now or clock >= pending.next_try):
                continue
            pending.retrying = True
            # Outside any request's log context: the retry frees the slots of earlier
            # requests, and its line is the daemon's, not the request whose free started it.
            contextvars.Context().run(self.spawn, self._retry_free(lv, pending))

    async def _retry_free(self, level: Level, pending: _Unfreed) -> None:
        slots, holds = pending.slots, pending.holds
        pending.slots, pending.holds = [], []
        try:
            freed = await self._release_logged(level, slots, " again")
        except BaseException:  # cancelled (the daemon stops): they stay for the next try
            freed = False
            raise
        finally:
            pending.retrying = False
            if not freed:
                pending.slots = slots + pending.slots
                pending.holds = holds + pending.holds
        self.counters.inc("free_retries", tier=level.label)
        if not freed:
            pending.delay_s = min(2 * pending.delay_s, FREE_RETRY_MAX_S)
            pending.next_try = time.monotonic() + pending.delay_s
            return
        self.end_holds(level, holds)
        self.counters.inc("frees_retried", len(slots), tier=level.label)
        if pending.slots:  # deferred while this try ran: try them at once
            self.retry_frees(level, now=True)
            return
        del self.unfreed[level.kind]
        log.warning(
            "%s: %d slots that could not be freed are free now (after %.1fs); their "
            "tenants' quota is given back",
            level.label,
            len(slots),
            time.monotonic() - pending.since,
        )

    async def settle_frees(self) -> None:
        """At the stop, once nothing else will free slots: every background task waited for
        (frees, and the retries they start), then the frees a persistent tier could not do
        tried once more, whatever their wait, and waited for. The index of a tier that still
        cannot free them keeps their rows, and the next start serves those blocks again
        (deleted or evicted ones): said once per tier. An index another process still keeps
        locked holds the stop up for one busy timeout (``index.BUSY_TIMEOUT_S``), as a free
        in flight at the stop already did."""
        self.free_read_held()
        await self.drain()
        self.retry_frees(now=True)
        await self.drain()
        for kind, pending in self.unfreed.items():
            log.warning(
                "%s: %d slots could not be freed before the stop; its index keeps their "
                "rows, so the blocks that held them (deleted or evicted) are served again "
                "after the restart",
                self.stack[kind].label,
                len(pending.slots),
            )

    def free_when_idle(self, level: Level, slots: np.ndarray, bids: np.ndarray) -> None:
        """Free ``slots`` of ``level``, just taken from ``bids`` (in flight: a read may have
        named them before), once nobody holds those blocks (``read_held``). Their rows go
        sooner, with the tier's next block commit of their keys (``SlotTier.removing``):
        kept till the free, a put of one of their keys (the block's later copy lost
        meanwhile, a failed read) committed its row beside the older one, which a crash then
        left to the next start's recovery to serve until it read the newer; and a release of
        one quarantined by a failed read of it handed it out before that free released it
        again."""
        level.slots.removing(slots.tolist(), self.table.block_refs(bids))
        held = self.read_held.setdefault(level.kind, [])
        held += zip(slots.tolist(), self.table.refs(bids).tolist(), strict=True)

    def free_read_held(self) -> None:
        """Free (``free_held``, in the background) the slots of ``read_held`` whose blocks
        nobody holds now (``_idle_read_held``); the others wait for a later call: each drop
        of an in-flight mark makes one while ``read_held`` is not empty (``end_in_flight``,
        a Get's end, a demotion's, a put's commit), so a slot goes as the last hold on its
        block ends."""
        for kind in list(self.read_held):
            level = self.stack[kind]
            if idle := self._idle_read_held(level):
                # No quota holds: the table counts the copies that replaced them. Outside any
                # request's log context: the slots are recovery's, not those of the request
                # whose hold ended last (its line is the daemon's, as ``retry_frees``' is).
                contextvars.Context().run(self.free_held, level, [], [], idle)

    def _idle_read_held(self, level: Level) -> list[int]:
        """Take out of ``read_held`` the slots of ``level`` whose blocks nobody holds now (no
        in-flight mark, or forgotten), so no read still uses them, and return them for the
        caller to free. None while recovery reads rows (``rows_unsettled``): their tier frees
        nothing before its last chunk is in."""
        held = self.read_held.get(level.kind)
        if not held or self.rows_unsettled:
            return []
        table = self.table
        rows = table.resolve_many(np.array([ref for _, ref in held], dtype=np.int64))
        busy = ((rows >= 0) & (table.inflight[np.maximum(rows, 0)] > 0)).tolist()
        idle = [slot for (slot, _), b in zip(held, busy, strict=True) if not b]
        if len(idle) == len(held):
            del self.read_held[level.kind]
        elif idle:
            self.read_held[level.kind] = [h for h, b in zip(held, busy, strict=True) if b]
        return idle

    async def give_back(self, level: Level, owner: int, slots: list[int], nbytes: int) -> None:
        """Release ``slots`` of ``level`` that ``reserve`` gave ``owner`` for blocks of
        ``nbytes`` and that no copy uses (it failed, or was not made), their hold on the
        owner's quota ending once they are free: a persistent tier frees them on a thread
        (``free_held``, awaited shielded), and until then a put of the owner at its quota
        taking their room would find no free slot and evict another tenant's block."""
        freeing = self.give_back_soon(level, owner, slots, nbytes)
        if freeing is not None:
            await asyncio.shield(freeing)

    def give_back_soon(
        self, level: Level, owner: int, slots: list[int], nbytes: int
    ) -> asyncio.Task[bool] | None:
        """``give_back`` without awaiting, for a caller that is unwinding (cancelled while
        it copied into the slots): a persistent tier's slots are freed by a background task
        (``free_held``, returned), other tiers' at once. Nothing else gives such slots back
        (the transfer engine frees none): not given back here, they were lost for good."""
        if not slots:
            return None
        held = (owner, len(slots) * nbytes)
        if level.persistent:
            return self.free_held(level, slots, [held])
        level.slots.remove(slots)
        self.end_hold(level, *held)
        return None

    def hold_copies(self, level: Level, bids: np.ndarray) -> list[tuple[int, int]]:
        """Hold the bytes of ``bids``' copies in ``level`` against their owners' quotas
        (``quota_held``) while their slots are given back; the ``(owner, bytes)`` held, for
        ``end_holds``."""
        table = self.table
        if len(bids) == 0:
            return []
        owners = table.owner[bids].astype(np.int64)
        per_owner = np.zeros(int(owners.max()) + 1, dtype=np.int64)
        np.add.at(per_owner, owners, table.nbytes[bids].astype(np.int64))
        holds = [(int(o), int(per_owner[o])) for o in np.flatnonzero(per_owner)]
        for owner, nbytes in holds:
            self.quota_held[(owner, level.kind)] += nbytes
        return holds

    def end_holds(self, level: Level, holds: list[tuple[int, int]]) -> None:
        """``end_hold`` of each ``(owner, bytes)`` that ``hold_copies`` held."""
        for owner, nbytes in holds:
            self.end_hold(level, owner, nbytes)

    async def _demote(
        self, level: Level, dirty: np.ndarray, priority: Priority, urgency: Urgency | None = None
    ) -> np.ndarray:
        """Write ``dirty`` (blocks whose only local copy is in ``level``) to the first lower
        slot tier that takes writes and admits each. Returns those a tier admitted but none
        stored (no room there: its blocks pinned, in flight or protected; a write that
        failed); the blocks no tier admitted are not among them."""
        todo = dirty
        wanted = dirty[:0]
        now = self._clock()
        for lower in self.stack.lower(level.kind):
            if len(todo) == 0:
                break
            # Key-addressed tiers are fed in the background (write_policy), never on the
            # path of the request that made room. A disk degraded by a fault that may pass
            # takes the batch it lets through to find out (``retry_due``): without a
            # demotion to send it, it refused writes until a restart.
            if lower.keyed or not lower.tier.health().takes_writes:
                continue
            if lower.write_policy != "write_through":
                todo_admit = todo[self.admit(lower, todo, now)]
            else:
                todo_admit = todo
            if len(todo_admit) == 0:
                continue
            ok = await self.place(todo_admit, lower, priority, urgency=urgency)
            self.counters.inc("demoted_blocks", int(np.count_nonzero(ok)), tier=lower.label)
            self.counters.inc("demotion_failures", int(np.count_nonzero(~ok)), tier=lower.label)
            wanted = np.union1d(wanted, todo_admit)
            placed = set(todo_admit[ok].tolist())
            todo = np.asarray([b for b in todo.tolist() if b not in placed], dtype=np.int64)
        return np.intersect1d(wanted, todo)

    def drop_copy(self, bid: int, level: Level) -> int | None:
        """Remove ``level``'s copy of a block (forgetting the block once no copy is left).
        Returns the slot when the caller must ``release`` it (persistent tiers); other slots
        are freed here."""
        slots = self.drop_copies(np.array([bid], dtype=np.int64), level)
        return slots[0] if slots else None

    def drop_copies(self, bids: np.ndarray, level: Level) -> list[int]:
        """``drop_copy`` of distinct blocks, each of which has a copy in ``level``, as array
        operations where the structures allow (an eviction drops thousands at once). Returns
        the slots the caller must ``release`` (persistent tiers; others are freed here)."""
        self.apply_touches()
        table = self.table
        bids = np.asarray(bids, dtype=np.int64)
        if level is self.stack.top and self.prefetches.outstanding:
            now = self._clock()
            for word in table.identities_of(bids):
                self.prefetches.evict(word, now)
        slots = table.slot[bids, level.col].tolist()
        table.clear_slots(bids, level.col)
        gone = ~(table.slot[bids] >= 0).any(axis=1)  # no copy left anywhere: forgotten
        if gone.any():
            self.misses.record(table.identities_of(bids[gone]), EVICTED)  # a delete discards
        # Each block leaves its policy before the next does, and is forgotten (its history
        # dropped by every policy) right after: a policy that bounds its history on each
        # removal (ARC's ghosts) keeps the same entries as removing them one by one.
        remove = level.policy.remove
        for bid, forgotten in zip(bids.tolist(), gone.tolist(), strict=True):
            remove(bid)
            if forgotten:
                table.remove(bid)
        if level.keyed:
            return []
        if level.persistent:
            return slots
        level.slots.remove(slots)
        return []

    async def release(self, level: Level, slots: list[int]) -> bool:
        """Give slots back to a tier: persistent tiers forget their blocks durably first
        (background I/O; the slots are reusable once it is done). False when the tier could
        not forget them (counted as ``remove_failures``; the slots stay held, and ``free_held``
        has them tried again)."""
        if not slots:
            return True
        if not level.persistent:
            level.slots.remove(slots)
            return True
        ok = bool(await self.transfers.run(Priority.BACKGROUND, level.slots.remove, slots))
        if not ok:
            self.counters.inc("remove_failures", len(slots), tier=level.label)
        return ok

    def lose_copy(self, bid: int, level: Level, slot: int | None = None) -> None:
        """A tier dropped its copy of a block (a read failed verification, or a probe of a
        key-addressed tier found it absent): forget it. The row stays, for its holder to
        forget once done (``forget_orphans``). ``slot``: the copy a failed read was of. The
        read waited for its thread; the copy may have been lost meanwhile (another request's
        read of it failed) and the block stored there again (a put, a move), in another slot:
        that copy stays."""
        held = self.table.slot[bid, level.col]
        if held >= 0 and (slot is None or held == slot):
            level.policy.remove(bid)
            self.table.clear_slots(bid, level.col)
            self.copies_lost += 1
            self.counters.inc("copies_lost", tier=level.label)
            if not (self.table.slot[bid] >= 0).any():
                self.bare_refs.add(self.table.ref(bid))

    def bare_rows(self) -> np.ndarray:
        """The rows of ``bare_refs`` still live and held in no tier; the refs of the others
        (forgotten since, or given a copy again) are dropped."""
        table = self.table
        rows = [table.resolve(ref) for ref in self.bare_refs]
        bare = [b for b in rows if b >= 0 and not (table.slot[b] >= 0).any()]
        if len(bare) < len(rows):
            self.bare_refs = {table.ref(b) for b in bare}
        return np.array(bare, dtype=np.int64)

    def lose_copies(self, bids: np.ndarray, level: Level) -> None:
        """``lose_copy`` of distinct blocks; those left with no copy and held by nobody (no
        pin, nothing in flight) are forgotten now, the others once their holds end."""
        for bid in bids.tolist():
            self.lose_copy(bid, level)
        self.forget_orphans(bids)

    def end_in_flight(self, bids: np.ndarray) -> None:
        """End one in-flight hold of each of ``bids`` (``table.inflight``, raised by whoever
        kept the blocks from eviction and deletion while it copied or persisted them; a block
        named twice loses two). A block that lost its last copy meanwhile, and is held by
        nobody now, is forgotten (``forget_orphans``), and the slots of ``read_held`` whose
        blocks nobody holds now are freed (``free_read_held``)."""
        add_at(self.table.inflight, bids, -1)
        self.forget_orphans(bids)
        if self.read_held:
            self.free_read_held()

    def forget_orphans(self, bids: np.ndarray) -> None:
        """A block that lost its last copy while held (a failed read) is forgotten once
        nobody holds it any more."""
        table = self.table
        orphans = bids[
            (table.state[bids] == READY)
            & (table.inflight[bids] == 0)
            & (table.pins[bids] == 0)
            & ~(table.slot[bids] >= 0).any(axis=1)
        ]
        # Nearly always none: only the few found are deduplicated (a sort of every batch
        # was a few percent of a durable put's event-loop time).
        for b in np.unique(orphans).tolist() if len(orphans) else ():
            self.bare_refs.discard(table.ref(b))
            table.remove(b)

    def _forget_in_policies(self, bid: int) -> None:
        for level in self.stack:
            level.policy.forget(bid)

    # A dropped block's history, kept by every policy (its hint at least; heat, density and
    # arc their ranking state too; see ``kvtier.daemon.policy.memento``).

    def _remember_in_policies(self, bid: int, slot: int) -> None:
        for level in self.stack:
            level.policy.remember(bid, slot)

    def _revive_in_policies(self, slot: int, bid: int) -> None:
        for level in self.stack:
            level.policy.revive(slot, bid)

    def _expire_in_policies(self, slot: int) -> None:
        for level in self.stack:
            level.policy.expire(slot)

    def _renumber_in_policies(self, order: np.ndarray) -> None:
        for level in self.stack:
            level.policy.renumber(order)

    # ------------------------------------------------------------- known in L3

    def forget_unconfirmed(self, unconfirmed_s: float, stale_s: float = np.inf) -> None:
        """Forget the blocks whose every copy is in key-addressed tiers and which none of them
        confirmed (``table.keyed_seen``) for ``unconfirmed_s``, unless an eviction from that
        tier could not take them either (pinned, in flight, protected, or hinted by its
        policy). Lookups ask the tier again about such rows of their chains and drop what it
        no longer holds (``BlockStore._discover``); a row no Lookup asks about would stay for
        good, so this bounds the table. Forgetting one loses nothing: a lookup that misses it
        asks the tier again.

        The same pass drops the key-addressed copy of blocks also held locally that was
        written there ``stale_s`` ago (``table.keyed_since``, ``L3Config.stale_after_s``: the
        store may have expired it by now, as its expiry runs from that write, which the
        tier's later confirmations do not renew): a block held here keeps being read here,
        and the node would neither write it there again (the tier's admission writes blocks
        without a copy there: ``_write_admitted``) nor count it out. Dropped,
        the block is written again at its next access the tier's admission takes, with a
        fresh expiry. Runs every quarter of ``unconfirmed_s`` (the balancer's period
        is its timer), so a row goes within 1.25 ``unconfirmed_s`` of its last confirmation
        (a backlog beyond ``batch_blocks`` takes a balancer period per batch more) and the
        table is scanned rarely."""
        keyed = [lv for lv in self.stack if lv.keyed]
        now = self._clock()
        if not keyed or now < self._last_forget + unconfirmed_s / 4:
            return
        self._last_forget = now
        table = self.table
        # Whole columns, not fancy indexing: a million rows cost milliseconds.
        slot = table.slot[: table.rows]
        stale = table.keyed_seen[: table.rows] < now - unconfirmed_s
        stale &= (slot[:, [lv.col for lv in keyed]] >= 0).any(axis=1)
        local = [lv.col for lv in self.stack if not lv.keyed]
        if local:
            held_here = (slot[:, local] >= 0).any(axis=1)
            stale &= ~held_here
            if stale_s < np.inf and self._drop_stale_copies(keyed, held_here, now - stale_s):
                self._last_forget = -np.inf  # a backlog: the next batch at the next pass
        cand = np.flatnonzero(stale)
        for level in keyed:
            # What an eviction from the tier would take (``evictable``: not pinned, in flight
            # or protected, and not hinted): a row a request used within the protection
            # period stays, so a Lookup's answer holds for the Get that follows it (a Get
            # does not ask the tier again).
            mask = self.evictable(level, now)
            if (unhinted := getattr(level.policy, "unhinted", None)) is not None:
                mask = unhinted(mask, now)
            if len(cand):
                cand = cand[mask(cand)]
        if len(cand) > self.batch_blocks:
            # A backlog (L3 confirmed many blocks at once) goes a batch per balancer pass,
            # as an eviction's does, so no pass holds the event loop long.
            cand = cand[: self.batch_blocks]
            self._last_forget = -np.inf
        for level in keyed:
            held = cand[table.slot[cand, level.col] >= 0]
            if len(held):
                self.drop_copies(held, level)
                self.counters.inc(
                    "rows_forgotten", len(held), tier=level.label, reason="unconfirmed"
                )

    def _drop_stale_copies(
        self, keyed: list[Level], held_here: np.ndarray | np.bool_, before: float
    ) -> bool:
        """``forget_unconfirmed``'s drop of key-addressed copies written ``before`` (as
        ``table.keyed_since`` dates them), of blocks held locally too (``held_here``, per row
        of the table; a batch per pass, as the rows it forgets). True when more are left than
        the batch took."""
        table = self.table
        slot = table.slot[: table.rows]
        old = table.keyed_since[: table.rows] < before
        old &= held_here
        old &= table.state[: table.rows] == READY
        more = False
        for level in keyed:
            held = np.flatnonzero(old & (slot[:, level.col] >= 0))
            # A row a transfer holds may be on its way there again: left for the next pass.
            held = held[table.inflight[held] == 0]
            if len(held) > self.batch_blocks:
                held, more = held[: self.batch_blocks], True
            if len(held):
                self.drop_copies(held, level)
                self.counters.inc("copies_expired", len(held), tier=level.label)
        return more

    # ------------------------------------------------------------- watermarks

    async def balance(self) -> None:
        """Above a tier's high watermark, move its coldest evictable blocks down until it is
        below the low watermark. During warm-up nothing moves before the hard limit. A victim
        a lower tier admits but has no room for (its blocks pinned, in flight or protected)
        or failed to write stays: the tier has room for it, and a later pass tries again
        (``BALANCE_RETRY_S`` later: the passes before then pick other victims, or where
        none moved leave the tier alone; only a reservation, making room for blocks to
        come, drops it). One that no lower
        tier admits leaves the store, as it would at the hard limit: the rule judged it not
        worth keeping, and the room it frees is there for the next puts. A tier
        in memory with no slot tier below it that takes writes now (a lone top tier, L1
        above L3 alone, L1 above a disk out of space or still reading its index back) is
        left alone: its victims would not move but be dropped (demotion never writes to a
        key-addressed tier), and dropping early would only waste capacity; a persistent one
        is kept under its watermarks, its drops being I/O done ahead of need. First, frees a
        persistent tier could not do whose wait is over are tried again (``retry_frees``:
        the balancer's period is their timer)."""
        self.apply_touches()
        if self.unfreed:
            self.retry_frees()
        now = self._clock()
        for level in self.stack:
            if level.keyed or not (level.persistent or self._moves_down(level)):
                continue
            if now < self.balance_after.get(level.kind, -np.inf):
                continue
            alloc = level.slots.allocator
            # What no block fits into counts as filled: a tier of blocks that leave a tail
            # in each segment never reached its high watermark by its used bytes alone.
            excess = level.guard.to_free(
                alloc.filled_bytes, alloc.capacity_bytes, now, self.started_at
            )
            resident = len(level.policy)
            if excess <= 0 or resident == 0:
                continue
            # The slot bytes a block takes on average: quarantined slots are in use, no
            # block's (counted as filled above, as they hold room).
            held = max(1, alloc.used_bytes - level.quarantined_bytes)
            n = max(1, int(np.ceil(excess / (held / resident))))
            mask = self.evictable(level, now)
            waiting, until = self.balance_kept.get(level.kind, _NONE_KEPT)
            if len(waiting):
                live = until > now
                waiting, until = waiting[live], until[live]
                mask = _without(mask, waiting)
            victims = self._victims(level, n, now, mask)
            if len(victims):
                # Not the victims that stayed (read, pinned or hinted while they were
                # demoted, or that a lower tier admitted but had no room for):
                # ``evictions`` does not count them either.
                _, kept, evicted = await self._evict(
                    level, victims, Priority.BACKGROUND, keep_unplaced=True
                )
                if len(kept):
                    # Asked again at the next period, the tier below would be scanned for
                    # room as often while puts keep this tier above its watermark; a pass
                    # that moved some victims down has others to move meanwhile. Each
                    # waits from the pass that kept it (not one wait for all, renewed by
                    # every pass that kept some: the first kept, the coldest, waited as
                    # long as the passes went on keeping others). None was waiting: the
                    # mask left those out.
                    waiting = np.r_[waiting, kept]
                    until = np.r_[until, np.full(len(kept), now + BALANCE_RETRY_S)]
                    if evicted == 0:
                        self.balance_after[level.kind] = now + BALANCE_RETRY_S
                self.counters.inc("watermark_evictions", evicted, tier=level.label)
            if len(waiting):
                self.balance_kept[level.kind] = (waiting, until)
            else:
                self.balance_kept.pop(level.kind, None)

    def _moves_down(self, level: Level) -> bool:
        """Whether a slot tier below ``level`` takes writes now (``_demote``'s targets; a
        disk tier reading its index back hands out no slots until it is done)."""
        return any(
            not lower.keyed and not lower.recovering and lower.tier.health().accepts_writes
            for lower in self.stack.lower(level.kind)
        )

    # --------------------------------------------------------------- background

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # Named in the line itself (a JSON log's message), not only in its traceback.
            what = getattr(task.get_coro(), "__qualname__", "") or task.get_name()
            log.error("background transfer %s failed: %r", what, exc, exc_info=exc)
            self.counters.inc("background_errors")

    async def drain(self) -> None:
        """Wait for every background transfer started so far. A task leaves ``background``
        in its done callback, which runs on the loop: ``asyncio.wait`` yields to it even when
        every task has finished (awaiting a finished task does not, and a drain that only
        did that spun forever)."""
        while self.background:
            await asyncio.wait(list(self.background))


@dataclass(frozen=True, slots=True)
class _SourceCopy:
    """The copies a move reads its blocks from, as they were when it started: which copy of
    each block it read, to tell once it is done whether the block is still that one."""

    col: int
    slots: np.ndarray
    checksums: np.ndarray
    # When each key-addressed copy was written or found (every copy has slot 0 there).
    since: np.ndarray | None

    @classmethod
    def of(cls, table: BlockTable, bids: np.ndarray, src: Level) -> _SourceCopy:
        since = table.keyed_since[bids].copy() if src.keyed else None
        slots = table.slot[bids, src.col].copy()
        return cls(src.col, slots, table.checksums(bids, src.col).copy(), since)

    def current(self, table: BlockTable, bids: np.ndarray, dst: Level) -> np.ndarray:
        """Per block, whether a copy read from this source may be recorded in ``dst``: none
        is there yet, and the row still holds the copy read, or no copy at all (the copy read
        was lost meanwhile: the bytes read, verified, are the block's last ones)."""
        rows = table.slot[bids]
        same = rows[:, self.col] == self.slots
        same &= table.checksums(bids, self.col) == self.checksums
        if self.since is not None:
            # A copy written or found since is dated later; the copy read may only have been
            # dated back to its write meanwhile (``BlockStore._date_copies``), still the same.
            same &= table.keyed_since[bids] <= self.since
        return (rows[:, dst.col] < 0) & (same | ~(rows >= 0).any(axis=1))


def _without(mask: EvictableFn, bids: np.ndarray) -> EvictableFn:
    """``mask``, less ``bids``."""
    if len(bids) == 0:
        return mask
    return lambda cand: mask(cand) & ~np.isin(cand, bids)


def _groups(
    src_col: np.ndarray, sizes: np.ndarray, owners: np.ndarray
) -> list[tuple[tuple[int, int, int], np.ndarray]]:
    """The positions of the blocks with a source (``src_col >= 0``), grouped by (source
    column, size, owner): each group's positions in order, the groups in the order of their
    first block. One group, the usual case, costs no step per block."""
    have = np.flatnonzero(src_col >= 0)
    if len(have) == 0:
        return []
    cols = np.column_stack((src_col[have], sizes[have], owners[have]))
    if (cols == cols[0]).all():
        return [(tuple(cols[0].tolist()), have)]  # type: ignore[list-item]
    uniq, first, inverse = np.unique(cols, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [
        (tuple(uniq[g].tolist()), have[inverse == g])  # type: ignore[misc]
        for g in np.argsort(first).tolist()
    ]
