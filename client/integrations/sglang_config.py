"""Configuration and identity of the SGLang HiCache storage backend: its options, the byte
format of a stored page, its namespace and its keys.

Nothing here imports SGLang; host pools and storage configs are read through their
attributes, so the rules are unit-tested without it.

Invariants:
- Options come only from SGLang's ``--hicache-storage-backend-extra-config``. Keys SGLang
  itself reads there are accepted and ignored; any other unknown key, or a bad value, is a
  ``ValueError`` naming it, raised when SGLang builds the backend (at engine start).
- A stored block is exactly one SGLang *flat data page*: the bytes of
  ``host_pool.get_data_page(index, flat=True)``, the same bytes SGLang's own file backend
  writes. Whether the daemon copies them straight out of the host pool (``segments``) or
  through a staging pool, the block is the same, so both paths share blocks.
- The namespace binds the model (name, revision, a fingerprint of a local checkpoint's
  weight files), the KV dtype (and SGLang's ``--kv-cache-dtype`` where the host pool holds
  the cache as bytes, as it holds either FP8 format), SGLang's host-pool class and layout
  (which fix the page's byte order), the pool geometry, the page size, the tensor- and
  pipeline-parallel rank (MLA caches are identical on every TP rank: rank 0 of 1), the
  tenant and, where SGLang packs a speculative-decoding draft's layers into the host pool
  beside the target's (MTP drafts), the draft model (``draft_fingerprint``).
- A block's key is ``H(tag || namespace seed || str(page hash))`` over SGLang's own page
  hash, which already chains over every token before the page (and SGLang's extra key and
  cache salt), so equal keys mean an equal prefix under an equal namespace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.integrations.fingerprint import folder_name, weights_dir_fingerprint
from kvtier.client.keys import Namespace
from kvtier.client.types import (
    MAX_SECONDS,
    as_float,
    pool_address_problem,
    shown,
    shown_keys,
)
from kvtier.kernels.layout import DTYPE_ITEMSIZE, LayerLayout

KEY_SCHEME = "sglang-hicache-v1"
"""Version of how this backend derives namespaces and keys; part of every namespace."""

PAGE_KEY_TAG = b"kvtier-sglang-page-v1"
WEIGHTS_TAG = b"kvtier-sglang-weights-v1"
DRAFT_TAG = b"kvtier-sglang-draft-v1"

SGLANG_KEYS = frozenset(
    {
        # The dynamic backend's loader.
        "backend_name",
        "module_path",
        "class_name",
        # The cache controller: zero-copy calls with host indices.
        "interface_v1",
        # The host pool's allocator: "shm" puts it in shared memory (memfd).
        "allocator",
        # Read (and mostly popped) by the controllers before the backend sees the dict.
        "tp_lcm_size",
        "file_storage_path",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
"""Keys of the extra config that SGLang reads for itself; the backend ignores them."""

BYTE_DTYPES = frozenset({"uint8"})
"""Host-pool dtypes that hide the KV cache's format: SGLang holds an FP8 cache (e4m3 or e5m2)
as uint8, so two engines whose caches differ only in that format have pools alike."""

# Host-pool classes whose flat page this module can locate inside the pool's buffer.
MHA_HOST_POOL = "MHATokenToKVPoolHost"
MLA_HOST_POOL = "MLATokenToKVPoolHost"


@dataclass(frozen=True)
class NamespaceOptions:
    """Overrides of namespace fields (``namespace`` in the extra config)."""

    model: str = ""
    """Default: SGLang's model name (its model path)."""
    revision: str = ""
    tenant: str = "default"
    extra: str = ""
    weights_fingerprint: bool = True
    """When the model name is a local folder, hash its weight files' names, sizes and
    sampled bytes (a few hundred KiB read at start)."""


@dataclass(frozen=True)
class StorageOptions:
    """The backend's options: every field is a key of the extra config."""

    address: str = ""
    """kvtierd's Unix socket (``unix:PATH``); empty: ``$KVTIER_ADDRESS``, else the default
    socket. Any other address (TCP ``host:port``) is refused at start: the daemon takes
    memory pools only on its Unix socket (``pool_address_problem``)."""
    namespace: NamespaceOptions = field(default_factory=NamespaceOptions)
    lookup_timeout_s: float = 0.5
    """Bound of one ``batch_exists`` Lookup."""
    io_timeout_s: float = 5.0
    """Bound of one Put or Get (and of opening a session)."""
    retry_after_s: float = 5.0
    """After a failed call, kvtier is not asked again for this long: everything misses."""
    late_copy_grace_s: float = 1.0
    """After a transfer straight into or out of the host pool ended without an answer
    (timeout, lost connection), how long to wait before giving its pages back to SGLang,
    so that a copy the daemon had already started can finish first."""
    register_host_pool: bool = True
    """Register SGLang's host pool with the daemon when it lives in shared memory
    (``"allocator": "shm"``); false stages every transfer."""
    staging_bytes: int = 256 << 20
    """Shared-memory staging pool (legacy calls, and host pools not in shared memory)."""
    save_durable: bool = False
    """A store answers only once the daemon's disk tier has written its pages; a page it did
    not write (no room there, the disk degraded) is answered not stored (``False``), though
    the daemon holds it above the disk (no gap in its chain: the pages after it in that call
    are stored as usual; SGLang then ends that backup, and its later batches of 128 pages
    are not sent, not even to memory)."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageOptions:
        raw: Any = {} if extra is None else extra
        if isinstance(raw, Mapping):
            raw = {k: v for k, v in raw.items() if k not in SGLANG_KEYS}
        # Anything else (JSON parses a list or a number too) is refused there, naming it: its
        # items() raised AttributeError, and an empty one passed as no config.
        options: StorageOptions = _parse(cls, raw, "kvtier HiCache storage: extra config")
        options._check()
        return options

    def _check(self) -> None:
        where = "kvtier HiCache storage: extra config"
        if (problem := pool_address_problem(self.address)) is not None:
            raise ValueError(f"{where}['address']: {problem}")
        for name in ("lookup_timeout_s", "io_timeout_s", "retry_after_s"):
            # inf passed "> 0" and failed later in a thread: gRPC's deadline, Event.wait; so
            # did a time past MAX_SECONDS (the client refuses it, naming no option).
            if not 0 < getattr(self, name) <= MAX_SECONDS:
                raise ValueError(
                    f"{where}[{name!r}] must be positive and finite (at most {MAX_SECONDS:g} s)"
                )
        if not 0 <= self.late_copy_grace_s <= MAX_SECONDS:
            raise ValueError(
                f"{where}['late_copy_grace_s'] must be finite and not negative (at most "
                f"{MAX_SECONDS:g} s)"
            )
        if self.staging_bytes < 1:
            raise ValueError(f"{where}['staging_bytes'] must be at least 1")


def _parse(cls: Any, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a dict, not {shown(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {shown_keys(unknown)}; known: {sorted(fields)}")
    values = {}
    for key, value in raw.items():
        typ = str(fields[key].type)
        here = f"{where}[{key!r}]"
        if typ == "NamespaceOptions":
            values[key] = _parse(NamespaceOptions, value, here)
        elif typ == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{here} must be true or false, not {shown(value)}")
            values[key] = value
        elif typ == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{here} must be an integer, not {shown(value)}")
            values[key] = value
        elif typ == "float":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{here} must be a number, not {shown(value)}")
            values[key] = as_float(value)
        elif typ == "str":
            if not isinstance(value, str):
                raise ValueError(f"{here} must be a string, not {shown(value)}")
            values[key] = value
        else:  # pragma: no cover - a field type this parser does not know
            raise AssertionError(f"unhandled option type {typ} for {key}")
    return cls(**values)


# ------------------------------------------------------------------ page format


@dataclass(frozen=True)
class PageFormat:
    """What one SGLang host page is, in bytes."""

    pool_class: str
    layout: str
    dtype: str
    """torch's name without ``torch.``."""
    page_tokens: int
    num_pages: int
    page_numel: int
    """Elements of one flat data page."""
    itemsize: int
    geometry: str
    """Layers and heads, for the namespace."""
    format_tag: str
    """The host pool's own ``storage_format_tag`` (empty if none)."""
    segments: tuple[LayerLayout, ...] | None
    """Where a flat page's bytes lie in the pool's buffer, in flat-page order (page ``p``'s
    segment ``s`` starts at ``offset + p * page_stride``); None when this pool's buffer
    cannot be described (then transfers are staged)."""
    why_no_segments: str = ""
    draft_layers: int = 0
    """Layers of a speculative-decoding draft that SGLang packs into the pool after the
    target's (MTP drafts): part of every page, so the draft model is bound too."""

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.itemsize


def describe_host_pool(host_pool: Any) -> PageFormat:
    """The page format of an SGLang host KV pool (``HostKVCache``).

    Raises ValueError for a pool whose pages cannot be stored at all: a dtype kvtier cannot
    name, or a page size that does not divide the pool."""
    pool_class = type(host_pool).__name__
    layout = str(host_pool.layout)
    dtype = str(host_pool.dtype).removeprefix("torch.")
    if dtype not in DTYPE_ITEMSIZE:
        raise ValueError(
            f"kvtier HiCache storage: KV dtype {dtype} is not one kvtier stores "
            f"({sorted(DTYPE_ITEMSIZE)})"
        )
    itemsize = DTYPE_ITEMSIZE[dtype]
    page_tokens = int(host_pool.page_size)
    size = int(host_pool.size)
    if page_tokens < 1 or size % page_tokens:
        raise ValueError(
            f"kvtier HiCache storage: a host pool of {size} tokens is not a whole number of "
            f"{page_tokens}-token pages"
        )
    page_numel = int(host_pool.get_dummy_flat_data_page().numel())
    segments, why = _segments(host_pool, pool_class, layout, page_tokens, itemsize)
    if segments is not None and sum(s.chunk_bytes for s in segments) != page_numel * itemsize:
        segments, why = None, "its flat page is not the pages this backend locates"
    return PageFormat(
        pool_class=pool_class,
        layout=layout,
        dtype=dtype,
        page_tokens=page_tokens,
        num_pages=size // page_tokens,
        page_numel=page_numel,
        itemsize=itemsize,
        geometry=_geometry(host_pool, pool_class),
        format_tag=str(getattr(host_pool, "storage_format_tag", None) or ""),
        segments=segments,
        why_no_segments=why,
        draft_layers=_packed_draft_layers(host_pool),
    )


def _packed_draft_layers(host_pool: Any) -> int:
    layers = getattr(host_pool, "layer_num", None)
    target = getattr(host_pool, "target_layer_num", None)
    if layers is None or target is None:
        return 0
    return max(0, int(layers) - int(target))


def _geometry(host_pool: Any, pool_class: str) -> str:
    layers = getattr(host_pool, "layer_num", "?")
    if pool_class == MLA_HOST_POOL:
        return f"layers={layers},kv_cache_dim={getattr(host_pool, 'kv_cache_dim', '?')}"
    return (
        f"layers={layers},heads={getattr(host_pool, 'head_num', '?')},"
        f"head_dim={getattr(host_pool, 'head_dim', '?')},"
        f"v_head_dim={getattr(host_pool, 'v_head_dim', '?')}"
    )


def _segments(
    host_pool: Any, pool_class: str, layout: str, page_tokens: int, itemsize: int
) -> tuple[tuple[LayerLayout, ...] | None, str]:
    """The flat page as byte ranges of the pool's one contiguous buffer, for the pool
    classes and layouts whose ``get_data_page`` this mirrors."""
    buffer = getattr(host_pool, "kv_buffer", None)
    if buffer is None or not hasattr(buffer, "shape") or not buffer.is_contiguous():
        return None, "its KV buffer is not one contiguous tensor"
    if int(getattr(host_pool, "dcp_size", 1)) != 1:
        return None, "decode context parallelism maps pages through the pool"
    shape = tuple(int(d) for d in buffer.shape)
    p = page_tokens

    def seg(offset: int, page_stride: int, chunk: int) -> LayerLayout:
        return LayerLayout(
            offset=offset * itemsize,
            kv_count=1,
            kv_stride=0,
            page_stride=page_stride * itemsize,
            chunk_bytes=chunk * itemsize,
        )

    if pool_class == MHA_HOST_POOL and shape[:1] == (2,):
        if layout == "layer_first" and len(shape) == 5:
            # [2, layers, tokens, heads, dim]: the page's K of every layer, then its V
            _, layers, tokens, heads, dim = shape
            row = heads * dim
            return tuple(
                seg((kv * layers + layer) * tokens * row, p * row, p * row)
                for kv in range(2)
                for layer in range(layers)
            ), ""
        if layout == "page_first" and len(shape) == 5:
            # [2, tokens, layers, heads, dim]: the page's K (every layer), then its V
            page = p * _prod(shape[2:])
            return tuple(seg(kv * _prod(shape[1:]), page, page) for kv in range(2)), ""
        if layout in ("page_first_direct", "page_head") and len(shape) == 6:
            # [2, pages, <one page>]
            page = _prod(shape[2:])
            return tuple(seg(kv * _prod(shape[1:]), page, page) for kv in range(2)), ""
    if pool_class == MLA_HOST_POOL:
        if layout == "layer_first" and len(shape) == 4:
            # [layers, tokens, 1, dim]: the page of every layer
            layers, tokens = shape[0], shape[1]
            row = _prod(shape[2:])
            return tuple(seg(layer * tokens * row, p * row, p * row) for layer in range(layers)), ""
        if layout == "page_first" and len(shape) == 4:
            # [tokens, layers, 1, dim]: one contiguous page
            page = p * _prod(shape[1:])
            return (seg(0, page, page),), ""
        if layout == "page_first_direct" and len(shape) == 5:
            # [pages, layers, page, 1, dim]
            page = _prod(shape[1:])
            return (seg(0, page, page),), ""
    return None, f"this backend does not locate pages of {pool_class} with layout {layout}"


def _prod(dims: Iterable[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


# -------------------------------------------------------------------- namespace


def model_weights(model_name: str, format_tag: str, enabled: bool) -> str:
    """The weights part of the namespace: a fingerprint of a local checkpoint folder
    (SGLang passes its model path as the model name), ``hub`` otherwise, ``off`` if
    disabled."""
    if not enabled:
        return "off"
    path = model_name
    if format_tag and path.endswith("-" + format_tag) and not os.path.isdir(path):
        path = path[: -len(format_tag) - 1]  # SGLang appends the pool's format tag
    if not path or not os.path.isdir(path):
        return "hub"
    return weights_dir_fingerprint(path, WEIGHTS_TAG)


@dataclass(frozen=True)
class DraftModel:
    """A speculative-decoding draft model as SGLang's server arguments name it."""

    algorithm: str
    path: str
    """``--speculative-draft-model-path``: a local folder or a hub id."""
    revision: str
    load_format: str
    quantization: str
    own: bool
    """The draft's weights are the target's own checkpoint (MTP layers bundled with it)."""


def draft_fingerprint(draft: DraftModel, weights: bool) -> str:
    """What binds a draft whose layers are in the pages: the algorithm, the draft's name (a hub
    id as given, a local folder by its last component, a symlink's by the folder's it leads to
    (``folder_name``), ``target`` for the target's own checkpoint however spelled
    (``DraftModel.own``), which the namespace's weights already bind), revision, load format and
    quantization, and (``weights``) a local folder's weight files as ``model_weights`` reads the
    target's; 32 hex digits. The folder's full path would have bound its copy on each node: the
    same draft files at another path are the same draft. Without ``weights`` the name alone
    binds a folder, so it is the full path of the folder a symlink or a relative path leads to
    (as the target's model path is the target's name): its last component (``checkpoint-1000``
    of two fine-tunes, say) would let different drafts share pages."""
    if draft.own:
        name = "target"
    elif os.path.isdir(draft.path):
        name = folder_name(draft.path) if weights else os.path.realpath(draft.path)
    else:
        name = draft.path
    parts = [draft.algorithm, name, draft.revision, draft.load_format, draft.quantization]
    # Random weights (load format dummy) have no files that decide them.
    if weights and not draft.own and draft.load_format != "dummy" and os.path.isdir(draft.path):
        parts.append(weights_dir_fingerprint(draft.path, WEIGHTS_TAG))
    h = hashlib.sha256(DRAFT_TAG)
    for part in parts:
        data = part.encode("utf-8")
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.hexdigest()[:32]


def namespace_for(
    storage_config: Any,
    page: PageFormat,
    options: StorageOptions,
    kv_cache_dtype: str = "",
    draft: str = "",
) -> Namespace:
    """The namespace of one SGLang rank's host pool (``storage_config`` is SGLang's
    ``HiCacheStorageConfig``). ``kv_cache_dtype``: SGLang's ``--kv-cache-dtype``, for a pool
    whose dtype does not tell the cache's format (``BYTE_DTYPES``); empty otherwise.
    ``draft``: the ``draft_fingerprint`` of a draft packed into the pool
    (``page.draft_layers``); empty otherwise, so other namespaces are as they were."""
    model_name = str(storage_config.model_name or "")
    model = options.namespace.model or model_name
    if not model:
        raise ValueError(
            "kvtier HiCache storage: SGLang passed no model name; set namespace.model in the "
            "extra config"
        )
    replicated = bool(storage_config.is_mla_model)
    tp_rank, tp_size = (0, 1) if replicated else (storage_config.tp_rank, storage_config.tp_size)
    weights = model_weights(model_name, page.format_tag, options.namespace.weights_fingerprint)
    extra = [
        KEY_SCHEME,
        f"pool={page.pool_class}",
        f"geometry={page.geometry}",
        f"weights={weights}",
    ]
    if page.format_tag:
        extra.append(f"format={page.format_tag}")
    if kv_cache_dtype:
        extra.append(f"kv_cache_dtype={kv_cache_dtype}")
    if draft:
        extra.append(f"draft={draft}")
    if replicated:
        extra.append("tp=replicated")
    if int(storage_config.attn_cp_size) > 1:
        extra.append(f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}")
    dcp_size = int(getattr(storage_config, "dcp_size", 1))
    if dcp_size > 1:
        extra.append(f"dcp={storage_config.dcp_rank}/{dcp_size}/tp{storage_config.tp_size}")
    if options.namespace.extra:
        extra.append(f"user={options.namespace.extra}")
    return Namespace(
        model=model,
        revision=options.namespace.revision,
        kv_dtype=page.dtype,
        kv_layout=f"sglang/{page.layout}",
        block_tokens=page.page_tokens,
        tp_rank=int(tp_rank),
        tp_size=int(tp_size),
        pp_rank=int(storage_config.pp_rank),
        pp_size=int(storage_config.pp_size),
        tenant=options.namespace.tenant,
        extra=";".join(extra),
    )


# ------------------------------------------------------------------------- keys


def storage_key(seed: bytes, page_key: str) -> bytes:
    """kvtier's key of one SGLang page: ``SHA-256(PAGE_KEY_TAG || seed || str(page_key))``
    where ``str(s)`` is ``u32le(len(utf8(s))) || utf8(s)``."""
    data = page_key.encode("utf-8")
    h = hashlib.sha256(PAGE_KEY_TAG)
    h.update(seed)
    h.update(struct.pack("<I", len(data)))
    h.update(data)
    return h.digest()


def storage_keys(seed: bytes, page_keys: Iterable[str]) -> list[bytes]:
    return [storage_key(seed, k) for k in page_keys]
