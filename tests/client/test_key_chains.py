"""store_keys / load_keys: a long key chain moved piece by piece through a small pool."""

from __future__ import annotations

import numpy as np

from kvtier.client import AsyncClient, Namespace, PoolLayout, SharedMemoryPool, block_keys

BLOCK = 4
PAGES = 3


def _layout() -> PoolLayout:
    return PoolLayout.staging(num_layers=2, num_pages=PAGES, block_tokens=BLOCK, chunk_bytes=64)


def _blocks(n: int) -> np.ndarray:
    """n distinct blocks of bytes, one per row."""
    return np.random.default_rng(0).integers(0, 256, (n, _layout().block_bytes), dtype=np.uint8)


NS = Namespace(model="chains", kv_dtype="uint8", block_tokens=BLOCK, kv_layout="HND")
TOKENS = list(range(8 * BLOCK))  # 8 blocks: more than the 3 pages of the pool


def test_a_chain_longer_than_the_pool_round_trips_in_pieces(daemon):
    layout, data = _layout(), _blocks(8)
    keys = block_keys(NS, TOKENS)
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout, NS)
        pages = shm.array()[: PAGES * layout.block_bytes].reshape(PAGES, -1)
        for lo in range(0, 8, PAGES):
            hi = min(8, lo + PAGES)
            pages[: hi - lo] = data[lo:hi]
            parent = keys[lo - 1] if lo else b""
            assert pool.store_keys(keys[lo:hi], range(hi - lo), parent_key=parent) == hi - lo
        # The token-level API sees the same chain.
        assert client.lookup(pool.keys(TOKENS)).prefix_len == 8
        for lo in range(0, 8, PAGES):
            hi = min(8, lo + PAGES)
            pages[:] = 0
            assert pool.load_keys(keys[lo:hi], range(hi - lo)) == hi - lo
            assert np.array_equal(pages[: hi - lo], data[lo:hi])


def test_load_keys_stops_at_the_first_missing_block(daemon):
    layout, data = _layout(), _blocks(3)
    keys = block_keys(NS, TOKENS)
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout, NS)
        shm.array()[: 3 * layout.block_bytes] = data.ravel()
        assert pool.store_keys([keys[0], keys[2]], [0, 2]) == 2
        assert pool.load_keys(keys[:3], range(3)) == 1


async def test_async_twins_store_and_load_key_chains(daemon):
    layout, data = _layout(), _blocks(2)
    keys = block_keys(NS, TOKENS)[3:5]
    async with AsyncClient(daemon.address) as client:
        with SharedMemoryPool.for_layout(layout) as shm:
            pool = await client.register_pool(shm, layout, NS)
            shm.array()[: 2 * layout.block_bytes] = data.ravel()
            assert await pool.store_keys(keys, [0, 1], parent_key=b"\0" * 32) == 2
            shm.array()[:] = 0
            assert await pool.load_keys(keys, [1, 0]) == 2
            loaded = shm.array()[: 2 * layout.block_bytes].reshape(2, -1)
            assert np.array_equal(loaded[::-1], data)
