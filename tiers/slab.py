"""Slot allocation for a tier: fixed-size slots carved from equal segments.

A tier's space is split into ``segment_bytes`` segments. A segment serves one slot size (a
block size rounded up to ``align``) from the moment its first slot is taken until its last
slot is freed, when it returns to the common pool. A size is known (a size class) only while
a segment serves it: the sizes seen pass through (up to ``segment_bytes // align`` of them),
and what walks the classes (``filled_bytes``, each balancer wake) walks the sizes held. Blocks of several sizes (several models on
one node) therefore share a tier without a general-purpose allocator, every slot of a size is
interchangeable, and allocation and release are O(1).

Slot ids are ``segment * slots_cap + index`` where ``slots_cap = segment_bytes // align``; the
slot's byte offset is ``segment * segment_bytes + index * slot_bytes``, always a multiple of
``align`` (so slots suit O_DIRECT I/O).

``SlabAllocator`` is not thread-safe: its owner calls it from one thread. ``LockedSlab`` is.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

# A size, or sizes (``SlabAllocator.slot_bytes_for``).
_Bytes = TypeVar("_Bytes", int, np.ndarray)

# Batches this short are freed one slot at a time (after all are checked).
_FEW_FREES = 8


@dataclass(slots=True)
class _SizeClass:
    slot_bytes: int
    slots_per_segment: int
    # Segments of this class with at least one free slot, and each one's free slots.
    open_segments: dict[int, set[int]] = field(default_factory=dict)
    segments: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class SlabStats:
    capacity_bytes: int
    used_bytes: int
    used_slots: int
    free_segments: int
    segments: int
    size_classes: dict[int, int]  # slot_bytes -> segments held


class SlabAllocator:
    def __init__(self, capacity_bytes: int, segment_bytes: int, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, not {align}")
        if segment_bytes < align or segment_bytes % align:
            raise ValueError(
                f"segment_bytes {segment_bytes} must be a positive multiple of {align}"
            )
        if capacity_bytes < segment_bytes:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} is smaller than one segment of {segment_bytes}"
            )
        self.align = align
        self.segment_bytes = segment_bytes
        self.num_segments = capacity_bytes // segment_bytes
        self.capacity_bytes = self.num_segments * segment_bytes
        self.slots_cap = segment_bytes // align
        # Per segment: slot size (0 while free), slots in use, slots never handed out yet.
        self._seg_slot_bytes = np.zeros(self.num_segments, dtype=np.int64)
        self._seg_used = np.zeros(self.num_segments, dtype=np.int64)
        self._seg_fresh = np.zeros(self.num_segments, dtype=np.int64)
        self._free_segments: list[int] = list(range(self.num_segments - 1, -1, -1))
        self._classes: dict[int, _SizeClass] = {}
        self._used_bytes = 0
        self._used_slots = 0

    # ------------------------------------------------------------------ sizes

    def slot_bytes_for(self, nbytes: _Bytes) -> _Bytes:
        """The slot size that holds a block of ``nbytes`` (of each, for an array)."""
        return -(-nbytes // self.align) * self.align

    def fits(self, nbytes: int) -> bool:
        return nbytes > 0 and self.slot_bytes_for(nbytes) <= self.segment_bytes

    # -------------------------------------------------------------- allocation

    def can_allocate(self, nbytes: int) -> bool:
        cls = self._classes.get(self.slot_bytes_for(nbytes))
        return bool(self._free_segments) or bool(cls and cls.open_segments)

    def free_slots(self, nbytes: int) -> int:
        """How many blocks of ``nbytes`` fit without freeing anything: the free slots of
        their size and the slots of the free segments."""
        slot_bytes = self.slot_bytes_for(nbytes)
        n = len(self._free_segments) * (self.segment_bytes // slot_bytes)
        cls = self._classes.get(slot_bytes)
        if cls is not None and cls.open_segments:
            segs = np.fromiter(cls.open_segments, dtype=np.int64, count=len(cls.open_segments))
            n += len(segs) * cls.slots_per_segment - int(self._seg_used[segs].sum())
        return n

    def allocate(self, nbytes: int) -> int | None:
        """A free slot for a block of ``nbytes``, or None when the tier has none."""
        got = self._take(nbytes, 1)
        return got[0] if got else None

    def allocate_many(self, nbytes: int, count: int) -> list[int]:
        """Up to ``count`` free slots for blocks of ``nbytes``: fewer only when the tier has
        no more. Slots of one segment are handed out together (a batch of a thousand blocks
        costs a few dictionary operations, not a thousand allocations)."""
        return self._take(nbytes, count)

    def _take(self, nbytes: int, count: int) -> list[int]:
        slot_bytes = self.slot_bytes_for(nbytes)
        if slot_bytes > self.segment_bytes or nbytes <= 0:
            raise ValueError(
                f"block of {nbytes} bytes does not fit a segment of {self.segment_bytes}"
            )
        cls = self._classes.get(slot_bytes)
        if cls is None:
            cls = self._classes[slot_bytes] = _SizeClass(
                slot_bytes, self.segment_bytes // slot_bytes
            )
        out: list[int] = []
        while len(out) < count:
            if not cls.open_segments:
                if not self._free_segments:
                    break
                seg = self._free_segments.pop()
                self._seg_slot_bytes[seg] = slot_bytes
                self._seg_fresh[seg] = 0
                cls.segments.add(seg)
                cls.open_segments[seg] = set()
            seg = next(iter(cls.open_segments))
            free = cls.open_segments[seg]
            base = seg * self.slots_cap
            want = count - len(out)
            taken = 0
            # Freed slots first (as one at a time would), then slots never handed out.
            while free and taken < want:
                out.append(base + free.pop())
                taken += 1
            # The counters are read as Python ints (``item``): numpy's scalars cost more.
            fresh = self._seg_fresh.item(seg)
            more = min(want - taken, cls.slots_per_segment - fresh)
            if more > 0:
                out.extend(range(base + fresh, base + fresh + more))
                self._seg_fresh[seg] = fresh + more
                taken += more
            used = self._seg_used.item(seg) + taken
            self._seg_used[seg] = used
            if used == cls.slots_per_segment:
                del cls.open_segments[seg]
            self._used_bytes += taken * slot_bytes
            self._used_slots += taken
        if not cls.segments:
            del self._classes[slot_bytes]  # no segment came: the size holds nothing
        return out

    def claim(self, slot: int, nbytes: int) -> None:
        """Mark a specific slot as used (recovery of a persistent tier).

        Raises ValueError when the slot is already used or its segment serves another size.
        """
        slot_bytes = self.slot_bytes_for(nbytes)
        seg, index = divmod(slot, self.slots_cap)
        if not 0 <= seg < self.num_segments:
            raise ValueError(f"slot {slot} is outside the tier")
        if index >= self.segment_bytes // slot_bytes:
            raise ValueError(
                f"slot {slot} is beyond the last {slot_bytes}-byte slot of its segment"
            )
        if self._seg_slot_bytes[seg] not in (0, slot_bytes):
            raise ValueError(
                f"slot {slot} lies in a segment of {int(self._seg_slot_bytes[seg])}-byte slots, "
                f"not {slot_bytes}"
            )
        cls = self._classes.get(slot_bytes)
        if cls is None:
            cls = self._classes[slot_bytes] = _SizeClass(
                slot_bytes, self.segment_bytes // slot_bytes
            )
        if self._seg_slot_bytes[seg] == 0:
            self._free_segments.remove(seg)
            self._seg_slot_bytes[seg] = slot_bytes
            self._seg_fresh[seg] = 0
            cls.segments.add(seg)
            cls.open_segments[seg] = set()
        free = cls.open_segments.get(seg)
        if index < self._seg_fresh[seg]:
            if free is None or index not in free:
                raise ValueError(f"slot {slot} is already in use")
            free.discard(index)
        else:
            # Slots skipped over become free slots of the segment.
            if free is None:
                raise ValueError(f"slot {slot} is already in use")
            free.update(range(int(self._seg_fresh[seg]), index))
            self._seg_fresh[seg] = index + 1
        self._seg_used[seg] += 1
        if self._seg_used[seg] == cls.slots_per_segment:
            cls.open_segments.pop(seg, None)
        self._used_bytes += slot_bytes
        self._used_slots += 1

    def claim_many(self, slots: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """``claim`` for many slots at once (recovery of a persistent tier), vectorised per
        segment. Returns which were claimed; a slot is refused, changing nothing for it, when
        it is outside the tier, already used, named twice (the first claim wins), or lies in
        a segment that serves another slot size (in a free segment, the size of the first
        claim of the batch there wins)."""
        slots = np.asarray(slots, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        ok = (slots >= 0) & (nbytes > 0)
        slot_bytes = -(-np.maximum(nbytes, 1) // self.align) * self.align
        ok &= slot_bytes <= self.segment_bytes
        seg, idx = np.divmod(slots, self.slots_cap)
        ok &= seg < self.num_segments
        ok &= idx < self.segment_bytes // slot_bytes
        cand = np.flatnonzero(ok)
        _, first = np.unique(slots[cand], return_index=True)
        dup = np.ones(len(cand), dtype=bool)
        dup[first] = False
        ok[cand[dup]] = False
        cand = np.flatnonzero(ok)
        if len(cand) == 0:
            return ok  # nothing to claim (the grouping below needs one row at least)
        order = cand[np.argsort(seg[cand], kind="stable")]
        bounds = np.flatnonzero(np.r_[True, seg[order][1:] != seg[order][:-1], True])
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            rows = order[a:b]
            s = int(seg[rows[0]])
            size = int(self._seg_slot_bytes[s]) or int(slot_bytes[rows[0]])
            wrong = slot_bytes[rows] != size
            ok[rows[wrong]] = False
            rows = rows[~wrong]
            cls = self._classes.get(size)
            if cls is None:
                cls = self._classes[size] = _SizeClass(size, self.segment_bytes // size)
            if self._seg_slot_bytes[s] == 0:
                self._seg_slot_bytes[s] = size
                self._seg_fresh[s] = 0
                cls.segments.add(s)
                cls.open_segments[s] = set()
            fresh = int(self._seg_fresh[s])
            free = cls.open_segments.get(s, set())
            want = idx[rows]
            taken = (want < fresh) & ~np.isin(want, np.fromiter(free, np.int64, len(free)))
            ok[rows[taken]] = False
            want = want[~taken]
            if len(want) == 0:
                continue
            top = max(fresh, int(want.max()) + 1)
            free = (free | set(range(fresh, top))) - set(want.tolist())
            self._seg_fresh[s] = top
            self._seg_used[s] += len(want)
            if self._seg_used[s] == cls.slots_per_segment:
                cls.open_segments.pop(s, None)
            else:
                cls.open_segments[s] = free
            self._used_bytes += len(want) * size
            self._used_slots += len(want)
        self._free_segments = [int(x) for x in np.flatnonzero(self._seg_slot_bytes == 0)[::-1]]
        return ok

    def free(self, slot: int) -> None:
        self._free(slot)

    def _free(self, slot: int) -> None:
        """``free`` without a lock (``LockedSlab`` holds its own around it)."""
        seg, index = divmod(slot, self.slots_cap)
        slot_bytes = int(self._seg_slot_bytes[seg])
        if slot_bytes == 0 or index >= self._seg_fresh[seg]:
            raise ValueError(f"slot {slot} is not allocated")
        cls = self._classes[slot_bytes]
        free = cls.open_segments.get(seg)
        if free is not None and index in free:
            raise ValueError(f"slot {slot} is already free")
        self._seg_used[seg] -= 1
        self._used_bytes -= slot_bytes
        self._used_slots -= 1
        if self._seg_used[seg] == 0:
            cls.open_segments.pop(seg, None)
            cls.segments.discard(seg)
            if not cls.segments:
                del self._classes[slot_bytes]
            self._seg_slot_bytes[seg] = 0
            self._seg_fresh[seg] = 0
            self._free_segments.append(seg)
            return
        if free is None:
            cls.open_segments[seg] = {index}
        else:
            free.add(index)

    def free_many(self, slots: Sequence[int] | np.ndarray) -> None:
        """``free`` of every slot, a segment at a time (an eviction frees thousands of small
        blocks). Raises ValueError, freeing none, when a slot is not allocated or is named
        twice."""
        if len(slots) <= _FEW_FREES:
            # A few slots (a delete frees one per block): checked, then freed one by one,
            # for a fraction of the array steps below. Unlocked calls: a LockedSlab holds
            # its lock around this whole method.
            listed = [int(s) for s in slots]
            for i, slot in enumerate(listed):
                if not SlabAllocator.is_allocated(self, slot):
                    raise ValueError(f"slot {slot} is not allocated")
                if slot in listed[:i]:
                    raise ValueError(f"slot {slot} is already free")
            for slot in listed:
                self._free(slot)
            return
        arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        segs, idx = np.divmod(arr, self.slots_cap)
        order = np.argsort(segs, kind="stable")
        segs, idx = segs[order], idx[order]
        cuts = np.flatnonzero(segs[1:] != segs[:-1]) + 1
        starts = np.concatenate(([0], cuts))
        # Where each segment's slots first and last appear in the batch: one by one, a
        # segment joins the open ones at its first slot and empties at its last, and the
        # order of those events decides which slots later allocations get.
        firsts = order[starts].tolist()
        lasts = order[np.append(cuts, len(order)) - 1].tolist()
        groups: list[tuple[int, list[int]]] = []
        for seg, part in zip(segs[starts].tolist(), np.split(idx, cuts), strict=True):
            indices = part.tolist()
            inside = 0 <= seg < self.num_segments
            slot_bytes = int(self._seg_slot_bytes[seg]) if inside else 0
            if slot_bytes == 0 or max(indices) >= self._seg_fresh[seg]:
                bad = indices[0] if slot_bytes == 0 else max(indices)
                raise ValueError(f"slot {seg * self.slots_cap + bad} is not allocated")
            free = self._classes[slot_bytes].open_segments.get(seg, set())
            if len(set(indices)) != len(indices) or not free.isdisjoint(indices):
                seen: set[int] = set()
                for i in indices:
                    if i in seen or i in free:
                        raise ValueError(f"slot {seg * self.slots_cap + i} is already free")
                    seen.add(i)
            groups.append((seg, indices))
        emptied: list[tuple[int, int]] = []
        emptied_sizes: set[int] = set()
        opened: list[tuple[int, int, list[int]]] = []
        for (seg, indices), first, last in zip(groups, firsts, lasts, strict=True):
            slot_bytes = int(self._seg_slot_bytes[seg])
            cls = self._classes[slot_bytes]
            n = len(indices)
            self._seg_used[seg] -= n
            self._used_bytes -= n * slot_bytes
            self._used_slots -= n
            if self._seg_used[seg] == 0:
                cls.open_segments.pop(seg, None)
                cls.segments.discard(seg)
                self._seg_slot_bytes[seg] = 0
                self._seg_fresh[seg] = 0
                emptied.append((last, seg))
                emptied_sizes.add(slot_bytes)
            elif seg in cls.open_segments:
                cls.open_segments[seg].update(indices)
            else:
                opened.append((first, seg, indices))
        for _, seg, indices in sorted(opened):
            self._classes[int(self._seg_slot_bytes[seg])].open_segments[seg] = set(indices)
        for size in emptied_sizes:
            if not self._classes[size].segments:
                del self._classes[size]
        self._free_segments += [seg for _, seg in sorted(emptied)]

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is currently handed out (or claimed)."""
        seg, index = divmod(slot, self.slots_cap)
        if not 0 <= seg < self.num_segments:
            return False
        slot_bytes = int(self._seg_slot_bytes[seg])
        if slot_bytes == 0 or index >= self._seg_fresh[seg]:
            return False
        free = self._classes[slot_bytes].open_segments.get(seg)
        return free is None or index not in free

    def allocated(self, slots: np.ndarray) -> np.ndarray:
        """``is_allocated`` for many slots: vectorised, but for one set intersection per
        segment that has free slots (a Python step per slot cost 1.8 ms for 4,096)."""
        slots = np.asarray(slots, dtype=np.int64)
        seg, idx = np.divmod(slots, self.slots_cap)
        ok = (slots >= 0) & (seg < self.num_segments)
        segc = np.where(ok, seg, 0)
        ok &= (self._seg_slot_bytes[segc] > 0) & (idx < self._seg_fresh[segc])
        sel = np.flatnonzero(ok)
        segs = segc[sel]
        for s in np.unique(segs).tolist():
            free = self._classes[int(self._seg_slot_bytes[s])].open_segments.get(s)
            if not free:
                continue
            mine = sel[segs == s]
            unallocated = free.intersection(idx[mine].tolist())
            if unallocated:
                gone = np.fromiter(unallocated, np.int64, len(unallocated))
                ok[mine[np.isin(idx[mine], gone)]] = False
        return ok

    def check(self) -> list[str]:
        """The allocator's own invariants (free + used = capacity, per segment and in all);
        a description of each one broken, or nothing."""
        problems = []
        used_bytes = used_slots = 0
        in_classes: set[int] = set()
        for size, cls in self._classes.items():
            for seg in cls.segments:
                in_classes.add(seg)
                if int(self._seg_slot_bytes[seg]) != size:
                    problems.append(
                        f"segment {seg} is in the {size}-byte class but serves {int(self._seg_slot_bytes[seg])}"
                    )
                free = cls.open_segments.get(seg, set())
                fresh, used = int(self._seg_fresh[seg]), int(self._seg_used[seg])
                if used != fresh - len(free) or any(i >= fresh for i in free):
                    problems.append(
                        f"segment {seg}: {used} used, {fresh} handed out, {len(free)} free"
                    )
                used_bytes += used * size
                used_slots += used
        free_segs = set(self._free_segments)
        if len(free_segs) != len(self._free_segments):
            problems.append("a free segment is listed twice")
        if free_segs & in_classes or len(free_segs) + len(in_classes) != self.num_segments:
            problems.append(
                f"{len(free_segs)} free + {len(in_classes)} used segments != {self.num_segments}"
            )
        if (used_bytes, used_slots) != (self._used_bytes, self._used_slots):
            problems.append(
                f"counted {self._used_slots} slots / {self._used_bytes} bytes in use, "
                f"segments hold {used_slots} / {used_bytes}"
            )
        return problems

    # ------------------------------------------------------------------ geometry

    def offset(self, slot: int) -> int:
        seg, index = divmod(slot, self.slots_cap)
        return seg * self.segment_bytes + index * self._seg_slot_bytes.item(seg)

    def offsets(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        if len(slots) == 1:  # one block: Python arithmetic, one array (np.array costs more)
            one = np.empty(1, dtype=np.uint64)
            one[0] = self.offset(int(slots[0]))
            return one
        slots = np.asarray(slots, dtype=np.int64)
        seg, index = np.divmod(slots, self.slots_cap)
        return (seg * self.segment_bytes + index * self._seg_slot_bytes[seg]).astype(np.uint64)

    def slot_sizes(self, slots: np.ndarray) -> np.ndarray:
        """Slot size of each slot id (0 for ids in free segments)."""
        return self._seg_slot_bytes[np.asarray(slots, dtype=np.int64) // self.slots_cap]

    def segment_slot_bytes(self) -> np.ndarray:
        """Each segment's slot size (0 for a free segment), a copy: a slot's size is that of
        its segment, ``slot // slots_cap``."""
        return self._seg_slot_bytes.copy()

    def segments_of(self, slots: np.ndarray) -> np.ndarray:
        return np.asarray(slots, dtype=np.int64) // self.slots_cap

    def segment_used(self, segs: np.ndarray) -> np.ndarray:
        """How many slots of each segment are handed out (0 for a free segment)."""
        return self._seg_used[np.asarray(segs, dtype=np.int64)].copy()

    def slot_size(self, slot: int) -> int:
        return int(self._seg_slot_bytes[slot // self.slots_cap])

    def segment_of(self, slot: int) -> int:
        return slot // self.slots_cap

    # --------------------------------------------------------------------- stats

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def used_slots(self) -> int:
        return self._used_slots

    @property
    def filled_bytes(self) -> int:
        """The capacity that takes no more blocks until slots are freed: the slots in use
        and, in each segment a size holds, the tail too short for another slot of that size
        (5 MiB blocks fill 60 MiB of each 64 MiB segment). A tier with no free slot and no
        free segment is filled to its capacity, whatever ``used_bytes`` says."""
        tails = sum(
            len(c.segments) * (self.segment_bytes % c.slot_bytes) for c in self._classes.values()
        )
        return self._used_bytes + tails

    def stats(self) -> SlabStats:
        return SlabStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self._used_bytes,
            used_slots=self._used_slots,
            free_segments=len(self._free_segments),
            segments=self.num_segments,
            size_classes={
                c.slot_bytes: len(c.segments) for c in self._classes.values() if c.segments
            },
        )


class LockedSlab(SlabAllocator):
    """A SlabAllocator safe to share between threads: the store's thread allocates while a
    worker thread frees (a persistent tier frees slots only once their removal is durable,
    on the thread that made it so)."""

    def __init__(self, capacity_bytes: int, segment_bytes: int, align: int = 4096) -> None:
        super().__init__(capacity_bytes, segment_bytes, align)
        self._lock = threading.Lock()

    def _take(self, nbytes: int, count: int) -> list[int]:
        with self._lock:
            return super()._take(nbytes, count)

    def can_allocate(self, nbytes: int) -> bool:
        with self._lock:
            return super().can_allocate(nbytes)

    @property
    def filled_bytes(self) -> int:
        with self._lock:
            return super().filled_bytes

    def free_slots(self, nbytes: int) -> int:
        with self._lock:
            return super().free_slots(nbytes)

    def claim(self, slot: int, nbytes: int) -> None:
        with self._lock:
            super().claim(slot, nbytes)

    def free(self, slot: int) -> None:
        with self._lock:
            super().free(slot)

    def free_many(self, slots: Sequence[int] | np.ndarray) -> None:
        with self._lock:
            super().free_many(slots)

    def claim_many(self, slots: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        with self._lock:
            return super().claim_many(slots, nbytes)

    def allocated(self, slots: np.ndarray) -> np.ndarray:
        with self._lock:
            return super().allocated(slots)

    def check(self) -> list[str]:
        with self._lock:
            return super().check()

    def stats(self) -> SlabStats:
        with self._lock:
            return super().stats()

    def segment_slot_bytes(self) -> np.ndarray:
        with self._lock:
            return super().segment_slot_bytes()

    def is_allocated(self, slot: int) -> bool:
        with self._lock:
            return super().is_allocated(slot)

    def segment_used(self, segs: np.ndarray) -> np.ndarray:
        with self._lock:
            return super().segment_used(segs)
