"""Child process of the L2 crash test: writes blocks through DiskTier until it is killed.

Prints ``C <id>`` once block ``id`` is committed (its data durable, its row durable) and
``D <id>`` before it starts removing block ``id`` to make room, so the parent knows exactly
which blocks must survive a SIGKILL: every C not followed by a D. Block contents are the
same functions of the id as in conftest.py, so the parent can check them byte for byte.

Usage: crash_writer.py DIRECTORY CAPACITY_BYTES SEGMENT_BYTES
"""

from __future__ import annotations

import hashlib
import sys
from collections import deque

import numpy as np

from kvtier.tiers.disk import CommitEntry, DiskTier, WriteItem

SIZES = (16_384, 100_000, 262_144)
BATCH = 8


def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def block_data(i: int, nbytes: int) -> bytes:
    return np.random.default_rng(i).bytes(nbytes)


def main() -> None:
    directory, capacity, segment = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = DiskTier(directory, capacity, segment, file_bytes=segment * 4)
    live: deque[tuple[int, int]] = deque()  # (id, slot), oldest first
    i = 0
    while True:
        batch = []
        for _ in range(BATCH):
            nbytes = SIZES[i % len(SIZES)]
            slot = tier.allocator.allocate(nbytes)
            while slot is None:
                victims = [live.popleft() for _ in range(min(BATCH, len(live)))]
                for vid, _ in victims:
                    print(f"D {vid}", flush=True)
                if not tier.remove([s for _, s in victims]):
                    raise SystemExit(f"remove failed: {tier.health()}")
                slot = tier.allocator.allocate(nbytes)
            batch.append((i, slot, nbytes))
            i += 1
        outcomes = tier.write_items([WriteItem(s, block_data(b, n), n) for b, s, n in batch])
        if not all(o.ok for o in outcomes):
            raise SystemExit(f"write failed: {tier.health()}")
        if not tier.commit([CommitEntry(1, block_key(b), s) for b, s, _ in batch]):
            raise SystemExit(f"commit failed: {tier.health()}")
        for b, s, _ in batch:
            print(f"C {b}", flush=True)
            live.append((b, s))


if __name__ == "__main__":
    main()
