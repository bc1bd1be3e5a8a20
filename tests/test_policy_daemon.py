"""L2 admission and the heat policy's split in a running daemon. (Protection, warm-up and watermarks run on an injected
clock in tests/daemon/test_store.py: no test waits out a period on the wall clock.)"""

from __future__ import annotations

import numpy as np
from races import wait_for

from kvtier.client import PoolLayout, PutStatus, SharedMemoryPool, Tier

BLOCK = 64 * 1024
LAYOUT = PoolLayout.staging(
    num_layers=1, num_pages=32, block_tokens=16, chunk_bytes=BLOCK, kv_count=1, dtype="uint8"
)


def keys(n: int, tag: int) -> list[bytes]:
    rng = np.random.default_rng(tag)
    return [rng.bytes(32) for _ in range(n)]


def l2(tmp_path, *extra: str) -> tuple[str, ...]:
    return (
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / 'l2'}",
        "tiers.l2.capacity_bytes=16MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=16MiB",
        *extra,
    )


def test_selective_writes_only_blocks_seen_twice(daemon_factory, tmp_path):
    d = daemon_factory(*l2(tmp_path, "tiers.l2.write_policy=selective"))
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        ks = keys(4, 5)
        client.put(pool.pool_id, ks, range(4))
        client.lookup(ks[:2])  # a second access of the first two
        wait_for(lambda: client.stats().counters.get("l2_committed_blocks", 0) == 2)
        counters = client.stats().counters
        assert counters["l2_committed_blocks"] == 2
        assert client.stats().counter("admission", tier="L2", reason="first_seen") >= 2


def test_an_l1_full_of_blocks_read_again_leaves_new_blocks_one_slot(daemon_factory):
    """Not a fault (README, `heat`): a 1 MiB L1 of 64 KiB blocks holds 16 of them, and 16 new
    ones take their place; but once the 16 were read again, the new blocks (seen once) get
    one slot between them, each evicting the one before, as ARC's split starts with no share
    for blocks seen once. A debug run saw this as an L1 of about one free block."""
    d = daemon_factory("tiers.l1.segment_bytes=1MiB", "policy.protect_s=0", l1_bytes="1MiB")
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        old, new, newer = keys(16, 6), keys(16, 7), keys(16, 8)
        assert client.put(pool.pool_id, old, range(16)).statuses == [PutStatus.STORED] * 16
        assert client.put(pool.pool_id, new, range(16)).statuses == [PutStatus.STORED] * 16
        assert client.lookup(old).tiers == [Tier.ABSENT] * 16  # seen once: replaced
        assert client.lookup(new).tiers == [Tier.L1_HOST] * 16  # now seen again
        for p, key in enumerate(newer):
            assert client.put(pool.pool_id, [key], [p]).statuses == [PutStatus.STORED]
        assert client.lookup(newer).tiers == [Tier.ABSENT] * 15 + [Tier.L1_HOST]
        assert client.lookup(new).tiers.count(Tier.L1_HOST) == 15  # one made the first room
