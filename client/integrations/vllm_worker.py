"""The worker side of the vLLM connector (runs in each vLLM worker process).

vLLM hands the worker its KV cache (``register_kv_caches``), then each step binds the
scheduler side's metadata and calls, in order: ``start_load_kv``; per attention layer,
``wait_for_layer_load`` before and ``save_kv_layer`` after it; ``wait_for_save``; then
``get_finished`` and ``get_block_ids_with_load_errors``.

Data path. vLLM's KV tensors are memory the daemon cannot address (private host memory;
on a GPU, blocks vLLM frees and reuses at its own pace), so every transfer goes through a
``StagingPool`` (layer-major pages, one block per page): shared memory for a KV cache on
the CPU, GPU memory on the cache's device exported over CUDA IPC for a KV cache on a GPU,
which the daemon's GPU tier (L0) copies into and out of. A load is a kvtier job that fills
staging pages, layer range by layer range, and each range is copied into vLLM's blocks
with ``index_copy_`` just before the first of its layers computes; a save copies each
layer's newly complete blocks into staging right after the layer's attention wrote them,
and one kvtier job stores them after the forward pass, in the background. On a GPU the
copies are device copies on vLLM's stream: a save's job starts once they have run (a
thread of the worker waits for them, so vLLM's thread never waits for the GPU here, and the
blocks are stored even when vLLM has nothing more to run), and a load's pages
are reused once the copies out of them have run (see ``staging``). vLLM's
per-layer tensors are views of ``[blocks, ...]`` in any stride order: a staged block is
the block in its logical order, whatever vLLM's physical layout.

Invariants:
- vLLM never computes with KV this side did not check: a block whose load did not complete
  in every layer, in time, is reported through ``get_block_ids_with_load_errors`` in the same
  step (layer-wise loads) or before its request is reported in ``finished_recving`` (async
  loads), and vLLM recomputes it. Its request is named to the scheduler side in the same
  step (``KVTierWorkerMetadata.failed_loads``); see the scheduler side for what it does.
- Saves in flight hold at most ``StagingPages.saves`` pages of the current staging pool, so
  the pages the scheduler counts as free for loads are free: a load it admitted never fails
  for want of a page. A step's saves that do not fit keep the head of each chain, in the
  order vLLM scheduled them (the first blocks: later ones are useless without them); the
  rest is counted in ``save_blocks_dropped``.
- At most ``max_save_jobs`` saves are in flight (jobs running, or on a GPU waiting for their
  copies): a save that would start one more takes no page and is dropped (counted, and warned
  of at most every ``OVER_LIMIT_WARN_S``), so a daemon that hangs before anything has failed
  (each job waits ``save_timeout_s``) holds that many jobs, not one per finished request.
  The breaker is not tripped: a daemon that answers again stores the jobs in flight, and the
  next save is stored as before.
- A step's saves of a request whose load failed in that step, or that read a block whose
  load failed (another request's, shared through vLLM's prefix cache: ``SaveSpec.reads``),
  are not stored: vLLM computed them with attention over the failed blocks, and recomputes
  them (the scheduler side plans them again from its first failed block;
  ``save_blocks_withheld``). So are their saves in later steps until the scheduler side
  says it has seen the failure (``KVTierConnectorMetadata.rewound``): with vLLM's async
  scheduling the next step is planned, and runs, before vLLM has rewound them. A request
  planned then that reads another's failed blocks (``SaveSpec.reads``: blocks loaded in the
  last ``RECENT_STEPS`` steps) is never rewound by vLLM: nothing more of it is stored. A
  failed block is fresh again once a step has computed it for a request not tainted.
- A request whose block this worker did not store (cut, paused, failed) has a gap in its
  chain here: none of its later blocks is stored (the gap is forgotten once vLLM has
  finished the request). With ``save_durable``, a block the daemon holds but its disk tier
  did not write is no gap (the chain is held); it is counted in ``save_blocks_not_durable``.
- A staging page is reused only after its transfer ended cleanly; a transfer that timed out
  or lost its daemon retires the whole staging pool (see ``staging``). On a GPU, the next
  pool is made only once the daemon's fence of the retired one's memory has ended (kvtier is
  off for this worker until then).
- Saves never hold vLLM's blocks past the step that copies them to staging, so a request's
  blocks are released as soon as its last copy ran (``finished_sending`` in the same step).
- A failing or slow daemon costs one timeout per ``retry_after_s``, and one that does not
  answer one timeout until a health check, off vLLM's thread, finds it serving again (no
  staging pool is made meanwhile); meanwhile loads are reported failed at once and nothing
  is saved.
- A staging pool the daemon refuses (a limit or a layout that waiting does not change:
  ``staging.REFUSALS``) is logged once as an ERROR naming both sides' settings; no staging
  memory is held or made until the next try, which backs off exponentially up to
  ``staging.REFUSED_RETRY_MAX_S`` (``staging.RegistrationRefusals`` says why); meanwhile
  loads fail at once, nothing is saved, and every step's metadata says the pool is refused
  (``KVTierWorkerMetadata.staging_refused``), so the scheduler side offers no hit.

Thread-safety: none; vLLM calls the worker connector from its model-runner thread. The one
thread of the worker's own (on a GPU) touches only the saves handed to it and the client.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.client.errors import KvtierError
from kvtier.client.integrations.breaker import Breaker, daemon_answers
from kvtier.client.integrations.staging import (
    REFUSALS,
    RegistrationRefusals,
    StagingPool,
    fencing_gpu_staging,
)
from kvtier.client.integrations.vllm_config import (
    ConnectorConfig,
    ModelIdentity,
    resolve_load_mode,
    staging_pages,
)
from kvtier.client.integrations.vllm_meta import (
    RECENT_STEPS,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvtier.client.integrations.vllm_stats import Deltas
from kvtier.client.jobs import JobStatus, LoadSegment, SaveSegment, TransferJob, layer_ranges
from kvtier.client.sync import Client

log = logging.getLogger(__name__)

OVER_LIMIT_WARN_S = 60.0
"""Saves dropped at ``max_save_jobs``, and blocks of a durable save its disk did not write,
are warned of at most this often (``_BlocksToWarn``)."""


class _BlocksToWarn:
    """Blocks of one kind to warn of, in one WARNING per ``OVER_LIMIT_WARN_S`` at most with
    the blocks counted since the last."""

    def __init__(self) -> None:
        self._due_at = 0.0  # no warning before (time.monotonic())
        self._blocks = 0  # counted since the last warning

    def add(self, n: int) -> int | None:
        """Count ``n`` blocks; the blocks to warn of now, or None before the next is due."""
        self._blocks += n
        now = time.monotonic()
        if now < self._due_at:
            return None
        self._due_at = now + OVER_LIMIT_WARN_S
        n, self._blocks = self._blocks, 0
        return n


@dataclass(eq=False)
class _Load:
    """One job loading the blocks of one step's (or one async) load specs."""

    specs: list[LoadSpec]
    arena: StagingPool | None
    pages: list[int]
    block_ids: np.ndarray
    job: TransferJob | None
    deadline: float
    ranges: list[tuple[int, int]]
    ok: np.ndarray  # per block: loaded by every range waited for so far
    asynchronous: bool = False  # reported through finished_recving
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The block (index into ``block_ids``) of each key of the job."""
    copied_upto: int = 0  # layers [0, copied_upto) are in vLLM's cache (or given up)
    finished: bool = False


@dataclass(eq=False)
class _Save:
    """Blocks being copied to staging during one step, then stored by one job."""

    specs: list[SaveSpec]
    arena: StagingPool
    pages: list[int]
    block_ids: torch.Tensor
    layers_copied: set[int] = field(default_factory=set)
    job: TransferJob | None = None
    segments: list[SaveSegment] = field(default_factory=list)  # what the job stores
    stored: int = 0  # blocks in ``segments``
    # On a GPU: the mark after the copies into staging; the worker's submitting thread
    # submits the job once it has passed, then sets ``submitted`` (``error`` if it failed).
    mark: object | None = None
    error: BaseException | None = None
    failed_at: float | None = None
    submitted: threading.Event = field(default_factory=threading.Event)


def _head(spec: SaveSpec, n: int) -> SaveSpec:
    """``spec`` cut to its first ``n`` blocks."""
    keys = {rank: keys[:n] for rank, keys in spec.keys.items()}
    return SaveSpec(spec.req_id, spec.block_ids[:n], keys, spec.parents, spec.at_finish)


class WorkerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        identity: ModelIdentity,
        layer_names: Sequence[str],
        num_engine_blocks: int,
        tp_rank: int,
        pp_rank: int,
        vllm_config: Any = None,
        client: Client | None = None,
    ) -> None:
        self.config = resolve_load_mode(config, identity)  # ``auto`` decided
        self.identity = identity
        self.layer_names = list(layer_names)
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.num_layers = len(self.layer_names)
        self.num_engine_blocks = num_engine_blocks
        self.rank = pp_rank * identity.tp_size + tp_rank
        self.namespace = identity.namespace(tp_rank, pp_rank)
        self.vllm_config = vllm_config
        self.client = client or Client(
            config.address or None,
            timeout_s=max(config.load_timeout_s, config.lookup_timeout_s),
            client_name=f"vllm worker tp{tp_rank} pp{pp_rank} pid {os.getpid()}",
        )
        self.breaker = Breaker(config.retry_after_s, "transfer", probe=daemon_answers(self.client))
        self.ranges = layer_ranges(self.num_layers, min(config.layer_groups, self.num_layers))
        self.staging_pages = staging_pages(config, identity, num_engine_blocks)
        self.kv: list[torch.Tensor] = []
        self.block_shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        self.device = torch.device("cpu")
        self._arena: StagingPool | None = None
        self._generation = 0
        # The daemon's refusals of the staging pool (a limit or a layout it will not take):
        # when to try again, and whether the scheduler side was told (see ``_refused``).
        self.refusals = RegistrationRefusals(config.retry_after_s)
        self._told_refused = False
        self._load: _Load | None = None  # this step's layer-wise load
        self._async_loads: list[_Load] = []
        self._step_save: _Save | None = None
        self._step_save_tried = False  # this step's saves were taken up at its first layer
        self._save_jobs: list[_Save] = []
        # Saves whose jobs the submitting thread starts once their copies into staging ran.
        self._copying: list[_Save] = []
        self._submit_queue: queue.SimpleQueue[_Save | None] | None = None
        self._shutting_down = False
        self._invalid: set[int] = set()
        # Engine blocks whose layer-wise load failed in an earlier step and that no step has
        # computed since: block -> (the request that loaded it, the step it failed in, as
        # ``_steps`` counts them); kept RECENT_STEPS steps at most.
        self._stale: dict[int, tuple[str, int]] = {}
        self._failed_owner: dict[int, str] = {}  # this step's failed blocks: their request
        self._steps = 0
        self._seen_in_flight: dict[int, _Save] = {}  # ``_saves_behind``
        self._done_leases: set[int] = set()
        self._failed_loads: set[str] = set()  # requests whose load failed, to report
        # Requests reported in failed_loads whose rewind the scheduler side has not yet
        # confirmed (meta.rewound): their saves are withheld meanwhile.
        self._tainted: set[str] = set()
        self._broken: set[str] = set()  # requests with a block not stored: store no more
        self._warned_dropped = False
        self._over_limit = _BlocksToWarn()  # dropped at max_save_jobs
        self._not_durable = _BlocksToWarn()  # saved durable but not on disk
        self._sending: set[str] = set()  # finish-saves copied, to report
        self._finished_seen: set[str] = set()
        self._recving: set[str] = set()
        self.stats: dict[str, int] = {
            "load_blocks": 0,
            "load_blocks_failed": 0,
            "save_blocks": 0,
            "save_blocks_dropped": 0,
            "save_blocks_withheld": 0,
            "save_blocks_not_durable": 0,
            "save_jobs_failed": 0,
            "saves_over_limit": 0,
            "staging_retired": 0,
        }
        self._deltas = Deltas()

    # ----------------------------------------------------------- registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        devices = sorted({str(t.device) for t in kv_caches.values()})
        if len(devices) > 1:
            raise ValueError(f"kvtier connector: the KV cache is on several devices: {devices}")
        if devices and torch.device(devices[0]).type not in ("cpu", "cuda"):
            raise ValueError(
                f"kvtier connector: a KV cache on {devices[0]} is not supported (CPU or CUDA)"
            )
        missing = sorted(set(self.layer_names) - set(kv_caches))
        if missing:
            raise ValueError(f"kvtier connector: no KV cache tensor for layers {missing}")
        tensors = [kv_caches[name] for name in self.layer_names]
        first = tensors[0]
        seen: set[int] = set()
        for name, t in zip(self.layer_names, tensors, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"kvtier connector: layer {name} has a KV cache of another shape")
            n = self.num_engine_blocks
            if t.dim() >= 2 and t.shape[0] > n > 0 and t.shape[0] % n == 0:
                raise ValueError(
                    f"kvtier connector: vLLM splits each of its {n} KV blocks into "
                    f"{t.shape[0] // n} attention kernel blocks (the attention backend's "
                    "block size is smaller than --block-size); the connector stores whole "
                    "blocks: set --block-size to the kernel's block size"
                )
            if t.dim() < 2 or t.shape[0] != self.num_engine_blocks:
                # Any stride order will do (vLLM views one allocation per its KV cache
                # layout): blocks are copied with index ops along dimension 0.
                raise ValueError(
                    f"kvtier connector: layer {name}'s KV cache {tuple(t.shape)} is not "
                    f"[{self.num_engine_blocks} blocks, ...]"
                )
            if t.data_ptr() in seen:
                raise ValueError("kvtier connector: layers sharing one KV cache are not supported")
            seen.add(t.data_ptr())
        block_bytes = first[0].numel() * first.element_size()
        if block_bytes != self.identity.layer_block_bytes:
            raise ValueError(
                f"kvtier connector: a block of one layer holds {block_bytes} bytes, not the "
                f"{self.identity.layer_block_bytes} the namespace was derived for"
            )
        self._check_isa()
        self.kv = tensors
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        try:
            self._staging()  # a refusal is logged there, once
        except KvtierError as e:
            self.breaker.trip(e)
        except OSError as e:
            # The staging region could not be made (/dev/shm too small or full): a setting
            # to change, said at start as for a GPU without room.
            raise RuntimeError(
                f"kvtier connector: cannot make the "
                f"{self.staging_pages.total * self.identity.block_bytes >> 20} MiB shared-memory "
                "staging region (set the connector's staging_bytes lower, or give /dev/shm more "
                f"room, e.g. a pod's emptyDir medium: Memory sizeLimit): {e}"
            ) from None
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"kvtier connector: no room on {self.device} for "
                f"{self.staging_pages.total * self.identity.block_bytes >> 20} MiB of staging "
                "pages (set the connector's staging_bytes lower, or vLLM's "
                f"gpu_memory_utilization): {e}"
            ) from None
        where = (
            "in private CPU memory: staged through a shared-memory pool"
            if self.device.type == "cpu"
            else f"on {self.device}: staged through a GPU memory pool registered over CUDA IPC"
        )
        if self.staging_registered():
            state = "registered"
        elif self.refusals.refused:
            state = "REFUSED by the daemon (see the error above): kvtier is off for this worker"
        else:
            state = "not registered yet (the daemon did not answer): made at first use"
        log.info(
            "kvtier connector (worker rank %d): %d layers, %d blocks of %d tokens, %s; "
            "KV cache %s of %d pages (%d MiB, %d pages of it for saves), %s; loads %s in %d "
            "layer ranges; namespace %s %s",
            self.rank,
            self.num_layers,
            self.num_engine_blocks,
            self.identity.block_tokens,
            self.identity.kv_dtype,
            where,
            self.staging_pages.total,
            self.staging_pages.total * self.identity.block_bytes >> 20,
            self.staging_pages.saves,
            state,
            self.config.load_mode,
            len(self.ranges),
            self.namespace.model,
            self.namespace.kv_layout,
        )

    def _check_isa(self) -> None:
        """On the CPU, the attention layers' kernel must be the one the namespace names."""
        if self.vllm_config is None:
            return
        context = getattr(self.vllm_config.compilation_config, "static_forward_context", {})
        expected = self.identity.kv_layout.rsplit("isa=", 1)[-1]
        for name in self.layer_names:
            isa = getattr(context.get(name), "isa", None)
            if isa is not None and isa != expected:
                raise ValueError(
                    f"kvtier connector: layer {name} runs the {isa!r} attention kernel, "
                    f"not the {expected!r} one its namespace was derived for"
                )

    @property
    def staging_generation(self) -> int:
        """How many staging pools this worker has made (one more after each retirement)."""
        return self._generation

    def staging_registered(self) -> bool:
        """Whether the current staging pool is registered in a live session (no RPC)."""
        return self._arena is not None and not self._arena.retired and self._arena.registered()

    def saves_in_flight(self) -> int:
        """Saves not yet stored: on a GPU, saves handed to the submitting thread (seen again
        at the next step's calls), and save jobs still running (no RPC; finished ones are
        reaped on the next step)."""
        running = sum(1 for s in self._save_jobs if s.job is not None and not s.job.done())
        return running + len(self._copying)

    def _staging(self) -> StagingPool | None:
        """The current staging pool, created on first use or after one was retired; None
        while the daemon's refusal of it stands (see ``_refused``)."""
        arena = self._arena
        if arena is not None and not arena.retired:
            if arena.registered():
                return arena
            arena.retire("the daemon no longer holds it (its session ended)", unclean=False)
        if not self.kv or not self.breaker.ok():
            return None
        if fencing_gpu_staging():
            # A retired pool's GPU memory waits for the daemon's fence: no second pool
            # meanwhile (loads fail at once, saves are dropped), so a slow daemon holds one
            # pool's memory rather than one more per retirement.
            return None
        if self.refusals.standing():
            return None  # no new region until the refusal may have changed
        assert self.dtype is not None
        try:
            self._arena = StagingPool(
                self.client,
                num_layers=self.num_layers,
                num_pages=self.staging_pages.total,
                block_tokens=self.identity.block_tokens,
                block_shape=self.block_shape,
                dtype=self.dtype,
                namespace=self.namespace,
                generation=self._generation + 1,
                device=self.device,
            )
        except REFUSALS as e:
            self._refused(e)
            return None
        self._generation += 1
        if self.refusals.refused:
            log.info(
                "kvtier connector (worker rank %d): the daemon took the staging pool after %d "
                "refusals; kvtier is used again",
                self.rank,
                self.refusals.accepted(),
            )
        return self._arena

    def _refused(self, error: KvtierError) -> None:
        """The daemon will not register the staging pool as asked (``staging.REFUSALS``): a
        limit below the pool's size or count, a layout or memory it cannot use. Waiting
        ``retry_after_s`` would not change that, and each try makes a region of the pool's
        whole size: one ERROR names what to change on either side, kvtier is off for this
        worker (loads fail at once, nothing is stored, and the scheduler side is told to
        offer no hit: ``KVTierWorkerMetadata.staging_refused``), and tries back off
        exponentially up to ``staging.REFUSED_RETRY_MAX_S`` (``RegistrationRefusals`` says
        why). The breaker is not tripped: the daemon is up and fast, and its pause would
        warn again at every try."""
        first = self.refusals.news(error)
        wait = self.refusals.refuse(error)
        pool_bytes = self.staging_pages.total * self.identity.block_bytes
        if not first:
            log.debug(
                "kvtier connector: staging pool refused again (%s); next try in %.3gs", error, wait
            )
            return
        log.error(
            "kvtier connector (worker rank %d): the daemon refused this worker's staging pool "
            "of %d bytes (%d pages of %d bytes, sized by the connector's staging_bytes=%d) "
            "with %s: %s. kvtier is off for this worker: vLLM runs without it (no hit is "
            "offered, nothing is stored). To use kvtier, change the daemon's setting named "
            "above (its config; a daemon restart applies it: a SIGHUP reloads no pool limit) so that it "
            "allows this pool of %d bytes, or, for a limit on bytes, lower the connector's "
            "staging_bytes (kv_connector_extra_config) below it; the pool "
            "is tried again in %.3gs, then at doubling intervals up to %.0fs",
            self.rank,
            pool_bytes,
            self.staging_pages.total,
            self.identity.block_bytes,
            self.config.staging_bytes,
            type(error).__name__,
            error,
            pool_bytes,
            wait,
            self.refusals.max_s,
        )

    def _alloc(self, n: int, *, save: bool = False) -> tuple[StagingPool, list[int]] | None:
        """``n`` pages of the current staging pool (none for ``n`` 0); for a save, as many as
        the saves' share has free, up to ``n`` (the rest of the pool is the loads', which the
        scheduler counts on)."""
        self._reap_saves()
        try:
            arena = self._staging()
        except (KvtierError, torch.OutOfMemoryError, OSError) as e:
            # No daemon, or (a later generation) no room for the pages on the GPU or in
            # /dev/shm: kvtier pauses for retry_after_s rather than failing vLLM's step.
            self.breaker.trip(e)
            return None
        if arena is None:
            return None
        if save:
            n = min(n, self.staging_pages.saves - self._save_pages(arena))
        if n <= 0:
            return None
        pages = arena.alloc(n)
        return (arena, pages) if pages is not None else None

    def _save_pages(self, arena: StagingPool) -> int:
        """Pages of ``arena`` that saves hold (this step's, and the jobs in flight)."""
        saves = [*self._save_jobs, *self._copying, self._step_save]
        return sum(len(s.pages) for s in saves if s is not None and s.arena is arena)

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        if not meta.loads:
            return
        load = self._submit_load(meta.loads, layerwise=self.config.load_mode == "layerwise")
        if self.config.load_mode == "layerwise":
            self._load = load
        else:
            self._async_loads.append(load)

    def _submit_load(self, specs: list[LoadSpec], *, layerwise: bool) -> _Load:
        block_ids = np.asarray([b for s in specs for b in s.block_ids], dtype=np.int64)
        ranges = self.ranges if layerwise else [(0, self.num_layers)]
        load = _Load(
            specs,
            None,
            [],
            block_ids,
            None,
            time.monotonic() + self.config.load_timeout_s,
            ranges,
            np.zeros(len(block_ids), dtype=bool),
            asynchronous=not layerwise,
        )
        self.stats["load_blocks"] += len(block_ids)
        if not self.breaker.ok():
            self._give_up(load, "kvtier is paused after a failure")
            return load
        got = self._alloc(len(block_ids))
        if got is None:
            self._give_up(load, "no staging pages (or no staging pool)")
            return load
        load.arena, load.pages = got
        segments = []
        rows: list[int] = []
        offset = 0
        for spec in specs:
            n = len(spec.block_ids)
            # A block without a key (never expected) is never loaded, so it is reported.
            k = min(n, len(spec.keys.get(self.rank, [])))
            keys = spec.keys.get(self.rank, [])[:k]
            segments.append(
                LoadSegment(keys, load.pages[offset : offset + k], spec.leases.get(self.rank, 0))
            )
            rows.extend(range(offset, offset + k))
            offset += n
        load.rows = np.asarray(rows, dtype=np.int64)
        try:
            load.job = self.client.submit_load(
                load.arena.pool,
                segments,
                layer_groups=ranges,
                timeout_s=self.config.load_timeout_s,
            )
        except KvtierError as e:
            self.breaker.trip(e)
            self._give_up(load, f"submit failed: {e}")
        return load

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._load
        if load is None or load.finished:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        while not load.finished and load.copied_upto <= layer:
            end = next(e for b, e in load.ranges if b <= load.copied_upto < e)
            if not self._advance(load, end):
                break

    def _advance(self, load: _Load, end: int) -> bool:
        """Wait for layers up to ``end`` and copy them in; False when the load gave up."""
        assert load.job is not None and load.arena is not None
        mask = load.job.wait_layers(end, max(0.0, load.deadline - time.monotonic()))
        if mask is None:
            self._give_up(load, f"not loaded within {self.config.load_timeout_s}s")
            return False
        load.ok = np.zeros(len(load.block_ids), dtype=bool)
        load.ok[load.rows] = mask
        rows = np.flatnonzero(load.ok)  # blocks (not job keys: a block may have no key)
        if len(rows):
            pages = [load.pages[i] for i in rows]
            # On the CPU: runs of consecutive blocks copy as slices (``staging``).
            blocks = torch.from_numpy(load.block_ids[rows])
            for layer in range(load.copied_upto, end):
                load.arena.scatter(layer, pages, self.kv[layer], blocks)
        load.copied_upto = end
        if end >= self.num_layers:
            self._finish_load(load)
        return True

    def _finish_load(self, load: _Load) -> None:
        """Every layer is in (or given up): report the blocks that failed, free the pages."""
        if load.finished:
            return
        load.finished = True
        failed = load.block_ids[~load.ok]
        self._invalid.update(int(b) for b in failed)
        self.stats["load_blocks_failed"] += len(failed)
        if load.job is not None and load.arena is not None:
            self._check_job(load.job.poll(), "load", load.arena)
        if load.arena is not None:
            load.arena.free(load.pages)
        offset = 0
        for spec in load.specs:
            n = len(spec.block_ids)
            if not load.ok[offset : offset + n].all():
                self._failed_loads.add(spec.req_id)
                if not load.asynchronous:
                    for b in np.asarray(spec.block_ids)[~load.ok[offset : offset + n]]:
                        self._failed_owner[int(b)] = spec.req_id
            offset += n
            lease = spec.leases.get(self.rank)
            if lease:
                self._done_leases.add(lease)
            if load.asynchronous:
                self._recving.add(spec.req_id)
        if len(failed):
            # While the staging pool is refused the ERROR said so once; the loads planned
            # before the scheduler side learnt of it fail here without a warning each.
            log.log(
                logging.DEBUG if self.refusals.refused else logging.WARNING,
                "kvtier connector: %d of %d blocks did not load; vLLM recomputes them",
                len(failed),
                len(load.block_ids),
            )

    def _give_up(self, load: _Load, why: str) -> None:
        """Fail every block of the load not yet in vLLM's cache in every layer."""
        if load.job is not None and not load.job.done():
            load.job.cancel()
        load.ok = np.zeros(len(load.block_ids), dtype=bool)
        load.copied_upto = self.num_layers
        if load.job is not None:
            self.breaker.trip(TimeoutError(why))
        log.debug("kvtier connector: load of %d blocks failed: %s", len(load.block_ids), why)
        self._finish_load(load)

    def _check_job(self, status: JobStatus, what: str, arena: StagingPool) -> None:
        if status.error is not None:
            self.breaker.trip(status.error, at=status.ended_at)
        if not status.pages_reusable and not arena.retired:
            self.stats["staging_retired"] += 1
            arena.retire(f"a {what} job ended uncleanly ({status.state.value})")

    # ------------------------------------------------------------------ saves

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, meta: KVTierConnectorMetadata
    ) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        save = self._step_save
        if save is None:
            if self._step_save_tried:
                return  # dropped at the first layer: a later layer cannot start it
            self._step_save_tried = True
            specs = [s for s in meta.saves if not s.at_finish]
            if not specs:
                return
            save = self._start_save(specs)
            if save is None:
                return
            self._step_save = save
        if layer in save.layers_copied:
            return
        # The registered view (checked at start), not ``kv_layer``: vLLM may hand the
        # attention a view of other (kernel) blocks.
        save.arena.gather(layer, save.pages, self.kv[layer], save.block_ids)
        save.layers_copied.add(layer)

    def _start_save(self, specs: list[SaveSpec]) -> _Save | None:
        """Take staging pages for ``specs``' blocks, or for the longest prefix of each chain
        that the saves' share has room for (see ``_fit``); the rest is dropped."""
        specs = self._skip_broken(specs)
        nblocks = sum(len(s.block_ids) for s in specs)
        if not nblocks:
            return None
        self._reap_saves()
        if self.breaker.ok() and self.saves_in_flight() >= self.config.max_save_jobs:
            # The daemon is hung or crawling: one more job would only wait behind these.
            self.stats["saves_over_limit"] += 1
            self._drop(specs, [0] * len(specs), over_limit=True)
            return None
        got = self._alloc(nblocks, save=True) if self.breaker.ok() else None
        if got is None:
            # Paused, or the saves' share is full of saves in flight: nothing is stored.
            self._drop(specs, [0] * len(specs))
            return None
        arena, pages = got
        if len(pages) < nblocks:
            kept = self._fit(specs, len(pages))
            self._drop(specs, kept)
            specs = [_head(s, k) for s, k in zip(specs, kept, strict=True) if k]
        # On the CPU: runs of consecutive blocks copy as slices (``staging``).
        blocks = torch.as_tensor([b for s in specs for b in s.block_ids], dtype=torch.long)
        return _Save(specs, arena, pages, blocks)

    @staticmethod
    def _fit(specs: list[SaveSpec], pages: int) -> list[int]:
        """How many of each spec's first blocks ``pages`` pages store, in the order vLLM
        scheduled them: a chain's later blocks are of no use without its first ones, so a
        spec that is cut keeps its head, and the specs after it get nothing."""
        kept = []
        for spec in specs:
            k = min(len(spec.block_ids), pages)
            kept.append(k)
            pages -= k
        return kept

    def _drop(self, specs: list[SaveSpec], kept: list[int], *, over_limit: bool = False) -> None:
        """Count the blocks of ``specs`` past their first ``kept`` as dropped; their
        requests' chains now have a gap here, so nothing more of them is stored.
        ``over_limit``: dropped because ``max_save_jobs`` jobs are in flight."""
        dropped = 0
        for spec, k in zip(specs, kept, strict=True):
            if k < len(spec.block_ids):
                dropped += len(spec.block_ids) - k
                self._broken.add(spec.req_id)
        if not dropped:
            return
        self.stats["save_blocks_dropped"] += dropped
        if over_limit:
            self._warn_over_limit(dropped)
        elif not self._warned_dropped and self.breaker.ok() and not self.refusals.refused:
            self._warned_dropped = True
            log.warning(
                "kvtier connector: saves outgrew their %d staging pages; %d blocks not stored "
                "(raise staging_bytes or staging_save_share to store more)",
                self.staging_pages.saves,
                dropped,
            )
        else:
            log.debug("kvtier connector: %d blocks not stored", dropped)

    def _warn_over_limit(self, dropped: int) -> None:
        """One WARNING per ``OVER_LIMIT_WARN_S`` at most while saves meet ``max_save_jobs``
        (a hang drops a save at every step), with the blocks dropped since the last one."""
        since = self._over_limit.add(dropped)
        if since is None:
            log.debug("kvtier connector: %d blocks not stored (max_save_jobs)", dropped)
            return
        log.warning(
            "kvtier connector: %d save jobs in flight (max_save_jobs), the daemon is slow or "
            "does not answer; %d blocks not stored since the last such warning (warned at "
            "most every %.0fs; the worker's save_blocks_dropped counts them all)",
            self.config.max_save_jobs,
            since,
            OVER_LIMIT_WARN_S,
        )

    def _skip_broken(self, specs: list[SaveSpec]) -> list[SaveSpec]:
        """Drop the specs that continue a chain this worker already failed to store a block
        of: stored after that gap, a block can never be found."""
        broken = [s for s in specs if s.req_id in self._broken]
        if not broken:
            return specs
        self.stats["save_blocks_dropped"] += sum(len(s.block_ids) for s in broken)
        return [s for s in specs if s.req_id not in self._broken]

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        load = self._load
        if load is not None:
            if not load.finished:
                # The forward pass did not wait for every layer (it should have): vLLM may
                # have computed with blocks not yet copied in, so all of them are reported.
                log.error("kvtier connector: a load was not waited for in every layer")
                self._give_up(load, "not waited for")
            self._load = None
        save, self._step_save = self._step_save, None
        self._step_save_tried = False
        self._tainted -= meta.rewound  # planned again from where vLLM rewound them
        if save is not None:
            if len(save.layers_copied) == self.num_layers:
                unrewound = self._taint(save.specs)
                self._submit_save(save, withhold=self._failed_loads | self._tainted | unrewound)
            else:
                self._lost(save)
        finish = [s for s in meta.saves if s.at_finish]
        if finish:
            self._save_finished_requests(finish)
        # The next step may have been planned before vLLM sees these failures.
        self._tainted |= self._failed_loads
        self._age_stale()
        self._reap_saves()

    def _taint(self, specs: list[SaveSpec]) -> set[str]:
        """Requests that read a block whose load failed (through vLLM's prefix cache:
        ``SaveSpec.reads``) computed this step's blocks over it. Failed in this step: vLLM
        rewinds them too, and here they count as failed loads (their blocks withheld, the
        scheduler side told to plan them again). Failed in an earlier step (async scheduling
        planned this one before vLLM saw it): vLLM does not rewind them, so nothing more of
        them is stored (``_broken``); returned, to withhold this step's blocks. A failed
        block this step computes for a request not tainted (a rewound request recomputing
        it) is fresh again: each layer writes the step's KV before its attention reads any."""
        unrewound: set[str] = set()
        if not self._invalid and not self._stale:
            return unrewound
        for spec in specs:
            if spec.req_id not in self._failed_loads and self._invalid.intersection(spec.reads):
                self._failed_loads.add(spec.req_id)
        tainted = self._failed_loads | self._tainted
        if self._stale:
            for spec in specs:
                if spec.req_id not in tainted:
                    for b in spec.block_ids:
                        self._stale.pop(b, None)
        for spec in specs:
            if spec.req_id in tainted or not spec.reads or not self._stale:
                continue
            # (A request's own failed blocks are what it recomputes once rewound.)
            if any(self._stale.get(b, (spec.req_id,))[0] != spec.req_id for b in spec.reads):
                unrewound.add(spec.req_id)
                self._broken.add(spec.req_id)
        return unrewound

    def _age_stale(self) -> None:
        """At a step's end: this step's failed layer-wise blocks become stale, blocks this
        step computed (saved now) are fresh again, and stale blocks older than RECENT_STEPS
        steps are forgotten."""
        self._steps += 1
        for b, req_id in self._failed_owner.items():
            self._stale[b] = (req_id, self._steps)
        self._failed_owner = {}
        if self._stale:
            oldest = self._steps - RECENT_STEPS
            self._stale = {b: v for b, v in self._stale.items() if v[1] > oldest}

    def _save_finished_requests(self, specs: list[SaveSpec]) -> None:
        """Copy finished requests' blocks to staging now; vLLM may free them right after."""
        save = self._start_save(specs)
        if save is not None:
            for layer in range(self.num_layers):
                save.arena.gather(layer, save.pages, self.kv[layer], save.block_ids)
            save.layers_copied = set(range(self.num_layers))
            self._submit_save(save, withhold=self._tainted)
        self._sending.update(s.req_id for s in specs)

    def _submit_save(self, save: _Save, withhold: set[str] | frozenset[str] = frozenset()) -> None:
        """Store ``save``'s blocks, but those of the requests in ``withhold`` (whose load failed
        in the step that computed them: see ``wait_for_save``). On a GPU the copies into
        staging run after this returns: the worker's submitting thread starts the job once
        they have, so vLLM's thread never waits for its forward pass here, and the blocks are
        stored even if vLLM calls the worker no more (it stops when it has nothing to run)."""
        if not self._prepare(save, withhold):
            return
        save.mark = save.arena.mark()
        if save.mark is None or save.arena.passed(save.mark):
            self._submit_job(save)
            self._started(save)
            return
        self._copying.append(save)
        if self._submit_queue is None:
            self._submit_queue = queue.SimpleQueue()
            threading.Thread(
                target=self._submit_when_copied,
                args=(self._submit_queue,),
                name="kvtier-save-submit",
                daemon=True,
            ).start()
        self._submit_queue.put(save)

    def _prepare(self, save: _Save, withhold: set[str] | frozenset[str]) -> bool:
        """The job's segments: ``save``'s blocks but those of ``withhold``'s requests; False
        (pages freed) when none is left."""
        offset = 0
        for spec in save.specs:
            n = len(spec.block_ids)
            if spec.req_id in withhold:
                # Computed by attention over blocks that failed to load: wrong KV, which vLLM
                # recomputes (it rewinds the request to its first failed block); the
                # scheduler side plans these blocks again from there. Stored now, they would
                # be kept over the right ones (a block already held is not stored again).
                self.stats["save_blocks_withheld"] += n
            else:
                save.segments.append(
                    SaveSegment(
                        spec.keys[self.rank],
                        save.pages[offset : offset + n],
                        spec.parents.get(self.rank, b""),
                    )
                )
                save.stored += n
            offset += n
        save.specs = [s for s in save.specs if s.req_id not in withhold]  # what a failure breaks
        if not save.segments:
            save.arena.free(save.pages)
            return False
        return True

    def _submit_job(self, save: _Save) -> None:
        """Start ``save``'s job (on vLLM's thread, or the submitting thread: it touches only
        ``save`` and the client, which threads may share)."""
        try:
            save.job = self.client.submit_save(
                save.arena.pool,
                save.segments,
                durable=self.config.save_durable,
                timeout_s=self.config.save_timeout_s,
            )
        except Exception as e:  # KvtierError; anything else is not to kill the thread
            save.error, save.failed_at = e, time.monotonic()
        save.submitted.set()

    def _submit_when_copied(self, saves: queue.SimpleQueue[_Save | None]) -> None:
        """The submitting thread: each save's job, in order, once its copies have run."""
        while (save := saves.get()) is not None:
            try:
                save.arena.wait(save.mark)
                if self._shutting_down:
                    raise RuntimeError("the worker shut down before the save's copies ran")
            except Exception as e:
                save.error, save.failed_at = e, time.monotonic()
                save.submitted.set()
                continue
            self._submit_job(save)

    def _started(self, save: _Save) -> None:
        """Account for a save whose submission has ended (on vLLM's thread)."""
        if save.error is None:
            self.stats["save_blocks"] += save.stored
            self._save_jobs.append(save)
            return
        if not isinstance(save.error, KvtierError):
            log.error("kvtier connector: a save job could not start", exc_info=save.error)
        self.breaker.trip(save.error, at=save.failed_at)
        self.stats["save_blocks_dropped"] += save.stored
        self._broken.update(s.req_id for s in save.specs)
        save.arena.free(save.pages)

    def _submit_copied(self, wait_s: float | None = None) -> None:
        """Account for the saves the submitting thread has submitted, in the order they were
        made; with ``wait_s``, wait up to that long for the others."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while self._copying:
            save = self._copying[0]
            if not save.submitted.is_set() and (
                deadline is None or not save.submitted.wait(max(0.0, deadline - time.monotonic()))
            ):
                return
            self._copying.pop(0)
            self._started(save)

    def _lost(self, save: _Save) -> None:
        """A save that had its pages and is not stored after all: counted, pages freed."""
        self.stats["save_blocks_dropped"] += len(save.block_ids)
        self._broken.update(spec.req_id for spec in save.specs)
        save.arena.free(save.pages)

    def _reap_saves(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        self._submit_copied(wait_s if wait_s else None)
        running = []
        for save in self._save_jobs:
            assert save.job is not None
            status = (
                save.job.wait(max(0.0, deadline - time.monotonic())) if wait_s else save.job.poll()
            )
            if not status.finished:
                running.append(save)
                continue
            if status.error is not None:
                self.stats["save_jobs_failed"] += 1
                self._broken.update(spec.req_id for spec in save.specs)
            if status.persisted is not None:
                self._count_not_durable(int(np.count_nonzero(status.done & ~status.persisted)))
            self._check_job(status, "save", save.arena)
            save.arena.free(save.pages)
        self._save_jobs = running

    def _count_not_durable(self, n: int) -> None:
        """Count a durable save's blocks the daemon holds but its disk tier did not write (no
        room there, the disk degraded or failing), with one WARNING per ``OVER_LIMIT_WARN_S``
        at most: the engine asked for them on disk, and they are in memory only."""
        if not n:
            return
        self.stats["save_blocks_not_durable"] += n
        since = self._not_durable.add(n)
        if since is None:
            return
        log.warning(
            "kvtier connector: %d saved blocks are not on the daemon's disk tier though "
            "save_durable asked for it (no room there, or the disk is degraded: see `kvtier "
            "stats`); they are held in memory only (warned at most every %.0fs; the worker's "
            "save_blocks_not_durable counts them all)",
            since,
            OVER_LIMIT_WARN_S,
        )

    # --------------------------------------------------------------- results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._submit_copied()
        for load in list(self._async_loads):
            if load.job is not None and not load.finished:
                if load.job.done():
                    self._advance(load, self.num_layers)
                elif time.monotonic() >= load.deadline:
                    self._give_up(load, f"not loaded within {self.config.load_timeout_s}s")
            if load.finished:
                self._async_loads.remove(load)
        # A finish-save's request id comes in finished_req_ids of the step that carries the
        # save; vLLM accepts only ids it has passed here.
        seen = self._finished_seen | finished_req_ids
        sending = self._sending & seen
        self._sending -= sending
        self._finished_seen = seen - sending if self._sending else set()
        recving, self._recving = self._recving, set()
        self._broken -= finished_req_ids
        self._tainted -= finished_req_ids
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        """What the scheduler side learns after the step: leases done, loads failed, and
        whether the staging pool is refused (True every step while it is, so that the OR of
        the workers' metadata says so whichever worker reports first; False once, in the
        step after a try was accepted). A refused pool whose next try is due is tried here,
        so a worker that is offered no loads and stores nothing still tries."""
        if self.refusals.refused and self.refusals.due():
            try:
                self._staging()
            except (KvtierError, torch.OutOfMemoryError, OSError) as e:
                self.breaker.trip(e)
        refused: bool | None = self.refusals.refused
        if not refused and not self._told_refused:
            refused = None  # nothing to tell
        self._told_refused = self.refusals.refused
        if not self._done_leases and not self._failed_loads and refused is None:
            return None
        meta = KVTierWorkerMetadata(self._done_leases, self._failed_loads, refused)
        self._done_leases, self._failed_loads = set(), set()
        return meta

    def take_stats(self) -> dict[str, int]:
        """The counters' increments since the last call, and the saves in flight
        (``Deltas``: vLLM's per-step connector stats)."""
        return self._deltas.take(self.stats, {"save_jobs_behind": self._saves_behind()})

    def _saves_behind(self) -> int:
        """The saves in flight now that were in flight at the last ``take_stats`` already: a
        backlog. A step's own save usually still runs when vLLM takes the step's stats, and
        vLLM takes none once idle, so the saves in flight themselves read 1 on an idle engine
        that keeps up. The saves of the last call are kept (``_seen_in_flight``) so that an
        id is not reused by a new one meanwhile."""
        now = {id(s): s for s in self._save_jobs if s.job is not None and not s.job.done()}
        now.update((id(s), s) for s in self._copying)
        behind = sum(1 for k in now if k in self._seen_in_flight)
        self._seen_in_flight = now
        return behind

    def shutdown(self) -> None:
        """Let saves in flight finish (up to ``shutdown_timeout_s``), then let go."""
        if self._save_jobs or self._copying:
            self._reap_saves(wait_s=self.config.shutdown_timeout_s)
        self._shutting_down = True  # the submitting thread starts no more jobs
        self.breaker.close()
        if self._submit_queue is not None:
            self._submit_queue.put(None)
        for save in self._save_jobs:
            assert save.job is not None
            save.job.cancel()
        for load in self._async_loads:
            if load.job is not None:
                load.job.cancel()
        if self._arena is not None:
            if self._save_jobs or self._async_loads or self._copying:
                self._arena.retire("shutdown with transfers in flight")
            else:
                self._arena.close()
        self.client.close()
