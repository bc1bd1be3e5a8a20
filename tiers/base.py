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
    """What every tier offers the store: its kind, its slots, its health, and a close.

    How bytes move is the tier's own: L1 hands out memory views of its slots (the copy
    kernel and L2's ``O_DIRECT`` I/O read and write them in place); L2 moves batches between
    such views and its files (``persist``, ``read``, ``remove``), blocking, off the event loop.
    """

    @property
    def kind(self) -> TierKind: ...

    @property
    def allocator(self) -> SlabAllocator: ...

    def state(self) -> str: ...

    def close(self) -> None: ...
