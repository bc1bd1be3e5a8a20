"""The eviction-policy plug point.

A policy orders the blocks resident in one tier and proposes victims. It is pure decision
code: it never touches bytes or I/O, and it takes ``now`` as an argument instead of reading a
clock, so the daemon and the offline trace replayer run the very same objects.

Whether a block *may* go (pinned by a lease, in flight, inside its protection period, of the
wrong slot size) is not the policy's business: the caller passes an ``evictable`` mask
function and the policy only ranks. ``victims`` is atomic: it proposes exactly ``n`` blocks or
none, and changes nothing; the caller then ``remove``s the ones it actually evicted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

EvictableFn = Callable[[np.ndarray], np.ndarray]
"""Maps an int64 array of block ids to a bool array: may each block be evicted now?"""


class EvictionPolicy(Protocol):
    def insert(self, bid: int, now: float, parent: int = -1) -> None:
        """A block became resident in this tier; ``parent`` is its chain predecessor or -1."""

    def touch(self, bid: int, now: float) -> None:
        """A resident block was read or written again."""

    def remove(self, bid: int) -> None:
        """A block left this tier (evicted, demoted, deleted). Unknown ids raise KeyError."""

    def victims(self, n: int, now: float, evictable: EvictableFn) -> np.ndarray | None:
        """Exactly ``n`` evictable resident blocks, coldest first, or None if fewer exist."""

    def __len__(self) -> int: ...

    def __contains__(self, bid: object) -> bool: ...
