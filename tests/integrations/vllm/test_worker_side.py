"""The worker side of the connector on its own, against a real daemon: no scheduler, no
engine; the metadata is built by hand so that cases vLLM rarely produces are reachable."""

from __future__ import annotations

import torch

from kvtier.client.integrations.vllm_config import ConnectorConfig, KeyChain, ModelIdentity
from kvtier.client.integrations.vllm_meta import KVTierConnectorMetadata, LoadSpec, SaveSpec
from kvtier.client.integrations.vllm_worker import WorkerSide

LAYERS = ["layer.0", "layer.1"]
BLOCKS = 8
BLOCK_SHAPE = (2, 4, 2)  # K and V, 4 tokens, 2 values: 64 bytes per layer block (float32)
IDENTITY = ModelIdentity(
    model="worker-side",
    revision="",
    kv_dtype="float32",
    kv_layout="test",
    block_tokens=4,
    tp_size=1,
    pp_size=1,
    tenant="default",
    extra="",
    num_layers=len(LAYERS),
    layer_block_bytes=64,
)


def worker(address: str) -> tuple[WorkerSide, list[torch.Tensor]]:
    config = ConnectorConfig(address=address, layer_groups=1)
    side = WorkerSide(config, IDENTITY, LAYERS, BLOCKS, tp_rank=0, pp_rank=0)
    kv = [torch.zeros((BLOCKS, *BLOCK_SHAPE), dtype=torch.float32) for _ in LAYERS]
    side.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    return side, kv


def run_step(side: WorkerSide, meta: KVTierConnectorMetadata) -> set[int]:
    """What the model runner does around one forward pass; returns the blocks to recompute."""
    side.start_load_kv(meta)
    for name in LAYERS:
        side.wait_for_layer_load(name)
    side.wait_for_save(meta)
    return side.get_block_ids_with_load_errors()


def test_a_block_without_a_key_does_not_shift_the_blocks_after_it(daemon):
    """A load spec with fewer keys than blocks (its last block has none) is followed by a
    spec whose blocks all load: each of those receives its own key's KV, or is reported for
    recompute; none keeps what it held before, unreported."""
    keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(12)), 3, None)
    saver, saved_kv = worker(daemon.address)
    loader, kv = worker(daemon.address)
    try:
        for layer, t in enumerate(saved_kv):
            for block in range(3):
                t[block] = 100 * layer + block + 1
        save = SaveSpec("stored", [0, 1, 2], {0: keys}, {0: b""}, at_finish=True)
        run_step(saver, KVTierConnectorMetadata(saves=[save]))
        saver.shutdown()  # waits for the save

        loads = [
            LoadSpec("short", [0, 1], {0: keys[:1]}),  # block 1 has no key
            LoadSpec("full", [2, 3], {0: keys[1:3]}),
        ]
        invalid = run_step(loader, KVTierConnectorMetadata(loads=loads))
        assert 1 in invalid
        # Only the request whose load failed is named to the scheduler side.
        meta = loader.build_connector_worker_meta()
        assert meta is not None and meta.failed_loads == {"short"}
        expected = {0: 0, 2: 1, 3: 2}  # engine block: the stored block its key names
        for layer, t in enumerate(kv):
            for block, source in expected.items():
                if block not in invalid:
                    assert torch.equal(t[block], saved_kv[layer][source]), (layer, block)
    finally:
        loader.shutdown()
