from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from kvtier.tiers.slab import LockedSlab, SlabAllocator

MiB = 1 << 20


def test_slots_are_aligned_disjoint_and_fill_the_tier():
    alloc = SlabAllocator(8 * MiB, 2 * MiB)
    slots = []
    while (s := alloc.allocate(300_000)) is not None:
        slots.append(s)
    slot_bytes = alloc.slot_bytes_for(300_000)
    assert slot_bytes % 4096 == 0 and slot_bytes >= 300_000
    assert len(slots) == 4 * (2 * MiB // slot_bytes)
    offsets = sorted(alloc.offset(s) for s in slots)
    assert all(o % 4096 == 0 for o in offsets)
    assert all(b - a >= slot_bytes for a, b in itertools.pairwise(offsets))
    assert offsets[-1] + slot_bytes <= alloc.capacity_bytes
    assert alloc.used_bytes == len(slots) * slot_bytes
    assert alloc.offsets(np.array(slots)).tolist() == [alloc.offset(s) for s in slots]


def test_sizes_share_the_tier_by_segment():
    alloc = SlabAllocator(4 * MiB, 1 * MiB)
    small = [alloc.allocate(4096) for _ in range(256)]  # exactly one segment
    big = [alloc.allocate(MiB) for _ in range(3)]
    assert None not in small + big
    assert alloc.allocate(MiB) is None
    assert alloc.allocate(4096) is None
    assert alloc.stats().size_classes == {4096: 1, MiB: 3}
    for s in small:
        alloc.free(s)
    # The emptied segment serves the other size now.
    assert alloc.allocate(MiB) is not None
    assert alloc.stats().free_segments == 0


def test_free_and_reuse_is_lifo_within_a_segment():
    alloc = SlabAllocator(MiB, MiB)
    a, b = alloc.allocate(4096), alloc.allocate(4096)
    alloc.free(a)
    assert alloc.allocate(4096) == a
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(b + 1)
    alloc.free(b)
    with pytest.raises(ValueError):
        alloc.free(b)


def test_claim_rebuilds_state_for_recovery():
    alloc = SlabAllocator(4 * MiB, MiB)
    slot_bytes = 64 * 1024
    target = 2 * alloc.slots_cap + 5  # segment 2, sixth slot
    alloc.claim(target, slot_bytes)
    assert alloc.offset(target) == 2 * MiB + 5 * slot_bytes
    with pytest.raises(ValueError, match="already in use"):
        alloc.claim(target, slot_bytes)
    with pytest.raises(ValueError, match="segment of"):
        alloc.claim(2 * alloc.slots_cap + 1, 4096)
    # Slots skipped over by the claim are free for new blocks of that size.
    got = {alloc.allocate(slot_bytes) for _ in range(5)}
    assert {alloc.segment_of(s) for s in got} == {2}
    assert target not in got


def test_bad_geometry():
    with pytest.raises(ValueError):
        SlabAllocator(MiB, 1000)
    with pytest.raises(ValueError):
        SlabAllocator(1000, 4096 * 4)
    alloc = SlabAllocator(MiB, MiB)
    with pytest.raises(ValueError):
        alloc.allocate(2 * MiB)
    assert not alloc.fits(2 * MiB) and alloc.fits(MiB)


def test_claim_many_of_nothing_claimable_changes_nothing():
    """Regression: a batch with no claimable slot (a recovery chunk whose rows all lie in a
    damaged data file) raised IndexError, which failed the tier's recovery."""
    alloc = SlabAllocator(8 << 20, 1 << 20)
    before = alloc.stats()
    assert alloc.claim_many(np.empty(0, np.int64), np.empty(0, np.int64)).tolist() == []
    refused = alloc.claim_many(np.array([-1, 8 * alloc.slots_cap]), np.array([4096, 4096]))
    assert refused.tolist() == [False, False]
    assert alloc.stats() == before


def test_claim_many_matches_claim_one_by_one():
    rng = np.random.default_rng(3)
    one = SlabAllocator(64 << 20, 1 << 20)
    many = SlabAllocator(64 << 20, 1 << 20)
    sizes = [4096, 10_000, 65_536]
    slots, nbytes = [], []
    for seg in rng.permutation(64)[:40].tolist():
        size = sizes[seg % 3]
        per = (1 << 20) // one.slot_bytes_for(size)
        for i in rng.choice(per, size=min(per, 9), replace=False).tolist():
            slots.append(seg * one.slots_cap + i)
            nbytes.append(size)
    # Refusals: a duplicate, a slot of the wrong size in a segment, out of range, negative.
    slots += [slots[0], slots[1] + 1, 64 * one.slots_cap, -1]
    nbytes += [nbytes[0], 2 << 20, 4096, 4096]
    order = rng.permutation(len(slots))
    slots_arr, nbytes_arr = np.array(slots)[order], np.array(nbytes)[order]
    want = []
    for slot, n in zip(slots_arr.tolist(), nbytes_arr.tolist(), strict=True):
        try:
            one.claim(slot, n)
            want.append(True)
        except ValueError:
            want.append(False)
    got = many.claim_many(slots_arr, nbytes_arr)
    assert got.tolist() == want
    assert many.stats() == one.stats()
    # Both hand out exactly the same free slots afterwards (in their own order), and free
    # the same way.
    for size in sizes:
        a, b = set(), set()
        while (x := many.allocate(size)) is not None:
            a.add(x)
        while (y := one.allocate(size)) is not None:
            b.add(y)
        assert a == b and not a & set(slots_arr[got].tolist())
        for x in a:
            many.free(x)
            one.free(x)
    for slot in slots_arr[got].tolist():
        many.free(slot)
        one.free(slot)
    assert many.stats() == one.stats() and many.used_bytes == 0


def _random_requests(rng: np.random.Generator, rounds: int, most: int) -> list[tuple[int, int]]:
    """(block size, count) of ``rounds`` allocations of mixed sizes."""
    return [
        (int(rng.choice([4096, 12_288, 65_536])), int(rng.integers(1, most))) for _ in range(rounds)
    ]


def test_allocate_many_hands_out_what_one_at_a_time_would():
    """A batch takes the same slots, in the same order, as as many single allocations,
    across freed slots, fresh slots and segment boundaries, and stops where the tier is full."""
    rng = np.random.default_rng(7)
    one, many = SlabAllocator(4 * MiB, 1 * MiB), SlabAllocator(4 * MiB, 1 * MiB)
    held: list[int] = []
    for size, count in _random_requests(rng, 60, 200):
        singles = []
        while len(singles) < count and (s := one.allocate(size)) is not None:
            singles.append(s)
        batch = many.allocate_many(size, count)
        assert batch == singles
        held += batch
        assert one.stats() == many.stats()
        # Free a random half of what is held, in both.
        rng.shuffle(held)
        for s in held[: len(held) // 2]:
            one.free(s)
            many.free(s)
        held = held[len(held) // 2 :]
    assert many.check() == []
    assert many.allocate_many(4096, 0) == []
    with pytest.raises(ValueError):
        many.allocate_many(2 * MiB, 1)


def test_allocated_matches_is_allocated_one_by_one():
    """Across sizes, freed slots, fresh slots, free segments and slots out of range, the
    vectorised ``allocated`` answers what ``is_allocated`` answers for each slot."""
    rng = np.random.default_rng(11)
    slab = SlabAllocator(4 * MiB, 1 * MiB)
    held: list[int] = []
    for size, count in _random_requests(rng, 40, 200):
        held += slab.allocate_many(size, count)
        rng.shuffle(held)
        for s in held[: len(held) // 3]:
            slab.free(s)
        held = held[len(held) // 3 :]
        probe = np.concatenate(
            [
                np.array(held, dtype=np.int64),
                rng.integers(-2, 4 * slab.slots_cap + 2, 300),
            ]
        )
        rng.shuffle(probe)
        expect = [slab.is_allocated(int(s)) for s in probe]
        assert slab.allocated(probe).tolist() == expect
    assert slab.allocated(np.zeros(0, dtype=np.int64)).tolist() == []


def test_free_slots_is_what_allocate_many_would_hand_out():
    """Across sizes, freed slots, fresh slots and free segments, ``free_slots`` counts
    exactly the slots a batch of that size gets before the tier is full."""
    rng = np.random.default_rng(5)
    alloc = SlabAllocator(4 * MiB, 1 * MiB)
    held: list[int] = []
    for size, count in _random_requests(rng, 40, 200):
        held += alloc.allocate_many(size, count)
        rng.shuffle(held)
        for s in held[: len(held) // 3]:
            alloc.free(s)
        held = held[len(held) // 3 :]
        for each in (4096, 12_288, 65_536):
            room = alloc.free_slots(each)
            assert room == len(copy.deepcopy(alloc).allocate_many(each, 10**6)), each
    assert LockedSlab(MiB, MiB).free_slots(4096) == 256


def test_free_many_matches_free_one_by_one_and_refuses_without_freeing():
    """A batch frees what as many single frees would, across sizes and segments (emptying
    some), so both then hand out the same slots; a bad batch frees nothing. (The batch side
    is a LockedSlab: its lock is taken once, around frees that take none.)"""
    rng = np.random.default_rng(11)
    one, many = SlabAllocator(8 * MiB, 1 * MiB), LockedSlab(8 * MiB, 1 * MiB)
    held: list[int] = []
    for size, count in _random_requests(rng, 40, 300):
        got = one.allocate_many(size, count)
        assert many.allocate_many(size, count) == got
        held += got
        rng.shuffle(held)
        batch, held = held[: len(held) // 2], held[len(held) // 2 :]
        for s in batch:
            one.free(s)
        many.free_many(np.array(batch, dtype=np.int64))
        assert many.stats() == one.stats() and many.check() == []
    # Refusals: a slot named twice, one already free, one never handed out, out of range;
    # in a short batch (freed one by one) and a long one (a segment at a time).
    before = many.stats()
    freed = one.allocate(4096)
    one.free(freed)
    assert len(held) > 40
    for live in (held[:5], held[:40]):
        bad_batches = [
            [*live, live[0]],
            [*live, freed],
            [*live, many.num_segments * many.slots_cap - 1],
            [*live, -1],
            [*live, many.num_segments * many.slots_cap],
        ]
        for bad in bad_batches:
            with pytest.raises(ValueError, match=r"not allocated|already free"):
                many.free_many(bad)
            assert many.stats() == before
    many.free_many([])
    many.free_many(held)
    for s in held:
        one.free(s)
    assert many.stats() == one.stats() and many.used_bytes == 0 and many.check() == []


@pytest.mark.parametrize("cls", [SlabAllocator, LockedSlab])
def test_segment_used_counts_the_slots_handed_out_in_each_segment(cls):
    alloc = cls(4 * MiB, 1 * MiB)
    small = alloc.allocate_many(4096, 300)  # one full segment and 44 of the next
    big = alloc.allocate_many(MiB, 1)
    segs = alloc.segments_of(np.array([small[0], small[-1], big[0]]))
    assert alloc.segment_used(segs).tolist() == [256, 44, 1]
    alloc.free_many(small[:10])
    alloc.free(big[0])
    assert alloc.segment_used(segs).tolist() == [246, 44, 0]  # the big one's is free again
    assert alloc.segment_used(np.arange(4)).sum() == alloc.used_slots


@pytest.mark.parametrize("cls", [SlabAllocator, LockedSlab])
def test_filled_bytes_counts_the_tails_no_slot_fits(cls):
    """What the balancer measures against the watermarks: 96 KiB slots fill 960 KiB of a
    1 MiB segment, and a tier with no free slot is filled to its capacity."""
    alloc = cls(4 * MiB, 1 * MiB)
    slot = 96 << 10
    tail = MiB - 10 * slot
    taken = alloc.allocate_many(slot, 40)
    assert len(taken) == 40 and alloc.allocate(slot) is None
    assert (alloc.used_bytes, alloc.filled_bytes) == (40 * slot, alloc.capacity_bytes)
    alloc.free_many(taken[:5])  # from one segment: a free slot there
    assert alloc.filled_bytes == 35 * slot + 4 * tail
    alloc.free_many(taken[5:10])  # that segment is free again, its tail with it
    assert alloc.filled_bytes == 30 * slot + 3 * tail
    small = alloc.allocate_many(4096, 3)  # 4 KiB slots leave no tail
    assert alloc.filled_bytes == 30 * slot + 3 * tail + 3 * 4096 == alloc.used_bytes + 3 * tail
    alloc.free_many(taken[10:] + small)
    assert alloc.filled_bytes == 0 == alloc.used_bytes


@pytest.mark.parametrize("cls", [SlabAllocator, LockedSlab])
def test_sizes_no_segment_serves_are_forgotten(cls):
    """Regression: every block size ever allocated stayed a size class, and ``filled_bytes``
    (each balancer wake) walked them all: up to ``segment_bytes // align`` (16,384 for 64 MiB
    segments). A size is known while a segment serves it, whichever way its last slot goes
    (one free, a batch, a refused allocation, a refused claim)."""
    alloc = cls(4 * MiB, 1 * MiB)
    for k in range(1, 200):
        alloc.free(alloc.allocate_many(k * 4096 // 4, 1)[0])
        alloc.free_many(alloc.allocate_many(k * 4096 + 1, 3))
        alloc.free_many(alloc.allocate_many(4096, 20))  # a batch the array path frees
    kept = alloc.allocate_many(MiB, 4)
    assert alloc.allocate(8192) is None  # no segment left for the size
    alloc.free_many(kept[1:])
    with pytest.raises(ValueError, match="segment of 1048576-byte slots"):
        alloc.claim(kept[0] + 1, 4096)
    assert sorted(alloc._classes) == [MiB] and alloc.filled_bytes == MiB
    assert alloc.check() == []
