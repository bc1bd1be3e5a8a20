"""Eviction rules in a running daemon: protection, warm-up and L2 admission."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.client import PoolLayout, PutStatus, SharedMemoryPool, Tier

BLOCK = 64 * 1024
LAYOUT = PoolLayout.staging(
    num_layers=1, num_pages=32, block_tokens=16, chunk_bytes=BLOCK, kv_count=1, dtype="uint8"
)


def keys(n: int, tag: int) -> list[bytes]:
    rng = np.random.default_rng(tag)
    return [rng.bytes(32) for _ in range(n)]


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.mark.parametrize("protect_s, survivor", [(1.0, "fresh"), (0.0, "old")])
def test_a_protected_block_survives_pressure_that_evicts_an_unprotected_one(
    daemon_factory, protect_s, survivor
):
    """`old` is hot (read again and again) but past its protection period; `fresh` was just
    written, so it is cold but protected. Under pressure the policy would drop the cold block;
    protection makes it drop the hot one instead. Without protection (0 s) the cold one goes."""
    d = daemon_factory(
        "tiers.l1.segment_bytes=1MiB", f"policy.protect_s={protect_s}", l1_bytes="1MiB"
    )
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        fillers, old, fresh = keys(14, 1), keys(1, 2), keys(1, 3)
        client.put(pool.pool_id, fillers + old, range(15))
        for _ in range(5):
            client.lookup(old)
        lease = client.lookup(fillers, pin=True, lease_ms=60_000).lease_id  # out of the game
        time.sleep(1.2)  # `old` is past its protection period now
        client.put(pool.pool_id, fresh, [15])  # the tier is full now
        res = client.put(pool.pool_id, keys(1, 4), [16])
        assert res.statuses == [PutStatus.STORED]
        present = {"old": client.lookup(old).prefix_len, "fresh": client.lookup(fresh).prefix_len}
        assert present == {"old": int(survivor == "old"), "fresh": int(survivor == "fresh")}
        client.release(lease)


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
        time.sleep(0.3)
        counters = client.stats().counters
        assert counters["l2_committed_blocks"] == 2
        assert client.stats().counter("admission", tier="L2", reason="first_seen") >= 2


def test_warm_up_holds_watermark_demotion_until_the_hard_limit(daemon_factory, tmp_path):
    marks = (
        "tiers.l1.segment_bytes=1MiB",
        "tiers.l1.high_watermark=0.5",
        "tiers.l1.low_watermark=0.25",
        "policy.protect_s=0",
    )

    def fill_and_count(warmup_s: float) -> tuple[int, list[Tier]]:
        d = daemon_factory(
            *marks, *l2(tmp_path / str(warmup_s)), f"policy.warmup_s={warmup_s}", l1_bytes="1MiB"
        )
        with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
            pool = client.register_pool(shm, LAYOUT)
            ks = keys(12, 6)  # 75% of L1
            client.put(pool.pool_id, ks, range(12))
            time.sleep(0.5)  # several balancer rounds
            return client.stats().counter("watermark_evictions", tier="L1"), client.lookup(ks).tiers

    demoted, tiers = fill_and_count(0.0)
    assert demoted > 0 and Tier.L2_DISK in tiers
    demoted, tiers = fill_and_count(3600.0)
    assert demoted == 0 and tiers == [Tier.L1_HOST] * 12
