"""Configuration and identity of the vLLM connector: its options, its namespace, its keys.

Everything here is computed the same way in vLLM's scheduler process and in every worker
process, from the ``VllmConfig`` both receive, so the two sides always agree on the
namespace seed and on every block key without talking to each other.

Invariants:
- Options come only from ``kv_connector_extra_config``; an unknown key or a bad value is a
  ``ValueError`` naming the key (at engine start, not at the first request).
- The namespace binds the model (name, revision, a fingerprint of its config and of its weight
  files), a speculative-decoding draft model's alike, the KV dtype, the KV layout of the
  platform and attention backend, the block size, the tensor- and pipeline-parallel rank and
  the tenant: two engines that differ in any of them never share a block.
- A request's keys follow kvtier's block-key spec over its token ids; a LoRA adapter and a
  cache salt go into the first block's extra bytes and multimodal items into the extra bytes
  of every block they overlap, so the chain never matches a request that differs in them.
- Those extra bytes are an injective encoding: every free-text field (an adapter's name and
  folder, a cache salt, a multimodal item's identifier) has the characters that delimit
  fields (``%``, ``;``, ``|``) percent-escaped, so no field can end early or pose as another
  (an adapter named ``x;salt=y`` is not adapter ``x`` with salt ``y``). Text without them is
  written as is: the keys of requests whose names and salts never held them are unchanged.
- A LoRA adapter is keyed by its name, its folder and a digest of the folder's files, never
  by vLLM's ``lora_int_id``: that number is the engine's own, and another engine (or this
  one after a restart) may give it to another adapter. An adapter that is not a local folder
  (a hub id vLLM downloads itself) has no key: what the download holds cannot be known here,
  so such requests are neither looked up nor saved.

This module imports vLLM only inside functions that need a live ``VllmConfig``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.integrations.fingerprint import (
    AdapterDigests,
    folder_name,
    same_checkpoint,
    weights_dir_fingerprint,
)
from kvtier.client.keys import KEY_BYTES, Namespace, block_key
from kvtier.client.types import (
    MAX_SECONDS,
    as_float,
    int_field_range,
    pool_address_problem,
    shown,
    shown_keys,
)
from kvtier.proto import kvtier_pb2 as pb

log = logging.getLogger(__name__)

KEY_SCHEME = "vllm-v1"
"""Version of how this connector derives namespaces and keys; part of every namespace."""
LORA_TAG = b"kvtier-vllm-lora-v1"
# Percent-escapes of the characters that delimit a request's extra-byte fields: ";" between
# fields, "|" inside a LoRA key, and "%" itself, so the escaping can be undone.
_FIELD_ESCAPES = str.maketrans({"%": "%25", ";": "%3B", "|": "%7C"})

_SAVE_POLICIES = ("all", "prompt", "none")
_LOAD_MODES = ("auto", "layerwise", "async")
_TIER_NAMES = {"l0": 1, "l1": 2, "l2": 3, "l3": 4}
# hf_config entries that change nothing in the KV cache.
_CONFIG_KEYS_IGNORED = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_experts_implementation",
        "attn_implementation",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "architectures",
        "dtype",
        "torch_dtype",
    }
)


@dataclass(frozen=True)
class NamespaceOptions:
    """Overrides of namespace fields (``kv_connector_extra_config["namespace"]``)."""

    model: str = ""
    revision: str = ""
    tenant: str = "default"
    extra: str = ""
    weights_fingerprint: bool = True
    """Hash the weight files' names, sizes and sampled bytes (a few hundred KiB read, and
    three small reads per safetensors tensor: see ``fingerprint``)."""


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's options, from ``kv_connector_extra_config``.

    Every field is a key of that dict (``namespace`` is a nested dict); defaults in
    ``defaults()``.
    """

    address: str = ""
    """kvtierd's Unix socket (``unix:PATH``); empty: ``$KVTIER_ADDRESS``, else the default
    socket (``kvtier.paths``), as for ``Client``. Any other address (TCP ``host:port``) is
    refused at start: the daemon takes memory pools only on its Unix socket
    (``pool_address_problem``)."""
    load: bool = True
    save: str = "all"
    """Which computed blocks are stored: ``all`` (prompt and generated), ``prompt``, ``none``."""
    load_mode: str = "auto"
    """``layerwise``: the load runs during the forward pass that uses it, each layer waited
    for just before its attention; ``async``: the request waits (outside the batch) until
    its blocks are in, then joins a later step; ``auto``: layerwise with one worker, async
    with several (``resolve_load_mode``)."""
    load_tiers: tuple[str, ...] = ("l0", "l1", "l2", "l3")
    """Tiers a load may come from; a block found only in another tier ends the hit."""
    save_durable: bool = False
    """Ask the daemon to answer saves only once its disk tier has written them; a block it
    did not write (no room there, the disk degraded) is held above the disk and counted in
    ``save_blocks_not_durable`` (warned of at most every ``OVER_LIMIT_WARN_S``)."""
    layer_groups: int = 8
    """A load is split into this many layer ranges (at most one per layer)."""
    min_load_blocks: int = 1
    lookup_timeout_s: float = 0.5
    load_timeout_s: float = 5.0
    save_timeout_s: float = 30.0
    retry_after_s: float = 5.0
    """After a failed call, kvtier is not asked again for this long (requests run as if
    nothing were cached, and nothing is saved); after a call the daemon did not answer, not
    until a health check, made this often off vLLM's threads, finds it serving."""
    lease_ms: int = 30_000
    hint_ms: int = 30_000
    """A request vLLM leaves waiting in its queue has its hit protected from eviction (and
    promoted from lower tiers) for this long, by a Prefetch with this deadline; 0: never."""
    staging_bytes: int = 512 << 20
    """Shared-memory staging pool of each worker (CPU); capped at the KV cache's size."""
    staging_save_share: float = 0.5
    """The part of the staging pool that saves in flight may hold; loads have the rest to
    themselves (see ``StagingPages``)."""
    shutdown_timeout_s: float = 10.0
    """How long shutdown waits for saves in flight."""
    max_save_jobs: int = 16
    """Save jobs a worker keeps in flight at most (each waits up to ``save_timeout_s``); a
    save that would start one more is not stored (counted in ``save_blocks_dropped`` and
    ``saves_over_limit``, no staging page taken). A daemon that answers ends a job in
    milliseconds (1 MiB of blocks 2 ms, 16 MiB 9 ms, 64 MiB 84 ms into L1, measured on a
    2-core machine), so a worker has a few in flight at most; a daemon that hangs (each
    job waits ``save_timeout_s``) or crawls reaches the limit."""
    allow_failing_requests: bool = False
    """Keep vLLM's ``kv_load_failure_policy`` as set; by default the connector sets it to
    ``recompute``, so that a failed kvtier load costs a recompute, never the request."""
    namespace: NamespaceOptions = field(default_factory=NamespaceOptions)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        if extra is not None and not isinstance(extra, Mapping):
            # dict() of it raised TypeError (or took a list of pairs); an empty one passed.
            raise ValueError(
                f"kvtier connector: kv_connector_extra_config must be a dict, not {shown(extra)}"
            )
        extra = dict(extra or {})
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(extra) - set(names)
        if unknown:
            raise ValueError(
                f"kvtier connector: unknown kv_connector_extra_config key(s) "
                f"{shown_keys(unknown)}; "
                f"known: {sorted(names)}"
            )
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            values[key] = _convert(key, names[key].type, raw)
        cfg = cls(**values)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if (problem := pool_address_problem(self.address)) is not None:
            raise ValueError(f"kvtier connector: kv_connector_extra_config['address']: {problem}")
        if self.save not in _SAVE_POLICIES:
            raise ValueError(f"kvtier connector: save must be one of {_SAVE_POLICIES}")
        if self.load_mode not in _LOAD_MODES:
            raise ValueError(f"kvtier connector: load_mode must be one of {_LOAD_MODES}")
        bad = [t for t in self.load_tiers if t not in _TIER_NAMES]
        if bad or not self.load_tiers:
            raise ValueError(
                f"kvtier connector: load_tiers {list(self.load_tiers)} must name some of "
                f"{sorted(_TIER_NAMES)}"
            )
        for name in (
            "layer_groups",
            "min_load_blocks",
            "staging_bytes",
            "max_save_jobs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"kvtier connector: {name} must be at least 1")
        if not 0 < self.staging_save_share < 1:
            raise ValueError("kvtier connector: staging_save_share must be between 0 and 1")
        # Sent as a pinning Lookup's lease_ms and a Prefetch's deadline_ms: a value those
        # fields do not hold was refused at every call (no load pinned, no hint sent).
        for name, low, (message, wire) in (
            ("lease_ms", 1, (pb.LookupRequest, "lease_ms")),
            ("hint_ms", 0, (pb.PrefetchRequest, "deadline_ms")),
        ):
            high = int_field_range(message, wire)[1]
            if not low <= getattr(self, name) <= high:
                raise ValueError(
                    f"kvtier connector: {name} must be from {low} to {high} ms (the "
                    f"{wire} of a {message.DESCRIPTOR.name.removesuffix('Request')})"
                )
        for name in (
            "lookup_timeout_s",
            "load_timeout_s",
            "save_timeout_s",
            "retry_after_s",
            "shutdown_timeout_s",
        ):
            # inf passed "> 0" and failed later in a thread: gRPC's deadline, Event.wait; so
            # did a time past MAX_SECONDS (the client refuses it, naming no option).
            if not 0 < getattr(self, name) <= MAX_SECONDS:
                raise ValueError(
                    f"kvtier connector: {name} must be positive and finite (at most "
                    f"{MAX_SECONDS:g} s)"
                )

    @property
    def load_tier_values(self) -> frozenset[int]:
        """Wire values (``kvtier.proto.Tier``) of the tiers a load may come from."""
        return frozenset(_TIER_NAMES[t] for t in self.load_tiers)


def _convert(key: str, typ: Any, raw: Any) -> Any:
    typ = str(typ)
    where = f"kvtier connector: kv_connector_extra_config[{key!r}]"
    if key == "namespace":
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be a dict")
        fields = {f.name: f for f in dataclasses.fields(NamespaceOptions)}
        unknown = set(raw) - set(fields)
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {shown_keys(unknown)}; known: {sorted(fields)}"
            )
        return NamespaceOptions(
            **{k: _convert(f"namespace.{k}", fields[k].type, v) for k, v in raw.items()}
        )
    if typ == "bool":
        if not isinstance(raw, bool):
            raise ValueError(f"{where} must be true or false, not {shown(raw)}")
        return raw
    if typ == "int":
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"{where} must be an integer, not {shown(raw)}")
        return raw
    if typ == "float":
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ValueError(f"{where} must be a number, not {shown(raw)}")
        return as_float(raw)
    if typ == "str":
        if not isinstance(raw, str):
            raise ValueError(f"{where} must be a string, not {shown(raw)}")
        return raw
    if typ.startswith("tuple"):
        # Not str() of any item: an int past 4,300 digits raised Python's ValueError, naming
        # no option (and no item but a str names a tier).
        if isinstance(raw, str) or not isinstance(raw, Sequence):
            raise ValueError(f"{where} must be a list of strings")
        if not all(isinstance(x, str) for x in raw):
            raise ValueError(f"{where} must be a list of strings, not {shown(raw)}")
        return tuple(x.lower() for x in raw)
    raise AssertionError(f"unhandled option type {typ} for {key}")


# ------------------------------------------------------------------ namespace


@dataclass(frozen=True)
class ModelIdentity:
    """What a namespace says about the engine, computed once per process."""

    model: str
    revision: str
    kv_dtype: str
    kv_layout: str
    block_tokens: int
    tp_size: int
    pp_size: int
    tenant: str
    extra: str
    num_layers: int
    layer_block_bytes: int
    """Bytes of one block of one layer (a whole per-layer block, K and V together)."""

    def namespace(self, tp_rank: int, pp_rank: int) -> Namespace:
        return Namespace(
            model=self.model,
            revision=self.revision,
            kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout,
            block_tokens=self.block_tokens,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            pp_rank=pp_rank,
            pp_size=self.pp_size,
            tenant=self.tenant,
            extra=self.extra,
        )

    def ranks(self) -> list[tuple[int, int]]:
        """Every (tp_rank, pp_rank): the scheduler looks up each rank's chain."""
        return [(t, p) for p in range(self.pp_size) for t in range(self.tp_size)]

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes


@dataclass(frozen=True)
class StagingPages:
    """A worker's staging pool in pages of one block each, in two shares.

    The scheduler admits loads only as far as ``loads`` pages go (counting the loads still in
    flight), and the worker never lets saves in flight hold more than ``saves`` pages (a save
    that does not fit is not stored). Saves run in the background for as long as the daemon
    takes, so without a share of their own they could hold pages the scheduler counted as
    free, and a load it admitted would fail for want of pages."""

    loads: int
    saves: int

    @property
    def total(self) -> int:
        return self.loads + self.saves


def staging_pages(
    config: ConnectorConfig, identity: ModelIdentity, num_engine_blocks: int
) -> StagingPages:
    """A worker's staging pages: ``staging_bytes`` worth, no more than the engine's own
    blocks, split by ``staging_save_share``, at least one page each. The worker sizes its pool
    so and the scheduler counts loads against it, so both ask here."""
    pages = min(config.staging_bytes // identity.block_bytes, num_engine_blocks)
    saves = int(pages * config.staging_save_share)
    return StagingPages(loads=max(1, pages - saves), saves=max(1, saves))


def resolve_load_mode(config: ConnectorConfig, identity: ModelIdentity) -> ConnectorConfig:
    """``config`` with ``auto`` resolved (same on the scheduler and every worker).

    With several workers (tensor or pipeline parallel) a layer-wise load that fails on one
    of them can make the others store wrong KV: vLLM computes the rest of the step over the
    failed blocks on that worker, and the next layers of every worker mix its heads (tensor
    parallel) or its hidden states (pipeline parallel), while each worker knows only its own
    failure when it stores the step's blocks. An async load ends, on every worker, before its
    request computes anything, and vLLM recomputes a block any worker failed on all of them:
    so ``auto`` is ``async`` there and ``layerwise`` (faster: the load overlaps the forward
    pass) with one worker. An explicit ``layerwise`` with several workers stands, with a
    warning at start."""
    workers = identity.tp_size * identity.pp_size
    if config.load_mode == "auto":
        return dataclasses.replace(config, load_mode="layerwise" if workers == 1 else "async")
    if config.load_mode == "layerwise" and workers > 1:
        log.warning(
            "kvtier connector: load_mode 'layerwise' with %d workers: a load that fails on one "
            "worker mid-step can make the others store blocks computed over it (wrong KV for "
            "later hits); 'auto' uses 'async' here",
            workers,
        )
    return config


def identify(vllm_config: Any, kv_cache_config: Any, options: NamespaceOptions) -> ModelIdentity:
    """The namespace fields of this engine (identical in the scheduler and the workers)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"kvtier connector: the model has {len(groups)} KV cache groups (hybrid or "
            "sliding-window attention); only models whose layers share one full-attention "
            "cache are supported"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        raise ValueError(
            f"kvtier connector: KV cache spec {type(spec).__name__} is not plain full "
            "attention; not supported"
        )
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise ValueError("kvtier connector: K and V of different head sizes are not supported")
    parallel = vllm_config.parallel_config
    cp = {
        name: int(getattr(parallel, name, 1) or 1)
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
    }
    if any(size > 1 for size in cp.values()):
        # Each rank would hold some of a block's tokens, under a namespace that names only
        # its tensor and pipeline ranks: an engine without context parallelism would load
        # one rank's share as the whole block.
        raise ValueError(
            "kvtier connector: context parallelism ("
            + ", ".join(f"{k}={v}" for k, v in cp.items())
            + ") splits a block's tokens across ranks; not supported"
        )
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    kv_dtype = str(spec.dtype).removeprefix("torch.")
    itemsize = spec.dtype.itemsize
    layer_block_bytes = 2 * spec.block_size * spec.num_kv_heads * spec.head_size * itemsize
    page = getattr(spec, "page_size_bytes", None)
    if isinstance(page, int) and page != layer_block_bytes:
        raise ValueError(
            f"kvtier connector: a KV page of {page} bytes is not 2 x block_size x kv_heads x "
            f"head_size x {itemsize} = {layer_block_bytes} (padded or quantised pages are "
            "not supported)"
        )
    layout = kv_layout_name(vllm_config, kv_cache_config, spec)
    extra_parts = [
        KEY_SCHEME,
        f"config={config_fingerprint(model_config.hf_config)}",
        f"weights={weights_fingerprint(vllm_config) if options.weights_fingerprint else 'off'}",
        f"quantization={model_config.quantization or ''}",
        f"cache_dtype={cache_config.cache_dtype}",
        f"heads={spec.num_kv_heads}x{spec.head_size}",
        f"layers={len(groups[0].layer_names)}",
    ]
    packing = page_packing(spec)
    if packing:
        extra_parts.append(f"packing={packing}")
    draft = draft_fingerprint(vllm_config, options.weights_fingerprint)
    if draft:
        extra_parts.append(f"draft={draft}")
    if options.extra:
        extra_parts.append(f"user={options.extra}")
    return ModelIdentity(
        model=options.model or str(model_config.model),
        revision=options.revision or str(model_config.revision or ""),
        kv_dtype=kv_dtype,
        kv_layout=layout,
        block_tokens=int(spec.block_size),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        tenant=options.tenant,
        extra=";".join(extra_parts),
        num_layers=len(groups[0].layer_names),
        layer_block_bytes=layer_block_bytes,
    )


def page_packing(spec: Any) -> str:
    """How the attention backend packs a block's K and V, when it says it does
    (``num_head_slots``, ``state_content_bytes`` of vLLM's spec: the ``H`` and ``C`` of the
    logical ``[H, N, C]`` page); empty for the dense layout (one slot per KV head, K then V),
    so that the namespaces of dense caches stay as they were. Two backends that pack a page
    differently lay out the same bytes differently: this keeps their blocks apart, whatever
    the backend's name (``auto`` picks one per machine)."""
    slots = getattr(spec, "num_head_slots", None)
    content = getattr(spec, "state_content_bytes", None)
    if slots is None and content is None:
        return ""
    return f"{slots if slots is not None else spec.num_kv_heads}x{content or 'dense'}"


def kv_layout_name(vllm_config: Any, kv_cache_config: Any, spec: Any) -> str:
    """The byte order of one per-layer block: platform, vLLM's layout name and, on CPU, the
    attention kernel's ISA (the ``vec`` and ``amx`` kernels lay a block out differently); on
    a GPU, the attention backend the engine was told to use (backends may order a block's
    K and V differently; ``auto`` when vLLM chooses, so engines that share a namespace on a
    GPU should name their backend, or let vLLM choose on the same hardware)."""
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    layout = str(getattr(kv_cache_config, "kv_cache_layout", None) or "default")
    parts = [f"vllm/{device}", layout]
    if device == "cpu":
        parts.append(f"isa={cpu_attention_isa(vllm_config, spec)}")
    else:
        parts.append(f"backend={attention_backend_name(vllm_config)}")
    return "/".join(parts)


def attention_backend_name(vllm_config: Any) -> str:
    """The attention backend vLLM's config names for full-attention layers, or ``auto``: a
    ``backend_per_kind`` entry for them overrides ``backend``, as in vLLM's selector."""
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    per_kind = getattr(attention, "backend_per_kind", None) or {}
    backend = per_kind.get("full_attention", backend)
    if backend is None:
        return "auto"
    return str(getattr(backend, "name", backend)).lower()


def cpu_attention_isa(vllm_config: Any, spec: Any) -> str:
    """The CPU attention kernel vLLM picks for this model (it decides the block layout)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # pragma: no cover - depends on the vLLM build
        log.warning("kvtier connector: cannot tell vLLM's CPU attention ISA; namespace says so")
        return "unknown"
    return str(
        _get_attn_isa(
            vllm_config.model_config.dtype,
            spec.block_size,
            spec.head_size,
            vllm_config.cache_config.cache_dtype,
        )
    )


def config_fingerprint(hf_config: Any) -> str:
    """SHA-256 of the model config as canonical JSON, less entries that change no KV."""
    raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    text = json.dumps(_drop_ignored(raw), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _drop_ignored(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_ignored(v) for k, v in value.items() if k not in _CONFIG_KEYS_IGNORED}
    if isinstance(value, list):
        return [_drop_ignored(v) for v in value]
    return value


def weights_fingerprint(vllm_config: Any) -> str:
    """A cheap fingerprint of the weights: for a local checkpoint folder, every weight file's
    name, size and 16 evenly spaced 4 KiB samples, and a safetensors file's header and a
    sample at the start, middle and end of each tensor; for random weights
    (``load_format="dummy"``) that fact (vLLM seeds them); for a hub id, nothing more than the
    id and revision already in the namespace (pin ``revision`` to bind a checkpoint)."""
    return _checkpoint_fingerprint(str(vllm_config.model_config.model), vllm_config.load_config)


def _checkpoint_fingerprint(path: str, load_config: Any) -> str:
    load_format = str(getattr(load_config, "load_format", "auto"))
    if load_format == "dummy":
        return "dummy"
    if not os.path.isdir(path):
        return "hub"
    return weights_dir_fingerprint(path, b"kvtier-vllm-weights-v1")


def draft_fingerprint(vllm_config: Any, weights: bool) -> str:
    """What binds a speculative-decoding draft model, whose attention layers are in the KV
    cache beside the target's (they are saved and loaded with them): the method, the draft's
    name (``draft_name``), revision and config, and (``weights``) its weight files as
    ``weights_fingerprint`` reads the target's, unless they are the target's own (MTP
    layers); 32 hex digits. Empty
    where the draft has no KV cache (no speculation; n-gram, suffix and custom proposers,
    whose ``draft_model_config`` is the target's: vLLM's ``uses_draft_kv_cache``), so those
    namespaces are as they were. Without it, engines of one target with different drafts
    (another checkpoint of the same architecture) shared a namespace, and one loaded the
    other's draft layers: KV its draft never computed, which costs accepted tokens."""
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    uses_kv = getattr(speculative, "uses_draft_kv_cache", None)
    if draft is None or (uses_kv is not None and not uses_kv()):
        return ""
    path = str(draft.model)
    own = same_checkpoint(path, str(vllm_config.model_config.model))
    parts = [
        str(getattr(speculative, "method", "")),
        draft_name(path, own, weights),
        str(getattr(draft, "revision", None) or ""),
        config_fingerprint(draft.hf_config),
    ]
    if weights and not own:
        load_config = getattr(speculative, "draft_load_config", None) or vllm_config.load_config
        parts.append(_checkpoint_fingerprint(path, load_config))
    return hashlib.sha256("|".join(map(_field, parts)).encode()).hexdigest()[:32]


def draft_name(path: str, own: bool, weights: bool) -> str:
    """The draft's name in ``draft_fingerprint``: a hub id as given, a local checkpoint folder
    by its last component, a symlink's by the folder's it leads to (``folder_name``), ``target``
    for the target's own checkpoint however spelled (``own``: ``same_checkpoint``). A folder's
    full path bound the draft's copy on each node where it lay: engines whose drafts were the
    same files at other paths (another mount, another cache folder) shared no block, even with
    ``namespace.model`` set to keep the target's path out of the namespace; its contents are
    bound by the weights' fingerprint. Without it (``weights`` off) the name alone binds the
    folder, so it is the full path of the folder a symlink or a relative path leads to: a last
    component (``checkpoint-1000`` of two fine-tunes, say) would let different drafts share
    blocks."""
    if own:
        return "target"
    if os.path.isdir(path):
        return folder_name(path) if weights else os.path.realpath(path)
    return path


# ----------------------------------------------------------------------- keys


def lora_key(lora: Any, digests: AdapterDigests) -> str | None:
    """What keys a request's LoRA adapter (``LoRARequest``): its name, its folder as vLLM
    resolves a local path, and the digest of the folder's files; None when it is not a local
    folder. ``lora_int_id`` is left out (see the module docstring). An adapter rewritten in
    place under a running engine is keyed by its new files from then on, while vLLM may go
    on with the weights it loaded: replace an adapter with a new folder, not in place."""
    path = str(getattr(lora, "lora_path", "") or "")
    if not path:
        return None
    # As vLLM's get_adapter_absolute_path, less its download of a path that does not exist.
    folder = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(folder):
        return None
    digest = digests.digest(folder)
    if digest is None:
        return None
    key = f"{_field(str(getattr(lora, 'lora_name', '')))}|{_field(folder)}|{digest}"
    if getattr(lora, "is_3d_lora_weight", False):
        key += "|3d"  # the same files read in another layout
    return key


def request_extras(
    request: Any, block_tokens: int, nblocks: int, lora: str = ""
) -> list[bytes] | None:
    """Per-block extra bytes of a request (its LoRA adapter's ``lora_key``, cache salt,
    multimodal items), or None when it has none."""
    first: list[str] = []
    if lora:
        first.append(f"lora={lora}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        first.append(f"salt={_field(str(salt))}")
    per_block: dict[int, list[str]] = {}
    for feature in getattr(request, "mm_features", None) or []:
        pos = feature.mm_position
        lo = pos.offset // block_tokens
        hi = (pos.offset + max(pos.length, 1) - 1) // block_tokens
        for b in range(lo, min(hi, nblocks - 1) + 1):
            item = f"mm={_field(str(feature.identifier))}@{pos.offset}+{pos.length}"
            per_block.setdefault(b, []).append(item)
    if not first and not per_block:
        return None
    extras = []
    for b in range(nblocks):
        parts = (first if b == 0 else []) + per_block.get(b, [])
        extras.append(";".join(parts).encode())
    return extras


def _field(text: str) -> str:
    """``text`` as one field of a request's extra bytes (see the module docstring)."""
    return text.translate(_FIELD_ESCAPES)


class KeyChain:
    """A request's block keys under one namespace, extended as its tokens grow.

    Thread-safety: none; one per request and rank, used by the scheduler thread.
    """

    def __init__(self, namespace: Namespace) -> None:
        self.block_tokens = namespace.block_tokens
        self._seed = namespace.seed()
        self.keys: list[bytes] = []

    def extend(
        self, token_ids: Sequence[int], nblocks: int, extras: list[bytes] | None
    ) -> list[bytes]:
        """Keys of the first ``nblocks`` full blocks of ``token_ids`` (computed once each)."""
        n = self.block_tokens
        nblocks = min(nblocks, len(token_ids) // n)
        while len(self.keys) < nblocks:
            i = len(self.keys)
            parent = self.keys[-1] if self.keys else self._seed
            extra = extras[i] if extras is not None and i < len(extras) else b""
            self.keys.append(block_key(parent, list(token_ids[i * n : (i + 1) * n]), extra))
        return self.keys[:nblocks]

    def parent_of(self, index: int) -> bytes:
        """The key before block ``index`` (empty for block 0)."""
        return self.keys[index - 1] if index > 0 else b""


assert KEY_BYTES == 32
