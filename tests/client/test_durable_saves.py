"""The vLLM worker's ``save_durable`` against a daemon whose disk tier does not write every
block it is sent (past the tenant's L2 quota): it counts (and warns of) the blocks held in
memory only. A real daemon; the worker side driven by hand, as vLLM's model runner calls it
(without vLLM installed, ``conftest.vllm_modules`` provides the two base classes the
metadata derive from). ``tests/integrations/vllm`` runs it through vLLM's scheduler and
the connector vLLM loads, ``tests/integrations/sglang`` SGLang's backend's side. And the
rate limit its warning shares with ``max_save_jobs``', on a clock the test moves.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import torch
from harness import l2_quota_args

LAYERS = ["layer.0", "layer.1"]
BLOCKS = 8
BLOCK_SHAPE = (2, 4, 2)  # K and V, 4 tokens, 2 values: 64 bytes a layer (float32)


def test_regression_save_durable_counted_blocks_its_disk_did_not_write_as_saved(
    vllm_modules: Any, daemon_factory: Any, tmp_path: Any, caplog: Any
) -> None:
    """A durable save of 4 blocks past the tenant's L2 quota of 2 (256 bytes): the daemon
    holds all 4, its disk wrote 2. The worker read only which keys the daemon held, so the 2
    others counted as saved as asked with nothing said; now they are counted in
    ``save_blocks_not_durable``, with a warning."""
    mods = vllm_modules
    daemon = daemon_factory(*l2_quota_args(tmp_path / "l2", 256))
    identity = mods.identity("durable-saves")
    config = mods.config.ConnectorConfig(address=daemon.address, layer_groups=1, save_durable=True)
    side = mods.worker.WorkerSide(config, identity, LAYERS, BLOCKS, tp_rank=0, pp_rank=0)
    kv = [torch.ones((BLOCKS, *BLOCK_SHAPE), dtype=torch.float32) for _ in LAYERS]
    side.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    keys = mods.config.KeyChain(identity.namespace(0, 0)).extend(list(range(16)), 4, None)
    meta = mods.meta.KVTierConnectorMetadata(
        saves=[mods.meta.SaveSpec("r", [0, 1, 2, 3], {0: keys}, {0: b""})]
    )
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            side.start_load_kv(meta)
            for name, t in zip(LAYERS, side.kv, strict=True):
                side.save_kv_layer(name, t, meta)
            side.wait_for_save(meta)
            deadline = time.monotonic() + 30
            while side.saves_in_flight() and time.monotonic() < deadline:
                time.sleep(0.02)
            side.wait_for_save(mods.meta.KVTierConnectorMetadata())  # the next step reaps it
        assert side.saves_in_flight() == 0
        assert side.client.lookup(keys).prefix_len == 4
        assert side.stats["save_blocks"] == 4 and side.stats["save_blocks_not_durable"] == 2
        warned = [r.getMessage() for r in caplog.records if "save_durable" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith("kvtier connector: 2 saved blocks")
    finally:
        side.shutdown()


def test_blocks_to_warn_of_are_told_once_a_period_counted_since_the_last_warning(
    vllm_modules: Any, monkeypatch: Any
) -> None:
    """The rate limit that the ``save_durable`` and ``max_save_jobs`` warnings share
    (``_BlocksToWarn``): the first blocks are warned of at once; those counted within
    ``OVER_LIMIT_WARN_S`` of a warning are not, and the next warning tells them all, then
    counts from 0. Each warning keeps its own period."""
    worker = vllm_modules.worker
    now = [1000.0]
    monkeypatch.setattr(worker, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(worker, "OVER_LIMIT_WARN_S", 60.0)
    durable, over = worker._BlocksToWarn(), worker._BlocksToWarn()
    assert durable.add(2) == 2
    now[0] += 59.0
    assert (durable.add(3), durable.add(4), over.add(1)) == (None, None, 1)
    now[0] += 1.0
    assert (durable.add(1), over.add(5)) == (8, None)
    assert durable.add(6) is None
    now[0] += 60.0
    assert (durable.add(0), over.add(0)) == (6, 5)
