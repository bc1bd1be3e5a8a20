import time

import numpy as np

from kvtier.client import Namespace, PoolLayout, SharedMemoryPool

LAYOUT = PoolLayout.staging(num_layers=1, num_pages=8, block_tokens=4, chunk_bytes=4096)


def test_store_then_load_round_trip(daemon):
    layout = PoolLayout.vllm(
        num_layers=2, num_pages=8, block_tokens=4, num_kv_heads=2, head_dim=8, dtype="float16"
    )
    ns = Namespace(model="smoke", kv_dtype="float16", block_tokens=4)
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout, ns)
        data = shm.array()
        data[:] = np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8)
        before = data.copy()
        tokens = list(range(17))
        assert pool.store(tokens, range(4)) == 16
        data[:] = 0
        assert pool.load(tokens, range(4)) == 16
        assert np.array_equal(data, before * _page_mask(layout, 4))


def _page_mask(layout, pages):
    mask = np.zeros(layout.extent_bytes, dtype=np.uint8)
    t = layout.chunk_table
    for p in range(pages):
        for base, stride, length in zip(t.pool_base, t.page_stride, t.length, strict=True):
            start = int(base + p * stride)
            mask[start : start + int(length)] = 1
    return mask


def test_l1_is_prefaulted_in_the_background_unless_the_config_says_none(daemon_factory):
    """tiers.l1.prefault: ``background`` (the default) faults the arena in on a thread once
    the daemon serves; ``none`` leaves each page to its first write (the tests' daemons)."""
    background = daemon_factory("tiers.l1.prefault=background")
    with background.client() as client:
        deadline = time.monotonic() + 30
        while client.stats().gauges["l1_prefaulting"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stats().gauges["l1_prefaulting"] == 0
    assert "L1 arena pre-faulted in" in background.log()
    none = daemon_factory("tiers.l1.prefault=none")
    with none.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert client.stats().gauges["l1_prefaulting"] == 0
        data, half = shm.array(), 4 * LAYOUT.block_bytes
        data[:half] = np.arange(half) % 251
        data[half:] = 0
        pool = client.register_pool(shm, LAYOUT)
        keys = [bytes([i]) * 32 for i in range(4)]
        assert client.put(pool.pool_id, keys, range(4)).prefix_len == 4
        assert client.get(pool.pool_id, keys, range(4, 8)).loaded == [True] * 4
        assert np.array_equal(data[half:], data[:half])
    none.stop()
    assert "pre-faulted" not in none.log()
