"""Kept histories: a policy's per-block history of dropped blocks, by memento slot.

The block table frees a dropped block's row at once but remembers its key a while by a
*memento slot* (``kvtier.daemon.table``, History). A policy whose history is per row
(``heat``, ``density``) copies the few per-row values that make up that history into a
``Kept`` at the slot (``remember``), writes them into the block's new row when its key
returns (``revive``) and forgets them when the table does (``expire``). Only those values are
kept, a few tens of bytes a block, where keeping the row held every per-block array;
sequence numbers in half their width (``seq_keep``).

Not thread-safe: owned by a policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from kvtier.daemon.table import slots_for

V = TypeVar("V")

# A policy's sequence numbers (counts of its accesses or evictions: they only grow, and a
# kept one is compared with the count of the day) are kept as their residue modulo
# ``SEQ_MOD`` plus one in a uint32, 0 meaning none: half the bytes of an int64, and read back
# exact while fewer than ``SEQ_MOD`` (four billion) counts pass in one memento's life.
SEQ_MOD = (1 << 32) - 1


def seq_keep(seq: int) -> int:
    """``seq`` (>= 0) as kept in a uint32 field (``seq_back`` reads it back)."""
    return seq % SEQ_MOD + 1


def seq_back(kept: int, count: int) -> int:
    """The sequence number ``seq_keep`` kept as ``kept`` (not 0), given the count it was
    taken from now stands at ``count``: the latest number not above ``count`` with that
    residue."""
    return count - (count - kept + 1) % SEQ_MOD


def seq_ages(kept: np.ndarray, count: int) -> np.ndarray:
    """``count - seq_back(k, count)`` for each of ``kept`` (none 0), vectorised."""
    return (count - kept.astype(np.int64) + 1) % SEQ_MOD


class Kept:
    """Per slot, one value of each named field; a slot never written holds each field's
    fill. Arrays grow as the table's (``slots_for``) to the highest slot written, and are
    sized as the table's again at each renumbering (``renumber``)."""

    __slots__ = ("_fills", "arrays", "fields", "views")

    def __init__(self, fields: Sequence[tuple[str, Any, float]]) -> None:
        self.fields = [name for name, _, _ in fields]
        self._fills = {name: (dtype, fill) for name, dtype, fill in fields}
        self.arrays: dict[str, np.ndarray] = {
            name: np.full(0, fill, dtype=dtype) for name, dtype, fill in fields
        }
        # Per-slot access through memoryviews: Python scalars at a fraction of the cost of
        # numpy's scalar indexing (re-taken when the arrays grow).
        self.views: dict[str, Any] = {name: a.data for name, a in self.arrays.items()}

    def __deepcopy__(self, memo: dict[int, Any]) -> Kept:
        """A copy with its own arrays (memoryviews do not copy): policies are cloned whole
        to compare their decisions."""
        other = Kept([(name, dtype, fill) for name, (dtype, fill) in self._fills.items()])
        other.arrays = {name: a.copy() for name, a in self.arrays.items()}
        other.views = {name: a.data for name, a in other.arrays.items()}
        return other

    def __len__(self) -> int:
        return len(self.arrays[self.fields[0]])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def fit(self, slot: int) -> None:
        """Room for ``slot``."""
        size = len(self)
        if slot < size:
            return
        grown = slots_for(max(slot + 1, size + 1))
        for name, (dtype, fill) in self._fills.items():
            arr = np.full(grown, fill, dtype=dtype)
            arr[:size] = self.arrays[name]
            self.arrays[name] = arr
            self.views[name] = arr.data

    def renumber(self, order: np.ndarray) -> None:
        """The table renumbered its slots (``Mementos.compact``): new slot ``i`` holds
        what old slot ``order[i]`` held; the arrays shrink as the table's."""
        n, size = len(order), len(self)
        known = order < size
        for name, (dtype, fill) in self._fills.items():
            arr = np.full(slots_for(n), fill, dtype=dtype)
            arr[:n][known] = self.arrays[name][order[known]]
            self.arrays[name] = arr
            self.views[name] = arr.data

    def clear(self, slot: int) -> None:
        """``slot`` holds each field's fill (a row the policy never knew)."""
        for name, (_, fill) in self._fills.items():
            self.views[name][slot] = fill


def renumbered(kept: dict[int, V], order: np.ndarray) -> dict[int, V]:
    """``kept`` (values by memento slot) as the table renumbered its slots (``new slot i``:
    old slot ``order[i]``). The few slots a policy keeps in a dict (hints) are looked up
    in the inverse of ``order``."""
    if not kept:
        return kept
    old = np.fromiter(kept, np.int64, len(kept))
    new = np.searchsorted(order, old)  # ``order`` is ascending (``Mementos.compact``)
    held = (new < len(order)) & (order[np.minimum(new, len(order) - 1)] == old)
    values = list(kept.values())
    return {int(n): values[i] for i, n in enumerate(new.tolist()) if held[i]}
