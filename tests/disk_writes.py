"""Writing blocks of mixed sizes to a DiskTier the way the daemon does: one ``write`` (a
``WriteBatch`` of host buffers) per block size, outcomes back in the caller's order."""

from __future__ import annotations

from typing import NamedTuple

from kvtier.tiers.base import BlockRef, HostBuffers, Priority, WriteBatch, WriteOutcome
from kvtier.tiers.disk import DiskTier


class PersistItem(NamedTuple):
    """Block ``(ns, key)``: ``data[:nbytes]`` into the allocated ``slot``."""

    ns: int
    key: bytes
    slot: int
    data: bytes | bytearray | memoryview
    nbytes: int


def persist(
    tier: DiskTier, items: list[PersistItem], priority: Priority = Priority.BACKGROUND
) -> list[WriteOutcome]:
    """Write and commit ``items``: one ``write`` per block size, smallest first. An outcome
    ``ok`` means the block is durable and in the index."""
    out: list[WriteOutcome | None] = [None] * len(items)
    for nbytes in sorted({it.nbytes for it in items}):
        at = [i for i, it in enumerate(items) if it.nbytes == nbytes]
        batch = WriteBatch(
            [items[i].slot for i in at],
            [BlockRef(items[i].ns, items[i].key) for i in at],
            nbytes,
            HostBuffers([memoryview(items[i].data).cast("B") for i in at]),
            priority,
        )
        for i, outcome in zip(at, tier.write(batch), strict=True):
            out[i] = outcome
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]
