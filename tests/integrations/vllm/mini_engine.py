"""vLLM's real scheduler and KV cache bookkeeping, with the kvtier connector on both sides,
driven in one process without a model.

``MiniEngine`` builds vLLM's ``Scheduler`` (which loads the connector through vLLM's own
factory, from ``kv_connector_module_path``) and a worker-side connector over real CPU KV
tensors of vLLM's CPU shape. ``step()`` does what vLLM's model runner does around a forward
pass, in the same order: bind the metadata, ``start_load_kv``; per layer:
``wait_for_layer_load``, write this step's KV (a marker per token that encodes the layer,
the position and every token before it; a wrong one where the prefix's KV in that layer
lacks its markers, as attention over a block that failed to load computes wrong KV),
``save_kv_layer``; then ``wait_for_save``, ``get_finished``,
``get_block_ids_with_load_errors``, the worker's connector stats, and hands vLLM a
``ModelRunnerOutput`` (as vLLM, a step
without layer-wise loads calls ``start_load_kv`` after the layers instead). A block that
holds the right markers therefore holds exactly the KV of its own prefix, wherever it came
from (computed here, or loaded from kvtier after another engine computed it).

Only the model is absent (no GPU or weights are needed to test the connector's protocol);
the scheduler, the block manager, the connector and the daemon are the real ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.client.integrations.vllm import KVTierConnector
from kvtier.client.integrations.vllm_worker import WorkerSide

BLOCK = 128
LAYERS = 4
KV_HEADS = 2
HEAD = 64
MARK_MOD = 251  # markers are integers below 256: exact in bfloat16


class MiniEngine:
    def __init__(
        self,
        model_dir: Path,
        extra: dict[str, Any],
        *,
        num_blocks: int = 64,
        kv_load_failure_policy: str = "fail",
        max_num_batched_tokens: int = 4096,
    ) -> None:
        model_config = ModelConfig(
            model=str(model_dir),
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=2048,
            seed=0,
            enforce_eager=True,
        )
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=BLOCK),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=2048,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVTierConnector",
                kv_connector_module_path="kvtier.client.integrations.vllm",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
                kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
            ),
            device_config=DeviceConfig("cpu"),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
        )
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * num_blocks,
                    layers=[n],
                    layer_stride=page * num_blocks,
                    block_stride=page,
                )
                for n in self.layer_names
            ],
            kv_cache_groups=[KVCacheGroupSpec(self.layer_names, spec)],
            kv_cache_layout="LBHNC",
        )
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KVTierConnector)
        self.connector = connector
        self.worker = WorkerSide(
            connector.config,
            connector.identity,
            self.layer_names,
            num_blocks,
            tp_rank=0,
            pp_rank=0,
            vllm_config=self.vllm_config,
        )
        # vLLM's CPU KV cache: per layer [blocks, kv_heads, block_size, 2 * head_size].
        self.kv = {
            n: torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
            for n in self.layer_names
        }
        self.worker.register_kv_caches(self.kv)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self._codes: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.invalid_reported: set[int] = set()
        self.finished_sending: set[str] = set()
        # Each step's connector stats as vLLM's scheduler hands them to its front end
        # (``SchedulerStats.kv_connector_stats``: the worker's and the scheduler side's).
        self.connector_stats: list[dict[str, Any]] = []

    # -------------------------------------------------------------- requests

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        lora: LoRARequest | None = None,
        **params: Any,
    ) -> Request:
        """``params``: more ``SamplingParams`` fields."""
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
        request = Request(
            req_id, prompt, sampling, None, lora_request=lora, block_hasher=self._hasher
        )
        self.scheduler.add_request(request)
        self.outputs[req_id] = []
        return request

    def request(self, req_id: str) -> Request:
        return self.scheduler.requests[req_id]

    def run(self, max_steps: int = 100) -> None:
        """Step until every request has finished and its blocks are released."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests still running after {max_steps} steps")

    # ------------------------------------------------------------------ step

    def step(
        self, before_forward: Callable[[SchedulerOutput], None] | None = None
    ) -> SchedulerOutput:
        out = self.scheduler.schedule()
        if before_forward is not None:
            before_forward(out)
        self._update(out, self._forward(out))
        return out

    def overlapped_steps(
        self,
        before_forward: Callable[[SchedulerOutput], None] | None = None,
        between: Callable[[], None] | None = None,
    ) -> tuple[SchedulerOutput, SchedulerOutput]:
        """Two steps as vLLM's async scheduling runs them: the second is scheduled (and its
        forward pass run) before the scheduler has seen the first one's output.
        ``before_forward`` runs before the first one's forward pass, ``between`` after it
        (before the second is scheduled: a request arriving then)."""
        first = self.scheduler.schedule()
        if before_forward is not None:
            before_forward(first)
        first_output = self._forward(first)
        if between is not None:
            between()
        second = self.scheduler.schedule()
        second_output = self._forward(second)
        self._update(first, first_output)
        self._update(second, second_output)
        return first, second

    def _forward(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The worker's side of one step: its connector calls around the forward pass."""
        meta = out.kv_connector_metadata
        worker = self.worker
        sampled: dict[str, list[int]] = {}
        writes = self._writes(out)
        # vLLM starts a step's async loads after its forward pass has been launched.
        if out.has_sync_kv_loads:
            worker.start_load_kv(meta)
        for layer, name in enumerate(self.layer_names):
            worker.wait_for_layer_load(name)
            for req_id, start, slots in writes:
                # Attention reads the prefix's KV: over a slot that lacks its marker (a block
                # that failed to load), this step's KV is wrong too, as a model's would be.
                bad = 0 if self._prefix_holds(req_id, start, layer) else 1
                for block, offset, code in slots:
                    self.kv[name][block, :, offset, :] = float((code + 17 * layer + bad) % MARK_MOD)
            worker.save_kv_layer(name, self.kv[name], meta)
        if not out.has_sync_kv_loads:
            worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        sending, recving = worker.get_finished(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker_stats = worker.take_stats()
        self.invalid_reported |= invalid
        self.finished_sending |= sending or set()
        req_ids = list(out.num_scheduled_tokens)
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled[req_id] = [self._sample(request)] if done else []
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=invalid,
                kv_connector_stats=(
                    KVTierConnector.build_kv_connector_stats(worker_stats) if worker_stats else None
                ),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            ),
        )

    def _update(self, out: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        outputs = self.scheduler.update_from_output(out, mro)
        for engine_outputs in outputs.values():
            stats = engine_outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
            for o in engine_outputs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)

    def _writes(self, out: SchedulerOutput) -> list[tuple[str, int, list[tuple[int, int, int]]]]:
        """Per request: (id, first position, (block, offset, code) of every token this step
        computes)."""
        writes = []
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - n
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            codes = self._prefix_codes(req_id, request.all_token_ids, start + n)
            slots = [(blocks[p // BLOCK], p % BLOCK, codes[p]) for p in range(start, start + n)]
            writes.append((req_id, start, slots))
        return writes

    def _prefix_holds(self, req_id: str, n: int, layer: int) -> bool:
        """Whether the request's first ``n`` tokens' KV slots of ``layer`` hold their markers."""
        if n == 0:
            return True
        request = self.scheduler.requests[req_id]
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        codes = self._prefix_codes(req_id, request.all_token_ids, n)
        pos = torch.arange(n)
        rows = torch.as_tensor([blocks[p // BLOCK] for p in range(n)])
        got = self.kv[self.layer_names[layer]][rows, :, pos % BLOCK, :].float()
        want = torch.tensor([float((c + 17 * layer) % MARK_MOD) for c in codes[:n]])
        return bool((got == want.view(n, 1, 1)).all())

    def _prefix_codes(self, req_id: str, tokens: Any, n: int) -> list[int]:
        codes = self._codes.setdefault(req_id, [])
        while len(codes) < n:
            p = len(codes)
            prev = codes[-1] if codes else 7
            codes.append((prev * 1_000_003 + int(tokens[p]) * 31 + p) % (1 << 61))
        return codes

    @staticmethod
    def _sample(request: Request) -> int:
        """A deterministic stand-in for greedy decoding: a function of every token so far."""
        tokens = list(request.all_token_ids)
        return 3 + (sum((i + 1) * t for i, t in enumerate(tokens)) % 997)

    # ---------------------------------------------------------------- checks

    def blocks_hold_their_prefix(self, req_id: str, upto: int | None = None) -> bool:
        """Whether every KV slot of the request's first ``upto`` tokens holds the marker of
        its own prefix, in every layer."""
        request = self.scheduler.requests[req_id]
        n = upto if upto is not None else request.num_computed_tokens
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        codes = self._prefix_codes(req_id, request.all_token_ids, n)
        for layer, name in enumerate(self.layer_names):
            for p in range(n):
                want = float((codes[p] + 17 * layer) % MARK_MOD)
                got = self.kv[name][blocks[p // BLOCK], :, p % BLOCK, :]
                if not bool((got == want).all()):
                    return False
        return True

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
