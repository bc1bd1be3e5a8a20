"""The block store: index, tiers and their policies, glued together.

Tiers are ordered fastest first: L1 (host arena) and, when configured, L2 (disk). A block may
have a copy in several tiers; ``index.slot[bid, t] >= 0`` exactly when tier ``t`` holds a
complete copy, and then tier ``t``'s policy knows the block. Blocks move down when a tier
passes its high watermark or must make room (demotion: L1 -> L2 -> dropped), and up when they
are read or prefetched (promotion: L2 -> L1). Every tier-to-tier copy goes through the mover.

Invariants:
- All store state is touched from one thread (the server's event loop). Bytes move on worker
  threads, but only for blocks the loop has marked in flight (``index.inflight``), so no slot
  is freed, reused or evicted while a copy reads or writes it, and no lock is needed.
- A block is visible to lookups only once its first copy is complete (state READY). A new key
  enters the index (state WRITING) before the store awaits anything, so two puts of one key
  never both store it.
- A block with a pin (lease), a copy in flight, or inside its protection period is never
  evicted. Eviction takes exactly the victims a policy proposed, or none.
- An L2 copy becomes visible only once the disk tier reports it durable and indexed; a failed
  L2 read (checksum, I/O) is a miss and drops that copy.

Thread-safety: not thread-safe by design (see above); call from the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.daemon.config import Config
from kvtier.daemon.errors import FailedPrecondition, InvalidArgument
from kvtier.daemon.index import READY, BlockIndex, keys_to_words
from kvtier.daemon.mover import Mover, PrefetchExpired, Priority
from kvtier.daemon.policy.admission import Admission, make_admission
from kvtier.daemon.policy.base import EvictionPolicy
from kvtier.daemon.policy.guard import EvictionGuard
from kvtier.daemon.policy.prefetch import PrefetchLedger
from kvtier.daemon.policy.registry import default_admission, make_policy
from kvtier.daemon.pools import Pool
from kvtier.kernels.copy import blocks_to_pool, pool_to_blocks
from kvtier.tiers.base import BlockTier, TierKind
from kvtier.tiers.disk import DiskTier, PersistItem, ReadItem
from kvtier.tiers.host import HostArena

log = logging.getLogger(__name__)

L1, L2 = 0, 1


class PutResult(enum.IntEnum):
    STORED = 0
    EXISTS = 1
    REJECTED_FULL = 2


@dataclass(frozen=True, slots=True)
class TierUsage:
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    blocks: int
    state: str


@dataclass(frozen=True, slots=True)
class DeleteResult:
    deleted: int
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
        executor: Executor,
        *,
        clock: Callable[[], float] = time.monotonic,
        host: HostArena | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.config = config
        self._executor = executor
        self._clock = clock
        self.started_at = clock()
        # The disk tier first: it fails fast (no room, directory in use) before the arena
        # spends seconds pre-faulting memory.
        if disk is None and config.tiers.l2.enabled:
            disk = _open_disk(config)
        self.disk = disk
        self.host = host or HostArena(
            config.tiers.l1.capacity_bytes,
            config.tiers.l1.segment_bytes,
            pin_cuda=_want_pinning(config),
        )
        self.tiers: list[BlockTier] = [self.host] if disk is None else [self.host, disk]
        self.index = BlockIndex(num_tiers=len(self.tiers))
        self.checksum = np.zeros(self.index.capacity, dtype=np.uint64)  # of the L2 copy
        # Readahead hints: a block's latest child and each block's parent. Ids are reused, so
        # a child link counts only while the child still names this block as its parent.
        self.child = np.full(self.index.capacity, -1, dtype=np.int32)
        self.parent = np.full(self.index.capacity, -1, dtype=np.int32)
        # Last read or write of each block: the protection period runs from it. Heat itself
        # lives in each tier's policy (the heat policy keeps a decayed count per block).
        self.last_access = np.full(self.index.capacity, -np.inf, dtype=np.float64)
        pc = config.policy
        self.policies: list[EvictionPolicy] = [
            make_policy(pc.name, half_life_s=pc.half_life_s) for _ in self.tiers
        ]
        marks = [
            (config.tiers.l1.high_watermark, config.tiers.l1.low_watermark),
            (config.tiers.l2.high_watermark, config.tiers.l2.low_watermark),
        ]
        self.guards = [
            EvictionGuard(pc.protect_s, pc.warmup_s, high, low)
            for high, low in marks[: len(self.tiers)]
        ]
        # Which blocks L2 takes when they leave L1 (write_back) or as soon as it admits them
        # (selective). Keys are the first 64 bits of block keys: stable across id reuse.
        self.l2_admission: Admission = make_admission(_l2_admission_name(config))
        self.prefetches = PrefetchLedger()
        self.counters: Counter[str] = Counter()
        self.mover = Mover(
            {"l2_read": config.tiers.l2.read_bytes_s, "l2_write": config.tiers.l2.write_bytes_s},
            workers=config.mover.workers,
            clock=clock,
        )
        self._copy_threads = config.server.copy_threads
        self._promoting: dict[int, asyncio.Future[bool]] = {}
        self._writing: dict[int, asyncio.Future[bool]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._pending_touches: list[tuple[np.ndarray, float]] = []
        self._balancer: asyncio.Task[None] | None = None
        if disk is not None:
            self._recover()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the mover and the watermark balancer (needs the running event loop)."""
        self.mover.start()
        self._balancer = asyncio.create_task(self._balance_forever(), name="balancer")

    async def stop(self, *, flush: bool) -> None:
        """Stop background work; with ``flush``, first write every block held only in L1 to
        L2 so that a restart serves it."""
        if self._balancer is not None:
            self._balancer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._balancer
            self._balancer = None
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        if flush and self.disk is not None:
            await self.flush()
        await self.mover.stop()

    async def flush(self) -> int:
        """Write every READY block held only in L1 to L2; returns how many were written."""
        dirty = self._dirty_l1_blocks()
        if len(dirty) == 0:
            return 0
        started = time.monotonic()
        ok = await self._write_l2(dirty, Priority.BACKGROUND)
        written = int(np.count_nonzero(ok))
        log.info(
            "flushed %d of %d L1-only blocks to L2 in %.2fs",
            written,
            len(dirty),
            time.monotonic() - started,
        )
        return written

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    # ------------------------------------------------------------------ queries

    def max_block_bytes(self) -> int:
        return min(t.allocator.segment_bytes for t in self.tiers)

    def lookup(
        self, ns: int, words: np.ndarray, *, touch: bool = True
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """(prefix length, wire tier of each key, block id of each key or -1)."""
        ids = self.index.lookup(ns, words)
        found = ids >= 0
        prefix = int(np.argmin(found)) if not found.all() else len(ids)
        tiers = np.zeros(len(ids), dtype=np.int32)
        if found.any():
            fid = ids[found]
            tiers[found] = self._fastest_tier(fid)
            if touch:
                self._touch(fid, self._clock())
        self.counters["lookup_keys"] += len(ids)
        self.counters["lookup_hits"] += int(found.sum())
        return prefix, tiers, ids

    def usage(self) -> list[TierUsage]:
        return [
            TierUsage(
                t.kind,
                t.allocator.capacity_bytes,
                t.allocator.used_bytes,
                len(self.policies[i]),
                t.state(),
            )
            for i, t in enumerate(self.tiers)
        ]

    def gauges(self) -> dict[str, float]:
        """Point-in-time values: what is pinned, in flight or queued for the mover."""
        live = self.index.state != 0
        return {
            "blocks_pinned": int(np.count_nonzero(live & (self.index.pins > 0))),
            "blocks_in_flight": int(np.count_nonzero(live & (self.index.inflight > 0))),
            "transfers_queued": self.mover.queued,
            "transfers_running": self.mover.running,
            "background_tasks": len(self._background),
        }

    def all_counters(self) -> dict[str, int]:
        out = dict(self.counters)
        pf = self.prefetches.stats()
        out.update(
            prefetch_issued=pf.issued,
            prefetch_used=pf.used,
            prefetch_late=pf.late,
            prefetch_wasted=pf.wasted,
            prefetch_duplicates=pf.duplicates,
        )
        for name, value in self.mover.counters.items():
            out[f"mover_{name}"] = value
        if self.disk is not None:
            for name, value in self.disk.stats().items():
                if isinstance(value, int) and not isinstance(value, bool):
                    out[f"l2_{name}"] = value
        return out

    # ------------------------------------------------------------------ writes

    async def put(
        self,
        pool: Pool,
        ns: int,
        words: np.ndarray,
        pages: np.ndarray,
        parent_words: np.ndarray | None,
        *,
        durable: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Store pool pages under keys; returns a PutResult per key, and with ``durable``
        whether each key's block is on the disk tier.

        Keys form one chain (``words[i]`` follows ``words[i-1]``); when room runs out the
        leading new blocks are stored and the rest rejected, since a child is useless without
        its parent.
        """
        if durable and self.disk is None:
            raise FailedPrecondition("durable puts need the disk tier (l2.enabled is false)")
        now = self._clock()
        n = len(words)
        block_bytes = pool.block_bytes
        results = np.full(n, PutResult.STORED, dtype=np.int32)
        existing = self.index.find_any(ns, words)
        self._check_sizes(existing, block_bytes)
        is_new = existing < 0
        _, first = np.unique(words, axis=0, return_index=True)
        dup = np.ones(n, dtype=bool)
        dup[first] = False
        is_new &= ~dup  # a key repeated within the batch is stored once
        results[~is_new] = PutResult.EXISTS
        ready = existing[existing >= 0]
        ready = ready[self.index.state[ready] == READY]
        if len(ready):
            self._touch(ready, now)

        # Claim the new keys before awaiting anything (see the module invariants).
        new_idx = np.flatnonzero(is_new)
        bids = np.array(
            [self._add_block(ns, words[i], block_bytes) for i in new_idx], dtype=np.int64
        )
        self.index.inflight[bids] = 1
        try:
            slots = await self._reserve(L1, block_bytes, len(bids), now, Priority.DEMAND)
        except BaseException:
            self._abandon(bids)
            raise
        stored = bids[: len(slots)]
        self._abandon(bids[len(slots) :])
        results[new_idx[len(slots) :]] = PutResult.REJECTED_FULL
        new_idx = new_idx[: len(slots)]
        for bid, slot in zip(stored.tolist(), slots, strict=True):
            self.index.slot[bid, L1] = slot
        if len(stored):
            try:
                with pool.use() as mem:
                    await self._run(
                        pool_to_blocks,
                        pool.layout.chunk_table,
                        mem,
                        pages[new_idx],
                        self.host.array,
                        self.host.allocator.offsets(np.asarray(slots, dtype=np.int64)),
                        self._copy_threads,
                    )
            except BaseException:
                self._abandon(stored)
                raise
            self._commit_new(stored, new_idx, existing, ns, parent_words)
        self.counters["bytes_put"] += len(stored) * block_bytes
        self._count_put(results)

        persisted = None
        chain = existing.copy()
        chain[new_idx] = stored
        if durable:
            held = chain[chain >= 0]
            held = held[(self.index.state[held] == READY)]
            need = held[self.index.slot[held, L2] < 0]
            if len(need):
                await self._write_l2(need, Priority.DEMAND)
            persisted = np.zeros(n, dtype=bool)
            live = chain >= 0
            persisted[live] = self.index.slot[chain[live], L2] >= 0
        elif (
            len(stored)
            and self.disk is not None
            and self.config.tiers.l2.write_policy == "write_through"
        ):
            self._spawn(self._write_l2(stored, Priority.BACKGROUND))
        return results, persisted

    def _commit_new(
        self,
        bids: np.ndarray,
        new_idx: np.ndarray,
        existing: np.ndarray,
        ns: int,
        parent_words: np.ndarray | None,
    ) -> None:
        self._apply_touches()
        now = self._clock()
        self.index.inflight[bids] = 0
        self.index.state[bids] = READY
        self.last_access[bids] = now
        for word in self.index.keys[bids, 0].tolist():
            self.l2_admission.record(word, now)
        chain = existing.copy()
        chain[new_idx] = bids
        parent = -1
        if parent_words is not None:
            parent = int(self.index.lookup(ns, parent_words[None, :])[0])
        policy = self.policies[L1]
        for bid, i in zip(bids.tolist(), new_idx.tolist(), strict=True):
            par = int(chain[i - 1]) if i > 0 else parent
            policy.insert(bid, now, par)
            if par >= 0:
                self.child[par] = bid
                self.parent[bid] = par
        if self.config.tiers.l2.write_policy == "selective":
            self._write_admitted(bids, now)

    # ------------------------------------------------------------------- reads

    async def get(
        self,
        pool: Pool,
        ns: int,
        words: np.ndarray,
        pages: np.ndarray,
        *,
        touch: bool,
        layers: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Copy stored blocks into pool pages; returns whether each key was loaded.

        Blocks only on L2 are promoted to L1 first (a read the request waits on). With
        ``layers``, only the chunks of layers ``[begin, end)`` are copied (checked by the
        service); a block counts as loaded once, by the Get that copies its layer 0.
        """
        table = pool.layout.layer_range_table(*layers) if layers else pool.layout.chunk_table
        ids = self.index.lookup(ns, words)
        self._check_sizes(ids, pool.block_bytes)
        found = ids >= 0
        bids = ids[found]
        now = self._clock()
        if touch:
            self._touch(bids, now)
        elif len(bids):
            # The pinning Lookup counted this access; only the protection clock restarts.
            self.last_access[bids] = now
        np.add.at(self.index.inflight, bids, 1)
        try:
            await self._ensure_in_l1(bids, Priority.DEMAND)
            in_l1 = np.zeros(len(ids), dtype=bool)
            in_l1[found] = self.index.slot[bids, L1] >= 0
            loaded_ids = ids[in_l1]
            if len(loaded_ids):
                offsets = self.host.allocator.offsets(self.index.slot[loaded_ids, L1])
                with pool.use() as mem:
                    await self._run(
                        blocks_to_pool,
                        table,
                        self.host.array,
                        offsets,
                        mem,
                        pages[in_l1],
                        self._copy_threads,
                    )
        finally:
            self._release(bids)
        self._account_reads(loaded_ids)
        if layers is None or layers[0] == 0:
            self.counters["get_blocks_loaded"] += len(loaded_ids)
            self.counters["get_blocks_missing"] += len(ids) - len(loaded_ids)
        self.counters["bytes_get"] += len(loaded_ids) * table.nbytes
        if len(loaded_ids) and self.disk is not None:
            self._read_ahead(int(loaded_ids[-1]))
        return in_l1

    def prefetch(
        self, ns: int, words: np.ndarray, deadline_ms: int, priority: int
    ) -> PrefetchResult:
        """Start promoting the keys' L2-only blocks to L1; never waits for them."""
        ids = self.index.lookup(ns, words)
        found = ids[ids >= 0]
        l2_only = found[(self.index.slot[found, L1] < 0)] if len(found) else found
        deadline = self._clock() + deadline_ms / 1000.0 if deadline_ms else None
        started = self._start_promotions(l2_only, Priority.PREFETCH, deadline, priority)
        return PrefetchResult(
            resident=len(found) - len(l2_only),
            scheduled=started,
            missing=int(np.count_nonzero(ids < 0)),
        )

    def promote_in_background(self, bids: np.ndarray) -> None:
        """A pinning Lookup found these blocks: bring the L2-only ones up before the Get."""
        if self.disk is None or len(bids) == 0:
            return
        self._start_promotions(bids[self.index.slot[bids, L1] < 0], Priority.PREFETCH, None, 0)

    async def _ensure_in_l1(self, bids: np.ndarray, priority: Priority) -> None:
        if self.disk is None or len(bids) == 0:
            return
        need = bids[self.index.slot[bids, L1] < 0]
        if len(need) == 0:
            return
        fresh = _distinct([b for b in need.tolist() if b not in self._promoting])
        if len(fresh):
            self._spawn_promotion(fresh, priority, None, 0, prefetch=False)
        waits = [self._promoting[b] for b in need.tolist() if b in self._promoting]
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    def _start_promotions(
        self, bids: np.ndarray, priority: Priority, deadline: float | None, engine_priority: int
    ) -> int:
        fresh = _distinct([b for b in bids.tolist() if b not in self._promoting])
        if self.disk is None or len(fresh) == 0:
            return 0
        self._spawn_promotion(fresh, priority, deadline, engine_priority, prefetch=True)
        now = self._clock()
        for word in self.index.keys[fresh, 0].tolist():
            self.prefetches.issue(word, now)
        return len(fresh)

    def _spawn_promotion(
        self,
        bids: np.ndarray,
        priority: Priority,
        deadline: float | None,
        engine_priority: int,
        *,
        prefetch: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        for b in bids.tolist():
            self._promoting[b] = loop.create_future()
        np.add.at(self.index.inflight, bids, 1)
        # One promotion per block size: a slot reservation serves one size.
        sizes = self.index.nbytes[bids]
        for size in np.unique(sizes).tolist():
            group = bids[sizes == size]
            self._spawn(
                self._promote(group, int(size), priority, deadline, engine_priority, prefetch)
            )

    async def _promote(
        self,
        bids: np.ndarray,
        nbytes: int,
        priority: Priority,
        deadline: float | None,
        engine_priority: int,
        prefetch: bool,
    ) -> None:
        """Read L2-only blocks of ``nbytes`` into fresh L1 slots. The caller registered their
        futures in ``_promoting`` and marked them in flight; this resolves and unmarks them."""
        assert self.disk is not None
        disk = self.disk
        ok = np.zeros(len(bids), dtype=bool)
        l1_slots: list[int] = []
        try:
            l1_slots = await self._reserve(L1, nbytes, len(bids), self._clock(), priority)
            if len(l1_slots) < len(bids):
                self.counters["promotion_no_room"] += len(bids) - len(l1_slots)
            todo = bids[: len(l1_slots)].tolist()
            slot_bytes = self.host.allocator.slot_bytes_for(nbytes)
            items = [
                ReadItem(
                    int(self.index.slot[b, L2]),
                    self.host.view(s, slot_bytes),
                    nbytes,
                    int(self.checksum[b]),
                    self.index.key_bytes(b),
                )
                for b, s in zip(todo, l1_slots, strict=True)
            ]
            if not items:
                return
            read_failed = False
            try:
                good = await self.mover.submit(
                    priority,
                    "l2_read",
                    len(items) * nbytes,
                    lambda: self._run(disk.read, items),
                    engine_priority=engine_priority,
                    deadline=deadline,
                )
                read_failed = True  # a False below is a failed verification or I/O error
            except PrefetchExpired:
                good = [False] * len(items)
            except Exception:
                good = [False] * len(items)
            now = self._clock()
            for j, (b, s) in enumerate(zip(todo, l1_slots, strict=True)):
                if good[j]:
                    self.index.slot[b, L1] = s
                    self.policies[L1].insert(b, now, -1)
                    ok[j] = True
                    if prefetch:
                        self.prefetches.complete(int(self.index.keys[b, 0]), now)
                else:
                    if prefetch:
                        self.prefetches.evict(int(self.index.keys[b, 0]), now)
                    self.host.allocator.free(s)
                    if read_failed:
                        self._lose_l2_copy(b)
            l1_slots = []
            self.counters["promoted_blocks"] += int(ok.sum())
        finally:
            for s in l1_slots:
                self.host.allocator.free(s)
            for b, good_one in zip(bids.tolist(), ok.tolist(), strict=True):
                fut = self._promoting.pop(b, None)
                if fut is not None and not fut.done():
                    fut.set_result(good_one)
            self._release(bids)

    def _lose_l2_copy(self, bid: int) -> None:
        """The disk tier dropped this block's copy (failed verification): forget the copy."""
        if self.index.slot[bid, L2] >= 0:
            self.policies[L2].remove(bid)
            self.index.slot[bid, L2] = -1
            self.counters["l2_read_failures_seen"] += 1

    def _read_ahead(self, last: int) -> None:
        """Reading the end of a chain prefetches its next blocks from L2."""
        k = self.config.policy.readahead_blocks
        nxt, chain = last, []
        for _ in range(k):
            prev, nxt = nxt, int(self.child[nxt])
            if nxt < 0 or self.parent[nxt] != prev or self.index.state[nxt] != READY:
                break
            chain.append(nxt)
        if chain:
            ids = np.asarray(chain, dtype=np.int64)
            self._start_promotions(ids[self.index.slot[ids, L1] < 0], Priority.PREFETCH, None, 0)

    def _account_reads(self, bids: np.ndarray) -> None:
        if not self.prefetches.outstanding:
            return  # the common case: nothing prefetched is waiting for its read
        now = self._clock()
        for word in self.index.keys[bids, 0].tolist():
            self.prefetches.demand(word, now)

    # ------------------------------------------------------------------ delete

    async def delete(self, ns: int, words: np.ndarray) -> DeleteResult:
        found = self.index.find_any(ns, words)
        missing = int(np.count_nonzero(found < 0))
        ids = np.unique(found[found >= 0])
        busy = (
            (self.index.state[ids] != READY)
            | (self.index.pins[ids] > 0)
            | (self.index.inflight[ids] > 0)
        )
        l2_slots: list[int] = []
        for bid in ids[~busy].tolist():
            for t in range(len(self.tiers)):
                if self.index.slot[bid, t] >= 0:
                    released = self._drop_copy(bid, t)
                    if released is not None:
                        l2_slots.append(released)
        await self._remove_l2_slots(l2_slots)
        deleted = int(np.count_nonzero(~busy))
        self.counters["deleted_blocks"] += deleted
        return DeleteResult(deleted=deleted, missing=missing, busy=int(np.count_nonzero(busy)))

    # -------------------------------------------------------------------- pins

    def pin(self, bids: np.ndarray) -> None:
        np.add.at(self.index.pins, bids, 1)

    def unpin(self, bids: np.ndarray) -> None:
        np.subtract.at(self.index.pins, bids, 1)
        if (self.index.pins[bids] < 0).any():
            raise AssertionError("pin count went below zero: a lease was released twice")
        self._forget_orphans(bids)

    # ---------------------------------------------------------------- eviction

    def evictable(
        self, tier: int, now: float, slot_bytes: int | None = None
    ) -> Callable[[np.ndarray], np.ndarray]:
        """Mask function for the policy of ``tier``: unpinned, idle, unprotected blocks (of one
        slot size when ``slot_bytes`` is given)."""
        guard = self.guards[tier]
        alloc = self.tiers[tier].allocator
        index = self.index

        def mask(bids: np.ndarray) -> np.ndarray:
            ok = guard.evictable(
                now, self.last_access[bids], index.pins[bids], index.inflight[bids]
            )
            ok &= index.state[bids] == READY
            if slot_bytes is not None:
                ok &= alloc.slot_sizes(self.index.slot[bids, tier]) == slot_bytes
            return ok

        return mask

    async def _reserve(
        self, tier: int, nbytes: int, count: int, now: float, priority: Priority
    ) -> list[int]:
        """Up to ``count`` free slots of ``tier`` for blocks of ``nbytes``, evicting (L1:
        demoting) to make room."""
        self._apply_touches()
        alloc = self.tiers[tier].allocator
        slots: list[int] = []
        while len(slots) < count and (slot := alloc.allocate(nbytes)) is not None:
            slots.append(slot)
        deficit = count - len(slots)
        if deficit == 0:
            return slots
        slot_bytes = alloc.slot_bytes_for(nbytes)
        if alloc.stats().size_classes.get(slot_bytes):
            policy = self.policies[tier]
            mask = self.evictable(tier, now, slot_bytes)
            victims = policy.victims(deficit, now, mask)
            if victims is None:
                # Fewer evictable blocks than needed: take all there are.
                possible = int(np.count_nonzero(mask(self._residents(tier))))
                victims = policy.victims(possible, now, mask) if possible else None
            if victims is not None and len(victims):
                await self._evict(tier, victims, priority)
        else:
            await self._reclaim_segment(tier, now, priority)
        while len(slots) < count and (slot := alloc.allocate(nbytes)) is not None:
            slots.append(slot)
        if len(slots) < count:
            self.counters[f"{self.tiers[tier].kind.label.lower()}_full_rejections"] += count - len(
                slots
            )
        return slots

    async def _reclaim_segment(self, tier: int, now: float, priority: Priority) -> None:
        """Free a whole segment for a block size the tier has no segment for yet: the segment
        whose blocks are all evictable and were least recently used."""
        alloc = self.tiers[tier].allocator
        holders = self._residents(tier)
        if len(holders) == 0:
            return
        segs = alloc.segments_of(self.index.slot[holders, tier])
        ok = self.evictable(tier, now)(holders)
        best_seg, best_age = -1, np.inf
        for seg in np.unique(segs):
            in_seg = segs == seg
            if not ok[in_seg].all():
                continue
            newest = float(self.last_access[holders[in_seg]].max())
            if newest < best_age:
                best_seg, best_age = int(seg), newest
        if best_seg >= 0:
            await self._evict(tier, holders[segs == best_seg], priority)
            self.counters["segment_reclaims"] += 1

    async def _evict(self, tier: int, victims: np.ndarray, priority: Priority) -> None:
        """Take ``victims`` out of ``tier``. From L1, blocks without an L2 copy are written to
        L2 first (demotion) when there is a healthy L2; otherwise they are dropped."""
        label = self.tiers[tier].kind.label.lower()
        if tier == L1 and self._l2_accepts_writes():
            dirty = victims[self.index.slot[victims, L2] < 0]
            if self.config.tiers.l2.write_policy != "write_through":
                dirty = dirty[self._admit_to_l2(dirty, self._clock())]
            if len(dirty):
                np.add.at(self.index.inflight, victims, 1)
                try:
                    ok = await self._write_l2(dirty, priority)
                finally:
                    np.subtract.at(self.index.inflight, victims, 1)
                self.counters["demoted_blocks"] += int(np.count_nonzero(ok))
                self.counters["demotion_failures"] += int(np.count_nonzero(~ok))
                # While the writes ran, a request may have pinned, read or touched a victim:
                # such a block stays (and now has a clean L2 copy).
                victims = victims[self.evictable(tier, self._clock())(victims)]
        released = [s for v in victims.tolist() if (s := self._drop_copy(v, tier)) is not None]
        await self._remove_l2_slots(released)
        self.counters[f"{label}_evictions"] += len(victims)

    def _drop_copy(self, bid: int, tier: int) -> int | None:
        """Remove tier ``tier``'s copy of a block; forget the block if no copy is left.
        Returns an L2 slot the caller must hand to ``_remove_l2_slots``; L1 slots are freed
        here."""
        self._apply_touches()
        if tier == L1 and self.prefetches.outstanding:
            self.prefetches.evict(int(self.index.keys[bid, 0]), self._clock())
        self.policies[tier].remove(bid)
        slot = int(self.index.slot[bid, tier])
        self.index.slot[bid, tier] = -1
        if not (self.index.slot[bid] >= 0).any():
            self._forget(bid)
        if tier == L2:
            return slot
        self.tiers[tier].allocator.free(slot)
        return None

    async def _remove_l2_slots(self, slots: list[int]) -> None:
        if slots and self.disk is not None:
            ok = await self._run(self.disk.remove, slots)
            if not ok:
                self.counters["l2_remove_failures"] += len(slots)

    # ------------------------------------------------------------------ L2 writes

    def _l2_accepts_writes(self) -> bool:
        return self.disk is not None and self.disk.state() == "ok"

    async def _write_l2(self, bids: np.ndarray, priority: Priority) -> np.ndarray:
        """Write L1 copies of ``bids`` to L2 and index them; returns which now have an L2
        copy. A block already being written is waited for, not written twice."""
        ok = np.zeros(len(bids), dtype=bool)
        if self.disk is None or len(bids) == 0:
            return ok
        waits: dict[int, asyncio.Future[bool]] = {}
        mine: list[int] = []
        loop = asyncio.get_running_loop()
        for b in bids.tolist():
            if self.index.slot[b, L2] >= 0:
                continue
            if b in self._writing:
                waits[b] = self._writing[b]
            else:
                self._writing[b] = loop.create_future()
                mine.append(b)
        if mine:
            own = np.asarray(mine, dtype=np.int64)
            np.add.at(self.index.inflight, own, 1)
            try:
                batch = self.config.mover.batch_blocks
                await asyncio.gather(
                    *(
                        self._write_l2_batch(own[i : i + batch], priority)
                        for i in range(0, len(own), batch)
                    )
                )
            finally:
                self._release(own)
                for b in mine:
                    fut = self._writing.pop(b)
                    fut.set_result(bool(self.index.slot[b, L2] >= 0))
        if waits:
            await asyncio.gather(*waits.values(), return_exceptions=True)
        return self.index.slot[bids, L2] >= 0

    async def _write_l2_batch(self, bids: np.ndarray, priority: Priority) -> None:
        assert self.disk is not None
        disk = self.disk
        for size in np.unique(self.index.nbytes[bids]).tolist():
            group = bids[self.index.nbytes[bids] == size]
            slots = await self._reserve(L2, size, len(group), self._clock(), priority)
            if not slots:
                continue
            group = group[: len(slots)]
            slot_bytes = self.host.allocator.slot_bytes_for(size)
            items = [
                PersistItem(
                    int(self.index.ns[b]),
                    self.index.key_bytes(b),
                    s,
                    self.host.view(int(self.index.slot[b, L1]), slot_bytes),
                    size,
                )
                for b, s in zip(group.tolist(), slots, strict=True)
            ]
            try:
                outcomes = await self.mover.submit(
                    priority,
                    "l2_write",
                    len(items) * size,
                    lambda items=items: self._run(disk.persist, items),
                )
            except Exception:
                outcomes = None
            now = self._clock()
            failed: list[int] = []
            for j, (b, s) in enumerate(zip(group.tolist(), slots, strict=True)):
                if outcomes is not None and outcomes[j].ok and self.index.state[b] == READY:
                    self.index.slot[b, L2] = s
                    self.checksum[b] = outcomes[j].checksum
                    self.policies[L2].insert(b, now, -1)
                else:
                    failed.append(s)
            self.counters["l2_writes_failed"] += len(failed)
            await self._remove_l2_slots(failed)

    def _admit_to_l2(self, bids: np.ndarray, now: float) -> np.ndarray:
        """Which of ``bids`` the L2 admission rule lets in, counting each decision's reason."""
        assert self.disk is not None
        admit = np.zeros(len(bids), dtype=bool)
        victim_word: int | None = None
        if len(bids) and not self.disk.allocator.can_allocate(int(self.index.nbytes[bids[0]])):
            coldest = self.policies[L2].victims(1, now, self.evictable(L2, now))
            if coldest is not None:
                victim_word = int(self.index.keys[coldest[0], 0])
        for j, word in enumerate(self.index.keys[bids, 0].tolist()):
            decision = self.l2_admission.decide(word, victim_word, now)
            admit[j] = decision.admit
            self.counters[f"l2_admission_{decision.reason}"] += 1
        return admit

    def _write_admitted(self, bids: np.ndarray, now: float) -> None:
        """``selective``: write L1-only blocks to L2 as soon as the admission rule takes them."""
        if not self._l2_accepts_writes():
            return
        held = bids[(self.index.slot[bids, L1] >= 0) & (self.index.slot[bids, L2] < 0)]
        held = np.array([b for b in held.tolist() if b not in self._writing], dtype=np.int64)
        if len(held):
            admitted = held[self._admit_to_l2(held, now)]
            if len(admitted):
                self._spawn(self._write_l2(admitted, Priority.BACKGROUND))

    def _dirty_l1_blocks(self) -> np.ndarray:
        if self.disk is None:
            return np.empty(0, dtype=np.int64)
        held = self._residents(L1)
        return held[(self.index.slot[held, L2] < 0) & (self.index.state[held] == READY)]

    # -------------------------------------------------------------- watermarks

    async def _balance_forever(self) -> None:
        interval = self.config.mover.balance_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.balance()
            except Exception:
                log.exception("watermark balancing failed")
                self.counters["background_errors"] += 1

    async def balance(self) -> None:
        """Above a tier's high watermark, move its coldest evictable blocks down until it is
        below the low watermark. During warm-up nothing moves before the hard limit."""
        self._apply_touches()
        now = self._clock()
        for tier, guard in enumerate(self.guards):
            if tier == L1 and self.disk is None:
                # Nothing to move down into: dropping early would only waste capacity, and a
                # put that finds L1 full drops what it needs at no cost.
                continue
            alloc = self.tiers[tier].allocator
            excess = guard.to_free(alloc.used_bytes, alloc.capacity_bytes, now, self.started_at)
            resident = len(self.policies[tier])
            if excess <= 0 or resident == 0:
                continue
            n = max(1, int(np.ceil(excess / (alloc.used_bytes / resident))))
            mask = self.evictable(tier, now)
            victims = self.policies[tier].victims(n, now, mask)
            if victims is None:
                possible = int(np.count_nonzero(mask(self._residents(tier))))
                victims = self.policies[tier].victims(possible, now, mask) if possible else None
            if victims is not None and len(victims):
                await self._evict(tier, victims, Priority.BACKGROUND)
                label = self.tiers[tier].kind.label.lower()
                self.counters[f"{label}_watermark_evictions"] += len(victims)

    # ----------------------------------------------------------------- recovery

    def _recover(self) -> None:
        """Index every block the disk tier recovered, so a restart serves it."""
        assert self.disk is not None
        blocks = self.disk.recover()
        if not blocks:
            return
        now_mono, now_wall = self._clock(), time.time()
        for blk in blocks:
            bid = self._add_block(blk.ns, keys_to_words([blk.key])[0], blk.nbytes)
            self.index.state[bid] = READY
            self.index.slot[bid, L2] = blk.slot
            self.checksum[bid] = blk.checksum
            seen = now_mono - max(0.0, now_wall - blk.written_at)
            self.last_access[bid] = seen
            self.policies[L2].insert(bid, seen, -1)
        log.info("indexed %d blocks recovered from L2", len(blocks))

    # ----------------------------------------------------------------- helpers

    def _add_block(self, ns: int, words: np.ndarray, nbytes: int) -> int:
        bid = self.index.add(ns, words, nbytes)
        if self.index.capacity > len(self.checksum):
            self.checksum = _grown(self.checksum, self.index.capacity, 0)
            self.child = _grown(self.child, self.index.capacity, -1)
            self.parent = _grown(self.parent, self.index.capacity, -1)
            self.last_access = _grown(self.last_access, self.index.capacity, -np.inf)
        self.last_access[bid] = -np.inf
        self.child[bid] = -1
        self.parent[bid] = -1
        self.checksum[bid] = 0
        return bid

    def _forget(self, bid: int) -> None:
        self.index.remove(bid)
        for policy in self.policies:
            policy.forget(bid)

    def _abandon(self, bids: np.ndarray) -> None:
        """Undo reservations of new blocks whose copy failed or found no room."""
        for bid in bids.tolist():
            slot = int(self.index.slot[bid, L1])
            if slot >= 0:
                self.host.allocator.free(slot)
            self._forget(bid)

    def _release(self, bids: np.ndarray) -> None:
        """End an in-flight mark."""
        np.subtract.at(self.index.inflight, bids, 1)
        self._forget_orphans(bids)

    def _forget_orphans(self, bids: np.ndarray) -> None:
        """A block that lost its last copy while held (a failed L2 read) is forgotten once
        nobody holds it any more."""
        for b in bids.tolist():
            if (
                self.index.state[b] == READY
                and self.index.inflight[b] == 0
                and self.index.pins[b] == 0
                and not (self.index.slot[b] >= 0).any()
            ):
                self._forget(b)

    def _residents(self, tier: int) -> np.ndarray:
        return np.flatnonzero(self.index.slot[:, tier] >= 0)

    def _touch(self, bids: np.ndarray, now: float) -> None:
        """Record an access. The protection clock restarts at once; the policies hear of it
        right after the current request is answered (one ``touch_many`` per tier, which a
        1,024-key Lookup need not wait for), and in any case before the store next inserts,
        evicts or drops anything."""
        self.last_access[bids] = now
        self._pending_touches.append((bids.copy(), now))
        if len(self._pending_touches) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._apply_touches)
            except RuntimeError:  # no event loop (offline use): apply now
                self._apply_touches()

    def _apply_touches(self) -> None:
        pending, self._pending_touches = self._pending_touches, []
        for bids, now in pending:
            for t, policy in enumerate(self.policies):
                policy.touch_many(bids[self.index.slot[bids, t] >= 0], now)
            if self.disk is not None:
                for word in self.index.keys[bids, 0].tolist():
                    self.l2_admission.record(word, now)
                if self.config.tiers.l2.write_policy == "selective":
                    self._write_admitted(bids, now)

    def _fastest_tier(self, bids: np.ndarray) -> np.ndarray:
        out = np.zeros(len(bids), dtype=np.int32)
        for t in reversed(range(len(self.tiers))):
            out[self.index.slot[bids, t] >= 0] = int(self.tiers[t].kind)
        return out

    def _check_sizes(self, ids: np.ndarray, block_bytes: int) -> None:
        live = ids[ids >= 0]
        wrong = live[self.index.nbytes[live] != block_bytes]
        if len(wrong):
            raise InvalidArgument(
                f"key {self.index.key_bytes(int(wrong[0])).hex()} is stored with "
                f"{int(self.index.nbytes[wrong[0]])} bytes but this pool's blocks have {block_bytes}; "
                "keys of different layouts must come from different namespaces"
            )

    def _count_put(self, results: np.ndarray) -> None:
        self.counters["put_blocks_stored"] += int(np.count_nonzero(results == PutResult.STORED))
        self.counters["put_blocks_existing"] += int(np.count_nonzero(results == PutResult.EXISTS))
        self.counters["put_blocks_rejected"] += int(
            np.count_nonzero(results == PutResult.REJECTED_FULL)
        )

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background transfer failed", exc_info=exc)
            self.counters["background_errors"] += 1

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def _distinct(bids: list[int]) -> np.ndarray:
    """Ids in first-seen order without repeats: a transfer must not name one slot twice."""
    return np.asarray(list(dict.fromkeys(bids)), dtype=np.int64)


def _grown(a: np.ndarray, size: int, fill: float) -> np.ndarray:
    out = np.full(size, fill, dtype=a.dtype)
    out[: len(a)] = a
    return out


def _l2_admission_name(config: Config) -> str:
    """``l2.admission``, or its default: second_hit for ``selective`` (its point is to keep
    one-off blocks off the disk), else the eviction policy's own choice."""
    if config.tiers.l2.admission:
        return config.tiers.l2.admission
    if config.tiers.l2.write_policy == "selective":
        return "second_hit"
    return default_admission(config.policy.name)


def _open_disk(config: Config) -> DiskTier:
    c = config.tiers.l2
    return DiskTier(
        c.path,
        c.capacity_bytes,
        c.segment_bytes,
        io_threads=c.io_threads,
        file_bytes=c.file_bytes,
        direct_io=c.direct_io,
        enospc_retry_s=c.enospc_retry_s,
    )


def _want_pinning(config: Config) -> bool:
    setting = config.tiers.l1.pin_memory
    if setting == "auto":
        # Importing torch costs a second or two: only ask it when a GPU driver is present.
        if not os.path.exists("/dev/nvidiactl"):
            return False
        import torch

        return bool(torch.cuda.is_available())
    return setting == "true"
