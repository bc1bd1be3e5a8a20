"""The batch vocabulary of ``tiers/base.py`` as sequences: ``BlockRefs`` and ``WriteOutcomes``
hold arrays and must read exactly as the lists of ``BlockRef`` and ``WriteOutcome`` that
callers and tiers took before (indexing, negative indexes, slices, iteration, equality)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.tiers.base import BlockRef, BlockRefs, WriteOutcome, WriteOutcomes, ref_columns

NS = [1, 2, (1 << 63) + 3, (1 << 64) - 1, 0]


def _keys(n: int) -> np.ndarray:
    """Keys that end in zero bytes: a fixed-width bytes dtype would drop those."""
    keys = np.zeros((n, 32), dtype=np.uint8)
    keys[:, 0] = np.arange(1, n + 1)
    return keys


@pytest.mark.parametrize(
    "as_given",
    [
        lambda k: k,  # (n, 32) bytes, as the disk tier's recovery has them
        lambda k: k.view(np.uint64),  # (n, 4) words, as the block table has them
        lambda k: k.view("S32").reshape(-1),  # one fixed-width bytes item per key
    ],
    ids=["uint8_rows", "uint64_words", "fixed_width_bytes"],
)
def test_block_refs_read_as_the_list_of_their_refs(as_given: object) -> None:
    keys = _keys(len(NS))
    refs = BlockRefs(np.array(NS, dtype=np.uint64), as_given(keys))  # type: ignore[operator]
    listed = [BlockRef(ns, keys[j].tobytes()) for j, ns in enumerate(NS)]
    assert len(refs) == len(listed)
    assert list(refs) == listed and refs == listed and listed == refs
    assert [refs[i] for i in range(-len(NS), len(NS))] == listed + listed
    for part in (slice(1, 3), slice(None, None, -1), slice(None, None, 2), slice(7, 9)):
        assert list(refs[part]) == listed[part]
    assert refs.key_bytes(np.array([3, 0])) == [listed[3].key, listed[0].key]
    ns, key_bytes = ref_columns(refs, np.array([3, 0]))
    assert ns.dtype == np.uint64 and ns.tolist() == [NS[3], NS[0]]
    assert key_bytes == [listed[3].key, listed[0].key]
    assert ref_columns(listed, np.array([3, 0]))[0].tolist() == ns.tolist()
    with pytest.raises(IndexError):
        refs[len(NS)]


def test_empty_block_refs_and_outcomes_are_empty_sequences() -> None:
    refs = BlockRefs(np.zeros(0, dtype=np.uint64), np.zeros((0, 32), dtype=np.uint8))
    assert len(refs) == 0 and not refs and list(refs) == [] and refs.key_bytes() == []
    outs = WriteOutcomes.of([])
    assert len(outs) == 0 and not outs and list(outs) == []
    # Equal to the empty list they stand for, not to every empty sequence.
    assert refs == [] and outs == () and refs != "" and outs != "" and outs != range(0)


def test_write_outcomes_read_as_the_list_of_their_outcomes() -> None:
    listed = [
        WriteOutcome(3, True, (1 << 64) - 1),
        WriteOutcome(4, False, 0),
        WriteOutcome(5, True, 9),
    ]
    outs = WriteOutcomes(
        np.array([3, 4, 5]),
        np.array([True, False, True]),
        np.array([(1 << 64) - 1, 77, 9], dtype=np.uint64),
    )
    # A failed block's checksum reads as 0, whatever the tier computed for it.
    assert outs == listed and list(outs) == listed and WriteOutcomes.of(listed) == listed
    assert [outs[i] for i in range(-3, 3)] == listed + listed
    assert list(outs[1:]) == listed[1:] and list(outs[::-1]) == listed[::-1]
    assert all(type(o.ok) is bool and type(o.slot) is int for o in outs)
    assert all(type(outs[i].ok) is bool and type(outs[i].checksum) is int for i in range(3))


def test_all_stored_outcomes_are_those_of_every_block_stored_without_a_checksum() -> None:
    slots = np.array([7, 2, 9], dtype=np.int64)
    built = WriteOutcomes(slots, np.ones(3, dtype=bool), np.zeros(3, dtype=np.uint64))
    outs = WriteOutcomes.all_stored(slots)
    assert (
        outs
        == built
        == [WriteOutcome(7, True, 0), WriteOutcome(2, True, 0), WriteOutcome(9, True, 0)]
    )
    assert outs.slots.dtype == np.int64 and outs.ok.dtype == bool
    assert outs.checksums.dtype == np.uint64
    assert len(WriteOutcomes.all_stored(slots[:0])) == 0
    # One block's (every single-block put's): the same, its columns shared and read-only.
    one = WriteOutcomes.all_stored(slots[1:2])
    assert one == [WriteOutcome(2, True, 0)] and one.ok.dtype == bool
    assert one.checksums.dtype == np.uint64
    assert WriteOutcomes.all_stored(slots[2:]).ok is one.ok
    with pytest.raises(ValueError, match="read-only"):
        one.ok[0] = False
