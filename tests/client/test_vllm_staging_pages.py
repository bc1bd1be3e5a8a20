"""The staging pool's size and its shares for loads and saves, as the vLLM connector's worker
makes it and its scheduler counts loads against it (``vllm_config.staging_pages``); no vLLM
needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.client.integrations.vllm_config import ConnectorConfig, staging_pages


@pytest.mark.parametrize(
    "staging_bytes, engine_blocks, loads, saves",
    [
        (64 << 20, 10_000, 16, 16),  # 64 MiB of 2 MiB blocks, half of them for saves
        (64 << 20, 8, 4, 4),  # no more pages than the engine has blocks
        (6 << 20, 10_000, 2, 1),  # an odd page goes to loads
        (1 << 20, 10_000, 1, 1),  # under one block: the worker still makes a page of each
        (0, 10_000, 1, 1),
    ],
)
def test_the_worker_and_the_scheduler_count_the_same_pages(
    staging_bytes, engine_blocks, loads, saves
):
    # Regression: the scheduler floored at 0 where the worker floors at 1, so with less than
    # a block of staging_bytes it counted no page and cut every hit to nothing.
    config = SimpleNamespace(staging_bytes=staging_bytes, staging_save_share=0.5)
    identity = SimpleNamespace(block_bytes=2 << 20)
    pages = staging_pages(config, identity, engine_blocks)
    assert (pages.loads, pages.saves) == (loads, saves)
    assert pages.total == loads + saves


@pytest.mark.parametrize("share, loads, saves", [(0.25, 24, 8), (0.9, 4, 28), (0.01, 32, 1)])
def test_saves_get_their_share_of_the_pool(share, loads, saves):
    config = SimpleNamespace(staging_bytes=64 << 20, staging_save_share=share)
    pages = staging_pages(config, SimpleNamespace(block_bytes=2 << 20), 10_000)
    assert (pages.loads, pages.saves) == (loads, saves)


def test_the_share_is_checked():
    for bad in (0, 1, 1.5, -0.5):
        with pytest.raises(ValueError, match="staging_save_share"):
            ConnectorConfig.from_extra_config({"staging_save_share": bad})
