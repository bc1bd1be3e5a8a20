"""Child process of the L2 crash test: writes blocks through DiskTier until it is killed.

Prints ``C <id>`` once block ``id`` is committed (its data durable, its row durable) and
``D <id>`` before it starts removing block ``id`` to make room, so the parent knows exactly
which blocks must survive a SIGKILL: every C not followed by a D. Block contents are the
same functions of the id as in conftest.py, so the parent can check them byte for byte.

It writes as the store does, ``write`` batches of ``BlockRefs``, from two threads at once
(their syncs and commits shared by the group commit).

Usage: crash_writer.py DIRECTORY CAPACITY_BYTES SEGMENT_BYTES
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import deque

import numpy as np

from kvtier.tiers.base import BlockRefs, HostBuffers, WriteBatch
from kvtier.tiers.disk import DiskTier

SIZES = (16_384, 100_000, 262_144)
BATCH = 8


def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def block_data(i: int, nbytes: int) -> bytes:
    return np.random.default_rng(i).bytes(nbytes)


def main() -> None:
    directory, capacity, segment = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = DiskTier(directory, capacity, segment, file_bytes=segment * 4)
    lock = threading.Lock()
    for start in (0, 1):
        threading.Thread(target=write, args=(tier, start, 2, lock)).start()


def write(tier: DiskTier, first: int, step: int, lock: threading.Lock) -> None:
    """Write blocks ``first``, ``first + step``, ... until killed, removing the oldest to
    make room."""
    try:
        live: deque[tuple[int, int]] = deque()  # (id, slot), oldest first
        i = first
        while True:
            batch = []
            for _ in range(BATCH):
                nbytes = SIZES[i % len(SIZES)]
                slot = tier.allocator.allocate(nbytes)
                while slot is None:
                    victims = [live.popleft() for _ in range(min(BATCH, len(live)))]
                    with lock:
                        for vid, _ in victims:
                            print(f"D {vid}", flush=True)
                    if not tier.remove([s for _, s in victims]):
                        raise RuntimeError(f"remove failed: {tier.health()}")
                    slot = tier.allocator.allocate(nbytes)
                batch.append((i, slot, nbytes))
                i += step
            commit(tier, batch)
            with lock:
                for b, s, _ in batch:
                    print(f"C {b}", flush=True)
                    live.append((b, s))
    except BaseException as e:
        print(f"writer failed: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)


def commit(tier: DiskTier, batch: list[tuple[int, int, int]]) -> None:
    for nbytes in SIZES:
        group = [(b, s) for b, s, n in batch if n == nbytes]
        if not group:
            continue
        ids = [b for b, _ in group]
        keys = np.frombuffer(b"".join(map(block_key, ids)), dtype=np.uint8).reshape(-1, 32)
        refs = BlockRefs(np.ones(len(ids), dtype=np.uint64), keys)
        views = HostBuffers([memoryview(block_data(b, nbytes)) for b in ids])
        outcomes = tier.write(WriteBatch([s for _, s in group], refs, nbytes, views))
        if not all(o.ok for o in outcomes):
            raise RuntimeError(f"write failed: {tier.health()}")


if __name__ == "__main__":
    main()
