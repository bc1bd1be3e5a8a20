"""The integrations' ``save_durable`` against a daemon whose disk tier does not write every
block it is sent (past the tenant's L2 quota): the vLLM worker counts (and warns of) the
blocks held in memory only, and SGLang's backend answers them not stored. A real daemon; the
vLLM worker side driven by hand, as vLLM's model runner calls it (without vLLM installed,
``conftest.vllm_modules`` provides the two base classes the metadata derive from); SGLang's
backend's Put on its own, with the three names it imports from SGLang stood in for when
SGLang is not installed (``tests/integrations/sglang`` runs it under SGLang).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.client import PoolLayout, SharedMemoryPool
from kvtier.client.integrations.sglang_config import StorageOptions

LAYERS = ["layer.0", "layer.1"]
BLOCKS = 8
BLOCK_SHAPE = (2, 4, 2)  # K and V, 4 tokens, 2 values: 64 bytes a layer (float32)


def l2_quota_args(path: Path) -> tuple[str, ...]:
    """An L2 whose tenant (root's: the tests' uid) may hold 2 blocks of 128 bytes there."""
    return (
        "tiers.l2.enabled=true",
        f"tiers.l2.path={path}",
        "tiers.l2.capacity_bytes=16MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=16MiB",
        "tenants=[{name: ops, uids: [0], admin: true, quotas: {l2: 256}}]",
    )


def test_regression_save_durable_counted_blocks_its_disk_did_not_write_as_saved(
    vllm_modules: Any, daemon_factory: Any, tmp_path: Any, caplog: Any
) -> None:
    """A durable save of 4 blocks past the tenant's L2 quota of 2 (256 bytes): the daemon
    holds all 4, its disk wrote 2. The worker read only which keys the daemon held, so the 2
    others counted as saved as asked with nothing said; now they are counted in
    ``save_blocks_not_durable``, with a warning."""
    mods = vllm_modules
    daemon = daemon_factory(*l2_quota_args(tmp_path / "l2"))
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


@pytest.fixture
def sglang_backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``kvtier.client.integrations.sglang``, with SGLang's storage base classes stood in for
    where SGLang is not installed (``_put`` uses none of them)."""
    name = "sglang.srt.mem_cache.hicache_storage"
    try:
        importlib.import_module(name)
    except ImportError:
        stub = types.ModuleType(name)
        for cls in ("HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo"):
            setattr(stub, cls, type(cls, (), {}))
        parts = name.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(parts[i - 1]))
        monkeypatch.setitem(sys.modules, name, stub)
        monkeypatch.delitem(sys.modules, "kvtier.client.integrations.sglang", raising=False)
    return importlib.import_module("kvtier.client.integrations.sglang")


def test_regression_sglangs_save_durable_answered_pages_its_disk_did_not_write_stored(
    sglang_backend: Any, daemon_factory: Any, tmp_path: Any
) -> None:
    """SGLang's durable store of 4 pages past the L2 quota of 2: the backend answered all 4
    stored, reading only which keys the daemon held; the 2 its disk did not write are now
    answered not stored (SGLang does not count them backed up), the others stored."""
    daemon = daemon_factory(*l2_quota_args(tmp_path / "l2"))
    backend = sglang_backend.KVTierHiCacheStorage.__new__(sglang_backend.KVTierHiCacheStorage)
    backend.options = StorageOptions(save_durable=True)
    layout = PoolLayout.staging(
        num_layers=2, num_pages=8, block_tokens=4, chunk_bytes=32, dtype="uint8"
    )
    keys = [bytes([i]) * 32 for i in range(1, 6)]
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        backend.client = client
        pool = client.register_pool(shm, layout)
        stored = backend._put(pool.pool_id, keys[:4], [0, 1, 2, 3], b"")
        assert stored.count(True) == 2 and client.lookup(keys[:4]).prefix_len == 4
        backend.options = StorageOptions()
        assert backend._put(pool.pool_id, keys[4:], [4], keys[3]) == [True]
