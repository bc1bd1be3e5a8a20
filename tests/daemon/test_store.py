"""The store in process, with an injected clock: eviction order, pins, protection, chains."""

from __future__ import annotations

import asyncio
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.index import keys_to_words
from kvtier.daemon.pools import Pool
from kvtier.daemon.store import BlockStore, PutResult
from kvtier.kernels.layout import PoolLayout
from kvtier.tiers.host import HostArena

SEG = 64 * 1024
# Rules that hold whatever the ranking: every live policy must obey them.
POLICIES = ["lru", "heat", "arc"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(
    clock: Clock, *, segments: int = 1, protect_s: float = 0.0, policy: str = "lru"
) -> BlockStore:
    config = load_config(None, [f"policy.protect_s={protect_s}", f"policy.name={policy}"])
    host = HostArena(segments * SEG, SEG)
    return BlockStore(config, ThreadPoolExecutor(2), clock=clock, host=host)


def make_pool(block_bytes: int = 4096, pages: int = 64) -> Pool:
    layout = PoolLayout.staging(
        num_layers=1, num_pages=pages, block_tokens=1, chunk_bytes=block_bytes, kv_count=1
    )
    buf = mmap.mmap(-1, layout.extent_bytes)
    pool = Pool(1, "s", "test", layout, buf)
    pool.array[:] = np.random.default_rng(0).integers(0, 256, len(pool.array), dtype=np.uint8)
    return pool


def keys(n: int) -> np.ndarray:
    return keys_to_words([os.urandom(32) for _ in range(n)])


def put(store, pool, words, pages=None, parent=None):
    pages = np.arange(len(words)) if pages is None else np.asarray(pages)
    return asyncio.run(store.put(pool, 0, words, pages % pool.layout.num_pages, parent))[0].tolist()


def present(store, words) -> list[bool]:
    return (store.index.lookup(0, words) >= 0).tolist()


def test_full_tier_evicts_least_recently_used():
    clock = Clock()
    store, pool = make_store(clock), make_pool()
    a, b = keys(8), keys(8)  # 16 slots of 4 KiB in one 64 KiB segment
    put(store, pool, a)
    clock.now += 1
    put(store, pool, b)
    clock.now += 1
    store.lookup(0, a[:2])  # touch: a[0], a[1] become most recent
    clock.now += 1
    c = keys(4)
    assert put(store, pool, c) == [PutResult.STORED] * 4
    assert present(store, a) == [True, True] + [False] * 4 + [True, True]
    assert all(present(store, b)) and all(present(store, c))
    assert store.counters["l1_evictions"] == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_blocks_are_never_evicted(policy):
    clock = Clock()
    store, pool = make_store(clock, policy=policy), make_pool()
    a = keys(16)
    put(store, pool, a)
    ids = store.index.lookup(0, a)
    store.pin(ids)
    clock.now += 100
    assert put(store, pool, keys(2)) == [PutResult.REJECTED_FULL] * 2
    assert all(present(store, a))
    store.unpin(ids)
    assert put(store, pool, keys(2)) == [PutResult.STORED] * 2
    with pytest.raises(AssertionError, match="below zero"):
        store.unpin(ids[:1])


@pytest.mark.parametrize("policy", POLICIES)
def test_protected_blocks_survive_until_their_period_ends(policy):
    clock = Clock()
    store, pool = make_store(clock, policy=policy, protect_s=5.0), make_pool()
    a = keys(16)
    put(store, pool, a)
    clock.now += 4.9
    assert put(store, pool, keys(1)) == [PutResult.REJECTED_FULL]
    clock.now += 0.2
    assert put(store, pool, keys(1)) == [PutResult.STORED]
    assert sum(present(store, a)) == 15


@pytest.mark.parametrize("policy", POLICIES)
def test_a_chain_that_does_not_fit_keeps_its_head(policy):
    clock = Clock()
    store, pool = make_store(clock, policy=policy, protect_s=60.0), make_pool()
    chain = keys(20)
    results = put(store, pool, chain)
    assert results == [PutResult.STORED] * 16 + [PutResult.REJECTED_FULL] * 4
    assert present(store, chain) == [True] * 16 + [False] * 4
    assert store.counters["put_blocks_rejected"] == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_is_all_or_nothing_per_request(policy):
    """With 3 evictable blocks and 4 needed, the 3 are evicted and 1 block is refused; no
    half-evicted block is left behind."""
    clock = Clock()
    store, pool = make_store(clock, policy=policy), make_pool()
    a = keys(16)
    put(store, pool, a)
    store.pin(store.index.lookup(0, a[3:]))
    results = put(store, pool, keys(4))
    assert results == [PutResult.STORED] * 3 + [PutResult.REJECTED_FULL]
    assert present(store, a) == [False] * 3 + [True] * 13
    assert store.host.allocator.used_slots == 16


def test_get_copies_exact_bytes_and_skips_missing():
    clock = Clock()
    store, pool = make_store(clock), make_pool()
    a = keys(3)
    put(store, pool, a, pages=[5, 6, 7])
    expected = [pool.array[p * 4096 : (p + 1) * 4096].copy() for p in (5, 6, 7)]
    pool.array[:] = 0
    words = np.concatenate([a[:2], keys(1), a[2:]])
    loaded = asyncio.run(store.get(pool, 0, words, np.array([10, 11, 12, 13]), touch=True))
    assert loaded.tolist() == [True, True, False, True]
    for page, exp in zip((10, 11, 13), expected, strict=True):
        assert np.array_equal(pool.array[page * 4096 : (page + 1) * 4096], exp)
    assert not pool.array[12 * 4096 : 13 * 4096].any()


def test_a_new_block_size_takes_a_whole_segment_from_the_coldest():
    clock = Clock()
    store = make_store(clock, segments=2)
    small, big = make_pool(4096), make_pool(8192)
    old, new = keys(16), keys(16)
    put(store, small, old)
    clock.now += 10
    put(store, small, new)
    clock.now += 10
    assert put(store, big, keys(1)) == [PutResult.STORED]
    # The segment of the older blocks went as a whole; the newer segment is intact.
    assert not any(present(store, old)) and all(present(store, new))
    assert store.counters["segment_reclaims"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_delete_keeps_pinned_and_counts_missing(policy):
    clock = Clock()
    store, pool = make_store(clock, policy=policy), make_pool()
    a = keys(3)
    put(store, pool, a)
    store.pin(store.index.lookup(0, a[:1]))
    res = asyncio.run(store.delete(0, np.concatenate([a, keys(1)])))
    assert (res.deleted, res.busy, res.missing) == (2, 1, 1)
    assert present(store, a) == [True, False, False]
    assert store.host.allocator.used_slots == 1
