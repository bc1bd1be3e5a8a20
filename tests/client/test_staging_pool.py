"""The vLLM connector's staging pool (``client/integrations/staging.py``) against a real
daemon: transfers hold it open once retired, and an empty transfer holds nothing."""

from __future__ import annotations

import torch

from kvtier.client import Client
from kvtier.client.integrations.staging import StagingPool


def _pool(client: Client) -> StagingPool:
    return StagingPool(
        client,
        num_layers=2,
        num_pages=4,
        block_tokens=16,
        block_shape=(2, 16, 8),
        dtype=torch.float16,
    )


def test_an_empty_transfer_holds_the_pool_open_for_nobody(daemon):
    with Client(daemon.address) as client:
        pool = _pool(client)
        held = pool.alloc(2)
        assert held is not None and len(held) == 2
        empty = pool.alloc(0)
        assert empty == []
        # Regression: free([]) counted a transfer ending that alloc(0) never counted, so the
        # pool closed while the first transfer still held its pages.
        pool.free(empty)
        pool.retire("test")
        assert not pool.closed
        pool.free(held)
        assert pool.closed
        assert pool.free_pages == 4
