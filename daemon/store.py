"""The block store: the request façade over the block table, the tier stack, the space manager
and the transfer engine.

A block may have a copy in several tiers; ``table.slot[bid, col] >= 0`` exactly when the tier
of column ``col`` holds a complete copy, and then that tier's policy knows the block. New
blocks go to the top tier; they move down when a tier passes its high watermark or must make
room (demotion), and up when read or prefetched (promotion), all through the space manager.

Invariants:
- All store state is touched from one thread (the server's event loop). Bytes move on worker
  threads, but only for blocks the loop has marked in flight (``table.inflight``), so no slot
  is freed, reused or evicted while a copy reads or writes it, and no lock is needed.
- A block is visible to lookups only once its first copy is complete (state READY). A new key
  enters the table (state WRITING) before the store awaits anything, so two puts of one key
  never both store it.
- Stored means loadable: a Get loads every block any tier holds, whenever the client's pages
  exist. A block on a lower tier is promoted when the top tier has room it can take without
  waiting (free, or held by blocks with other copies); otherwise it is read from the lower tier
  straight into the client's pages. Protection delays eviction; it never makes a miss.
- A failed read (checksum, I/O, absent from L3) is a miss and drops that tier's copy; an L3
  read its store did not answer (unreachable, timed out) is a miss that keeps it, to be read
  once the store is back; a put of a block held only where it cannot be read now forgets
  that record and stores the block (``_forget_unserved``), unless somebody holds the row.
  A block left with no copy while held (pinned, in flight) keeps its
  row until released; a put of its key stores into that row, as for a new key
  (``_claim_bare``): EXISTS means some tier holds the block.
- A pool names its own batch buffer (``pool.batch``): pages of shared memory or of GPU memory
  (a CUDA IPC pool). The store never branches on which; the transfer engine routes each by
  what the tiers can do (only the GPU tier reaches GPU memory; the others go through it).

Thread-safety: not thread-safe by design (see above); call from the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, cast

import numpy as np

from kvtier.daemon.config import Config
from kvtier.daemon.counts import add_at
from kvtier.daemon.droppable import unchanged_wait
from kvtier.daemon.eager import eager_future
from kvtier.daemon.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kvtier.daemon.hintbudget import HintBudget
from kvtier.daemon.latency import Histograms
from kvtier.daemon.misses import ABSENT, DECLINED, REASONS, UNREACHABLE
from kvtier.daemon.policy.prefetch import PrefetchLedger
from kvtier.daemon.pools import EnginePool
from kvtier.daemon.space import SpaceManager
from kvtier.daemon.stack import Level, TierStack, build_stack
from kvtier.daemon.stats import Counters
from kvtier.daemon.table import READY, WRITING, BlockTable, repeats
from kvtier.daemon.transfer import TransferEngine
from kvtier.tiers.base import (
    PROBE_UNKNOWN,
    BlockRef,
    BlockRefs,
    Health,
    Priority,
    Quarantine,
    QuarantinedSlot,
    RecoveredBlocks,
    TierHealth,
    TierKind,
    TierUnavailable,
    WriteOutcomes,
    block_checksum,
    written_after,
)
from kvtier.tiers.sizes import counted

log = logging.getLogger(__name__)

T = TypeVar("T")

# The owner of blocks whose namespace no tenant claimed (a daemon without tenants).
DEFAULT_OWNER = "default"

# Index rows a persistent tier hands over at a time during recovery: requests are served
# between chunks.
RECOVERY_ROWS = 32768
# A Lookup or Get with a key not found while recovery runs waits for its end this long at
# most, and only within this long of recovery's start; then it answers what is indexed so
# far: a client that comes right after a restart finds what a small L2 holds, while the vLLM
# connector's Lookup gives up after 0.5 s (and backs off) and a recovery of millions of rows
# takes seconds (``kvtier bench restart`` prints when every sampled key is found).
RECOVERY_WAIT_S = 0.2
RECOVERY_WAITS_FOR_S = 2.0
# A Get of more than this many bytes, some of them below the top tier, goes in parts of about
# this size, in chain order, each promoted and then copied into the pages on its own: the
# copies of one part overlap the reads of the next instead of all waiting for the last read.
GET_PART_BYTES = 16 << 20
# Likewise for durable puts: the copies into the top tier of one part overlap the writes of
# the previous one to the persistent tier.
PUT_PART_BYTES = 32 << 20
# With blocks of at least PUT_GROWING_MIN_BLOCK_BYTES, the first part of such a put is this
# small and each next one twice the one before (up to PUT_PART_BYTES): the persistent tier
# starts writing after one small copy instead of a whole part's, and each copy into the top
# tier (several times faster than the disk) still ends before the disk has written the part
# before it. Smaller blocks keep whole parts: for them each part costs a group commit more
# (a 4,096-block put of 4 KiB in three parts ran at 65-77k blocks/s against 98-110k in one);
# the bound between is not measured finely (2 MiB blocks gain, 4 KiB ones lose).
PUT_FIRST_PART_BYTES = 4 << 20
PUT_GROWING_MIN_BLOCK_BYTES = 256 << 10
# Up to this many rows held nowhere (``_bare``), a put compares its keys' rows with each in
# turn: about 2 us a row, where ``np.isin`` costs 16-24 us whatever the sizes (numpy micro-
# measure, 32 and 4,096 keys, this machine).
BARE_ROWS_COMPARED = 8
# The blocks ``check_suspects`` examines one by one (their keys looked up, their policies
# and allocators asked) in one step of the event loop. All 262,144 of a daemon's 4 KiB blocks
# in one step held another client's one-key Lookups for the Check's whole 0.75 s (p50 750 ms
# beside Checks back to back; 2 busy cores); in slices of 8,192 its p50 was 28 ms, of 2,048
# 9 ms.
CHECK_SLICE_BLOCKS = 2048
# The rows of the table's copy that a Check's last steps add up (namespaces, per-tenant
# bytes and slots, pins) in one step of the event loop, vectorised: 0.2-2.0 ms a slice (a
# copy of 1,048,576 rows in 8).
CHECK_SLICE_ROWS = 1 << 17
# Positions in a lookup's chain, shared: never written to.
_NO_POSITIONS = np.zeros(0, dtype=np.int64)
_FIRST_POSITION = np.zeros(1, dtype=np.int64)


class PutResult(enum.IntEnum):
    STORED = 0
    EXISTS = 1
    REJECTED_FULL = 2


# The same as plain ints, for numpy: an IntEnum operand makes a comparison or fill of a small
# array several times slower (numpy converts the member on every call).
_STORED, _EXISTS, _REJECTED_FULL = (int(r) for r in PutResult)


def _shared(values: list[int] | list[bool], dtype: type) -> np.ndarray:
    out: np.ndarray = np.array(values, dtype=dtype)
    out.flags.writeable = False
    return out


# A single-key Put's or Get's answer, shared by all of them (read-only: building a
# one-element array cost each a third of a microsecond).
_ONE_RESULT = {r: _shared([r], np.int32) for r in (_STORED, _EXISTS, _REJECTED_FULL)}
_ONE_LOADED = {ok: _shared([ok], bool) for ok in (False, True)}


_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class CheckProblem:
    """One broken invariant (``BlockStore.check_problems``): its description, and the blocks
    and the slots (of the tier it names) it found at fault, where it can tell them. The
    blocks are refs (``BlockTable.ref``) of the blocks their rows held where they were read,
    or for those found in a copy of the table, when the copy was made: a Check's later steps
    let calls in, and a block freed meanwhile (its row another block's) resolves to none."""

    text: str
    blocks: np.ndarray = field(default_factory=lambda: _NO_IDS)
    slots: np.ndarray = field(default_factory=lambda: _NO_IDS)


@dataclass(frozen=True, slots=True)
class CheckSuspects:
    """The rows that broke a per-row invariant when ``check_suspects`` examined them, for
    ``check_problems`` to examine again: ``lost``, not found by their keys; per tier column,
    ``strays``, committed copies unknown to that tier's policy, ``unallocated``, copies in
    slots its allocator has not handed out, and ``freed``, freed rows holding a copy."""

    lost: np.ndarray
    strays: dict[int, np.ndarray]
    unallocated: dict[int, np.ndarray]
    freed: dict[int, np.ndarray]


@dataclass(slots=True)
class _LevelCheck:
    """One tier's part of a Check (``BlockStore._check_steps``): what its first step read of
    the live state, and the sums its slices add up over the copy of the table."""

    label: str
    keyed: bool
    policy_blocks: int
    dead: np.ndarray = field(default_factory=lambda: _NO_IDS)
    dead_slots: np.ndarray = field(default_factory=lambda: _NO_IDS)
    strays: np.ndarray = field(default_factory=lambda: _NO_IDS)
    allocator: list[str] = field(default_factory=list)
    unallocated: tuple[np.ndarray, np.ndarray] = (_NO_IDS, _NO_IDS)
    used_slots: int = 0
    quarantined: int = 0
    quota_held: int = 0
    usage: np.ndarray = field(default_factory=lambda: _NO_IDS)
    slot_usage: np.ndarray = field(default_factory=lambda: _NO_IDS)
    segment_slot_bytes: np.ndarray = field(default_factory=lambda: _NO_IDS)
    slots_cap: int = 1
    # Added up slice by slice.
    holders: int = 0
    committed: int = 0
    usage_sum: np.ndarray = field(default_factory=lambda: _NO_IDS)
    slot_usage_sum: np.ndarray = field(default_factory=lambda: _NO_IDS)
    held_slots: list[np.ndarray] = field(default_factory=list)

    def add(
        self,
        part: slice,
        slot: np.ndarray,
        state: np.ndarray,
        owner: np.ndarray,
        nbytes: np.ndarray,
    ) -> None:
        """Count the copy's rows ``part`` in (``slot``: the tier's column)."""
        slots = slot[part]
        held = slots >= 0
        self.holders += int(np.count_nonzero(held))
        self.committed += int(np.count_nonzero(held & (state[part] == READY)))
        if self.keyed:
            return
        slots, owners = slots[held], owner[part][held]
        np.add.at(self.usage_sum, owners, nbytes[part][held].astype(np.int64))
        # A slot past the tier's segments (not allocated: reported so) is of no size, the
        # last entry's.
        segments = np.minimum(slots // self.slots_cap, len(self.segment_slot_bytes) - 1)
        np.add.at(self.slot_usage_sum, owners, self.segment_slot_bytes[segments])
        self.held_slots.append(slots)

    def problems(
        self, slot: np.ndarray, quiet: bool, refs: Callable[[np.ndarray], np.ndarray]
    ) -> list[CheckProblem]:
        """The tier's broken invariants, once every slice is counted in (``slot``: the copy
        of its column; ``quiet``: nothing was in flight when it was made; ``refs``: the
        refs of rows of the copy, as of the copy)."""
        label = self.label
        out: list[CheckProblem] = []
        if len(self.dead):
            # Freed rows: their keys are gone, their slots are what is held.
            out.append(
                CheckProblem(
                    f"{label}: "
                    + counted(len(self.dead), "freed row still holds", "freed rows still hold")
                    + " a copy",
                    slots=self.dead_slots,
                )
            )
        if len(self.strays):
            out.append(
                CheckProblem(
                    f"{label}: {counted(len(self.strays), 'block')} with a copy unknown to the "
                    "policy",
                    blocks=self.strays,
                )
            )
        # A new block joins the policies when it is committed: a put that fills this tier
        # and goes on to the next holds the copies made here (state WRITING) meanwhile.
        if self.policy_blocks != self.committed:
            out.append(
                CheckProblem(
                    f"{label}: the policy knows {counted(self.policy_blocks, 'block')}, "
                    + counted(self.committed, "stored one has", "stored ones have")
                    + " a copy"
                )
            )
        if self.keyed:
            return out
        out += [CheckProblem(f"{label} allocator: {p}") for p in self.allocator]
        # Sorted alone first: counting each slot's blocks (np.unique) took four times as
        # long, and only a store that breaks this needs the counts.
        ordered = np.sort(np.concatenate([_NO_IDS.astype(np.int32), *self.held_slots]))
        if (ordered[1:] == ordered[:-1]).any():
            holders = np.flatnonzero(slot >= 0)
            slots = slot[holders].astype(np.int64)
            uniq, counts = np.unique(slots, return_counts=True)
            shared = uniq[counts > 1]
            out.append(
                CheckProblem(
                    f"{label}: slot {int(shared[0])} belongs to {int(counts.max())} blocks"
                    + (f" ({len(shared)} slots shared)" if len(shared) > 1 else ""),
                    blocks=refs(holders[np.isin(slots, shared)]),
                    slots=shared,
                )
            )
        bad, bad_slots = self.unallocated
        if len(bad):
            out.append(
                CheckProblem(
                    f"{label}: "
                    + counted(
                        len(bad),
                        "block holds a slot that is not allocated",
                        "blocks hold slots that are not allocated",
                    ),
                    blocks=bad,
                    slots=bad_slots,
                )
            )
        if quiet and self.used_slots != self.holders + self.quarantined:
            out.append(
                CheckProblem(
                    f"{label}: {counted(self.used_slots, 'slot')} allocated, {self.holders} held "
                    "by blocks"
                    + (f" and {self.quarantined} quarantined" if self.quarantined else "")
                )
            )
        if not np.array_equal(self.usage_sum, self.usage):
            out.append(CheckProblem(f"{label}: per-tenant usage does not add up to its blocks"))
        if not np.array_equal(self.slot_usage_sum, self.slot_usage):
            out.append(CheckProblem(f"{label}: per-tenant slots do not add up to its blocks"))
        if quiet and self.quota_held:
            out.append(
                CheckProblem(
                    f"{label}: "
                    + counted(self.quota_held, "tenant holds", "tenants hold")
                    + " reserved slots no copy uses"
                )
            )
        return out


@dataclass(frozen=True, slots=True)
class TierUsage:
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    blocks: int
    health: TierHealth
    counters: dict[str, int]
    gauges: dict[str, float]


@dataclass(frozen=True, slots=True)
class DeleteResult:
    deleted: int
    missing: int
    busy: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    evicted: int
    missing: int
    busy: int


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    resident: int
    scheduled: int
    missing: int


class BlockStore:
    def __init__(
        self,
        config: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        tiers: Sequence[Any] | None = None,
    ) -> None:
        """``tiers``: the tier objects to stack (tests); by default the ones ``config``
        enables are opened."""
        self.config = config
        self._clock = clock
        self.started_at = clock()
        self.stack: TierStack = build_stack(config, tiers, clock=clock)
        self.table = BlockTable(
            len(self.stack),
            checksummed=tuple(lv.checksummed for lv in self.stack),
            accounted=tuple(not lv.keyed for lv in self.stack),
            slot_align=tuple(1 if lv.keyed else lv.slots.allocator.align for lv in self.stack),
        )
        self.table.history_factor = config.policy.history_factor
        self.counters = Counters()
        c = self.counters
        # Counters of every request's path, resolved once (Counters.key).
        self._n_lookup_keys = c.key("lookup_keys")
        self._n_lookup_hits = c.key("lookup_hits")
        self._n_misses = {r: c.key("misses", reason=r) for r in REASONS}
        self._n_hits = {int(kind): c.key("hits", tier=kind.label) for kind in TierKind}
        self._n_get = {r: c.key("get_blocks", result=r) for r in ("loaded", "missing")}
        self._n_bytes_get = c.key("bytes_get")
        self._n_bytes_put = c.key("bytes_put")
        self._n_put = [c.key("put_blocks", result=r) for r in ("stored", "existing", "rejected")]
        self._n_loaded_from = {lv.col: c.key("loaded_from", tier=lv.label) for lv in self.stack}
        self._n_load_failures = {lv.col: c.key("load_failures", tier=lv.label) for lv in self.stack}
        # Latency histograms (transfers here; the RPC layer adds its own), for metrics.
        self.latency = Histograms()
        self.prefetches = PrefetchLedger()
        # What one owner's hints may protect at once (hintbudget): a share of the top tier
        # where tenants share it, else no limit and no bookkeeping on the hint's path (tenants
        # are turned on or off by a restart). Not the whole top tier then: a hint's blocks in
        # lower tiers count too, and the top tier may be the GPU's, far smaller than the host's.
        self.hint_budget: HintBudget | None = None
        if config.tenants:
            top_bytes = self.stack.top.tier.stats().capacity_bytes
            self.hint_budget = HintBudget(
                int(config.policy.hint_max_share * top_bytes),
                int(config.policy.hint_max_total_share * top_bytes),
            )
            self.table.on_free.append(self.hint_budget.forget)
        self.transfers = TransferEngine(
            self.counters,
            background_workers=config.mover.workers,
            clock=clock,
            latency=self.latency,
            device=self.stack.device,
        )
        self.space = SpaceManager(
            self.table,
            self.stack,
            self.transfers,
            self.counters,
            self.prefetches,
            clock=clock,
            started_at=self.started_at,
            batch_bytes=config.mover.batch_bytes,
            batch_blocks=config.mover.batch_blocks,
        )
        self._copy_threads = config.server.copy_threads
        self._keyed = [lv for lv in self.stack if lv.keyed]
        self._local_cols = [lv.col for lv in self.stack if not lv.keyed]
        # Key-addressed tiers are the slowest kinds: a row whose fastest copy is of this kind
        # or slower is held only in them.
        self._keyed_kind = min((int(lv.kind) for lv in self._keyed), default=0)
        # Per probe of the key-addressed tiers awaiting its answer (by id): the keys ``(ns,
        # key bytes)`` Deletes took out of those tiers meanwhile, which the answer may still
        # name.
        self._probes_open: dict[int, set[tuple[int, bytes]]] = {}
        self._probe_ids = itertools.count()
        # The keys ``(ns, key bytes)`` Deletes are taking out of those tiers, from when each
        # Delete begins until its removals are done (a count per key: two Deletes may name
        # one). A probe that begins meanwhile may read a value before its removal reaches the
        # store, and be answered before the removal ends: it starts with these as deleted.
        self._removing: Counter[tuple[int, bytes]] = Counter()
        # Until when lookups answer rows held only in L3 from the table without asking L3
        # again, however long unconfirmed: set by a probe L3 could not answer (late, or gone
        # meanwhile), so that a slow store costs a lookup of known rows its probe deadline
        # once per quarter of ``known_s``, not every time (a miss still asks).
        self._stale_asks_after = -np.inf
        # Owners (tenants) by label, and the owner of every namespace seen or recovered.
        self.owners: dict[str, int] = {DEFAULT_OWNER: 0}
        self.ns_owner: dict[int, int] = {}
        # Namespaces whose owner is being recorded by a persistent tier: done when it is.
        self._ns_recording: dict[int, asyncio.Future[None]] = {}
        # The owner a namespace being recorded keeps should its record fail: the one it had,
        # or the one recovery read meanwhile (recorded before this start).
        self._ns_kept: dict[int, int] = {}
        self._balancer: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None
        self.recovered = asyncio.Event()
        # Resolved (and dropped) when a new block is committed or abandoned: a durable put
        # whose chain has a block another put is still writing waits on it (``_written``).
        self._write_settled: asyncio.Future[None] | None = None
        self._recovering = False  # recover() is between its first chunk and its end
        # A stop cancelled recovery: rows of the persistent tiers were left unread.
        self._recovery_cut = False
        self._recovery_waits_until = 0.0  # a request waits for recovery until then at most
        # Refs of blocks a put was writing when recovery gave them a copy (their key's row
        # from before this start), each with the levels whose recovered copy the put has not
        # replaced and that copy's size (the block's is the put's until it ends): should the
        # put fail, they keep that copy at its size (``_abandon``); should it succeed, those
        # copies go (``_drop_put_over``): the row may hold other bytes.
        self._recovered_under_put: dict[int, dict[int, int]] = {}
        # Refs of blocks puts committed while recovery ran: a row of their key read later is
        # older than the put, and taken only where it holds the put's bytes
        # (``_index_recovered``), whichever tier the put's copy is on by then.
        self._put_in_recovery: set[int] = set()

    # ---------------------------------------------------------------- lifecycle

    @property
    def top(self) -> Level:
        return self.stack.top

    async def open(self) -> None:
        """Connect the tiers that connect on the event loop (a remote store). A tier that
        refuses to start (bad credentials) raises TierUnavailable: the daemon stops. A
        remote store's unconfirmed removals are kept in the first persistent tier that keeps
        such a journal (the disk tier's index), so that a restart does not bring a deleted
        block back, unless the tier keeps them in a file of its own
        (``tiers.l3.removals_file``): then those the disk tier kept are moved into it."""
        journal = next((lv.tier for lv in self.stack if hasattr(lv.tier, "record_removals")), None)
        in_file = bool(self.config.tiers.l3.removals_file)
        for level in self._keyed:
            if journal is not None and in_file:
                carry = getattr(level.tier, "carry_removals_from", None)
                if carry is not None:
                    carry(journal)
            elif journal is not None:
                keep = getattr(level.tier, "keep_removals_in", None)
                if keep is not None:
                    await keep(journal)
            start = getattr(level.tier, "start", None)
            if start is not None:
                await start()

    def start(self) -> None:
        """Start recovery (the persistent tiers' blocks join the table chunk by chunk while
        requests are served) and the watermark balancer. Needs the running event loop."""
        self._begin_recovery()  # from now: a request may come before the task's first step
        self._recovery = asyncio.create_task(self.recover(), name="recovery")
        self._balancer = asyncio.create_task(self._balance_forever(), name="balancer")
        for level in self.stack:
            start_prefault = getattr(level.tier, "start_prefault", None)
            if start_prefault is not None:
                start_prefault()

    async def stop(self, *, flush: bool, flush_timeout_s: float | None = None) -> None:
        """Stop background work; with ``flush``, first write every block held only in
        volatile tiers to the first persistent tier, so that a restart serves it, starting no write
        after ``flush_timeout_s``. A recovery still running is let end first (where there is such a
        block), within that same bound: cancelled, it leaves a persistent tier allocating nothing
        (the slots of the rows it did not read are held until a restart), so the flush would find no
        room there. Then the slots a persistent tier could not free are tried once more
        (``SpaceManager.settle_frees``): their rows left in its index would bring deleted blocks
        back at the restart."""
        recovery, self._recovery = self._recovery, None
        recovery_ended = True
        left_s = flush_timeout_s
        await _cancelled(self._balancer)
        self._balancer = None
        # Only for blocks to flush: a recovery of millions of rows takes seconds.
        if flush and recovery is not None and not recovery.done() and len(self._volatile_only()):
            started = time.monotonic()
            recovery_ended = await self._recovery_ends(recovery, flush_timeout_s)
            if left_s is not None:
                left_s = max(0.0, left_s - (time.monotonic() - started))
        await _cancelled(recovery)
        await self.space.drain()
        if flush and recovery_ended:
            await self.flush(left_s)
        elif flush and len(dirty := self._volatile_only()):
            log.warning(
                "flushed none of %d volatile-only blocks: recovery had not ended within "
                "tiers.l2.flush_timeout_s (%gs); lost (held only in memory)",
                len(dirty),
                flush_timeout_s,
            )
        # Last, as the flush's evictions free slots too: a free still failed is tried once
        # more, and nothing frees after the tiers close.
        await self.space.settle_frees()
        for level in self._keyed:
            await level.keys.close()

    async def _recovery_ends(self, recovery: asyncio.Task[None], timeout_s: float | None) -> bool:
        """Wait for ``recovery`` to end, for at most ``timeout_s``; whether it did."""
        log.info(
            "waiting for recovery to end before the flush%s",
            "" if timeout_s is None else f" (for at most {timeout_s:g}s)",
        )
        try:
            # Shielded: a wait that times out leaves the task to stop()'s cancel.
            await asyncio.wait_for(asyncio.shield(recovery), timeout_s)
        except asyncio.TimeoutError:  # asyncio's: on Python 3.10 not the builtin
            return False
        return True

    async def flush(self, timeout_s: float | None = None) -> int:
        """Write every READY block held only in volatile tiers to the first persistent tier,
        parents before their children (a flush cut short keeps leading runs of chains, not
        blocks a restart could not reach), starting no write after ``timeout_s``; returns
        how many were written."""
        target = self.stack.first_persistent()
        if target is None:
            return 0
        dirty = self._volatile_only()
        if len(dirty) == 0:
            return 0
        if target.recovering:
            # Its recovery ended before the last row (an error, logged then): a slot whose
            # row was not read is never handed out. Not "no room", which asks for disk space.
            log.warning(
                "flushed none of %d volatile-only blocks: %s takes no new block until a "
                "restart (its recovery did not read every index row); lost (held only in "
                "memory)",
                len(dirty),
                target.label,
            )
            return 0
        dirty = dirty[np.argsort(self.table.depths(dirty), kind="stable")]
        nbytes = int(self.table.nbytes[dirty].sum())
        # The last chance for these blocks: a full disk (or locked index) freed since the
        # tier's last try is found out now, not after tiers.l2.enospc_retry_s.
        target.retry_writes_now()
        bound = "" if timeout_s is None else f" (for at most {timeout_s:g}s)"
        log.info(
            "flushing %d volatile-only blocks (%.1f MiB) to %s%s",
            len(dirty),
            nbytes / (1 << 20),
            target.label,
            bound,
        )
        started = time.monotonic()
        no_room = self.counters.get("no_room", tier=target.label)
        deadline = None if timeout_s is None else self._clock() + timeout_s
        ok = await self.space.place(dirty, target, Priority.BACKGROUND, deadline=deadline)
        written = int(np.count_nonzero(ok))
        line = (
            f"flushed {written} of {len(dirty)} volatile-only blocks to {target.label} in "
            f"{time.monotonic() - started:.2f}s"
        )
        if written == len(dirty):
            log.info("%s", line)
            return written
        # Why the rest were not written: no room; else the tier refusing writes (degraded
        # before or during the flush: the disk needs mending, not the timeout); else the
        # timeout (or a failed write, which the transfer engine logged).
        full = min(self.counters.get("no_room", tier=target.label) - no_room, len(dirty) - written)
        why = [f"{full} found no room there"] if full else []
        if len(dirty) - written - full:
            late = len(dirty) - written - full
            health = target.tier.health()
            if not health.accepts_writes:
                why.append(f"{late} not written: {target.label} refuses writes ({health})")
            elif deadline is not None:
                why.append(f"{late} not written within tiers.l2.flush_timeout_s ({timeout_s:g}s)")
            else:
                why.append(f"{late} failed")
        log.warning("%s; lost (held only in memory): %s", line, ", ".join(why))
        return written

    def close(self) -> None:
        self.transfers.close()
        self.stack.close()

    # ------------------------------------------------------------------ queries

    def max_block_bytes(self) -> int:
        return min(lv.slots.allocator.segment_bytes for lv in self.stack if not lv.keyed)

    def max_block_key(self) -> str:
        """The config key that sets ``max_block_bytes`` (the smallest slot tier's segment)."""
        level = min(
            (lv for lv in self.stack if not lv.keyed),
            key=lambda lv: lv.slots.allocator.segment_bytes,
        )
        return f"tiers.{level.label.lower()}.segment_bytes"

    async def lookup(
        self, ns: int, words: np.ndarray, *, touch: bool = True, owner: int = 0
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """(prefix length, wire tier of each key (0: absent), block id of each key or -1).

        Keys past the locally held prefix are probed in the key-addressed tiers (one batch
        probe per tier for the rest of the chain); blocks found there join the table as
        ``owner``'s (the tenant whose namespace ``ns`` is), which ``ns`` is then bound to
        (``_bind_found``) if no put bound it. Rows of the chain held only in
        those tiers that none confirmed for ``tiers.l3.known_s`` are asked about in the same
        probe (``_discover``): the tier may have dropped them since. Rows held only in such a
        tier that is down are misses, their records kept (``_unreadable_to_misses``)."""
        ids, identities = self.table.lookup_identified(ns, words)
        if self._recovering and (ids < 0).any():
            ids, identities = await self._after_recovery(ns, words)
        n = len(ids)
        found = ids >= 0
        hits = int(np.count_nonzero(found))
        tiers = self._tiers_of(ids, found, hits)
        if self._keyed:
            stale = self._unconfirmed(ids, tiers) if hits else _NO_POSITIONS
            if hits < n or len(stale):
                start = n if hits == n else int(np.argmin(found))
                await self._discover(ns, words, ids, start, stale[stale < start], owner)
                if ns not in self.ns_owner and (ids >= 0).any():
                    await self._bind_found(ns, owner)
                    # Other requests ran meanwhile: a Delete may have taken the rows found.
                    ids[:] = self.table.lookup(ns, words)
                found = ids >= 0
                hits = int(np.count_nonzero(found))
                tiers = self._tiers_of(ids, found, hits)
        if hits and self._keyed:
            self._unreadable_to_misses(ids, tiers)
        if hits and (held := int(np.count_nonzero(tiers))) < hits:
            # Rows whose every copy is gone (a failed read of a block still pinned, kept
            # until its lease ends) or is in a tier that is down are misses: nothing could
            # load them now.
            found = tiers > 0
            ids[~found] = -1
            hits = held
        prefix = n if hits == n else int(np.argmin(found))
        if hits and touch:
            self.space.touch(ids if hits == n else ids[found], self._clock())
        unreachable = self._unserved_misses(ns, words, found) if self._keyed and hits < n else None
        self._count_hits(identities, tiers, found, hits, unreachable)
        return prefix, tiers, ids

    async def _bind_found(self, ns: int, owner: int) -> None:
        """Bind ``ns`` to ``owner`` for blocks a lookup found in a key-addressed tier, in a
        namespace no put here has bound: they may go down to a persistent tier, which must
        know their tenant, or they come back at the next start with none (the default
        owner's, off their tenant's usage and quota). Not refused past
        ``server.max_namespaces_per_tenant`` (the blocks are in the table already), but the
        owner's empty namespaces are unbound to make room as for a put, so that lookups alone
        cannot pile up bindings and their records. A record that fails is logged; the next
        lookup that finds the namespace's blocks tries again."""
        try:
            await self.namespace(ns, self.space.owner_labels[owner], limited=False)
        except Exception:
            log.exception("recording the tenant of namespace %d (blocks found in L3) failed", ns)
            self.counters.inc("background_errors")

    def _begin_recovery(self) -> None:
        """Requests wait for recovery (``_after_recovery``) from now on, for at most
        ``RECOVERY_WAITS_FOR_S``."""
        self._recovering = self.space.rows_unsettled = True
        self._recovery_waits_until = time.monotonic() + RECOVERY_WAITS_FOR_S

    async def _after_recovery(
        self, ns: int, words: np.ndarray
    ) -> tuple[np.ndarray, list[int] | np.ndarray]:
        """``table.lookup_identified`` once recovery has read every row, or after
        ``RECOVERY_WAIT_S`` (none after ``RECOVERY_WAITS_FOR_S`` of recovery): a key whose
        row it has not read yet is not a miss that only the restart made (an engine would
        compute the block again)."""
        wait_s = min(RECOVERY_WAIT_S, self._recovery_waits_until - time.monotonic())
        if wait_s > 0:
            # asyncio's: on Python 3.10 wait_for raises its own, not the builtin TimeoutError.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.recovered.wait(), wait_s)
        return self.table.lookup_identified(ns, words)

    def _tiers_of(self, ids: np.ndarray, found: np.ndarray, hits: int) -> np.ndarray:
        """The wire tier of each key (``_fastest_kind``; 0 where ``found`` is False)."""
        if hits == len(ids):
            return self._fastest_kind(ids)
        tiers = np.zeros(len(ids), dtype=np.int32)
        if hits:
            tiers[found] = self._fastest_kind(ids[found])
        return tiers

    def _unreadable_to_misses(self, ids: np.ndarray, tiers: np.ndarray) -> None:
        """Set ``tiers`` to 0 (absent) for the rows held only in key-addressed tiers that
        cannot serve them now (``KeyTier.unserved``: the tier down, or the block's cluster
        master lost): a Get of them misses (``KeyTier.read`` answers None), so a Lookup that
        answered them found would have an engine plan loads that fail, request after request,
        all through an outage. Their records stay, read again once the tier is back."""
        only_keyed = np.flatnonzero(tiers >= self._keyed_kind)
        if len(only_keyed) == 0:
            return
        # Only a tier that is not OK is asked (it names keys for that): none on a healthy path.
        impaired = [lv for lv in self._keyed if lv.tier.health().state is not Health.OK]
        if not impaired:
            return
        rows = ids[only_keyed]
        readable = np.zeros(len(rows), dtype=bool)
        for level in self._keyed:
            held = self.table.slot[rows, level.col] >= 0
            if level in impaired and held.any():
                at = np.flatnonzero(held)
                held[at[level.keys.unserved(self.table.block_refs(rows[at]))]] = False
            readable |= held
        tiers[only_keyed[~readable]] = 0

    def _forget_unserved(self, rows: np.ndarray) -> bool:
        """Forget the rows of a put's keys (``rows``, -1: none) held only in key-addressed
        tiers that cannot serve them now (``KeyTier.unserved``), but those somebody holds
        (pinned, in flight). A Lookup answers such rows as misses and a Get cannot read them
        (``_unreadable_to_misses``), so the engine computes the blocks again and puts them:
        found, they would be answered EXISTS and stored nowhere, request after request, until
        the rows went unconfirmed (``forget_unconfirmed``). Forgotten, the put stores them
        here. Whether any was."""
        for level in self._keyed:  # (not all() over a generator: asked by most puts)
            if level.tier.health().state is not Health.OK:
                break
        else:
            return False
        table = self.table
        rows = rows[rows >= 0]
        rows = rows[self._fastest_kind(rows) >= self._keyed_kind]
        if len(rows) == 0:
            return False  # each has a copy in L1 or L2: most puts while such a tier is not OK
        rows = np.unique(rows)
        rows = rows[
            (table.state[rows] == READY) & (table.inflight[rows] == 0) & (table.pins[rows] == 0)
        ]
        tiers = self._fastest_kind(rows)
        self._unreadable_to_misses(rows, tiers)
        unserved = rows[tiers == 0]
        for level in self._keyed:
            held = unserved[table.slot[unserved, level.col] >= 0]
            if len(held):
                self.space.drop_copies(held, level)
                self.counters.inc("rows_forgotten", len(held), tier=level.label, reason="unserved")
        return len(unserved) > 0

    def _unconfirmed(self, ids: np.ndarray, tiers: np.ndarray) -> np.ndarray:
        """The positions of the rows whose fastest copy (``tiers``) is in a key-addressed
        tier, the slowest kinds, and which none confirmed for ``tiers.l3.known_s``
        (``table.keyed_seen``)."""
        if len(ids) == 1:  # a single-key request: scalar reads, no array operations
            if int(tiers[0]) < self._keyed_kind or (now := self._clock()) < self._stale_asks_after:
                return _NO_POSITIONS
            cutoff = now - self.config.tiers.l3.known_limit_s()
            return _FIRST_POSITION if self.table.keyed_seen[ids[0]] < cutoff else _NO_POSITIONS
        only_keyed = np.flatnonzero(tiers >= self._keyed_kind)
        if len(only_keyed) == 0 or (now := self._clock()) < self._stale_asks_after:
            return _NO_POSITIONS
        cutoff = now - self.config.tiers.l3.known_limit_s()
        return only_keyed[self.table.keyed_seen[ids[only_keyed]] < cutoff]

    def _unserved_misses(self, ns: int, words: np.ndarray, found: np.ndarray) -> np.ndarray | None:
        """Where a lookup missed (``found`` false) a key that a key-addressed tier could not
        be asked about now (``KeyTier.unserved``: the tier down, or the block's cluster
        master lost), as a mask of the positions; None where there is none. Such a miss may
        be a block the tier holds: its reason is ``unreachable``, not ``absent``. Only a
        tier that is not OK is asked (none on a healthy path)."""
        impaired = [lv for lv in self._keyed if lv.tier.health().state is not Health.OK]
        if not impaired:
            return None
        missed = np.flatnonzero(~found)
        # As arrays, as ``table.block_refs``: a tier that is down answers every position
        # without naming a key, and a lookup costs nothing per key for it.
        refs: Sequence[BlockRef] = (
            [BlockRef(ns, words[missed.item(0)].tobytes())]
            if len(missed) == 1
            else BlockRefs(np.full(len(missed), ns, dtype=np.uint64), words[missed])
        )
        unserved: set[int] = set()
        for level in impaired:
            unserved.update(level.keys.unserved(refs))
        if not unserved:
            return None
        mask = np.zeros(len(found), dtype=bool)
        mask[missed[sorted(unserved)]] = True
        return mask

    def _count_hits(
        self,
        identities: list[int] | np.ndarray,
        tiers: np.ndarray,
        found: np.ndarray,
        hits: int,
        unreachable: np.ndarray | None = None,
    ) -> None:
        """lookup_keys, lookup_hits, hits{tier} by the fastest tier holding the key, and
        misses{reason}: why a key is not held (``identities``: of every key, from the
        table's lookup); ``unreachable`` (``_unserved_misses``): the misses that a
        key-addressed tier could not be asked about, counted ``unreachable`` where no other
        reason is known (the ledger's ``absent``)."""
        c = self.counters
        c.add(self._n_lookup_keys, len(tiers))
        if hits:
            c.add(self._n_lookup_hits, hits)
            if len(tiers) == 1:
                c.add(self._n_hits[int(tiers[0])])
            else:
                for kind, k in enumerate(np.bincount(tiers).tolist()[1:], start=1):
                    c.add(self._n_hits[kind], k)
        if hits < len(tiers):
            missed = ~found
            if unreachable is not None:
                missed &= ~unreachable
                why = self.space.misses.classify(
                    self.table.identities_where(identities, unreachable)
                )
                why[UNREACHABLE] = why.pop(ABSENT)
                for reason, k in why.items():
                    c.add(self._n_misses[reason], k)
            missing = self.table.identities_where(identities, missed)
            for reason, k in self.space.misses.classify(missing).items():
                c.add(self._n_misses[reason], k)

    async def _discover(
        self,
        ns: int,
        words: np.ndarray,
        ids: np.ndarray,
        start: int,
        stale: np.ndarray,
        owner: int,
    ) -> None:
        """Probe the key-addressed tiers for ``words[start:]`` and, in the same probe, the
        keys at the positions ``stale`` (before ``start``: rows held only there that they
        have not confirmed for a while). Blocks of the present prefix from ``start`` each
        reports gain that tier's column (new ones enter the table as ``owner``'s, with the
        size the tier reports), but those held here (the copy's age is unknown), and so do
        the stale rows it still holds; all of them count as confirmed now
        (``table.keyed_seen``). A copy new to the table is dated from the probe, then from
        its write once the tier tells it (``_date_copies``, in the background). A copy there
        that the tier says it does not hold (absent, or another layout's value under the key)
        is lost (``SpaceManager.lose_copies``), unless something confirmed it after the probe
        was sent (a write behind, a read): the answer may predate it. An answer the tier
        could not give (late, unreachable) changes nothing. Updates ``ids`` in place."""
        table = self.table
        asked = [*stale.tolist(), *range(start, len(words))]
        refs = [BlockRef(ns, words[i].tobytes()) for i in asked]
        k = len(stale)
        sent = self._clock()
        max_block = self.max_block_bytes()
        for level in self._keyed:
            if not level.tier.health().serves_reads:
                continue
            probe_id = next(self._probe_ids)
            self._probes_open[probe_id] = set(self._removing)
            try:
                answers: list[int] | None = await level.keys.probe_each(refs)
            except Exception:
                log.exception("%s probe failed", level.label)
                self.counters.inc("probe_failures", tier=level.label)
                answers = None
            finally:
                deleted = self._probes_open.pop(probe_id)
            # The probe waited: rows found before it may have been deleted (even reused for
            # another block) meanwhile, and other requests may have stored some of the keys.
            ids[:] = table.lookup(ns, words)
            if answers is None:
                continue
            if k and all(size == PROBE_UNKNOWN for size in answers[:k]):
                # No word on the stale rows (late, or the tier went down meanwhile): trusted
                # as they are for a quarter of known_s before a lookup waits for it again.
                self._stale_asks_after = self._clock() + self.config.tiers.l3.known_limit_s() / 4
            # The present prefix from ``start``. A value larger than a slot is no block of
            # any pool here (RegisterPool refuses larger blocks): nothing could load or
            # promote it.
            prefix = next(
                (j for j, size in enumerate(answers[k:]) if not 0 <= size <= max_block),
                len(asked) - k,
            )
            self.counters.inc("probed_keys", len(refs), tier=level.label)
            self.counters.inc("probe_hits", prefix, tier=level.label)
            lost: list[int] = []
            found: list[int] = []  # rows given the tier's copy by this probe
            for j, (i, size) in enumerate(zip(asked, answers, strict=True)):
                if size == PROBE_UNKNOWN:
                    continue
                if deleted and (ns, words[i].tobytes()) in deleted:
                    continue  # the answer may predate the Delete's removal
                bid = int(ids[i])
                if not 0 <= size <= max_block or (bid >= 0 and int(table.nbytes[bid]) != size):
                    # No copy of this block there (another layout's value under its key, a
                    # namespace shared by two layouts, would fail its Gets).
                    if (
                        bid >= 0
                        and table.slot[bid, level.col] >= 0
                        and table.keyed_seen[bid] < sent
                    ):
                        lost.append(bid)
                    continue
                if j >= k + prefix:
                    continue  # past the present prefix: a block no lookup of this chain loads
                if bid < 0:
                    # A committed row here is this loop's own, for a key the chain names
                    # twice; any other is being written right now.
                    bid = int(table.find_any(ns, words[i : i + 1])[0])
                    if bid < 0:
                        bid = table.add(ns, words[i], size, owner)
                        table.state[bid] = READY
                    elif table.state[bid] != READY or int(table.nbytes[bid]) != size:
                        continue
                    ids[i] = bid
                # A read or write since the probe was sent confirmed it later than this.
                if table.keyed_seen[bid] < sent:
                    table.keyed_seen[bid] = sent
                if table.slot[bid, level.col] < 0:
                    if (table.slot[bid, self._local_cols] >= 0).any():
                        # Held here: that copy's age is unknown (this node's own, dropped
                        # from the table half of ttl_s after its write, or another node's),
                        # and finding it does not renew its expiry. Not counted, the block
                        # is written there again, afresh, at an access admission takes.
                        continue
                    table.set_slots(np.asarray([bid]), level.col, 0)
                    table.keyed_since[bid] = sent
                    level.policy.insert(bid, sent, -1)
                    found.append(bid)
            if found and self.config.tiers.l3.ttl_s > 0:
                self.space.spawn(self._date_copies(level, found, sent))
            if lost:
                self.space.lose_copies(np.unique(np.asarray(lost, dtype=np.int64)), level)
                ids[:] = table.lookup(ns, words)

    async def _date_copies(self, level: Level, bids: list[int], found: float) -> None:
        """Date the copies in key-addressed tier ``level`` that a lookup's probe at ``found``
        gave rows ``bids`` from when they were written, as far as the tier tells
        (``KeyTier.value_ages``): another node wrote them, maybe long before, and their
        expiry runs from that write. Dated from the probe, such a copy of a block held here
        since was counted up to that long past half of ``ttl_s`` after its write
        (``SpaceManager._drop_stale_copies``), and the block not written there again before
        the store expired it. A row whose copy went, or was written or dated since, keeps
        its date."""
        table = self.table
        refs = [table.ref(bid) for bid in bids]
        ages = await level.keys.value_ages(table.block_refs(np.asarray(bids, dtype=np.int64)))
        for ref, age in zip(refs, ages, strict=True):
            bid = table.resolve(ref)
            if (
                age > 0
                and bid >= 0
                and table.slot[bid, level.col] >= 0
                and table.keyed_since[bid] == found
            ):
                table.keyed_since[bid] = found - age

    def usage(self) -> list[TierUsage]:
        out = []
        for lv in self.stack:
            st = lv.tier.stats()
            out.append(
                TierUsage(
                    lv.kind,
                    st.capacity_bytes,
                    st.used_bytes,
                    len(lv.policy),
                    st.health,
                    dict(st.counters),
                    dict(st.gauges),
                )
            )
        return out

    def gauges(self) -> dict[str, float]:
        """Point-in-time values: what is pinned, in flight or queued for the transfers, and
        each tier's own gauges (``l0_l2_gds``...), prefixed as its counters are."""
        live = self.table.state != 0
        out: dict[str, float] = {
            "blocks_pinned": int(np.count_nonzero(live & (self.table.pins > 0))),
            "blocks_in_flight": int(np.count_nonzero(live & (self.table.inflight > 0))),
            "transfers_queued": self.transfers.queued,
            "transfers_running": self.transfers.running,
            "background_tasks": len(self.space.background),
            # Dropped blocks whose policy history is kept for their keys (mementos).
            "blocks_remembered": self.table.history_rows,
            # 1 while the persistent tiers' blocks from before this start are still being
            # indexed (the daemon serves meanwhile; lookups find what is indexed so far).
            "recovering": 0 if self.recovered.is_set() else 1,
        }
        for lv in self.stack:
            for name, value in lv.tier.stats().gauges.items():
                out[f"{lv.label.lower()}_{name}"] = float(value)
        return out

    def all_counters(self) -> dict[str, int]:
        """The store's counters and each tier's own, flattened for the wire."""
        out = self.counters.flat()
        pf = self.prefetches.stats()
        out.update(
            prefetch_issued=pf.issued,
            prefetch_used=pf.used,
            prefetch_late=pf.late,
            prefetch_wasted=pf.wasted,
            prefetch_duplicates=pf.duplicates,
        )
        for lv in self.stack:
            for name, value in lv.tier.stats().counters.items():
                out[f"{lv.label.lower()}_{name}"] = int(value)
        out.update(self.latency.flat())
        return out

    # ------------------------------------------------------------------ writes

    def check_durable(self) -> None:
        """Refuse a durable put where no tier persists (``put`` checks it; the service checks
        it before binding the put's namespace, so a refused put leaves nothing behind)."""
        if self.stack.first_persistent() is None:
            raise FailedPrecondition(
                "durable puts need a persistent tier (set tiers.l2.enabled=true)"
            )

    async def put(
        self,
        pool: EnginePool,
        ns: int,
        words: np.ndarray,
        pages: np.ndarray,
        parent_words: np.ndarray | None,
        *,
        durable: bool = False,
        owner: int = 0,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Store pool pages under keys for ``owner`` (a tenant: whose quota they count
        against); returns a PutResult per key, and with ``durable`` whether each key's block
        is on a persistent tier.

        Keys form one chain (``words[i]`` follows ``words[i-1]``); when room runs out the
        leading new blocks are stored and the rest rejected, since a child is useless without
        its parent.

        A durable put of more than ``PUT_PART_BYTES`` goes in parts of that size (``_parts``;
        with blocks of ``PUT_GROWING_MIN_BLOCK_BYTES`` or more, from ``PUT_FIRST_PART_BYTES``
        on, each part twice the one before, up to ``PUT_PART_BYTES``), in chain order, each
        one stored and committed as a put of its own (its parent: the key before it) whose
        persistent copies are written while the next part is copied in; once a part has
        rejected keys, the later parts store nothing new.
        """
        n = len(words)
        if n == 1 and not durable and self.stack.levels[0].own_admission is None:
            one = await self._put_one(pool, ns, words[0], pages, parent_words, owner)
            if one is not None:
                return one, None
        durable_level = self.stack.first_persistent()
        if durable:
            self.check_durable()
        results = np.full(n, _STORED, dtype=np.int32)
        persisting: list[asyncio.Future[np.ndarray]] = []
        full = False
        try:
            for s, e in _parts(n, pool.block_bytes if durable else 0):
                parent = parent_words if s == 0 else words[s - 1]
                part, chain = await self._put_part(
                    pool, ns, words[s:e], pages[s:e], parent, owner, store=not full, hold=durable
                )
                full = full or bool((part == _REJECTED_FULL).any())
                if durable_level is not None and durable:
                    # The part's blocks stay in flight until they are on the persistent tier:
                    # a later part cannot push them out first (it is refused room instead,
                    # as the tail of one put would be).
                    held = chain[chain >= 0]
                    held = held[self.table.state[held] == READY]
                    add_at(self.table.inflight, held, 1)
                    try:
                        if not full:
                            again = await self._put_gone(
                                pool, ns, words, pages, parent_words, owner, s, part, chain
                            )
                            held = np.concatenate((held, again))
                            full = bool((part == _REJECTED_FULL).any())
                    except BaseException:
                        self.space.end_in_flight(held)  # no persist task will
                        raise
                    # Refs, not rows: a block still may go (a failed copy) and its row be
                    # reused.
                    refs = np.where(chain >= 0, self.table.refs(np.maximum(chain, 0)), -1)
                    task = asyncio.ensure_future(self._persist(refs, durable_level))
                    # Released when the task ends, however: cancelled before its first step
                    # (the put cancelled meanwhile), its body never runs.
                    task.add_done_callback(functools.partial(self._persisted, held))
                    persisting.append(task)
                results[s:e] = part
        except BaseException:
            # Parts already committed are stored; their persistent copies finish (or fail)
            # before the error goes back.
            await asyncio.gather(*persisting, return_exceptions=True)
            raise
        if not durable:
            return results, None
        done = await _all_done(persisting)
        return results, np.concatenate(done) if done else np.zeros(0, dtype=bool)

    async def _put_gone(
        self,
        pool: EnginePool,
        ns: int,
        words: np.ndarray,
        pages: np.ndarray,
        parent_words: np.ndarray | None,
        owner: int,
        s: int,
        part: np.ndarray,
        chain: np.ndarray,
    ) -> np.ndarray:
        """Store again, from the caller's pages, each key of a durable put's part starting at
        ``s`` that was found present but whose block is gone once the part is copied in (an
        eviction under way when the part looked, or the put writing it did not store it):
        else it could not persist. Updates ``part`` and ``chain`` in place; returns the rows
        stored, held in flight as the part's are (released here if this raises)."""
        held: list[int] = []
        try:
            for j in np.flatnonzero((part == _EXISTS) & (chain < 0)).tolist():
                k = s + j
                up = parent_words if k == 0 else words[k - 1]
                again, row = await self._put_part(
                    pool, ns, words[k : k + 1], pages[k : k + 1], up, owner, store=True, hold=True
                )
                part[j], chain[j] = again[0], row[0]
                if again[0] == _REJECTED_FULL:
                    break  # the chain's later keys would have no parent
                if row[0] >= 0 and self.table.state[row[0]] == READY:
                    add_at(self.table.inflight, row, 1)
                    held.append(int(row[0]))
        except BaseException:
            self.space.end_in_flight(np.array(held, dtype=np.int64))
            raise
        return np.array(held, dtype=np.int64)

    async def _put_part(
        self,
        pool: EnginePool,
        ns: int,
        words: np.ndarray,
        pages: np.ndarray,
        parent_words: np.ndarray | None,
        owner: int,
        *,
        store: bool,
        hold: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One put (see ``put``): a PutResult per key and the block of each key (-1: none,
        and for every key rejected).
        Without ``store``, new keys are rejected (an earlier part of the chain was). With
        ``hold`` (a durable put), the blocks of keys already stored stay in flight while the
        new ones are copied in, so that no eviction takes one of them before the caller holds
        the part. A key whose row holds no copy (``_bare``) is stored as a new key is, into
        that row."""
        table = self.table
        now = self._clock()
        n = len(words)
        block_bytes = pool.block_bytes
        results = np.full(n, _STORED, dtype=np.int32)
        existing = table.find_any(ns, words)
        # Before anything changes: a refused put leaves the rows as they were.
        self._check_sizes(existing, block_bytes)
        if self._keyed and self._forget_unserved(existing):
            existing = table.find_any(ns, words)
        first = ~repeats(words)  # a key repeated within the batch is stored once
        is_new = existing < 0
        is_new &= first
        reused = existing[:0]
        if self.space.bare_refs and len(bare := self._bare(existing, first)):
            # Rows with nothing to answer EXISTS for: the put stores into them.
            is_new[bare] = True
            reused = existing[bare]
        results[~is_new] = _EXISTS
        ready = existing[existing >= 0]
        ready = ready[table.state[ready] == READY]
        if len(reused):
            ready = ready[~np.isin(ready, reused)]
        if len(ready):
            self.space.touch(ready, now)

        new_idx = np.flatnonzero(is_new)
        stored = kept_recovered = np.zeros(0, dtype=np.int64)
        if store and len(new_idx):
            # Claim the new keys before awaiting anything (see the module invariants).
            if len(reused):
                bids = existing[new_idx]
                fresh = bids < 0
                bids[fresh] = table.add_many(ns, words[new_idx[fresh]], block_bytes, owner=owner)
                table.inflight[bids[fresh]] = 1
                self._claim_bare(reused, owner)
            else:
                bids = table.add_many(ns, words[new_idx], block_bytes, owner=owner)
                table.inflight[bids] = 1
            # The top tier's own admission weighs each block with its lineage, and hears of
            # the blocks it did not keep.
            own = self.top.own_admission is not None
            kept = ready if hold else ready[:0]
            add_at(table.inflight, kept, 1)
            try:
                pars = self._new_parents(bids, new_idx, existing, ns, parent_words) if own else None
                placed = await self._store_new(pool, bids, pars, pages[new_idx], now, owner)
            except BaseException:
                self._abandon(bids, reused)
                raise
            finally:
                # Nothing below awaits: the caller holds the part before anything else runs.
                self.space.end_in_flight(kept)
            stored = bids[:placed]
            # The copies waited: a block of an existing key may have been deleted meanwhile,
            # its row even reused by another block.
            if len(old := np.flatnonzero(existing >= 0)):
                existing[old] = table.find_any(ns, words[old])
            try:
                if placed or own:
                    # The links as they stand now that the copies are done.
                    pars = self._new_parents(bids, new_idx, existing, ns, parent_words)
                    if placed:
                        self._commit_new(stored, pars[:placed])
                    if own:
                        # The top tier keeps a leading run; the rest are its policy's misses,
                        # told in chain order once the blocks before them are in it, and
                        # before the blocks stored nowhere are forgotten.
                        kept = int(np.count_nonzero(table.slot[bids, self.top.col] >= 0))
                        self.space.missed(self.top, bids[kept:], pars[kept:], self._clock())
            finally:
                # The rows of blocks stored nowhere, whatever.
                kept_recovered = self._abandon(bids[placed:], reused)
        rejected = new_idx[len(stored) :]
        if len(kept_recovered):
            # Present with the copies recovery read under the put: found, as an EXISTS key's
            # block is (its row joins the chain below, as a repeated key's does).
            back = np.isin(bids[len(stored) :], kept_recovered)
            results[rejected[back]] = _EXISTS
            rejected = rejected[~back]
        results[rejected] = _REJECTED_FULL
        self.space.misses.record(self.table.identities(ns, words[rejected]), DECLINED)
        unstored = rejected
        if len(rejected) and not first.all():
            # A key named again after the put rejected it has no block either.
            unstored = np.concatenate((rejected, _naming_again(words, first, rejected)))
            results[unstored] = _REJECTED_FULL
        new_idx = new_idx[: len(stored)]
        if self.space.misses:  # nothing to forget in an empty ledger: no identities to hash
            self.space.misses.discard(self.table.identities(ns, words[new_idx]))
        self.counters.add(self._n_bytes_put, len(stored) * block_bytes)
        self._count_put(results)
        chain = existing.copy()
        chain[new_idx] = stored
        if len(unstored):
            # A row given back held nowhere (``_claim_bare``) is not this put's block: another
            # put may store the key into it before a durable put's persisting looks.
            chain[unstored] = -1
        # A key repeated within the part is the block its first occurrence stored.
        again = (chain < 0) & (results == _EXISTS)
        if again.any():
            chain[again] = table.lookup(ns, words[again])
        return results, chain

    async def _put_one(
        self,
        pool: EnginePool,
        ns: int,
        key: np.ndarray,
        pages: np.ndarray,
        parent_words: np.ndarray | None,
        owner: int,
    ) -> np.ndarray | None:
        """``put`` of one new key, not durable, where the top tier has no own admission (an
        engine's commonest small Put), with Python scalars where ``_put_part`` uses arrays:
        the same claim before any await, copies (``_store_new``), link to the parent as it
        stands once they are done, commit, abandon, miss records and counts. None, having
        changed nothing, for a key already present or being written: ``_put_part`` answers
        those. ``pages``: the request's, one page."""
        table = self.table
        identity = table.identity(ns, key)  # hashed once: probe, insertion, miss ledger
        if table.find_one(ns, key, identity) >= 0:
            return None
        now = self._clock()
        block_bytes = pool.block_bytes
        # Claimed before awaiting anything (see the module invariants).
        bid = table.add(ns, key, block_bytes, owner=owner, identity=identity, inflight=1)
        # np.empty and a store cost half of np.array([bid]), which first works out a dtype.
        bids = np.empty(1, dtype=np.int64)
        bids[0] = bid
        placed = 0
        try:
            placed = await self._store_new(pool, bids, None, pages, now, owner)
            if placed:
                parent = -1
                if parent_words is not None:
                    parent = table.find_one(ns, parent_words)
                    if parent >= 0 and table.state.item(parent) != READY:
                        parent = -1
                table.inflight[bid] = 0  # a new row: nobody else holds it
                self._commit_one(bid, parent)
        finally:
            if not placed:
                # The row of a block stored nowhere, whatever; or kept with the copy recovery
                # read under the put (``_abandon``): present, found as by a later put.
                kept_recovered = len(self._abandon(bids))
        c = self.counters
        if placed:
            if self.space.misses:  # nothing to forget in an empty ledger
                self.space.misses.discard([identity])
            c.add(self._n_bytes_put, block_bytes)
            c.add(self._n_put[_STORED])
            return _ONE_RESULT[_STORED]
        if kept_recovered:
            c.add(self._n_put[_EXISTS])
            return _ONE_RESULT[_EXISTS]
        self.space.misses.record([identity], DECLINED)
        c.add(self._n_put[_REJECTED_FULL])
        return _ONE_RESULT[_REJECTED_FULL]

    async def _persist(self, refs: np.ndarray, level: Level) -> np.ndarray:
        """Give the blocks ``refs`` name (table refs, -1: none) a copy on the persistent
        ``level``; whether each still has one. (``put`` holds them in flight until this
        task has ended.)"""
        table = self.table
        held = np.zeros(0, dtype=np.int64)
        try:
            if level.recovering:
                # The disk tier allocates once its index is read: a durable put waits for
                # that (seconds at most) rather than failing.
                await self.recovered.wait()
            await self._written(refs)
            chain = table.resolve_many(refs)
            held = chain[chain >= 0]
            held = held[table.state[held] == READY]
            # In flight until counted, as ``put``'s are: a block another put was writing is
            # not among those, and an eviction must not take the copy made here.
            add_at(table.inflight, held, 1)
            need = held[table.slot[held, level.col] < 0]
            if len(need):
                await self.space.place(need, level, Priority.DEMAND)
        finally:
            self.space.end_in_flight(held)
        chain = table.resolve_many(refs)
        persisted = np.zeros(len(chain), dtype=bool)
        live = (chain >= 0) & (table.state[np.maximum(chain, 0)] == READY)
        persisted[live] = table.slot[chain[live], level.col] >= 0
        return persisted

    def _persisted(self, held: np.ndarray, _: asyncio.Future[np.ndarray]) -> None:
        """A ``_persist`` task ended (or was cancelled before it ran): end ``put``'s
        in-flight mark of the rows ``held``."""
        self.space.end_in_flight(held)

    async def _written(self, refs: np.ndarray) -> None:
        """Wait until none of the blocks ``refs`` name (-1: none) is still being written by
        another put (a key of a durable put found ``EXISTS`` while that put copies it in):
        each is then stored (READY) or gone, and is persisted or reported as it is."""
        table = self.table
        while True:
            chain = table.resolve_many(refs)
            if not (table.state[chain[chain >= 0]] == WRITING).any():
                return
            if self._write_settled is None:
                self._write_settled = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._write_settled)

    def _writes_settled(self) -> None:
        """Wake the durable puts waiting for blocks being written (``_written``)."""
        if self._write_settled is not None:
            self._write_settled.set_result(None)
            self._write_settled = None

    async def _store_new(
        self,
        pool: EnginePool,
        bids: np.ndarray,
        pars: np.ndarray | None,
        pages: np.ndarray,
        now: float,
        owner: int,
    ) -> int:
        """Copy new blocks (``pars``: their predecessors, needed where the top tier has an
        own admission) from the pool into the top tier; when it has no room for all of them
        (everything evictable taken, the rest pinned or protected) or its policy's own
        admission declines one, the rest go straight to the next slot tier below that takes
        writes and admits them. Where no tier below stores what the top tier admitted (their
        admission declines it, or they are full of what they keep), the top tier displaces
        for it as it does with no tier below (``SpaceManager.reserve``'s ``nowhere_else``).
        Blocks are placed in chain order, so what each tier stores is a leading run of what
        reached it, and what is stored is a leading run; returns its length."""
        done = 0
        levels = self.stack.levels  # the list itself: this runs for every Put
        top = levels[0]
        # The end of the run the top tier admitted but had no room for, and whether a tier
        # below was asked about it.
        top_short = 0
        went_below = False
        # Per tier, the blocks (positions in ``bids``) it had no room for: those no tier
        # stored in the end are its ``full_rejections`` (``_count_refused``).
        short: list[tuple[Level, int, int]] = []
        for level in levels:
            if done == len(bids):
                break
            if level.keyed or not level.tier.health().accepts_writes:
                continue
            went_below = level is not top
            # Whole arrays are taken as they are, not sliced: a view costs as much as a
            # small function call, and a single-key put would make four.
            todo = bids[done:] if done else bids
            # A level that admits everything (the default) is not asked: ``admit`` would
            # build an array of True for it.
            if not (level.admits_all and level.own_admission is None):
                pars_left = None if pars is None else pars[done:]
                admitted = self.space.admit(level, todo, now, pars_left)
                if not (admitted[0] if len(admitted) == 1 else admitted.all()):
                    todo = todo[: int(np.argmin(admitted))]
                    if len(todo) == 0:
                        if level is top:
                            continue
                        break
            stored, taken = await self._store_in(level, pool, todo, pages, done, owner)
            if taken < len(todo):
                short.append((level, done + taken, done + len(todo)))
                if level is top:
                    top_short = done + len(todo)
            done += stored
            if stored < taken:
                self._count_refused(short, done)
                return done  # a copy failed: what follows it is not stored
        if went_below and done < top_short:
            stored, _ = await self._store_in(
                top, pool, bids[done:top_short], pages, done, owner, nowhere_else=True
            )
            done += stored
        if short:
            self._count_refused(short, done)
        return done

    def _count_refused(self, short: list[tuple[Level, int, int]], stored: int) -> None:
        """Count in ``full_rejections`` the blocks of a put that no tier stored, at each tier
        that had no room for them (``short``: per tier, the positions in the put it had no
        slots for; the put stored a leading run of ``stored``). Counted as each tier fell
        short, they included blocks a lower tier, or the top tier displacing at a second
        try, then stored: refusals an operator read that never happened."""
        for level, start, end in short:
            if end > max(start, stored):
                self.counters.inc("full_rejections", end - max(start, stored), tier=level.label)

    async def _store_in(
        self,
        level: Level,
        pool: EnginePool,
        todo: np.ndarray,
        pages: np.ndarray,
        done: int,
        owner: int,
        nowhere_else: bool = False,
    ) -> tuple[int, int]:
        """``_store_new``'s copy of ``todo`` (the blocks past its first ``done``, whose pages
        are ``pages[done:]``) into ``level``, as many as it reserves slots for: how many it
        stored (a leading run) and how many it had slots for. ``nowhere_else``: no tier
        below took them (``SpaceManager.reserve``)."""
        table = self.table
        nbytes = pool.block_bytes
        top = self.stack.levels[0]
        slots = await self.space.reserve(
            level,
            nbytes,
            len(todo),
            Priority.DEMAND,
            owner=owner,
            displace=True,
            nowhere_else=nowhere_else,
        )
        if not slots:
            return 0, 0
        group = todo if len(slots) == len(todo) else todo[: len(slots)]
        if done == 0 and len(group) == len(pages):
            group_pages = pages
        else:
            group_pages = pages[done : done + len(group)]
        try:
            with pool.use():
                outcomes = await self.transfers.from_pool(
                    level,
                    slots,
                    table.block_refs(group),
                    nbytes,
                    pool.batch(group_pages, self._copy_threads),
                )
        except BaseException:
            # The reservation's hold lasts until the slots are free: a persistent tier
            # frees them on a thread (``free_held``).
            self.space.give_back_soon(level, owner, slots, nbytes)
            raise
        outs = WriteOutcomes.of(outcomes)
        if len(outs) == 1:  # a single-key put: no array reduction for one flag
            ok = int(outs.ok.item(0))
        else:
            ok = len(outs) if outs.ok.all() else int(np.argmin(outs.ok))
        stored = group if ok == len(group) else group[:ok]
        # What the copies stored counts in the table's usage from the set_slots below;
        # the slots of the copies that failed stay held until they are free.
        self.space.end_hold(level, owner, ok * nbytes)
        if (
            self._recovered_under_put
            and level.persistent
            and (replaced := stored[table.slot[stored, level.col] >= 0]).size
        ):
            # Recovery gave these blocks the tier's copy of their key from before this
            # start while the put wrote them (only then has a block being written a
            # copy here): the put's copy replaces it, whose slot goes back as an
            # evicted copy's does (one slot per block and tier).
            self._free_copies(level, replaced)
            for ref in table.refs(replaced).tolist():
                if (cols := self._recovered_under_put.get(ref)) is not None:
                    cols.pop(level.col, None)
        if ok == 1:  # a single-key put: the slot and checksum as scalars
            table.set_slots(stored, level.col, outs.slots.item(0))
            if level.checksummed:
                table.set_checksums(stored, level.col, outs.checksums.item(0))
        else:
            table.set_slots(stored, level.col, outs.slots[:ok])
            if level.checksummed:
                table.set_checksums(stored, level.col, outs.checksums[:ok])
        if ok < len(outs):
            await self.space.give_back(level, owner, outs.slots[ok:].tolist(), nbytes)
        if level is not top:
            self.counters.inc("stored_below", ok, tier=level.label)
        return ok, len(group)

    def _new_parents(
        self,
        bids: np.ndarray,
        new_idx: np.ndarray,
        existing: np.ndarray,
        ns: int,
        parent_words: np.ndarray | None,
    ) -> np.ndarray:
        """Each new block's predecessor: the block of the key before it in the put (stored
        already, or new in this put), or for the first key the request's parent; -1 where
        that block is not stored."""
        table = self.table
        chain = existing.copy()
        chain[new_idx] = bids
        parent = -1
        if parent_words is not None:
            parent = int(table.lookup(ns, parent_words[None, :])[0])
        prev = np.maximum(new_idx - 1, 0)
        pars = np.where(new_idx > 0, chain[prev], parent)
        new = np.zeros(len(chain), dtype=bool)
        new[new_idx] = True
        ours = (new_idx > 0) & new[prev]
        pars[~ours & (table.state[np.maximum(pars, 0)] != READY)] = -1
        return pars

    def _commit_new(self, bids: np.ndarray, pars: np.ndarray) -> None:
        """New blocks (``pars``: their predecessors) become visible, linked and known to the
        policies of the tiers holding them."""
        # The put's own in-flight mark ends: a row it stored into again (``_claim_bare``) may
        # be held by others too.
        add_at(self.table.inflight, bids, -1)
        if self.space.read_held:
            self.space.free_read_held()
        if len(bids) == 1:
            self._commit_one(int(bids[0]), int(pars[0]))
            return
        self.space.apply_touches()
        self._writes_settled()
        table = self.table
        now = self._clock()
        if self._recovered_under_put:
            self._drop_put_over(bids)
        if self._recovering:
            self._put_in_recovery.update(table.refs(bids).tolist())
        table.state[bids] = READY
        table.last_access[bids] = now
        table.link_many(bids, pars)
        held = table.slot[bids] >= 0
        for level in self.stack:
            mine = held[:, level.col]
            if mine.any():
                level.policy.insert_many(bids[mine], now, pars[mine])
        self.space.after_store(bids[table.slot[bids, self.top.col] >= 0], now)

    def _commit_one(self, bid: int, parent: int) -> None:
        """``_commit_new`` of one block: the table's marks, link and the policies' insert as
        scalars (``insert_many`` of one block is that insert, after converting its arrays
        back; ``after_store`` still takes a one-element array). The caller has ended the
        put's in-flight mark."""
        self.space.apply_touches()
        self._writes_settled()
        table = self.table
        now = self._clock()
        if self._recovered_under_put:
            self._drop_put_over(np.array([bid], dtype=np.int64))
        if self._recovering:
            self._put_in_recovery.add(table.ref(bid))
        table.state[bid] = READY
        table.last_access[bid] = now
        table.link(bid, parent)
        levels = self.stack.levels
        for level in levels:
            if table.slot.item(bid, level.col) >= 0:
                level.policy.insert(bid, now, parent)
        if len(levels) > 1:  # only tiers below the top hear of new blocks
            one = np.array([bid], dtype=np.int64)
            top_col = levels[0].col
            self.space.after_store(one if table.slot.item(bid, top_col) >= 0 else one[:0], now)

    def _drop_put_over(self, bids: np.ndarray) -> None:
        """Of the copies recovery gave ``bids`` (a put's, committing) from their key's rows of
        before this start, which the put did not replace itself, free those whose bytes are
        not the put's (the key put again with other bytes): a Get would load them once the
        put's copies are evicted. A copy of the put's bytes stays (the key as durable as it
        was)."""
        refs = self.table.refs(bids).tolist()
        cols = [self._recovered_under_put.pop(r, {}) for r in refs]
        for level in self.stack:
            over = bids[[level.col in c for c in cols]]
            if len(over):
                same = self._same_as_put(level, over, self.table.checksums(over, level.col))
                self._free_copies(level, over[~same])

    def _same_as_put(self, level: Level, bids: np.ndarray, checksums: np.ndarray) -> np.ndarray:
        """Whether the bytes of each of ``bids``' copies on the top tier have the checksum
        ``level`` keeps of a copy there (``checksums``); False where either cannot tell."""
        table, top = self.table, self.top
        same = np.zeros(len(bids), dtype=bool)
        view = getattr(top.tier, "view", None)
        if view is None or not level.checksummed:
            return same
        for i, bid in enumerate(bids.tolist()):
            if (slot := table.slot.item(bid, top.col)) >= 0:
                data = view(slot, int(table.nbytes[bid]))
                same[i] = block_checksum(data) == int(checksums[i])
        return same

    def _free_copies(self, level: Level, bids: np.ndarray) -> None:
        """Forget ``bids``' copies on ``level`` and give their slots back (held against their
        owners' quotas until free: ``free_held``)."""
        old = self.table.slot[bids, level.col].tolist()
        holds = self.space.hold_copies(level, bids)
        self.table.clear_slots(bids, level.col)
        self.space.free_held(level, old, holds, refs=self.table.block_refs(bids))

    # -------------------------------------------------------------------- reads

    async def get(
        self,
        pool: EnginePool,
        ns: int,
        words: np.ndarray,
        pages: np.ndarray,
        *,
        touch: bool,
        layers: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Copy stored blocks into pool pages; returns whether each key was loaded.

        Every block some tier holds is loaded (see the module invariants). With ``layers``,
        only the chunks of layers ``[begin, end)`` are copied (checked by the service); a
        block counts as loaded once, by the Get that copies its layer 0.
        """
        if len(words) == 1:
            one = await self._get_one(pool, ns, words[0], pages, touch, layers)
            if one is not None:
                return one
        table = self.table
        chunks = pool.layout.layer_range_table(*layers) if layers else pool.layout.chunk_table
        ids = table.lookup(ns, words)
        if self._recovering and (ids < 0).any():
            ids = (await self._after_recovery(ns, words))[0]
        self._check_sizes(ids, pool.block_bytes)
        found = np.flatnonzero(ids >= 0)
        bids = ids[found]
        now = self._clock()
        if touch:
            self.space.touch(bids, now)
        elif len(bids):
            # The pinning Lookup counted this access; only the protection clock restarts.
            table.last_access[bids] = now
        loaded = np.zeros(len(ids), dtype=bool)
        lost = self.space.copies_lost
        add_at(table.inflight, bids, 1)
        try:
            # Parts only pay where there is something to overlap: blocks to promote first.
            in_top = not (table.slot[bids, self.top.col] < 0).any()
            step = max(1, len(bids) if in_top else GET_PART_BYTES // max(pool.block_bytes, 1))
            with pool.use():
                if in_top and len(bids):
                    # The top tier holds every block (an engine's common Get): one read.
                    parts = [[await self._load(self.top, bids, found, pool, layers, pages)]]
                else:
                    # Every copy finishes before the pool may be unmapped, even when one fails.
                    parts = await _all_done(
                        [
                            self._get_part(
                                bids[s : s + step], found[s : s + step], pool, layers, pages
                            )
                            for s in range(0, len(bids), step)
                        ]
                    )
                for part in parts:
                    for idx, ok in part:
                        loaded[idx] = ok
        finally:
            add_at(table.inflight, bids, -1)
            # A block whose last copy failed (a read of this Get's, or of another request
            # while this one held the block) is forgotten once nobody holds it.
            if not loaded.all() or self.space.copies_lost != lost:
                self.space.forget_orphans(bids)
            if self.space.read_held:  # slots kept for reads of blocks this Get may have held
                self.space.free_read_held()
        loaded_ids = ids[loaded]
        self._account_reads(loaded_ids)
        if layers is None or layers[0] == 0:
            self.counters.add(self._n_get["loaded"], len(loaded_ids))
            self.counters.add(self._n_get["missing"], len(ids) - len(loaded_ids))
        self.counters.add(self._n_bytes_get, len(loaded_ids) * chunks.nbytes)
        if len(loaded_ids):
            self._read_ahead(int(loaded_ids[-1]))
        return loaded

    async def _get_one(
        self,
        pool: EnginePool,
        ns: int,
        key: np.ndarray,
        pages: np.ndarray,
        touch: bool,
        layers: tuple[int, int] | None,
    ) -> np.ndarray | None:
        """``get`` of one key whose block the top tier holds (an engine's commonest small
        Get), in Python scalars: the same steps, marks and counts as the batch path, without
        its array operations. None, having changed nothing, in every other case (the key
        absent or still being written, held only below, a size to refuse): the batch path
        takes those. ``pages``: the request's, one page."""
        table, top = self.table, self.top
        bid = table.find_one(ns, key)
        if bid < 0 or table.state[bid] != READY:
            return None
        slot = int(table.slot[bid, top.col])
        if slot < 0 or int(table.nbytes[bid]) != pool.block_bytes:
            return None
        now = self._clock()
        if touch:
            self.space.touch_one(bid, now)
        else:
            # The pinning Lookup counted this access; only the protection clock restarts.
            table.last_access[bid] = now
        lost = self.space.copies_lost
        table.inflight[bid] += 1
        ok = False
        try:
            with pool.use():
                ok = await self._load_one(top, bid, slot, pool, pages, layers)
        finally:
            table.inflight[bid] -= 1
            if not ok or self.space.copies_lost != lost:
                self.space.forget_orphans(np.array([bid], dtype=np.int64))
            if self.space.read_held:  # slots kept for reads of blocks this Get may have held
                self.space.free_read_held()
        c = self.counters
        if ok:
            if self.prefetches.outstanding:
                self._account_reads(np.array([bid], dtype=np.int64))
            if layers is None or layers[0] == 0:
                c.add(self._n_get["loaded"])
            chunks = pool.layout.layer_range_table(*layers) if layers else pool.layout.chunk_table
            c.add(self._n_bytes_get, chunks.nbytes)
            self._read_ahead(bid)
        elif layers is None or layers[0] == 0:
            c.add(self._n_get["missing"])
        return _ONE_LOADED[ok]

    async def _load_one(
        self,
        level: Level,
        bid: int,
        slot: int,
        pool: EnginePool,
        pages: np.ndarray,
        layers: tuple[int, int] | None,
    ) -> bool:
        """``_load`` of one block from ``slot`` of ``level`` into the one page of ``pages``."""
        table = self.table
        ok = await self.transfers.to_pool(
            level,
            [slot],
            [BlockRef(int(table.ns[bid]), table.keys[bid].tobytes())],
            pool.block_bytes,
            [table.checksum_of(bid, level.col)],
            pool.batch(pages, self._copy_threads, layers),
        )
        c = self.counters
        if ok[0]:
            if level.keyed:
                table.keyed_seen[bid] = self._clock()
            c.add(self._n_loaded_from[level.col])
            return True
        if ok[0] is not None:
            self.space.lose_copy(bid, level, slot)
        c.add(self._n_load_failures[level.col])
        return False

    async def _get_part(
        self,
        bids: np.ndarray,
        idx: np.ndarray,
        pool: EnginePool,
        layers: tuple[int, int] | None,
        pages: np.ndarray,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """One part of a Get (inside ``pool.use()``): promote what the top tier can take
        without waiting, then load each block from the fastest tier holding it (the rest is
        read from below straight into the pages). Raises once all of its copies are done."""
        lower = bids[self.table.slot[bids, self.top.col] < 0]
        # A Get past layer 0 is not an access (see ``get``). An own admission hears of
        # every promotion it declines as an access, so there the Get of layer 0 decided
        # for the whole read and a later layer's Get reads each block where it is.
        asks = layers is None or layers[0] == 0 or self.top.own_admission is None
        if len(lower) and asks:
            await self.space.place(lower, self.top, Priority.DEMAND, clean_only=True)
        jobs = []
        source = self._fastest_col(bids)
        # A row a put took to store into while this Get waited (it held no copy then:
        # ``_claim_bare``) holds the put's copies, which a put that fails frees: a miss.
        source[self.table.state[bids] != READY] = -1
        for level in self.stack:
            mine = np.flatnonzero(source == level.col)
            if len(mine):
                jobs.append(self._load(level, bids[mine], idx[mine], pool, layers, pages))
        return await _all_done(jobs)

    async def _load(
        self,
        level: Level,
        bids: np.ndarray,
        idx: np.ndarray,
        pool: EnginePool,
        layers: tuple[int, int] | None,
        pages: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read blocks ``level`` holds into their pages (the chunks of ``layers``, all when
        None; inside ``pool.use()``); a failed read drops that copy, one the level could not
        answer (L3 unreachable) keeps it."""
        table = self.table
        slots = table.slot[bids, level.col]
        if slots.min(initial=0) < 0:
            # A copy dropped since the read was planned (another request's read of it failed
            # in between) is a miss here, not a read of no slot.
            here = slots >= 0
            bids, idx, slots = bids[here], idx[here], slots[here]
        ok = await self.transfers.to_pool(
            level,
            slots.tolist(),
            self.table.block_refs(bids),
            pool.block_bytes,
            table.checksums(bids, level.col).tolist(),
            pool.batch(pages[idx], self._copy_threads, layers),
        )
        # Every block read, the common case, is told by the list's own count (a pass over
        # the one True object): converting the list, and looking for the misses' kinds in
        # it, took 0.35 ms per 4,096 blocks of the event loop's time, after the large Get's
        # turn (``daemon/stepturns.py``) while other tenants' calls waited.
        if ok.count(True) == len(ok):
            good = np.ones(len(ok), dtype=bool)
        else:
            good = np.asarray(ok, dtype=bool)
            # A miss the level could not tell (L3 unreachable) keeps the copy: it is read
            # once the store answers again.
            lost = np.fromiter((g is not None for g in ok), dtype=bool, count=len(ok)) & ~good
            for b, slot in zip(bids[lost].tolist(), slots[lost].tolist(), strict=True):
                self.space.lose_copy(b, level, slot)
        if level.keyed:
            table.keyed_seen[bids[good]] = self._clock()
        loaded = int(np.count_nonzero(good))
        self.counters.add(self._n_loaded_from[level.col], loaded)
        self.counters.add(self._n_load_failures[level.col], len(good) - loaded)
        return idx, good

    async def prefetch(
        self, ns: int, words: np.ndarray, deadline_ms: int, priority: int = 0
    ) -> PrefetchResult:
        """Start promoting the keys' blocks that only lower tiers hold; never waits for them.
        With a deadline, the blocks found are also protected from eviction in every tier until
        it passes (capped at ``policy.hint_max_s``). ``priority`` is the promotions' rank
        within ``Priority.PREFETCH``: it orders them among the prefetches still waiting for a
        thread or for room, higher sooner, equal ones in arrival order, always behind demand
        reads and ahead of background writes. A block some earlier prefetch is already moving
        keeps that move and its rank, unless a request waits for it (``SpaceManager.place``
        raises the move to the request's urgency).

        Counts name distinct keys, as Delete's and Evict's do: a key named twice is
        prefetched, hinted and counted once."""
        words = _distinct(words)  # in first-named order: a chain's head goes first
        ids = self.table.lookup(ns, words)
        found = ids[ids >= 0]
        lower = found[self.table.slot[found, self.top.col] < 0] if len(found) else found
        now = self._clock()
        deadline = now + deadline_ms / 1000.0 if deadline_ms else None
        hint_s = min(deadline_ms / 1000.0, self.config.policy.hint_max_s)
        if hint_s > 0 and len(found):
            # A hint: the engine will read these blocks by the deadline (a queued request).
            # Every tier keeps them until then, whichever of them holds a copy, as far as
            # their owner's hint budget goes (the rest are only promoted).
            hinted = found
            if (budget := self.hint_budget) is not None:
                table = self.table
                cost = self._protected_bytes(found)
                ok = budget.admit(found, table.owner[found], cost, now + hint_s, now)
                hinted = found if ok.all() else found[ok]
            if len(hinted):
                for level in self.stack:
                    level.policy.hint(hinted, now + hint_s, now)
                self.counters.inc("hinted_blocks", len(hinted))
            if len(hinted) < len(found):
                self.counters.inc("hints_over_budget_blocks", len(found) - len(hinted))
        started = self._start_promotions(lower, deadline, priority)
        return PrefetchResult(
            resident=len(found) - len(lower),
            scheduled=started,
            missing=int(np.count_nonzero(ids < 0)),
        )

    def _protected_bytes(self, bids: np.ndarray) -> np.ndarray:
        """What protecting each of ``bids`` charges its owner's hint budget: the slot its copy
        takes in the top tier, as the budget is a share of that tier's slots. Charged their
        bytes, blocks smaller than their slots let a tenant protect more than its share."""
        return self.stack.top.slots.allocator.slot_bytes_for(self.table.nbytes[bids])

    def promote_in_background(self, bids: np.ndarray) -> None:
        """A pinning Lookup found these blocks: bring the lower-tier-only ones up before the
        Get."""
        if len(bids):
            self._start_promotions(bids[self.table.slot[bids, self.top.col] < 0], None)

    def _start_promotions(self, bids: np.ndarray, deadline: float | None, rank: int = 0) -> int:
        top = self.top
        fresh = [
            b
            for b in dict.fromkeys(bids.tolist())
            if not self.transfers.moving(self.table.ref(b), top.kind)
        ]
        if not fresh:
            return 0
        now = self._clock()
        bids = np.asarray(fresh, dtype=np.int64)
        words = self.table.identities_of(bids)
        opened = [self.prefetches.issue(word, now) for word in words]
        # Refs taken now: a block may go, and its row be reused, before the task starts.
        refs = self.table.refs(bids)
        self.space.spawn(self._promote(bids, refs, words, opened, deadline, rank))
        return len(fresh)

    async def _promote(
        self,
        bids: np.ndarray,
        refs: np.ndarray,
        words: list[int],
        opened: list[bool],
        deadline: float | None,
        rank: int,
    ) -> None:
        """Promote prefetched blocks; then every prefetch this one opened that is still in
        flight ends: arrived when its block is in the top tier, else cancelled (the tier had
        no room, or the block went before its copy began)."""
        top, table = self.top, self.table
        try:
            await self.space.place(
                bids, top, Priority.PREFETCH, deadline=deadline, prefetch=True, rank=rank
            )
        finally:
            rows = table.resolve_many(refs)
            here = (rows >= 0) & (table.slot[np.maximum(rows, 0), top.col] >= 0)
            now = self._clock()
            for word, mine, arrived in zip(words, opened, here.tolist(), strict=True):
                if not mine:
                    continue
                if arrived:
                    self.prefetches.complete(word, now)
                else:
                    self.prefetches.evict(word, now)

    def _read_ahead(self, last: int) -> None:
        """Reading the end of a chain prefetches its next blocks from lower tiers."""
        if len(self.stack) == 1:
            return
        chain: list[int] = []
        nxt = last
        for _ in range(self.config.policy.readahead_blocks):
            nxt = self.table.child_of(nxt)
            if nxt < 0 or self.table.state[nxt] != READY:
                break
            chain.append(nxt)
        if chain:
            ids = np.asarray(chain, dtype=np.int64)
            self._start_promotions(ids[self.table.slot[ids, self.top.col] < 0], None)

    def _account_reads(self, bids: np.ndarray) -> None:
        if not self.prefetches.outstanding:
            return  # the common case: nothing prefetched is waiting for its read
        now = self._clock()
        for word in self.table.identities_of(bids):
            self.prefetches.demand(word, now)

    # ------------------------------------------------------------------- delete

    async def delete(self, ns: int, words: np.ndarray) -> DeleteResult:
        """Remove the keys' blocks from every tier, but those pinned, in flight or still being
        written (busy). Counts name distinct keys. Refused while a persistent tier has index
        rows its recovery did not read (cut by a stop, or ended by an error): they would bring
        the keys back at the next start."""
        words = _distinct(words)
        if self._recovery is not None:
            # A key whose row was not read yet would come back after its delete. Nothing is
            # done yet: a Delete whose client leaves meanwhile is dropped, not kept waiting.
            await unchanged_wait(self.recovered.wait())
            if self._recovery_cut:
                # Its rows left unread stay in the index: done now, it would report keys
                # deleted that the next start brings back.
                raise Unavailable("the daemon is stopping; the delete was not done (retry it)")
        for level in self.stack.levels:
            if level.persistent and not level.keyed and level.recovering:
                # Recovery ended early (an error): the rows it did not read stay until a
                # restart reads them, and would bring back keys said deleted or missing now.
                raise FailedPrecondition(
                    f"{level.label} did not read every index row at start (see the log); a "
                    "delete now would not last past the next start: restart the daemon"
                )
        # The keys' rows an earlier eviction's or Delete's free left in a persistent tier's
        # index (it failed, or still runs) go first: where they cannot, the Delete fails with
        # nothing done. What it finds is read after this await: a pin or a put of one of the
        # keys meanwhile keeps it (busy), as one before the Delete would.
        await self._rows_gone(ns, words, None)
        table = self.table
        found = table.find_any(ns, words)
        missing = int(np.count_nonzero(found < 0))
        ids = np.unique(found[found >= 0])
        busy = (table.state[ids] != READY) | (table.pins[ids] > 0) | (table.inflight[ids] > 0)
        gone = ids[~busy]
        refs: list[BlockRef] = []
        if self._keyed:
            # Whatever the local table knew, the keys leave the shared tiers too, except the
            # ones kept here as busy. A probe awaiting its answer now, or begun before their
            # removal is done (it may read them before that reaches the store), must not bring
            # them back (``_discover``).
            keep = {table.key_bytes(b) for b in ids[busy].tolist()}
            refs = [BlockRef(ns, w.tobytes()) for w in words if w.tobytes() not in keep]
            self._note_deleted(refs)
        # Handed to those tiers in this step, which decides them: a put of one of the keys
        # from now on writes its block there after the removal (which then leaves that key
        # alone: ``RemoteTier.write``), not before it, where the removal would delete the
        # new block's value and leave its row a copy there that no longer is. A background
        # task of the store's: a Delete cancelled meanwhile leaves it to finish, and a stop
        # waits for it.
        removal = self.space.spawn(eager_future(self._remove_keyed(refs))) if refs else None
        # Held against their owners' quotas until a persistent tier has freed their slots,
        # as evicted copies are (``SpaceManager.evict``). The blocks named with their slots,
        # in the order those are released below.
        holds = [
            (level, self.space.hold_copies(level, held), table.block_refs(held))
            for level in self.stack
            if level.persistent and not level.keyed
            for held in [gone[table.slot[gone, level.col] >= 0]]
        ]
        released: dict[TierKind, list[int]] = {}
        for bid in gone.tolist():
            for level in self.stack:
                if table.slot[bid, level.col] >= 0:
                    slot = self.space.drop_copy(bid, level)
                    if slot is not None:
                        released.setdefault(level.kind, []).append(slot)
        # Every tier's slots are on their way back before the first await: a Delete
        # cancelled meanwhile leaves none taken, and each hold lasts until its slots are free.
        freeing = [
            (level, self.space.free_held(level, released[level.kind], held, refs=held_refs))
            for level, held, held_refs in holds
            if level.kind in released
        ]
        unfreed = [level.kind for level, task in freeing if not await asyncio.shield(task)]
        if removal is not None:
            await asyncio.shield(removal)
        deleted = int(np.count_nonzero(~busy))
        self.space.misses.discard(table.identities(ns, words))  # deleted on purpose: "absent"
        # The blocks are gone from here whether or not the Delete is answered below (its
        # retry finds them missing, and counts nothing).
        self.counters.inc("deleted_blocks", deleted)
        await self._rows_gone(ns, words, unfreed)
        return DeleteResult(deleted=deleted, missing=missing, busy=int(np.count_nonzero(busy)))

    async def _rows_gone(self, ns: int, words: np.ndarray, unfreed: list[TierKind] | None) -> None:
        """That no persistent tier's index keeps a row of one of the keys ``words``, which a
        restart would bring back (a Get serving bytes the client was told were deleted):
        their rows in slots still on their way out (an earlier eviction's or Delete's free
        that failed, or is still running) are deleted now (``SlotTier.drop_rows_left``).
        ``unfreed``: None before the Delete drops the keys; after, the tiers whose free of
        them failed (retried in the background). Raises Unavailable, the Delete not
        acknowledged, where those rows cannot be deleted or this Delete's own free failed:
        before the drop, with nothing done; after, the keys gone from the table already (the
        message says which), and the client's retry deletes the rows once the index takes
        commits again (until then it fails so too)."""
        refs: Sequence[BlockRef] | None = None
        for level in self.stack.levels:
            if not level.persistent or level.keyed:
                continue
            freed = unfreed is None or level.kind not in unfreed
            if freed:
                if refs is None:
                    refs = BlockRefs(np.full(len(words), ns, dtype=np.uint64), words)
                if not level.slots.rows_left(refs):
                    continue
                freed = bool(
                    await self.transfers.run(Priority.DEMAND, level.slots.drop_rows_left, refs)
                )
            if not freed:
                cause = level.slots.health().detail or "see its log"
                if unfreed is None:
                    raise Unavailable(
                        f"{level.label} could not delete rows of the keys an earlier eviction or "
                        f"delete left in its index ({cause}): nothing was deleted; retry the "
                        "delete"
                    )
                raise Unavailable(
                    f"{level.label} could not delete the keys' rows from its index ({cause}): "
                    "the keys are dropped here, but a restart would bring the blocks back; "
                    "retry the delete"
                )

    async def _remove_keyed(self, refs: list[BlockRef]) -> None:
        """Remove ``refs`` from every key-addressed tier (each takes its removal before this
        first waits). Until every tier is done, a probe that begins starts with them as
        deleted (``_removing``): it may read a value before its removal reaches the store, and
        be answered before the removal ends."""
        keys = [(ref.ns, ref.key) for ref in refs]
        removing = self._removing
        removing.update(keys)
        try:
            # A tier's fault is its own: it keeps a removal it could not send, to send again.
            # Anything else it raises is a defect of its own, logged, not the Delete's.
            levels = self._keyed
            outcomes = await asyncio.gather(
                *(eager_future(level.keys.remove(refs)) for level in levels),
                return_exceptions=True,
            )
            for level, outcome in zip(levels, outcomes, strict=True):
                if isinstance(outcome, Exception):
                    log.error(
                        "%s: removing %d deleted keys failed; they may be found there again",
                        level.label,
                        len(refs),
                        exc_info=outcome,
                    )
        finally:
            for key in keys:
                if (left := removing[key] - 1) > 0:
                    removing[key] = left
                else:
                    del removing[key]

    def _note_deleted(self, refs: list[BlockRef]) -> None:
        """Tell every probe awaiting its answer now that a Delete removes ``refs``."""
        for deleted in self._probes_open.values():
            deleted.update((ref.ns, ref.key) for ref in refs)

    async def evict(self, ns: int, words: np.ndarray, kind: TierKind) -> EvictResult:
        """Take the keys' blocks out of tier ``kind`` as eviction would: a block whose only
        copy is there moves down to the first lower tier that takes it, else it leaves the
        store. Pinned and in-flight blocks stay (busy), and so does a block only there that
        was used within ``policy.protect_s`` or that a live hint protects (it keeps the lower
        copy just made). Counts name distinct keys."""
        if kind not in self.stack or self.stack[kind].keyed:
            raise InvalidArgument(
                f"this daemon has no slot tier {kind.label} to evict from "
                f"(tiers: {', '.join(lv.label for lv in self.stack if not lv.keyed)})"
            )
        level = self.stack[kind]
        table = self.table
        ids = table.lookup(ns, _distinct(words))
        found = np.unique(ids[ids >= 0])
        held = found[table.slot[found, level.col] >= 0]
        busy = (table.pins[held] > 0) | (table.inflight[held] > 0)
        victims = held[~busy]
        refs = table.refs(victims)
        if len(victims):
            await self.space.evict(level, victims, Priority.DEMAND)
        rows = table.resolve_many(refs)
        gone = (rows < 0) | (table.slot[np.maximum(rows, 0), level.col] < 0)
        evicted = int(np.count_nonzero(gone))
        self.counters.inc("evicted_blocks", evicted, tier=level.label)
        return EvictResult(
            evicted=evicted,
            missing=int(np.count_nonzero(ids < 0)) + len(found) - len(held),
            busy=len(held) - evicted,
        )

    # --------------------------------------------------------------------- pins

    def pin(self, bids: np.ndarray) -> np.ndarray:
        """Pin blocks (distinct ids); returns refs for ``unpin``. Where a hint budget is kept
        (tenants), the blocks not yet protected must fit their owners' share of it and the
        total, else ResourceExhausted and nothing is pinned (``HintBudget.pin``)."""
        table = self.table
        if (budget := self.hint_budget) is not None and not budget.pin(
            bids, table.owner[bids], self._protected_bytes(bids), self._clock()
        ):
            raise ResourceExhausted(
                f"pinning {counted(len(bids), 'block')} would pass what their owner's hints and "
                "pins may protect at once (policy.hint_max_share of the top tier), or what "
                "every tenant's may together (policy.hint_max_total_share); release leases, "
                "let them or hints expire, or pin fewer blocks"
            )
        add_at(table.pins, bids, 1)
        return table.refs(bids)

    def unpin(self, refs: np.ndarray, *, distinct: bool = True) -> None:
        """Take a pin off the block of each of ``refs`` (``pin``'s); ``distinct=False`` where
        a ref may repeat, once per pin to take (the refs of several leases at once). A pin
        that cannot be taken (its block freed, or its count at zero: a broken invariant)
        raises AssertionError once the others are taken: raised before, they were held for
        good (nothing owes them any more); raised after taking all, counts were left below
        zero, and the block's next lease did not keep it from eviction or a Delete."""
        refs = np.asarray(refs, dtype=np.int64)
        bids, pins = refs & 0xFFFFFFFF, self.table.pins
        if (self.table.resolve_many(refs) < 0).any():
            self._unpin_those_held(refs, "their blocks were freed, and pins must keep them alive")
        add_at(pins, bids, -1)
        if (pins[bids] < 0).any():
            add_at(pins, bids, 1)
            self._unpin_those_held(
                refs, "their blocks' counts were at zero: a lease released twice"
            )
        if (budget := self.hint_budget) is not None:
            if distinct:
                budget.unpin(bids, self._clock())
            else:
                ids, counts = np.unique(bids, return_counts=True)
                budget.unpin(ids, self._clock(), counts)
        self.space.forget_orphans(bids)

    def _unpin_those_held(self, refs: np.ndarray, why: str) -> NoReturn:
        """``unpin`` where some of ``refs`` cannot be: those of live blocks are taken, up to
        each block's count, and the AssertionError says how many are not and ``why``."""
        table = self.table
        ids, counts = np.unique(
            refs[table.resolve_many(refs) >= 0] & 0xFFFFFFFF, return_counts=True
        )
        taken = np.minimum(counts, np.maximum(table.pins[ids], 0))
        table.pins[ids] -= taken.astype(table.pins.dtype)
        if (budget := self.hint_budget) is not None:
            budget.unpin(ids[taken > 0], self._clock(), taken[taken > 0])
        self.space.forget_orphans(ids)
        lost = len(refs) - int(taken.sum())
        raise AssertionError(f"{lost} of {counted(len(refs), 'pin')} could not be taken off: {why}")

    # ------------------------------------------------------------------ checks

    def quiescent(self) -> bool:
        """Nothing in flight: no transfer, background task or in-flight mark, no slot held
        for a read that may still use it (``SpaceManager.read_held``), and no recovery
        running (it holds slots whose rows it has yet to sort out). A settled Check
        asks every 5 ms while it waits: the counters first, then the marks of the rows ever
        taken only (0.16-0.33 ms at 1,048,576 rows, against 2.4-3.0 ms for the passes over
        the whole state and in-flight columns it made each time, counters or not)."""
        space = self.space
        if self._recovering or space.background or space.read_held or self.transfers.running:
            return False
        table = self.table
        marked = np.flatnonzero(table.inflight[: table.rows] > 0)
        return not (table.state[marked] != 0).any()

    async def quarantine(
        self, release: bool, slots: Sequence[int], limit: int
    ) -> tuple[list[QuarantinedSlot], list[int], list[int]]:
        """(the slots the disk tier holds out of use, those given back to use, those the
        release left held for a later one, no check of theirs having failed), after a
        release of ``slots`` (when empty, the next ``limit`` held) with ``release``
        (``Quarantine.release_quarantined``). FailedPrecondition: there is no such tier, or
        it refused the release (degraded by a fault other than a failed read, recovering);
        InvalidArgument: a slot it does not hold."""
        level = next((lv for lv in self.stack if hasattr(lv.tier, "release_quarantined")), None)
        if level is None:
            raise FailedPrecondition("no tier quarantines slots: the daemon runs without L2")
        tier = cast(Quarantine, level.tier)
        released: list[int] = []
        deferred: list[int] = []
        if release:
            try:
                out = await self.transfers.run(
                    Priority.BACKGROUND, tier.release_quarantined, list(slots) or None, limit
                )
            except TierUnavailable as e:
                raise FailedPrecondition(str(e)) from None
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
            released = out.released
            deferred = [q.slot for q in out.kept if not q.tried]
        held = await self.transfers.run(Priority.BACKGROUND, tier.quarantined)
        return held, released, deferred

    def check(self, pins: np.ndarray | None = None) -> list[str]:
        """``check_problems``' descriptions."""
        return [p.text for p in self.check_problems(pins)]

    async def check_suspects(self) -> CheckSuspects:
        """The rows that break an invariant of their own (a live block found by its key; its
        committed copy known to its tier's policy; its copy in an allocated slot; a freed
        row holding no copy), examined ``CHECK_SLICE_BLOCKS`` rows at a time with a turn of
        the event loop between slices, so that a large store's Check does not hold every
        other call for the whole table. Rows change between slices: a suspect is only that,
        and ``check_problems`` examines it again in the state it then has (a block freed or
        moved meanwhile is not reported); a row broken after its slice is left to the next
        Check."""
        table = self.table
        lost: list[np.ndarray] = []
        strays: dict[int, list[np.ndarray]] = {level.col: [] for level in self.stack}
        unallocated: dict[int, list[np.ndarray]] = {level.col: [] for level in self.stack}
        freed: dict[int, list[np.ndarray]] = {level.col: [] for level in self.stack}
        for start in range(0, table.rows, CHECK_SLICE_BLOCKS):
            if start:
                await asyncio.sleep(0)
            # Rows past the table's end when the slices were cut are blocks put since.
            ids = np.arange(start, min(start + CHECK_SLICE_BLOCKS, table.rows))
            alive = table.state[ids] != 0
            dead, ids = ids[~alive], ids[alive]
            lost += [blocks for _, blocks in self._blocks_not_found(ids)]
            for level in self.stack:
                strays[level.col].append(self._unknown_to_policy(level, ids))
                freed[level.col].append(dead[table.slot[dead, level.col] >= 0])
                if not level.keyed:
                    unallocated[level.col].append(self._not_allocated(level, ids)[0])

        def joined(found: dict[int, list[np.ndarray]]) -> dict[int, np.ndarray]:
            return {col: np.concatenate([_NO_IDS, *arrays]) for col, arrays in found.items()}

        return CheckSuspects(
            np.concatenate([_NO_IDS, *lost]), joined(strays), joined(unallocated), joined(freed)
        )

    def _blocks_not_found(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(namespace, its blocks among the live ``ids`` that their keys do not find), for
        each namespace that has some, in namespace order."""
        table = self.table
        if not len(ids):
            return []
        ids = ids[np.argsort(table.ns[ids], kind="stable")]
        names, starts = np.unique(table.ns[ids], return_index=True)
        out: list[tuple[int, np.ndarray]] = []
        for ns, group in zip(names.tolist(), np.split(ids, starts[1:]), strict=True):
            found = table.find_any(int(ns), table.keys[group])
            if len(lost := group[found != group]):
                out.append((ns, lost))
        return out

    def _unknown_to_policy(self, level: Level, ids: np.ndarray) -> np.ndarray:
        """The blocks among ``ids`` committed (READY) with a copy in ``level`` that its
        policy does not know."""
        table = self.table
        ids = ids[(table.slot[ids, level.col] >= 0) & (table.state[ids] == READY)]
        policy = level.policy
        return np.array([b for b in ids.tolist() if b not in policy], dtype=np.int64)

    def _not_allocated(self, level: Level, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the blocks among ``ids`` with a copy in ``level`` in a slot its allocator has not
        handed out, those slots)."""
        ids = ids[self.table.slot[ids, level.col] >= 0]
        slots = self.table.slot[ids, level.col].astype(np.int64)
        ok = level.slots.allocator.allocated(slots)
        return ids[~ok], slots[~ok]

    def check_problems(
        self, pins: np.ndarray | None = None, suspects: CheckSuspects | None = None
    ) -> list[CheckProblem]:
        """The store's invariants; each one broken, with the blocks and slots it names, or
        nothing, in one step of the event loop (``check_problems_in_turns``: the same in
        turns). ``pins``: the block each pin of the live leases holds (a block once per lease
        that pins it; the sessions know), when known. ``suspects`` (``check_suspects``): the
        invariants of each row on its own are examined for these rows only, the others'
        having held in their slice; without it, for every row.

        Always: every slot of a tier belongs to at most one live block and is allocated;
        each tier's allocator is consistent; every committed block (READY) with a copy in a
        tier is known to that tier's policy and the policy knows nothing else (a block being
        written joins the policies when it is committed); every live block is found by
        its key; no freed row holds a copy; the blocks counted per namespace and the bytes
        each tenant holds per tier add up; pin counts match the leases. When nothing is in
        flight also: a tier's allocated slots are exactly its blocks' (plus, on a disk, its
        quarantined slots)."""
        steps = self._check_steps(pins, suspects)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value[0]

    async def check_problems_in_turns(
        self,
        pins: np.ndarray | None = None,
        suspects: CheckSuspects | None = None,
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[list[CheckProblem], bool]:
        """``check_problems`` with a turn of the event loop between its steps (``_check_steps``),
        and whether nothing was in flight at the step of any tier with slots (the strict
        invariants were examined for every tier). ``settle``: awaited before each such tier's
        step, where it may wait for the transfers in flight (the calls let in between the
        steps start some)."""
        steps = self._check_steps(pins, suspects)
        while True:
            try:
                settles = next(steps)
            except StopIteration as done:
                return done.value
            if settles and settle is not None:
                await settle()
            else:
                await asyncio.sleep(0)

    def _check_steps(
        self, pins: np.ndarray | None, suspects: CheckSuspects | None
    ) -> Generator[bool, None, tuple[list[CheckProblem], bool]]:
        """``check_problems``' steps; yields between them (True where the caller may wait
        for the transfers in flight first), returns the problems and whether every tier with
        slots was quiet at its step. Each whole-table invariant is compared at a moment
        of its own: one step copies the columns it reads and the counts kept beside them
        (the pins, at the caller's step, where it read the leases; the namespaces; each
        tier's copies), and the next ones add that copy up ``CHECK_SLICE_ROWS`` rows a step,
        whatever the table does meanwhile. A copy lives in the steps of its invariant only
        (``_pins_in_turns``, ``_namespaces_in_turns``, ``_level_in_turns``), not through the
        waits for the transfers in flight. At 1,048,576 blocks (16 leases of 4,096) the
        steps took at most 5.3 ms: the leases' and pins' 5.0, a tier's copy 2.7, its sort of
        the slots 5.2, a slice 0.2-2.0 (the first Check of the process up to 15 ms, its
        copies' memory new; the generations' copy, added since to the pins' and each tier's,
        0.3 ms more); one step over the whole table took 45-370 ms."""
        table = self.table
        # The suspects examined again, and the pins, at the moment the caller read the leases.
        if suspects is None:
            examined = table.live_ids()
        else:
            examined = np.unique(suspects.lost)
            examined = examined[table.state[examined] != 0]
        lost = [(ns, table.refs(blocks)) for ns, blocks in self._blocks_not_found(examined)]
        pin_problems = yield from self._pins_in_turns(pins)
        problems = yield from self._namespaces_in_turns()
        for ns_id, blocks in lost:
            problems.append(
                CheckProblem(
                    counted(
                        len(blocks),
                        f"block of namespace {ns_id} is not found by its key",
                        f"blocks of namespace {ns_id} are not found by their keys",
                    ),
                    blocks=blocks,
                )
            )
        # Each tier's copies, each after a wait for the transfers in flight (``settle``), but
        # a key-addressed tier's: it holds no slots, and none of its invariants is strict.
        strict = True
        for level in self.stack:
            yield not level.keyed
            quiet = level.keyed or self.quiescent()
            strict &= quiet
            problems += yield from self._level_in_turns(level, suspects, quiet)
        return problems + pin_problems, strict

    def _pins_in_turns(self, pins: np.ndarray | None) -> Generator[bool, None, list[CheckProblem]]:
        """``_check_steps``' pin counts: those of the live leases (``pins``) and the hint
        budget's, compared with the table's copied in the caller's step."""
        table, budget = self.table, self.hint_budget
        if pins is None and budget is None:
            return []
        rows = table.rows
        kept_pins, alive = table.pins[:rows].copy(), table.state[:rows] != 0
        gen = table.gen[:rows].copy()  # the blocks found are named as of the copy
        budgeted = budget.pins(rows) if budget is not None else None
        yield False
        want_pins = None if pins is None else np.bincount(pins, minlength=rows)
        bad_pins: list[np.ndarray] = []
        bad_budget: list[np.ndarray] = []
        for start in range(0, rows, CHECK_SLICE_ROWS):
            part = slice(start, start + CHECK_SLICE_ROWS)
            if want_pins is not None:
                bad_pins.append(np.flatnonzero(want_pins[part] != kept_pins[part]) + start)
            if budgeted is not None:
                differs = alive[part] & (budgeted[part] != kept_pins[part])
                bad_budget.append(np.flatnonzero(differs) + start)
            yield False
        problems: list[CheckProblem] = []
        if len(bad := np.concatenate([_NO_IDS, *bad_pins])):
            problems.append(
                CheckProblem(
                    counted(
                        len(bad),
                        "block's pin count differs from its live leases",
                        "blocks' pin counts differ from their live leases",
                    ),
                    blocks=table.refs(bad[alive[bad]], gen),
                )
            )
        if len(bad := np.concatenate([_NO_IDS, *bad_budget])):
            problems.append(
                CheckProblem(
                    counted(
                        len(bad),
                        "block's pin count differs from the hint budget's",
                        "blocks' pin counts differ from the hint budget's",
                    ),
                    blocks=table.refs(bad, gen),
                )
            )
        return problems

    def _namespaces_in_turns(self) -> Generator[bool, None, list[CheckProblem]]:
        """``_check_steps``' blocks counted per namespace."""
        table = self.table
        rows = table.rows
        live, ns, ns_blocks = table.state[:rows] != 0, table.ns[:rows].copy(), dict(table.ns_blocks)
        yield False
        ns_counts: Counter[int] = Counter()
        for start in range(0, rows, CHECK_SLICE_ROWS):
            part = slice(start, start + CHECK_SLICE_ROWS)
            names, counts = np.unique(ns[part][live[part]], return_counts=True)
            ns_counts.update(dict(zip(names.tolist(), counts.tolist(), strict=True)))
            yield False
        if ns_counts != ns_blocks:
            return [CheckProblem("the blocks counted per namespace differ from the live blocks'")]
        return []

    def _level_in_turns(
        self, level: Level, suspects: CheckSuspects | None, quiet: bool
    ) -> Generator[bool, None, list[CheckProblem]]:
        """``_check_steps``' invariants of one tier (``quiet``: nothing is in flight)."""
        table = self.table
        rows = table.rows
        slot, state = table.slot[:rows, level.col].copy(), table.state[:rows].copy()
        owner: np.ndarray = _NO_IDS
        nbytes: np.ndarray = _NO_IDS
        gen: np.ndarray = _NO_IDS  # the blocks found in the copy are named as of the copy
        if not level.keyed:
            owner, nbytes = table.owner[:rows].copy(), table.nbytes[:rows].copy()
            gen = table.gen[:rows].copy()
        now = self._level_now(level, slot, state, suspects)
        yield False
        for start in range(0, rows, CHECK_SLICE_ROWS):
            now.add(slice(start, start + CHECK_SLICE_ROWS), slot, state, owner, nbytes)
            yield False
        problems = now.problems(slot, quiet, lambda ids: table.refs(ids, gen))
        yield False
        return problems

    def _level_now(
        self, level: Level, slot: np.ndarray, state: np.ndarray, suspects: CheckSuspects | None
    ) -> _LevelCheck:
        """What ``_check_steps`` reads of one tier in the step that copies its column
        (``slot``, with the rows' ``state``): its suspects examined again, its allocator's
        own check, and the counts the copy's sums are compared with."""
        table, col = self.table, level.col
        now = _LevelCheck(level.label, level.keyed, len(level.policy))
        if suspects is None:
            holders = np.flatnonzero(slot >= 0)
            now.dead = holders[state[holders] == 0]
            now.strays = self._unknown_to_policy(level, holders)
        else:
            dead = np.unique(suspects.freed.get(col, _NO_IDS))
            now.dead = dead[(table.state[dead] == 0) & (table.slot[dead, col] >= 0)]
            now.strays = self._unknown_to_policy(
                level, np.unique(suspects.strays.get(col, _NO_IDS))
            )
        now.dead_slots = _NO_IDS if level.keyed else table.slot[now.dead, col].astype(np.int64)
        now.strays = table.refs(now.strays)
        if level.keyed:
            return now
        alloc = level.slots.allocator
        now.allocator = alloc.check()
        # The freed rows too: the slices examined live blocks only.
        examined = holders if suspects is None else suspects.unallocated.get(col, _NO_IDS)
        bad, bad_slots = self._not_allocated(level, np.union1d(examined, now.dead))
        now.unallocated = table.refs(bad), bad_slots
        now.used_slots = alloc.used_slots
        now.quarantined = int(level.tier.stats().gauges.get("quarantined_slots", 0))
        now.quota_held = sum(1 for _, kind in self.space.quota_held if kind == level.kind)
        now.usage, now.slot_usage = table.usage[col].copy(), table.slot_usage[col].copy()
        now.segment_slot_bytes = np.append(alloc.segment_slot_bytes(), 0)
        now.slots_cap = alloc.slots_cap
        now.usage_sum = np.zeros(len(now.usage), dtype=np.int64)
        now.slot_usage_sum = np.zeros(len(now.usage), dtype=np.int64)
        return now

    # ------------------------------------------------------------- watermarks

    async def balance(self) -> None:
        """Keep the tiers under their watermarks, forget blocks held only in L3 that it has
        not confirmed for twice ``tiers.l3.known_s`` (``L3Config.forget_after_s``,
        ``SpaceManager.forget_unconfirmed``), and drop the L3 copies of blocks held here too
        that may have expired there (``L3Config.stale_after_s``)."""
        await self.space.balance()
        l3 = self.config.tiers.l3
        self.space.forget_unconfirmed(l3.forget_after_s(), l3.stale_after_s())

    async def _balance_forever(self) -> None:
        interval = self.config.mover.balance_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.balance()
            except Exception:
                log.exception("watermark balancing failed")
                self.counters.inc("background_errors")

    # ----------------------------------------------------------------- recovery

    def owner_of(self, label: str) -> int:
        """The owner index of a tenant label (stable for this process)."""
        if label not in self.owners:
            self.owners[label] = len(self.owners)
            self.space.owner_labels[self.owners[label]] = label
        return self.owners[label]

    async def namespace(self, ns: int, label: str, *, limited: bool = True) -> int:
        """Bind namespace ``ns`` to the tenant ``label`` (recorded durably by persistent tiers
        the first time, so recovered blocks keep their owner); returns the owner index. A put
        that comes while another records the owner waits for that record: blocks it stored
        before the record is durable would come back after a crash with no owner (their usage
        counted to no tenant). A namespace new to the owner past
        ``server.max_namespaces_per_tenant`` raises ResourceExhausted, checked in the step
        that binds it (after any wait: a record that fails leaves room another put may take),
        unless ``limited`` is False (blocks already in the table: ``_bind_found``), which
        still unbinds the owner's empty namespaces as a put would."""
        owner = self.owner_of(label)
        while (recording := self._ns_recording.get(ns)) is not None:
            await asyncio.shield(recording)
        before = self.ns_owner.get(ns)
        if before != owner:
            unbound: list[int] = []
            if before is None:
                unbound = self._check_namespace_room(owner, label, refuse=limited)
            else:
                self._ns_kept[ns] = before
            self.ns_owner[ns] = owner
            recorded = self._ns_recording[ns] = asyncio.get_running_loop().create_future()
            # A bind of a namespace unbound here waits until its record is gone: forgotten
            # after being recorded again, it would lose its owner.
            for gone in unbound:
                self._ns_recording[gone] = recorded
            try:
                for level in self.stack:
                    forget = getattr(level.tier, "forget_namespaces", None)
                    if unbound and forget is not None:
                        await self.transfers.run(Priority.DEMAND, forget, unbound)
                    remember = getattr(level.tier, "remember_namespace", None)
                    if remember is not None:
                        await self.transfers.run(Priority.DEMAND, remember, ns, label)
            except BaseException:
                # Not recorded: the next put records it. The namespace keeps what it had.
                kept = self._ns_kept.get(ns)
                if kept is None:
                    self.ns_owner.pop(ns, None)
                else:
                    self.ns_owner[ns] = kept
                raise
            finally:
                self._ns_kept.pop(ns, None)
                for done in (ns, *unbound):
                    del self._ns_recording[done]
                recorded.set_result(None)
        return owner

    def _check_namespace_room(self, owner: int, label: str, *, refuse: bool = True) -> list[int]:
        """Refuse a new namespace to an owner at its limit (with ``refuse``; without it, only
        make room where it can). A namespace counts while the store holds a block of it (or
        a put records its owner): one whose blocks have all left is unbound here, when the
        limit is reached, so an owner that moves on from namespaces (models, adapters) is not
        refused for good. While recovery runs, the
        index does not yet know every block, so nothing is unbound. Returns the namespaces
        unbound: the caller forgets their records on the persistent tiers, which the limit
        no longer bounds otherwise (one durable row per namespace ever used, all read back
        at every start)."""
        limit = self.config.server.max_namespaces_per_tenant
        mine = [ns for ns, o in self.ns_owner.items() if o == owner]
        used = len(mine)
        unbound: list[int] = []
        if used >= limit and not self._recovering:
            holding = self.table.ns_blocks
            unbound = [ns for ns in mine if ns not in holding and ns not in self._ns_recording]
            used -= len(unbound)
        if used >= limit and refuse:
            raise ResourceExhausted(
                f"{label} already stores blocks in {counted(used, 'namespace')}, the most one "
                "tenant may use (server.max_namespaces_per_tenant)"
            )
        for ns in unbound:
            del self.ns_owner[ns]
        return unbound

    async def recover(self) -> None:
        """Index every block the persistent tiers hold from before this start, so a restart
        serves it. Chunks are read on a worker thread and indexed between requests: a lookup
        or get of keys all indexed is answered at once, one with a key not found waits a
        while for the end (``_after_recovery``), and a tier allocates nothing until its last
        chunk is in. A failure is logged and ends it: what was indexed is served."""
        started = time.monotonic()
        total = 0
        if not self._recovering:  # called without start()
            self._begin_recovery()
        try:
            for level in reversed(self.stack.levels):
                if level.keyed or not level.persistent:
                    continue
                names = getattr(level.tier, "namespaces", None)
                if names is not None:
                    for ns, label in (await self.transfers.run(Priority.BACKGROUND, names)).items():
                        owner = self.owner_of(label)
                        self.ns_owner.setdefault(ns, owner)
                        if ns in self._ns_recording:  # a put's: should it fail, this stays
                            self._ns_kept.setdefault(ns, owner)
                chunks = level.slots.recover_chunks(RECOVERY_ROWS)
                repeated: list[np.ndarray] = []
                # Slots and write times of the rows handed over: a later chunk's row of a key
                # indexed already is compared with them (references, no copy or work here).
                earlier: list[tuple[np.ndarray, np.ndarray]] = []
                while True:
                    chunk = await self.transfers.run(Priority.BACKGROUND, next, chunks, None)
                    if chunk is None:
                        break
                    repeated.append(self._index_recovered(level, chunk, earlier))
                    earlier.append((chunk.slots, chunk.written_at))
                    total += len(chunk)
                    await asyncio.sleep(0)
                await self._drop_repeated(level, np.concatenate([np.empty(0, np.int64), *repeated]))
        except asyncio.CancelledError:
            self._recovery_cut = True
            raise
        except Exception:
            # Said now: nothing reads the finished task's error until the store stops, and
            # meanwhile the store counts as recovered and serves what was indexed.
            log.exception(
                "recovery stopped after indexing %d blocks: blocks of the persistent tiers it "
                "did not index are not served",
                total,
            )
        finally:
            self._recovering = self.space.rows_unsettled = False
            self._put_in_recovery.clear()
            self.space.free_read_held()
            self.recovered.set()
        if total:
            log.info("indexed %d recovered blocks in %.2fs", total, time.monotonic() - started)

    def _index_recovered(
        self,
        level: Level,
        chunk: RecoveredBlocks,
        earlier: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    ) -> np.ndarray:
        """Index a chunk of ``level``'s recovered blocks; returns the slots of the rows to
        drop: of two rows of a key, the one written first (``written_after``), whether in
        this chunk or in one ``earlier`` (its rows' slots and write times): a block deleted
        or evicted where its slot was not freed may have been put again with other bytes. A
        key the level holds from a row not among ``earlier`` keeps that copy."""
        table = self.table
        now_mono, now_wall = self._clock(), time.time()
        latest = chunk.latest_of_each_key()
        repeated = [np.delete(chunk.slots, latest)] if len(latest) < len(chunk) else []
        if repeated:
            chunk = chunk.take(latest)
        words = np.ascontiguousarray(chunk.keys).view(np.uint64).reshape(-1, 4)
        # Blocks another tier already has (recovered there, or put since this start) gain a
        # column, not a row.
        known = np.full(len(chunk), -1, dtype=np.int64)
        for space_ns in np.unique(chunk.ns).tolist():
            sel = np.flatnonzero(chunk.ns == space_ns)
            known[sel] = table.find_any(int(space_ns), words[sel])
        held = known >= 0
        held[held] = table.slot[known[held], level.col] >= 0
        if held.any():
            at = np.flatnonzero(held)
            bids, slots = known[at], table.slot[known[at], level.col]
            newer = written_after(
                chunk.written_at[at], chunk.slots[at], _written_at(slots, earlier), slots
            )
            # A block put during recovery holds an earlier row of its key only where that
            # row held the put's bytes (below): a later row replaces it only where it does.
            if newer.any() and self._put_in_recovery:
                put = newer & self._put_during_recovery(bids)
                newer[put] = self._same_as_put(level, bids[put], chunk.checksums[at[put]])
            # An earlier row's copy of a committed block that a request holds (a Get, a
            # move) may be read still, its slot named before: that slot is freed once nobody
            # holds the block (``SpaceManager.free_when_idle``), not with the other rows
            # dropped. (A block being written is held by its put, which reads no copy here.)
            read = newer & (table.inflight[bids] > 0) & (table.state[bids] == READY)
            if read.any():
                self.space.free_when_idle(level, slots[read], bids[read])
            repeated.append(np.where(newer, slots, chunk.slots[at])[~read])
            if newer.any():
                rows = chunk.take(at[newer])
                seen = now_mono - np.maximum(0.0, now_wall - rows.written_at)
                self._replace_recovered(level, bids[newer], rows, seen)
            keep = np.flatnonzero(~held)
            chunk, words, known = chunk.take(keep), words[keep], known[keep]
        # A block put since this start (READY: on the top tier, or a put committed during
        # recovery, whose copy may have gone to L3 alone since) takes the row as its copy
        # only where the row holds its bytes: the row is older than the put, and a key put
        # again may have other bytes, which a Get would load once the put's copies above
        # are evicted; a block whose bytes cannot be compared (L3 alone) drops the row.
        # (One a put is still writing is settled when it commits: ``_drop_put_over``.)
        put = np.flatnonzero(known >= 0)
        put = put[table.state[known[put]] == READY]
        if len(put):
            later = self._put_during_recovery(known[put])
            put = put[later | (table.slot[known[put], self.top.col] >= 0)]
        if len(put):
            other = put[~self._same_as_put(level, known[put], chunk.checksums[put])]
            if len(other):
                repeated.append(chunk.slots[other])
                keep = np.setdiff1d(np.arange(len(chunk)), other)
                chunk, words, known = chunk.take(keep), words[keep], known[keep]
        new = np.flatnonzero(known < 0)
        bids = known.copy()
        owners = np.fromiter(
            (self.ns_owner.get(int(ns), 0) for ns in chunk.ns[new].tolist()), np.uint16, len(new)
        )
        for owner in np.unique(owners).tolist():
            sel = new[owners == owner]
            bids[sel] = table.add_many(chunk.ns[sel], words[sel], chunk.nbytes[sel], owner=owner)
        table.state[bids[new]] = READY
        seen = now_mono - np.maximum(0.0, now_wall - chunk.written_at)
        table.set_slots(bids, level.col, chunk.slots)
        table.set_checksums(bids, level.col, chunk.checksums)
        if len(at := np.flatnonzero(table.state[bids] == WRITING)):
            self._under_put(level, bids[at], chunk.nbytes[at])
        table.last_access[bids] = np.maximum(table.last_access[bids], seen)
        # A block a put is still writing joins the policies when that put commits it, as a
        # new block does, or with this copy alone if the put fails (``_abandon``).
        ready = table.state[bids] == READY
        for bid, when in zip(bids[ready].tolist(), seen[ready].tolist(), strict=True):
            level.policy.insert(bid, when, -1)
        return np.concatenate(repeated) if repeated else np.empty(0, dtype=np.int64)

    def _put_during_recovery(self, bids: np.ndarray) -> np.ndarray:
        """Whether each of ``bids`` is a block a put committed while recovery runs
        (``_put_in_recovery``)."""
        since = self._put_in_recovery
        return np.fromiter((r in since for r in self.table.refs(bids).tolist()), bool, len(bids))

    def _replace_recovered(
        self, level: Level, bids: np.ndarray, rows: RecoveredBlocks, seen: np.ndarray
    ) -> None:
        """Give ``bids``' copies on ``level`` (an earlier chunk's rows) the slots of ``rows``,
        written later (``_index_recovered``, which frees the earlier slots: at the end of
        recovery, or once nobody holds the block where a request may still read one)."""
        table = self.table
        table.clear_slots(bids, level.col)
        # A block with no other copy takes the row's size (its key put again with another
        # layout); one with a copy elsewhere, or that a put is writing (its copy not yet
        # recorded), keeps its own: the row's is noted for the put's failure (``_under_put``).
        alone = (table.slot[bids] < 0).all(axis=1) & (table.state[bids] != WRITING)
        table.nbytes[bids[alone]] = rows.nbytes[alone]
        table.set_slots(bids, level.col, rows.slots)
        table.set_checksums(bids, level.col, rows.checksums)
        table.last_access[bids] = np.maximum(table.last_access[bids], seen)
        if (writing := table.state[bids] == WRITING).any():
            self._under_put(level, bids[writing], rows.nbytes[writing])

    def _under_put(self, level: Level, bids: np.ndarray, nbytes: np.ndarray) -> None:
        """Note the copies recovery gave ``bids`` (blocks a put is writing) on ``level``, of
        ``nbytes`` each (``_recovered_under_put``)."""
        under = self._recovered_under_put
        for ref, size in zip(self.table.refs(bids).tolist(), nbytes.tolist(), strict=True):
            under.setdefault(ref, {})[level.col] = size

    async def _drop_repeated(self, level: Level, slots: np.ndarray) -> None:
        """Delete the rows (and free the slots) of recovered copies of a key that ``level``
        indexed from another row, written later (a delete or eviction whose free the tier
        refused, then a put of the key again); counted once freed, and where the tier
        refuses, tried again (``free_held``). The log line counts too those whose blocks
        requests hold (``SpaceManager.read_held``), freed and counted as those end."""
        held = len(self.space.read_held.get(level.kind, ()))
        if not len(slots) and not held:
            return
        log.warning(
            "%s: %d recovered rows repeat a key written later in another slot; dropping them%s",
            level.label,
            len(slots) + held,
            f" ({held} once the requests reading their blocks end)" if held else "",
        )
        if not len(slots):
            return
        # Through ``free_held`` (no quota holds: the copies never joined the table), so that
        # a free the tier refuses (its index locked) is tried again, as every other is.
        if await asyncio.shield(self.space.free_held(level, slots.tolist(), [])):
            self.counters.inc("recovered_repeats_dropped", len(slots), tier=level.label)

    # ------------------------------------------------------------------ helpers

    def _abandon(self, bids: np.ndarray, reused: np.ndarray | None = None) -> np.ndarray:
        """Forget new blocks whose copy failed or found no room, giving back any slot they
        took (a copy into one tier may fail after an earlier tier stored part of the batch).
        A block that recovery gave a copy meanwhile (its key's row from before this start,
        read while the put wrote it) is kept with that copy instead: the key was stored, and a
        put that failed must not delete it (``_keep_recovered``); returns the rows so kept.
        The rows of ``reused`` (``_claim_bare``) are given back as they were, with no copy,
        and forgotten only once nobody holds them: a lease may still name them."""
        table = self.table
        kept = bids[:0]
        if len(bids):
            self._writes_settled()
        if self._recovered_under_put and len(bids):
            under = self._recovered_under_put
            copies = [under.pop(r, None) for r in table.refs(bids).tolist()]
            recovered = np.fromiter((c is not None for c in copies), bool, len(copies))
            if recovered.any():
                kept = bids[recovered]
                self._keep_recovered(kept, [c for c in copies if c is not None])
                bids = bids[~recovered]
        for level in self.stack:
            if level.keyed or len(bids) == 0:
                continue
            held = bids[table.slot[bids, level.col] >= 0]
            if len(held):
                if level.persistent:
                    # Held against their owners' quotas until the tier has freed the
                    # slots, as evicted copies are (``SpaceManager.evict``).
                    self._free_copies(level, held)
                else:
                    slots = table.slot[held, level.col].tolist()
                    table.clear_slots(held, level.col)
                    level.slots.remove(slots)
        if reused is not None and len(reused) and (back := np.isin(bids, reused)).any():
            table.state[bids[back]] = READY
            # Held nowhere again: sought again by puts (a put that looked meanwhile, while
            # the put's copy was there, dropped the ref).
            self.space.bare_refs.update(table.refs(bids[back]).tolist())
            self.space.end_in_flight(bids[back])
            bids = bids[~back]
        for bid in bids.tolist():
            table.remove(bid)
        return kept

    def _bare(self, existing: np.ndarray, first: np.ndarray) -> np.ndarray:
        """The positions of ``existing`` (rows of a put's keys, -1: none; ``first``: the
        key's first occurrence in the put) whose row is committed but holds no copy in any
        tier: a block whose last copy failed a read while a pin or a request held it, kept
        until that ends (``SpaceManager.bare_rows``). Only lost copies leave such rows (an
        eviction or a drop forgets a block with its last copy)."""
        rows = self.space.bare_rows()
        if len(rows) == 0:
            return rows
        if len(rows) > BARE_ROWS_COMPARED:
            hit = np.isin(existing, rows)
        else:
            hit = existing == rows[0]
            for row in rows[1:].tolist():
                hit |= existing == row
        at = np.flatnonzero(hit & first)
        return at[self.table.state[existing[at]] == READY]

    def _claim_bare(self, rows: np.ndarray, owner: int) -> None:
        """Claim rows with no copy (``_bare``) for a put that stores into them rather than
        answering EXISTS for a block held nowhere: being written again (absent to lookups,
        EXISTS to other puts) and in flight as a new block is. The row, its key and the
        leases naming it stay; it becomes ``owner``'s, whose quota its new copies count
        against (it holds none of its old owner's). Another request (a Get, a durable put)
        may hold it in flight too: marks are added, not set."""
        table = self.table
        table.state[rows] = WRITING
        table.owner[rows] = owner
        add_at(table.inflight, rows, 1)

    def _keep_recovered(self, bids: np.ndarray, copies: list[dict[int, int]]) -> None:
        """Make blocks a failed put claimed, which recovery gave copies on persistent tiers
        while it wrote them, the recovered blocks they are: the put's own copies on volatile
        tiers go (no policy knows them), the persistent copies join their policies as
        recovery's do, at their rows' sizes (``copies``: per block, the columns and sizes of
        those the put did not replace; the block had the put's, of another layout maybe),
        and the blocks are visible again, with no parent (as recovered)."""
        table = self.table
        for level in self.stack:
            if level.keyed or level.persistent:
                continue
            held = bids[table.slot[bids, level.col] >= 0]
            if len(held):
                slots = table.slot[held, level.col].tolist()
                table.clear_slots(held, level.col)
                level.slots.remove(slots)
        for bid, sizes in zip(bids.tolist(), copies, strict=True):
            for col, size in sizes.items():
                if (slot := int(table.slot[bid, col])) >= 0 and size != table.nbytes[bid]:
                    # Counted in the owner's usage at the block's size: taken out at the old
                    # one, back in at the row's.
                    one = np.array([bid], dtype=np.int64)
                    table.clear_slots(one, col)
                    table.nbytes[bid] = size
                    table.set_slots(one, col, slot)
        add_at(table.inflight, bids, -1)  # the put's mark (see ``_commit_new``)
        if self.space.read_held:
            self.space.free_read_held()
        table.state[bids] = READY
        for level in self.stack:
            if level.persistent and not level.keyed:
                for bid in bids[table.slot[bids, level.col] >= 0].tolist():
                    level.policy.insert(bid, float(table.last_access[bid]), -1)

    def not_persisted(self) -> np.ndarray:
        """The live blocks, ready or still being written, of which no persistent tier holds a
        copy (L2, or L3's store: a restart finds it there): those a process that ends now
        loses."""
        live = self.table.live_ids()
        persistent = [lv.col for lv in self.stack if lv.persistent]
        if not persistent:
            return live
        return live[~(self.table.slot[live][:, persistent] >= 0).any(axis=1)]

    def _volatile_only(self) -> np.ndarray:
        table = self.table
        live = table.live_ids()
        live = live[table.state[live] == READY]
        persistent = [lv.col for lv in self.stack if lv.persistent and not lv.keyed]
        if not persistent:
            return live
        return live[~(table.slot[live][:, persistent] >= 0).any(axis=1)]

    def _fastest_col(self, bids: np.ndarray) -> np.ndarray:
        out = np.full(len(bids), -1, dtype=np.int64)
        for level in reversed(self.stack.levels):
            out[self.table.slot[bids, level.col] >= 0] = level.col
        return out

    def _fastest_kind(self, bids: np.ndarray) -> np.ndarray:
        if len(bids) == 1:  # a single-key request: scalar reads, no array operations
            bid = int(bids[0])
            slot = self.table.slot
            one = np.zeros(1, dtype=np.int32)
            # A loop, not next() over a generator: closing one left unfinished throws an
            # exception into it.
            for lv in self.stack.levels:
                if slot.item(bid, lv.col) >= 0:
                    one[0] = lv.kind
                    break
            return one
        out = np.zeros(len(bids), dtype=np.int32)
        for level in reversed(self.stack.levels):
            out[self.table.slot[bids, level.col] >= 0] = int(level.kind)
        return out

    def _check_sizes(self, ids: np.ndarray, block_bytes: int) -> None:
        """InvalidArgument when a block of ``ids`` has another size than ``block_bytes``."""
        if len(ids) == 1 and (ids[0] < 0 or int(self.table.nbytes[ids[0]]) == block_bytes):
            return  # a single-key request: scalar reads, no array operations
        live = ids[ids >= 0]
        wrong = live[self.table.nbytes[live] != block_bytes]
        if len(wrong):
            raise InvalidArgument(
                f"key {self.table.key_bytes(int(wrong[0])).hex()} is stored with "
                f"{int(self.table.nbytes[wrong[0]])} bytes but this pool's blocks have "
                f"{block_bytes}; keys of different layouts must come from different namespaces"
            )

    def _count_put(self, results: np.ndarray) -> None:
        for key, k in zip(self._n_put, np.bincount(results, minlength=3).tolist(), strict=True):
            self.counters.add(key, k)


def _distinct(words: np.ndarray) -> np.ndarray:
    """The keys of a batch, each once, in the order first named."""
    return words[~repeats(words)] if len(words) > 1 else words


def _naming_again(words: np.ndarray, first: np.ndarray, named: np.ndarray) -> np.ndarray:
    """The positions of ``words`` that repeat (``~first``) a key at one of the positions
    ``named``."""
    keys = {words[i].tobytes() for i in named.tolist()}
    later = np.flatnonzero(~first)
    return later[[words[i].tobytes() in keys for i in later.tolist()]]


def _written_at(slots: np.ndarray, earlier: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """When the rows in ``slots`` were written, found among ``earlier`` (pairs of slots and
    write times, no slot twice); infinity for a slot not there. Sorts every earlier row: for
    a chunk that repeats a key only."""
    if not earlier:
        return np.full(len(slots), np.inf)
    known = np.concatenate([s for s, _ in earlier])
    written = np.concatenate([w for _, w in earlier])
    order = np.argsort(known, kind="stable")
    at = np.minimum(np.searchsorted(known, slots, sorter=order), len(order) - 1)
    found = known[order[at]] == slots
    return np.where(found, written[order[at]], np.inf)


def _parts(n: int, block_bytes: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` key ranges a put of ``n`` keys goes in: one range without
    ``block_bytes`` (not durable); else parts of ``PUT_PART_BYTES`` (at least one block
    each), the first ones smaller for blocks of ``PUT_GROWING_MIN_BLOCK_BYTES`` or more:
    ``PUT_FIRST_PART_BYTES`` first, each next part twice the one before."""
    if block_bytes <= 0 or n <= 1:
        return [(0, n)]
    most = max(1, PUT_PART_BYTES // block_bytes)
    step = most
    if block_bytes >= PUT_GROWING_MIN_BLOCK_BYTES:
        step = max(1, min(most, PUT_FIRST_PART_BYTES // block_bytes))
    out: list[tuple[int, int]] = []
    s = 0
    while s < n:
        out.append((s, min(n, s + step)))
        s += step
        step = min(most, 2 * step)
    return out


async def _all_done(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Every result of ``aws``, run together; a failure is raised once all of them ended
    (their copies use buffers the caller may hand back only then)."""
    if len(aws) == 1:
        return [await aws[0]]
    results = await asyncio.gather(*aws, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


async def _cancelled(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (a background task of the store's) if it runs, and wait for its end."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
