"""What every tier is: a medium with slots that holds block bytes. No policy lives here.

A tier never decides what to keep; the store asks it for a slot, moves bytes in and out, and
frees the slot. Tier numbers match the wire enum ``kvtier.v1.Tier``.
"""

from __future__ import annotations

import enum
from typing import Protocol

from kvtier.tiers.slab import SlabAllocator


class TierKind(enum.IntEnum):
    GPU = 1
    HOST = 2
    DISK = 3
    REMOTE = 4

    @property
    def label(self) -> str:
        return {1: "L0", 2: "L1", 3: "L2", 4: "L3"}[self.value]


class TierError(Exception):
    """A tier could not move bytes (I/O error, corrupt data). Callers treat it as a miss."""


class TierUnavailable(TierError):
    """A tier cannot start: its medium cannot hold the configured capacity, or is in use by
    another process. Raised only by a tier's constructor; the daemon reports it and stops
    rather than running without the tier it was configured with."""


class BlockTier(Protocol):
    """A tier's mechanism: slots, and copies between a slot and a caller's buffer.

    ``write`` and ``read`` may block (disk I/O) and are called off the event loop; they move
    ``nbytes`` bytes between the slot and a buffer that holds at least that many.
    """

    kind: TierKind
    allocator: SlabAllocator

    def write(self, slot: int, data: memoryview, nbytes: int) -> None: ...

    def read(self, slot: int, out: memoryview, nbytes: int) -> None: ...

    def state(self) -> str: ...

    def close(self) -> None: ...
