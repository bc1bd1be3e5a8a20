"""Why a key is not in the store: a bounded memory of the keys that left it or were refused.

A lookup that misses says only "absent"; operators want to know whether the cache was too
small (the block was **evicted** from its last tier), the store refused it (**declined**: no
room, or no tier's admission rule took it), or it was simply never stored (**absent**, which
also covers deleted keys and keys forgotten since). The store records the first two as they
happen and asks ``classify`` for the keys a lookup missed.

The memory is bounded (``capacity`` keys, oldest forgotten first), so a miss long after the
event reads "absent": the counts are a lower bound for evicted and declined. Keys are the
first 64 bits of a block key (``table.keys[:, 0]``), the stable identity admission uses too.

Thread-safety: none; owned by the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

EVICTED = "evicted"
DECLINED = "declined"
ABSENT = "absent"
REASONS = (ABSENT, EVICTED, DECLINED)

DEFAULT_CAPACITY = 1 << 18


class MissLedger:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._why: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._why)

    def record(self, keys: Iterable[int], reason: str) -> None:
        why = self._why
        for key in keys:
            why[key] = reason
            why.move_to_end(key)
        while len(why) > self.capacity:
            why.popitem(last=False)

    def discard(self, keys: Iterable[int]) -> None:
        """The keys are stored again (or deleted on purpose): forget why they were missing."""
        if self._why:
            for key in keys:
                self._why.pop(key, None)

    def classify(self, keys: Iterable[int]) -> dict[str, int]:
        """How many of ``keys`` (all missing) are missing for each reason."""
        out = dict.fromkeys(REASONS, 0)
        why = self._why
        for key in keys:
            out[why.get(key, ABSENT)] += 1
        return out
