"""The worker side with its staging pool in GPU memory, against a real daemon: the engine's
GPU memory and CUDA IPC are stood in for by /dev/shm (tests/shm_ipc.py: the daemon's GPU
tier runs on CpuOps and opens the stand-in's handles; the engine's copies are counted as
stream operations that run only once waited for). vLLM's per-layer KV tensors are views of
one allocation in two stride orders, as vLLM's KV cache layouts make them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import shm_ipc
import torch
from mini_engine import wait_until
from test_worker_side import BLOCK_SHAPE, BLOCKS, IDENTITY, LAYERS, run_step

from kvtier.client import Client, Tier
from kvtier.client.integrations.vllm_config import ConnectorConfig, KeyChain
from kvtier.client.integrations.vllm_meta import KVTierConnectorMetadata, LoadSpec, SaveSpec
from kvtier.client.integrations.vllm_worker import WorkerSide


@pytest.fixture
def gpu_daemon(daemon_factory, tmp_path):
    return shm_ipc.start_daemon(daemon_factory, tmp_path)


def _views(order: str) -> list[torch.Tensor]:
    """Per-layer ``[blocks, *BLOCK_SHAPE]`` views of one allocation: ``layer-outer`` (each
    layer's blocks together) or ``block-outer`` (each block's layers together: strided)."""
    if order == "layer-outer":
        buf = torch.zeros((len(LAYERS), BLOCKS, *BLOCK_SHAPE))
        return [buf[i] for i in range(len(LAYERS))]
    buf = torch.zeros((BLOCKS, len(LAYERS), *BLOCK_SHAPE))
    return [buf[:, i] for i in range(len(LAYERS))]


def _worker(
    address: str, order: str, made: list[Any]
) -> tuple[WorkerSide, list[torch.Tensor], shm_ipc.ShmGpuMemory]:
    side = WorkerSide(
        ConnectorConfig(address=address, layer_groups=2),
        IDENTITY,
        LAYERS,
        BLOCKS,
        tp_rank=0,
        pp_rank=0,
    )
    kv = _views(order)
    side.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    memory = made[-1]
    real_save, real_load = side.client.submit_save, side.client.submit_load

    # The daemon must never touch a page an engine copy issued before has not yet run.
    def submit_save(pool, segments, **kw):  # type: ignore[no-untyped-def]
        assert not memory.busy_pages() & {p for s in segments for p in s.pages}
        return real_save(pool, segments, **kw)

    def submit_load(pool, segments, **kw):  # type: ignore[no-untyped-def]
        assert not memory.busy_pages() & {p for s in segments for p in s.pages}
        return real_load(pool, segments, **kw)

    side.client.submit_save = submit_save  # type: ignore[method-assign]
    side.client.submit_load = submit_load  # type: ignore[method-assign]
    return side, kv, memory


@pytest.mark.parametrize(
    ("saved_as", "loaded_as"), [("block-outer", "layer-outer"), ("layer-outer", "block-outer")]
)
def test_blocks_saved_and_loaded_through_gpu_staging_are_the_engines_blocks(
    gpu_daemon, monkeypatch, saved_as, loaded_as
):
    """A worker stores a request's blocks from GPU staging (the daemon's GPU tier takes
    them), and another worker, whose KV cache is laid out in the other stride order, loads
    them layer range by layer range: each block is what the first engine computed, and no
    transfer touched a page while an engine copy of it was pending."""
    made: list[shm_ipc.ShmGpuMemory] = []
    shm_ipc.use_shm_gpu_staging(monkeypatch, made)
    keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(16)), 4, None)
    saver, saved, device = _worker(gpu_daemon.address, saved_as, made)
    loader, kv, _ = _worker(gpu_daemon.address, loaded_as, made)
    try:
        assert not saved[0].is_contiguous() or not kv[0].is_contiguous()
        for layer, t in enumerate(saved):
            for block in range(BLOCKS):
                t[block] = torch.arange(16, dtype=torch.float32).view(BLOCK_SHAPE) + (
                    1000 * layer + 100 * block
                )
        blocks = [5, 2, 7, 0]
        run_step(saver, KVTierConnectorMetadata(saves=[SaveSpec("r", blocks, {0: keys}, {0: b""})]))
        saver.get_finished(set())
        # vLLM's thread did not wait for the copies into staging: the job starts once they
        # ran (the worker's submitting thread waits for them).
        assert threading.main_thread() not in device.waiters
        device.run()
        assert wait_until(lambda: saver.client.lookup(keys).tiers == [Tier.L0_GPU] * 4)
        saver.get_finished(set())
        assert wait_until(lambda: saver.saves_in_flight() == 0)
        assert saver.stats["save_blocks"] == 4

        into = [1, 3, 4, 6]
        invalid = run_step(loader, KVTierConnectorMetadata(loads=[LoadSpec("q", into, {0: keys})]))
        assert not invalid and loader.stats["load_blocks_failed"] == 0
        for layer in range(len(LAYERS)):
            for src, dst in zip(blocks, into, strict=True):
                assert torch.equal(kv[layer][dst], saved[layer][src]), (layer, src, dst)
            for untouched in set(range(BLOCKS)) - set(into):
                assert not kv[layer][untouched].any()
        # The load's pages wait for the copies out of them; a second load gets pages anyway.
        again = run_step(
            loader, KVTierConnectorMetadata(loads=[LoadSpec("q2", [0, 2, 5, 7], {0: keys})])
        )
        assert not again
        assert torch.equal(kv[1][7], saved[1][0])
    finally:
        saver.shutdown()
        loader.shutdown()


def test_a_save_is_stored_once_its_copies_ran_though_vllm_calls_the_worker_no_more(
    gpu_daemon, monkeypatch
):
    """vLLM stops calling the worker once it has nothing to run (its last request finished,
    with no finish-save to wait for): a step's save whose copies into staging had not run at
    the step's end is stored all the same once they have, not at some later request's step
    (which comes after that request's lookup, a miss)."""
    made: list[shm_ipc.ShmGpuMemory] = []
    shm_ipc.use_shm_gpu_staging(monkeypatch, made)
    keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(16)), 4, None)
    saver, _, device = _worker(gpu_daemon.address, "layer-outer", made)
    try:
        run_step(
            saver, KVTierConnectorMetadata(saves=[SaveSpec("r", [3, 1, 4, 5], {0: keys}, {0: b""})])
        )
        saver.get_finished({"r"})  # the last call vLLM makes
        device.run()  # the GPU catches up by itself
        assert wait_until(lambda: saver.client.lookup(keys).tiers == [Tier.L0_GPU] * 4)
    finally:
        saver.shutdown()


def test_shutdown_stores_the_saves_whose_copies_were_pending(gpu_daemon, monkeypatch):
    """A worker shut down right after a step (its copies into staging still pending) waits
    for them, then for the save job: the blocks are stored, and the pool is let go cleanly
    (no transfer left in flight)."""
    made: list[shm_ipc.ShmGpuMemory] = []
    shm_ipc.use_shm_gpu_staging(monkeypatch, made)
    keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(16)), 4, None)
    saver, _, device = _worker(gpu_daemon.address, "block-outer", made)
    meta = KVTierConnectorMetadata(saves=[SaveSpec("r", [6, 0, 2, 1], {0: keys}, {0: b""})])
    run_step(saver, meta)
    namespace = saver.client.namespace
    saver.shutdown()
    assert saver.stats["save_blocks"] == 4 and saver.saves_in_flight() == 0
    assert device.released == [False]
    with Client(gpu_daemon.address) as client:
        assert client.lookup(keys, namespace=namespace).tiers == [Tier.L0_GPU] * 4


def test_no_new_gpu_pool_while_a_retired_ones_memory_waits_for_its_fence(gpu_daemon, monkeypatch):
    """A pool retired after a transfer without an answer keeps its GPU memory until the
    daemon fences it (``CudaMemory``). While it waits, the worker makes no new pool: its loads
    fail at once (vLLM recomputes) rather than each retirement holding one more pool of GPU
    memory; once the fence came, the next step has a fresh pool."""
    import kvtier.client.integrations.staging as staging

    made: list[shm_ipc.ShmGpuMemory] = []
    shm_ipc.use_shm_gpu_staging(monkeypatch, made)
    keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(8)), 2, None)
    side, _, _ = _worker(gpu_daemon.address, "layer-outer", made)
    try:
        monkeypatch.setattr(staging, "_fencing", 1)  # the retired pool's fence, pending
        side._arena.retire("a load timed out")  # type: ignore[union-attr]
        load = KVTierConnectorMetadata(loads=[LoadSpec("q", [1, 2], {0: keys})])
        assert run_step(side, load) == {1, 2}
        assert side.staging_generation == 1 and len(made) == 1 and side.breaker.ok()
        monkeypatch.setattr(staging, "_fencing", 0)  # the daemon answered
        run_step(side, load)
        assert side.staging_generation == 2 and len(made) == 2 and side.staging_registered()
    finally:
        side.shutdown()


def test_a_daemon_without_a_gpu_tier_refuses_gpu_staging_and_vllm_runs_without_kvtier(
    daemon, monkeypatch, caplog
):
    """A daemon that does not run its GPU tier refuses a CUDA IPC registration: the worker
    starts anyway, says why (one ERROR), tells the scheduler side its pool is refused, and
    reports its loads failed (vLLM recomputes) rather than failing a step."""
    shm_ipc.use_shm_gpu_staging(monkeypatch, [])
    side = WorkerSide(
        ConnectorConfig(address=daemon.address, layer_groups=2),
        IDENTITY,
        LAYERS,
        BLOCKS,
        tp_rank=0,
        pp_rank=0,
    )
    try:
        with caplog.at_level("WARNING", logger="kvtier"):
            side.register_kv_caches(dict(zip(LAYERS, _views("layer-outer"), strict=True)))
        assert "FailedPreconditionError" in caplog.text and "GPU tier (L0)" in caplog.text
        # A refusal that waiting cannot mend: kvtier is off for this worker by its refusal
        # (backed off, told to the scheduler side), not by the breaker's short pause.
        assert not side.staging_registered() and side.refusals.refused
        assert side.build_connector_worker_meta().staging_refused
        keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(8)), 2, None)
        invalid = run_step(side, KVTierConnectorMetadata(loads=[LoadSpec("q", [1, 2], {0: keys})]))
        assert invalid == {1, 2}
    finally:
        side.shutdown()


def test_kv_caches_split_into_kernel_blocks_or_of_another_shape_are_refused_at_start(daemon):
    """vLLM may view its blocks as smaller attention-kernel blocks; the connector stores whole
    blocks, so it stops at start naming the setting to change, as for any other shape."""
    side = WorkerSide(ConnectorConfig(address=daemon.address), IDENTITY, LAYERS, BLOCKS, 0, 0)
    try:
        split = [torch.zeros((2 * BLOCKS, 2, 2, 2)) for _ in LAYERS]  # kernel blocks of 2 tokens
        with pytest.raises(ValueError, match="splits each of its 8 KV blocks into 2 attention"):
            side.register_kv_caches(dict(zip(LAYERS, split, strict=True)))
        short = [torch.zeros((BLOCKS - 1, *BLOCK_SHAPE)) for _ in LAYERS]
        with pytest.raises(ValueError, match=r"is not \[8 blocks, \.\.\.\]"):
            side.register_kv_caches(dict(zip(LAYERS, short, strict=True)))
        assert not side.kv
    finally:
        side.shutdown()


def test_the_gpu_namespace_names_the_backend_full_attention_layers_run():
    """vLLM's selector lets ``backend_per_kind`` override ``backend`` per kind of layer: an
    engine that sets it for full attention runs that backend, and its namespace says so (not
    ``auto``, which another engine letting vLLM choose would share, whatever it runs)."""
    from types import SimpleNamespace

    from vllm.config import AttentionConfig

    from kvtier.client.integrations.vllm_config import attention_backend_name

    def name(**kw: Any) -> str:
        return attention_backend_name(SimpleNamespace(attention_config=AttentionConfig(**kw)))

    assert name() == "auto"
    assert name(backend="FLASH_ATTN") == "flash_attn"
    assert name(backend_per_kind={"full_attention": "FLASHINFER"}) == "flashinfer"
    assert (
        name(backend="FLASH_ATTN", backend_per_kind={"full_attention": "TRITON_ATTN"})
        == "triton_attn"
    )
    # Overrides for other kinds of layer leave full attention's backend as it was.
    assert name(backend_per_kind={"mla_attention": "FLASHINFER_MLA"}) == "auto"


def test_a_backend_that_packs_its_pages_has_a_namespace_of_its_own():
    """vLLM's spec says when a backend packs a page's K and V into other head slots or
    content sizes (B12X: a K plane and a V plane, two slots of every head's K or V; FlashInfer
    with nvfp4: twice the heads): B12X's page has the dense page's size and another byte
    order, so the namespace names the packing; a dense spec's namespace field stays absent
    (its blocks keep their keys)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.client.integrations.vllm_config import page_packing

    def spec(**kw: Any) -> Any:
        return FullAttentionSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, **kw
        )

    dense = page_packing(spec())
    flashinfer = page_packing(spec(num_head_slots=16, state_content_bytes=72))
    b12x = page_packing(spec(num_head_slots=2, state_content_bytes=8 * 128 * 2))
    assert spec(num_head_slots=2, state_content_bytes=8 * 128 * 2).page_size_bytes == (
        spec().page_size_bytes
    )
    assert dense == ""
    assert flashinfer and b12x and flashinfer != b12x


@pytest.mark.parametrize(
    "sizes",
    [{"decode_context_parallel_size": 2}, {"prefill_context_parallel_size": 2}],
)
def test_context_parallelism_is_refused_at_start(sizes):
    """Context parallelism splits a block's tokens across ranks, which the namespace (tensor
    and pipeline ranks) does not name: an engine without it would load one rank's share as
    the whole block. Refused at start, naming the setting."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.client.integrations.vllm_config import NamespaceOptions, identify

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    parallel = SimpleNamespace(
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    for name, size in sizes.items():
        setattr(parallel, name, size)
    vllm_config = SimpleNamespace(parallel_config=parallel)
    with pytest.raises(ValueError, match=f"context parallelism .*{next(iter(sizes))}=2"):
        identify(vllm_config, kv_cache_config, NamespaceOptions())


def _engine_config(
    tmp_path: Any, draft_weights: bytes | None, method: str = "eagle"
) -> tuple[Any, Any]:
    """A CPU engine's config and KV cache config (the target a hub id), with a draft model
    (``method``) whose checkpoint folder holds ``draft_weights``, or without speculation."""
    from types import SimpleNamespace

    from transformers import LlamaConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1", "d0"])]
    )
    hf_config = LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=64)
    model_config = SimpleNamespace(
        model="org/target", revision=None, hf_config=hf_config, quantization=None,
        dtype=torch.bfloat16,
    )  # fmt: skip
    speculative = None
    if draft_weights is not None:
        folder = tmp_path / "draft"
        folder.mkdir(exist_ok=True)
        (folder / "model.bin").write_bytes(draft_weights)
        draft = SimpleNamespace(
            model=str(folder), revision=None, hf_config=LlamaConfig(num_hidden_layers=1)
        )
        if method == "ngram":  # vLLM names the target as its draft, which has no KV
            draft = model_config
        speculative = SimpleNamespace(
            method=method,
            draft_model_config=draft,
            draft_load_config=None,
            uses_draft_kv_cache=lambda: method != "ngram",
        )
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    vllm_config = SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        load_config=SimpleNamespace(load_format="auto"),
        parallel_config=parallel,
        speculative_config=speculative,
    )
    return vllm_config, kv_cache_config


def test_regression_engines_with_different_draft_weights_shared_a_namespace(tmp_path):
    """A speculative-decoding draft's attention layers are in the KV cache beside the
    target's, but the namespace bound only the target: two engines of one target whose
    drafts were different checkpoints of one architecture shared it, and one loaded the
    other's draft KV. The draft's weights are bound now; an engine without speculation keeps
    the namespace it had."""
    from kvtier.client.integrations.vllm_config import NamespaceOptions, identify

    def extra(draft_weights: bytes | None, method: str = "eagle") -> str:
        config = _engine_config(tmp_path, draft_weights, method)
        return identify(*config, NamespaceOptions()).extra

    plain = extra(None)
    assert "draft=" not in plain
    assert extra(b"", "ngram") == plain
    first, second = extra(b"\x01" * 8192), extra(b"\x02" * 8192)
    assert first != second
    assert first == extra(b"\x01" * 8192)


def test_regression_the_draft_part_bound_the_draft_folders_path(tmp_path):
    """The draft part of the namespace named a local draft checkpoint by its full path, so
    engines whose drafts were the same files in other folders (another mount or cache
    folder on each node) shared no block, though ``namespace.model`` kept the target's path
    out. A draft folder counts by its last component and its files now. Real vLLM configs
    (``EngineArgs.create_engine_config``) of a target with a draft model."""
    import os
    import shutil
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_harness import make_checkpoint

    from kvtier.client.integrations.vllm_config import NamespaceOptions, identify

    target = make_checkpoint(tmp_path / "target")
    draft = make_checkpoint(tmp_path / "node-a" / "draft", num_hidden_layers=1)
    moved = tmp_path / "node-b" / "draft"
    shutil.copytree(draft, moved)
    other = make_checkpoint(tmp_path / "node-c" / "draft", num_hidden_layers=1, rope_theta=5e4)
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(5)])
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group])

    def extra(draft_path: Any, weights: bool = True) -> str:
        args = EngineArgs(
            model=str(target),
            max_model_len=1024,
            block_size=128,
            speculative_config={
                "method": "draft_model",
                "model": str(draft_path),
                "num_speculative_tokens": 2,
            },
        )
        options = NamespaceOptions(model="tiny-llama", weights_fingerprint=weights)
        return identify(args.create_engine_config(), kv_cache_config, options).extra

    first = extra(draft)
    assert "draft=" in first
    assert extra(moved) == first
    assert extra(other) != first
    # A symlink to the folder names the folder it leads to, and the target's own folder
    # spelled with a trailing slash is the target's checkpoint.
    (tmp_path / "link").symlink_to(moved)
    assert extra(tmp_path / "link") == first
    assert extra(f"{target}/") == extra(target)
    # Without weight fingerprints the folder's path alone tells the drafts apart: a
    # fine-tune of one config in a folder of the same name is another draft.
    tuned = tmp_path / "node-d" / "draft"
    shutil.copytree(draft, tuned)
    with open(tuned / "model.safetensors", "r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"\x01" * 16)
    assert extra(tuned, weights=False) != extra(draft, weights=False)
    assert extra(f"{draft}/", weights=False) == extra(draft, weights=False)
