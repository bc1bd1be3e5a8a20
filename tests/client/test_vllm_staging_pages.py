"""The staging pool's size, as the vLLM connector's worker makes it and its scheduler counts
loads against it (``vllm_config.staging_pages``); no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.client.integrations.vllm_config import staging_pages


@pytest.mark.parametrize(
    "staging_bytes, engine_blocks, pages",
    [
        (64 << 20, 10_000, 32),  # 64 MiB of 2 MiB blocks
        (64 << 20, 8, 8),  # no more pages than the engine has blocks
        (1 << 20, 10_000, 1),  # under one block: the worker still makes one page
        (0, 10_000, 1),
    ],
)
def test_the_worker_and_the_scheduler_count_the_same_pages(staging_bytes, engine_blocks, pages):
    # Regression: the scheduler floored at 0 where the worker floors at 1, so with less than
    # a block of staging_bytes it counted no page and cut every hit to nothing.
    config = SimpleNamespace(staging_bytes=staging_bytes)
    identity = SimpleNamespace(block_bytes=2 << 20)
    assert staging_pages(config, identity, engine_blocks) == pages
