"""The block store: index, heat table, tiers and their policies, glued together.

Invariants:
- All store state is touched from one thread (the server's event loop). Bytes move on worker
  threads, but only between slots that the loop has marked in flight, so no lock is needed
  and no slot is freed or reused while a copy reads or writes it.
- A block is visible to lookups only once its bytes are complete (state READY).
- A block with a pin (lease), a copy in flight, or inside its protection period is never
  evicted. Eviction takes exactly the victims a policy proposed, or none.
- ``index.slot[bid, t] >= 0`` exactly when tier ``t`` holds a copy of block ``bid``, and then
  the tier's policy knows the block.

Thread-safety: not thread-safe by design (see above); call from the event loop only.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from kvtier.daemon.config import Config
from kvtier.daemon.errors import InvalidArgument
from kvtier.daemon.heat import HeatTable
from kvtier.daemon.index import READY, BlockIndex
from kvtier.daemon.policy.base import EvictionPolicy
from kvtier.daemon.policy.registry import make_policy
from kvtier.daemon.pools import Pool
from kvtier.kernels.copy import blocks_to_pool, pool_to_blocks
from kvtier.tiers.base import TierKind
from kvtier.tiers.host import HostArena

log = logging.getLogger(__name__)

HALF_LIFE_S = 600.0


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


class BlockStore:
    def __init__(
        self,
        config: Config,
        executor: Executor,
        *,
        clock: Callable[[], float] = time.monotonic,
        host: HostArena | None = None,
    ) -> None:
        self.config = config
        self._executor = executor
        self._clock = clock
        self.started_at = clock()
        self.host = host or HostArena(
            config.l1.capacity_bytes, config.l1.segment_bytes, pin_cuda=_want_pinning(config)
        )
        self.tiers = [self.host]
        self.index = BlockIndex(num_tiers=len(self.tiers))
        self.heat = HeatTable(HALF_LIFE_S, self.index.capacity)
        self.policies: list[EvictionPolicy] = [make_policy(config.policy.name) for _ in self.tiers]
        self.counters: Counter[str] = Counter()
        self._copy_threads = config.server.copy_threads

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

    # ----------------------------------------------------------------- writes

    async def put(
        self,
        pool: Pool,
        ns: int,
        words: np.ndarray,
        pages: np.ndarray,
        parent_words: np.ndarray | None,
    ) -> np.ndarray:
        """Store pool pages under keys; returns a PutResult per key.

        Keys form one chain (``words[i]`` follows ``words[i-1]``); when room runs out the
        leading new blocks are stored and the rest rejected, since a child is useless without
        its parent.
        """
        now = self._clock()
        n = len(words)
        block_bytes = pool.block_bytes
        results = np.full(n, PutResult.STORED, dtype=np.int32)
        existing = self.index.find_any(ns, words)
        self._check_sizes(existing, block_bytes)
        is_new = existing < 0
        # A key repeated within the batch is stored once.
        _, first = np.unique(words, axis=0, return_index=True)
        dup = np.ones(n, dtype=bool)
        dup[first] = False
        is_new &= ~dup
        results[~is_new] = PutResult.EXISTS
        ready_existing = existing[(existing >= 0)]
        ready_existing = ready_existing[self.index.state[ready_existing] == READY]
        if len(ready_existing):
            self._touch(ready_existing, now)

        new_idx = np.flatnonzero(is_new)
        slots = self._reserve(0, block_bytes, len(new_idx), now)
        results[new_idx[len(slots) :]] = PutResult.REJECTED_FULL
        new_idx = new_idx[: len(slots)]
        parent = -1
        if parent_words is not None:
            parent = int(self.index.lookup(ns, parent_words[None, :])[0])
        bids = np.empty(len(new_idx), dtype=np.int64)
        parents = np.empty(len(new_idx), dtype=np.int64)
        chain = existing.copy()
        for j, i in enumerate(new_idx):
            bid = self.index.add(ns, words[i], block_bytes)
            self.heat.ensure(self.index.capacity)
            self.heat.reset(bid)
            self.index.slot[bid, 0] = slots[j]
            self.index.inflight[bid] = 1
            bids[j] = bid
            chain[i] = bid
            parents[j] = chain[i - 1] if i > 0 else parent
        if len(bids) == 0:
            self._count_put(results)
            return results

        offsets = self.host.allocator.offsets(np.asarray(slots, dtype=np.int64))
        try:
            with pool.use() as mem:
                await self._run(
                    pool_to_blocks,
                    pool.layout.chunk_table,
                    mem,
                    pages[new_idx],
                    self.host.array,
                    offsets,
                    self._copy_threads,
                )
        except BaseException:
            for bid in bids:
                self._forget(int(bid))
            raise
        now = self._clock()
        self.index.inflight[bids] = 0
        self.index.state[bids] = READY
        self.heat.record(bids, now)
        policy = self.policies[0]
        for bid, par in zip(bids.tolist(), parents.tolist(), strict=True):
            policy.insert(bid, now, par)
        self.counters["bytes_put"] += len(bids) * block_bytes
        self._count_put(results)
        return results

    async def get(
        self, pool: Pool, ns: int, words: np.ndarray, pages: np.ndarray, *, touch: bool
    ) -> np.ndarray:
        """Copy stored blocks into pool pages; returns whether each key was loaded."""
        ids = self.index.lookup(ns, words)
        self._check_sizes(ids, pool.block_bytes)
        loaded = (ids >= 0) & (self.index.slot[np.maximum(ids, 0), 0] >= 0)
        bids = ids[loaded]
        self.counters["get_blocks_missing"] += int(len(ids) - len(bids))
        if len(bids) == 0:
            return loaded
        now = self._clock()
        if touch:
            self._touch(bids, now)
        else:
            # The pinning Lookup counted this access; only the protection clock restarts.
            self.heat.last_access[bids] = now
        np.add.at(self.index.inflight, bids, 1)
        try:
            offsets = self.host.allocator.offsets(self.index.slot[bids, 0])
            with pool.use() as mem:
                await self._run(
                    blocks_to_pool,
                    pool.layout.chunk_table,
                    self.host.array,
                    offsets,
                    mem,
                    pages[loaded],
                    self._copy_threads,
                )
        finally:
            np.subtract.at(self.index.inflight, bids, 1)
        self.counters["get_blocks_loaded"] += len(bids)
        self.counters["bytes_get"] += len(bids) * pool.block_bytes
        return loaded

    def delete(self, ns: int, words: np.ndarray) -> DeleteResult:
        found = self.index.find_any(ns, words)
        missing = int(np.count_nonzero(found < 0))
        ids = np.unique(found[found >= 0])
        busy = (
            (self.index.state[ids] != READY)
            | (self.index.pins[ids] > 0)
            | (self.index.inflight[ids] > 0)
        )
        for bid in ids[~busy].tolist():
            for t in range(len(self.tiers)):
                if self.index.slot[bid, t] >= 0:
                    self._drop_copy(bid, t)
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

    # ------------------------------------------------------------ eviction

    def evictable(
        self, tier: int, now: float, slot_bytes: int | None = None
    ) -> Callable[[np.ndarray], np.ndarray]:
        """Mask function for the policy of ``tier``: unpinned, idle, unprotected blocks (of one
        slot size when ``slot_bytes`` is given)."""
        protect_s = self.config.policy.protect_s
        alloc = self.tiers[tier].allocator

        def mask(bids: np.ndarray) -> np.ndarray:
            ok = (
                (self.index.pins[bids] == 0)
                & (self.index.inflight[bids] == 0)
                & (self.index.state[bids] == READY)
                & (self.heat.last_access[bids] + protect_s <= now)
            )
            if slot_bytes is not None:
                slots = self.index.slot[bids, tier]
                ok &= alloc.slot_sizes(slots) == slot_bytes
            return ok

        return mask

    def _reserve(self, tier: int, nbytes: int, count: int, now: float) -> list[int]:
        """Up to ``count`` free slots for blocks of ``nbytes``, evicting to make room."""
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
                residents = self._residents(tier)
                possible = int(np.count_nonzero(mask(residents)))
                victims = policy.victims(possible, now, mask) if possible else None
            if victims is not None and len(victims):
                self._evict(tier, victims)
        else:
            self._reclaim_segment(tier, now)
        while len(slots) < count and (slot := alloc.allocate(nbytes)) is not None:
            slots.append(slot)
        if len(slots) < count:
            self.counters[f"{self.tiers[tier].kind.label.lower()}_full_rejections"] += count - len(
                slots
            )
        return slots

    def _reclaim_segment(self, tier: int, now: float) -> None:
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
            newest = float(self.heat.last_access[holders[in_seg]].max())
            if newest < best_age:
                best_seg, best_age = int(seg), newest
        if best_seg >= 0:
            self._evict(tier, holders[segs == best_seg])
            self.counters["segment_reclaims"] += 1

    def _evict(self, tier: int, victims: np.ndarray) -> None:
        label = self.tiers[tier].kind.label.lower()
        for bid in victims.tolist():
            self._drop_copy(bid, tier)
        self.counters[f"{label}_evictions"] += len(victims)

    def _drop_copy(self, bid: int, tier: int) -> None:
        """Remove tier ``tier``'s copy of a block; forget the block if no copy is left."""
        self.policies[tier].remove(bid)
        self.tiers[tier].allocator.free(int(self.index.slot[bid, tier]))
        self.index.slot[bid, tier] = -1
        if not (self.index.slot[bid] >= 0).any():
            self.index.remove(bid)

    def _forget(self, bid: int) -> None:
        """Undo a reservation whose copy failed."""
        for t in range(len(self.tiers)):
            slot = int(self.index.slot[bid, t])
            if slot >= 0:
                self.tiers[t].allocator.free(slot)
                if bid in self.policies[t]:
                    self.policies[t].remove(bid)
        self.index.remove(bid)

    # ----------------------------------------------------------------- helpers

    def _residents(self, tier: int) -> np.ndarray:
        return np.flatnonzero(self.index.slot[:, tier] >= 0)

    def _touch(self, bids: np.ndarray, now: float) -> None:
        self.heat.record(bids, now)
        for t, policy in enumerate(self.policies):
            for bid in bids[self.index.slot[bids, t] >= 0].tolist():
                policy.touch(bid, now)

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

    async def _run(self, fn: Callable[..., object], *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def _want_pinning(config: Config) -> bool:
    setting = config.l1.pin_memory
    if setting == "auto":
        # Importing torch costs a second or two: only ask it when a GPU driver is present.
        if not os.path.exists("/dev/nvidiactl"):
            return False
        import torch

        return bool(torch.cuda.is_available())
    return setting == "true"
