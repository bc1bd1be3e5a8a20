"""Why a key is not in the store: a bounded memory of the keys that left it or were refused.

A lookup that misses says only "absent"; operators want to know whether the cache was too
small (the block was **evicted** from its last tier), the store refused it (**declined**: no
room, or no tier's admission rule took it), or it was simply never stored (**absent**, which
also covers deleted keys and keys forgotten since). The store records the first two as they
happen and asks ``classify`` for the keys a lookup missed. Of those it calls absent, the
keys that a key-addressed tier (L3) could not be asked about (down, or the block's cluster
master lost) are **unreachable**: the store's own judgement at the lookup, never recorded
here.

The memory is a fixed table allocated (and touched) once: ``capacity`` entries in 4-way
buckets chosen by a salted hash of the key, the oldest entry of a full bucket forgotten
first. So a miss long after the event reads "absent": the counts are a lower bound for
evicted and declined. Its size never changes while the daemon runs (about 13 bytes per
entry; a dict of Python ints took ten times that and grew with every eviction until full).
Keys are block identities (``BlockTable.identities``: a salted hash of the namespace and the
whole key), as admission uses too, so one tenant's keys never read as another's.

Thread-safety: none; owned by the event loop.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import numpy as np

EVICTED = "evicted"
DECLINED = "declined"
ABSENT = "absent"
UNREACHABLE = "unreachable"  # the store's, at a lookup (see the module docstring)
REASONS = (ABSENT, EVICTED, DECLINED, UNREACHABLE)
_CLASSES = (ABSENT, EVICTED, DECLINED)  # what ``classify`` tells

DEFAULT_CAPACITY = 1 << 18
_WAYS = 4
# Up to this many keys, discard works key by key (a numpy pass costs more for few keys).
_SCALAR_MAX = 64
_CODES = {EVICTED: 1, DECLINED: 2}
_NAMES = {1: EVICTED, 2: DECLINED}
_MASK64 = (1 << 64) - 1


class MissLedger:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        # Whole buckets, a power of two of them (at least two), holding at least ``capacity``.
        buckets = 1 << max(1, (-(-capacity // _WAYS) - 1).bit_length())
        self.capacity = buckets * _WAYS
        self._shift = 64 - (buckets.bit_length() - 1)
        self._mult = secrets.randbits(64) | 1
        # np.full writes every page now: the table's memory is all resident from the start.
        self._keys = np.full(self.capacity, 0, dtype=np.uint64)
        self._why = np.full(self.capacity, 0, dtype=np.uint8)  # 0: empty
        self._stamp = np.full(self.capacity, 0, dtype=np.uint32)
        self._keys_v = self._keys.data  # scalar access without numpy's per-item cost
        self._why_v = self._why.data
        self._stamp_v = self._stamp.data
        self._clock = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _bucket(self, key: int) -> int:
        # Multiply-shift by a secret odd multiplier: keys are hash outputs already, and a
        # client cannot aim its keys at one bucket without knowing the multiplier.
        return (((key * self._mult) & _MASK64) >> self._shift) * _WAYS

    def _buckets(self, keys: np.ndarray) -> np.ndarray:
        """``_bucket`` for many keys, vectorised (the same arithmetic modulo 2**64)."""
        with np.errstate(over="ignore"):
            h = (keys * np.uint64(self._mult)) >> np.uint64(self._shift)
        return h.astype(np.int64) * _WAYS

    def record(self, keys: Iterable[int], reason: str) -> None:
        code = _CODES[reason]
        keys_v, why_v, stamp_v = self._keys_v, self._why_v, self._stamp_v
        for key in keys:
            base = self._bucket(key)
            self._clock = clock = (self._clock + 1) & 0xFFFFFFFF
            slot = empty = -1
            for i in range(base, base + _WAYS):
                if why_v[i]:
                    if keys_v[i] == key:
                        slot = i
                        break
                elif empty < 0:
                    empty = i
            if slot < 0:
                if empty >= 0:
                    slot = empty
                    self._count += 1
                else:  # the bucket is full: its oldest entry goes
                    slot = max(
                        range(base, base + _WAYS),
                        key=lambda i: (clock - stamp_v[i]) & 0xFFFFFFFF,
                    )
                keys_v[slot] = key
            why_v[slot] = code
            stamp_v[slot] = clock

    def _find(self, keys: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """(the keys as an array, the slot holding each or -1)."""
        arr = np.fromiter(keys, dtype=np.uint64)
        if self._count == 0 or len(arr) == 0:
            return arr, np.full(len(arr), -1, dtype=np.int64)
        slots = self._buckets(arr)[:, None] + np.arange(_WAYS)
        hit = (self._keys[slots] == arr[:, None]) & (self._why[slots] > 0)
        found = hit.any(axis=1)
        out = np.full(len(arr), -1, dtype=np.int64)
        out[found] = slots[found, hit[found].argmax(axis=1)]
        return arr, out

    def discard(self, keys: Iterable[int]) -> None:
        """The keys are stored again (or deleted on purpose): forget why they were missing."""
        if not self._count:
            return
        keys = keys if isinstance(keys, list) else list(keys)
        if len(keys) > _SCALAR_MAX:
            _, slots = self._find(keys)
            slots = np.unique(slots[slots >= 0])
            self._why[slots] = 0
            self._count -= len(slots)
            return
        for key in keys:  # a put's few keys: cheaper one by one than as arrays
            if (i := self._slot(key)) >= 0:
                self._why_v[i] = 0
                self._count -= 1

    def _slot(self, key: int) -> int:
        """The slot holding ``key`` (-1: none), probed in Python: for a few keys."""
        keys_v, why_v = self._keys_v, self._why_v
        base = self._bucket(key)
        for i in range(base, base + _WAYS):
            if why_v[i] and keys_v[i] == key:
                return i
        return -1

    def classify(self, keys: Iterable[int]) -> dict[str, int]:
        """How many of ``keys`` (all missing) are missing for each reason."""
        keys = keys if isinstance(keys, list) else list(keys)
        if not self._count:
            return {ABSENT: len(keys), EVICTED: 0, DECLINED: 0}
        if len(keys) <= _SCALAR_MAX:
            # A lookup's few missed keys: bucket by bucket, as discard does (numpy's unique
            # and fancy indexing cost more than the probes for few keys).
            out = dict.fromkeys(_CLASSES, 0)
            for key in keys:
                i = self._slot(key)
                out[_NAMES[self._why_v[i]] if i >= 0 else ABSENT] += 1
            return out
        arr, slots = self._find(keys)
        out = dict.fromkeys(_CLASSES, 0)
        known = slots[slots >= 0]
        codes, counts = np.unique(self._why[known], return_counts=True)
        for code, n in zip(codes.tolist(), counts.tolist(), strict=True):
            out[_NAMES[code]] += n
        out[ABSENT] += len(arr) - len(known)
        return out
