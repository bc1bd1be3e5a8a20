import numpy as np

from kvtier.client import Namespace, PoolLayout, SharedMemoryPool


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
