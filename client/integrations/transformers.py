"""Prefix reuse for Hugging Face transformers models through kvtier.

``KVTierPrefixCache`` wraps a causal LM and a kvtier ``Client``. For a prompt it finds the
longest prefix whose KV blocks kvtier holds, loads them into a ``DynamicCache``, runs the
forward pass only on the remaining tokens, and stores the new full blocks back::

    with Client() as client, KVTierPrefixCache(model, client, block_tokens=64) as kv:
        logits, cache, reused = kv.prefill(input_ids)
        out = kv.generate(input_ids, max_new_tokens=32)   # greedy; out.tokens, out.ttft_s

Data path. Each instance owns one shared-memory staging pool, created and registered once and
reused by every call (it is replaced only after a transfer that ended without an answer). It
is laid out ``[pages, layers, 2 (K, V), kv_heads, block_tokens, head_dim]`` in the model's
dtype: page i holds one whole block, and each chunk is the ``[kv_heads, block_tokens,
head_dim]`` slice ("HND") of a ``DynamicCache`` layer tensor ``[1, kv_heads, seq, head_dim]``,
so moving a run of blocks between the cache and the pool is one strided tensor copy per layer
and per K/V. Sequences longer than the pool move through it in chunks of ``staging_tokens``.

Invariants:
- At least one prompt token is always computed, so ``prefill`` has logits to return: when the
  whole prompt is stored, the last block is recomputed rather than loaded.
- Only full blocks are stored, and only blocks whose KV this process computed (or loaded);
  the key of block i chains blocks 0..i, so a block is never reused after a different prefix.
- The namespace binds the model (config and weights fingerprints), the KV dtype, the block
  size and the chunk layout; engines that differ in any of them never share a block.
- kvtier is an optimisation: a ``KvtierError`` while loading or storing is logged and counted,
  and the prompt is computed as if nothing were stored. Errors of the model or of this
  module's arguments propagate, and so does a failure to register the pool when an instance
  is built (a wrong address fails fast; a daemon lost later is only a miss).
- A failure costs one timeout, not one per call: after it, loads and stores skip kvtier
  (counted as ``skipped_loads`` and ``skipped_stores``) for ``retry_after_s``, or, for a
  daemon that did not answer, until a health check off the caller's thread, every
  ``retry_after_s``, finds it serving again (``Breaker``).
- Staging pages hold one transfer's blocks at a time. A transfer that ended without an answer
  (a timeout, a lost connection) may still be copied by the daemon later, so its memory takes
  no other block: it is unregistered without waiting and replaced by fresh memory, which the
  next transfer registers.

Scope: batch size 1, decoder-only models whose layers are all plain full-attention
``DynamicLayer``s (Llama, Mistral without sliding window, Qwen2, ...), multi-head or
grouped-query attention. Sliding-window, linear-attention and MLA caches are refused at
construction. The pool is host memory; a model on a GPU works through plain tensor copies
between its device and the pool (not yet measured or tested; CPU is).

Thread-safety: an instance is not thread-safe (calls share the staging pool); use one per
thread, or serialise calls. Several instances may share one ``Client``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, NamedTuple

import numpy as np
import torch

from kvtier.client.errors import InvalidArgumentError, KvtierError, unclean
from kvtier.client.flows import PoolBinding
from kvtier.client.integrations.breaker import Breaker, daemon_answers
from kvtier.client.keys import Namespace, block_keys
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.sync import Client, RegisteredPool
from kvtier.client.types import (
    MAX_SECONDS,
    Tier,
    checked_int,
    checked_type,
    int_field_range,
    shown,
)
from kvtier.kernels.layout import DTYPE_ITEMSIZE, PoolLayout
from kvtier.proto import kvtier_pb2 as pb

try:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import DynamicLayer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvtier.client.integrations.transformers needs transformers 5.x: "
        "pip install 'kvtier[transformers]'"
    ) from e

log = logging.getLogger(__name__)

KV_LAYOUT = "HND"
"""Byte order inside one chunk: ``[kv_heads, block_tokens, head_dim]``."""

FINGERPRINT_SAMPLES = 4096
"""Elements sampled (evenly strided) from each weight tensor for the weights fingerprint."""

# Config entries that change nothing in the KV cache: runtime switches, provenance and the
# parameter dtype (the KV dtype is a namespace field of its own).
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
        "dtype",
        "torch_dtype",
    }
)


# ------------------------------------------------------------------ model identity


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of a model's KV cache: per layer, K and V of ``[batch, kv_heads, seq, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> KVGeometry:
        """Layers, KV heads and head size from the (text) config; the dtype from the
        parameters, since ``config.dtype`` is often unset. ``store`` checks every cache tensor
        against this, so a model whose cache differs is refused, never stored wrongly."""
        config = _text_config(model)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(int(config.num_hidden_layers), kv_heads, int(head_dim), _model_dtype(model))

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def chunk_bytes(self, block_tokens: int) -> int:
        return self.num_kv_heads * block_tokens * self.head_dim * self.itemsize

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


def config_fingerprint(model: PreTrainedModel) -> str:
    """SHA-256 of the model's config as canonical JSON, less the entries in
    ``_CONFIG_KEYS_IGNORED`` (they change nothing in the KV cache)."""
    raw = model.config.to_dict()
    data = _drop_ignored(raw)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def weights_fingerprint(model: PreTrainedModel, samples: int = FINGERPRINT_SAMPLES) -> str:
    """SHA-256 over every parameter's name, shape, dtype and ``samples`` evenly strided values.

    Cheap (a few MB read even for large models), and any real change of weights (another
    checkpoint, a fine-tune, a merged adapter, another quantisation) changes it; it is not a
    proof that two checkpoints are identical. Pass ``revision`` (say, a hub commit) to
    ``KVTierPrefixCache`` to bind an exact checkpoint as well.
    """
    h = hashlib.sha256(b"kvtier-hf-weights-v1")
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        sample = flat[::step][:samples]
        if sample.device.type == "meta":
            raise ValueError(f"parameter {name} is on the meta device; load the weights first")
        h.update(f"{name}|{tuple(param.shape)}|{param.dtype}|".encode())
        h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def namespace_for(
    model: PreTrainedModel,
    block_tokens: int,
    *,
    model_id: str = "",
    revision: str = "",
    tenant: str = "default",
) -> Namespace:
    """The kvtier namespace of ``model``'s KV blocks.

    ``model`` is ``model_id`` or the config's ``model_type``; ``extra`` carries the config and
    weights fingerprints, so two models share blocks only when both match, whatever they are
    called. ``kv_dtype`` is the model's dtype and ``kv_layout`` is ``"HND"``.
    """
    geometry = KVGeometry.from_model(model)
    config = model.config
    return Namespace(
        model=model_id or str(getattr(config, "model_type", "") or type(model).__name__),
        revision=revision,
        kv_dtype=geometry.dtype_name,
        kv_layout=KV_LAYOUT,
        block_tokens=block_tokens,
        tenant=tenant,
        extra=(
            f"transformers;config={config_fingerprint(model)};weights={weights_fingerprint(model)}"
        ),
    )


# ----------------------------------------------------------------------- results


class PrefillResult(NamedTuple):
    """What ``prefill`` returns; unpacks as ``logits, cache, reused_tokens``."""

    logits: torch.Tensor
    """Logits of the last prompt position, ``[1, vocab]``."""
    cache: DynamicCache
    """KV of the whole prompt; continue decoding with it."""
    reused_tokens: int
    """Leading prompt tokens whose KV came from kvtier instead of being computed."""


@dataclass(frozen=True, slots=True)
class Generation:
    """Greedy decoding of one prompt."""

    tokens: list[int]
    """New tokens, the first one included (at most ``max_new_tokens``)."""
    reused_tokens: int
    ttft_s: float
    """From the call to the first new token (load, prefill and the argmax)."""
    total_s: float


# ----------------------------------------------------------------- the integration


class KVTierPrefixCache:
    """Prefill and greedy generation of a transformers causal LM with kvtier prefix reuse.

    ``staging_tokens`` sizes the staging pool (rounded up to whole blocks); longer prompts
    move through it in chunks. ``model_id``, ``revision`` and ``tenant`` go into the namespace
    (see ``namespace_for``). ``lease_ms`` is the pin lease of each load (0: daemon default).
    ``retry_after_s``: how long kvtier is skipped after a failure (see the module docstring).

    Thread-safety: not thread-safe (see the module docstring).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        client: Client,
        *,
        block_tokens: int = 64,
        staging_tokens: int = 4096,
        model_id: str = "",
        revision: str = "",
        tenant: str = "default",
        lease_ms: int = 0,
        retry_after_s: float = 5.0,
    ) -> None:
        # Each checked before it is compared: a str or None raised TypeError from "<", a NaN
        # or infinite staging_tokens a ValueError or OverflowError from rounding it up.
        block_tokens = checked_int(block_tokens, "block_tokens", minimum=1)
        staging_tokens = checked_int(staging_tokens, "staging_tokens")
        seconds: object = retry_after_s  # typeshed has no float as a Real: mypy took none
        if isinstance(seconds, (bool, np.bool_)) or not isinstance(seconds, Real):
            raise InvalidArgumentError(
                f"retry_after_s: expected a number of seconds, not {shown(retry_after_s)}"
            )
        if not 0 < retry_after_s <= MAX_SECONDS:
            raise ValueError(
                f"retry_after_s must be positive and finite (at most {MAX_SECONDS:g} s)"
            )
        if staging_tokens < block_tokens:
            raise ValueError("staging_tokens must hold at least one block")
        high = int_field_range(pb.PoolLayout, "num_pages")[1] * block_tokens
        if staging_tokens > high:  # whole pages, as many as a layout holds
            raise InvalidArgumentError(
                f"staging_tokens: must hold at most {high} tokens ({shown(staging_tokens)})"
            )
        for name, text in (("model_id", model_id), ("revision", revision), ("tenant", tenant)):
            checked_type(text, str, name)  # a model_id of 0 or None took the model's type
        # A pinning Lookup's lease_ms: a value it does not hold (True, 1.5 or one out of its
        # range) was refused at every load.
        lease_ms = checked_int(lease_ms, "lease_ms")
        high = int_field_range(pb.LookupRequest, "lease_ms")[1]
        if not 0 <= lease_ms <= high:
            raise InvalidArgumentError(
                f"lease_ms: must be from 0 to {high} ms (the lease_ms of a Lookup)"
            )
        self.model = model
        self.client = client
        self.block_tokens = block_tokens
        self.lease_ms = lease_ms
        self.geometry = KVGeometry.from_model(model)
        if self.geometry.dtype_name not in DTYPE_ITEMSIZE:
            raise ValueError(f"KV dtype {self.geometry.dtype_name} is not one kvtier stores")
        self._cache_arg = _check_supported(model, self.geometry)
        self.namespace = namespace_for(
            model, block_tokens, model_id=model_id, revision=revision, tenant=tenant
        )
        g = self.geometry
        self.num_pages = -(-staging_tokens // block_tokens)  # in ints: no float overflow
        self.layout = PoolLayout.staging(
            num_layers=g.num_layers,
            num_pages=self.num_pages,
            block_tokens=block_tokens,
            chunk_bytes=g.chunk_bytes(block_tokens),
            kv_count=2,
            dtype=g.dtype_name,
        )
        self._shm: SharedMemoryPool | None = SharedMemoryPool.for_layout(self.layout)
        try:
            self.pool: RegisteredPool = client.register_pool(self._shm, self.layout, self.namespace)
        except BaseException:
            self._shm.close()
            raise
        self._staging: torch.Tensor | None = self._staging_view(self._shm)
        self._counters: Counter[str] = Counter()
        self._seconds: dict[str, float] = defaultdict(float)
        self.breaker = Breaker(retry_after_s, "prefix cache", probe=daemon_answers(client))
        log.info(
            "kvtier prefix cache for %s: %d layers x %d kv heads x %d dims (%s), "
            "%d-token blocks of %d bytes, staging pool of %d pages (%d MiB)",
            self.namespace.model,
            g.num_layers,
            g.num_kv_heads,
            g.head_dim,
            g.dtype_name,
            block_tokens,
            self.layout.block_bytes,
            self.num_pages,
            self.layout.extent_bytes >> 20,
        )

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Unregister and free the staging pool. The cache objects handed out stay valid.
        While kvtier is paused after a failure (see the module docstring) the pool is
        unregistered without waiting for the answer: a daemon that did not answer cost
        ``close()`` one more client timeout, on the thread that shuts the engine down."""
        if self._shm is None:
            return
        paused = not self.breaker.ok()
        self.breaker.close()
        self._staging = None
        with contextlib.suppress(KvtierError):
            if paused:
                self.client.unregister_pool_nowait(self.pool.binding)
            else:
                self.pool.unregister()
        self._shm.close()
        self._shm = None

    def __enter__(self) -> KVTierPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, float]:
        """A snapshot of counters (tokens, blocks, errors) and seconds spent per phase."""
        out: dict[str, float] = dict(self._counters)
        out.update({f"{k}_s": v for k, v in self._seconds.items()})
        return out

    # ----------------------------------------------------------------- API

    def prefill(self, input_ids: Any, *, store: bool = True) -> PrefillResult:
        """Prefill a prompt, reusing its longest stored prefix.

        ``input_ids``: a sequence of ints, a 1-D tensor or a ``[1, n]`` tensor. With ``store``,
        the prompt's new full blocks are stored before returning; an engine that wants the
        first token sooner passes ``store=False`` and calls ``store`` afterwards.
        """
        ids = _token_array(input_ids)
        logits, cache, reused = self._prefill(ids)
        if store:
            self.store(ids, cache, start_token=reused)
        return PrefillResult(logits, cache, reused)

    def generate(
        self,
        input_ids: Any,
        max_new_tokens: int,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        store: bool = True,
    ) -> Generation:
        """Greedy decoding. Stops after ``max_new_tokens`` or at ``eos_token_id`` (None:
        never early). With ``store``, the prompt's blocks are stored right after the first
        token, and the full blocks of prompt plus answer at the end, so that a follow-up turn
        reuses the whole conversation."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        stop = _stop_set(eos_token_id)
        start = time.perf_counter()
        ids = _token_array(input_ids)
        logits, cache, reused = self._prefill(ids)
        token = int(logits[0].argmax())
        ttft = time.perf_counter() - start
        held = self.store(ids, cache, start_token=reused) if store else 0
        tokens = [token]
        device = _model_device(self.model)
        with torch.inference_mode():
            while len(tokens) < max_new_tokens and token not in stop:
                pos = len(ids) + len(tokens) - 1
                out = self.model(
                    input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[pos]], device=device),
                    use_cache=True,
                    logits_to_keep=1,
                    **{self._cache_arg: cache},
                )
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
        if store and len(tokens) > 1:
            # The cache holds the prompt and every new token but the last (never fed back).
            seq = np.concatenate([ids, np.asarray(tokens[:-1], dtype=np.int64)])
            self.store(seq, cache, start_token=held)
        return Generation(tokens, reused, ttft, time.perf_counter() - start)

    def load(self, input_ids: Any) -> tuple[DynamicCache, int]:
        """A cache holding the longest stored prefix of ``input_ids`` that leaves at least one
        token to compute, and that prefix's length in tokens (0: nothing stored)."""
        ids = _token_array(input_ids)
        loadable = (len(ids) - 1) // self.block_tokens
        keys = block_keys(self.namespace, ids[: loadable * self.block_tokens])
        return self._load(keys)

    def store(self, input_ids: Any, cache: DynamicCache, *, start_token: int = 0) -> int:
        """Store the full blocks of ``input_ids`` whose KV ``cache`` holds, from the block
        containing ``start_token`` on (the blocks before it are taken to be stored already,
        e.g. because they were loaded). Returns the leading tokens now held: ``start_token``
        rounded down to a block, plus what this call stored or found stored."""
        ids = _token_array(input_ids)
        self._live_staging()
        bt = self.block_tokens
        nblocks = min(len(ids), cache.get_seq_length()) // bt
        first = min(start_token // bt, nblocks)
        if first == nblocks:
            return first * bt
        if not self.breaker.ok():
            self._counters["skipped_stores"] += 1
            return first * bt
        keys = block_keys(self.namespace, ids[: nblocks * bt])
        t0 = time.perf_counter()
        held = first
        try:
            for lo in range(first, nblocks, self.num_pages):
                hi = min(nblocks, lo + self.num_pages)
                self._cache_to_staging(cache, lo, hi)
                parent = keys[lo - 1] if lo else b""
                got = self.pool.store_keys(keys[lo:hi], range(hi - lo), parent_key=parent)
                held += got
                if got < hi - lo:
                    self._counters["store_rejected_blocks"] += hi - lo - got
                    break
        except KvtierError as e:
            self._counters["store_errors"] += 1
            log.warning("kvtier store failed; continuing without it: %s", e)
            self._after_error(e)
            self.breaker.trip(e)
        self._counters["stored_blocks"] += held - first
        self._seconds["store"] += time.perf_counter() - t0
        return held * bt

    # ------------------------------------------------------------- internals

    def _prefill(self, ids: np.ndarray) -> tuple[torch.Tensor, DynamicCache, int]:
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        self._live_staging()
        t0 = time.perf_counter()
        cache, reused = self.load(ids)
        t1 = time.perf_counter()
        device = _model_device(self.model)
        suffix = torch.as_tensor(ids[reused:], device=device).unsqueeze(0)
        # Positions continue after the loaded prefix; the causal mask is derived from the
        # cache length, which the loaded layers already report.
        positions = torch.arange(reused, len(ids), device=device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(
                input_ids=suffix,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
        if cache.get_seq_length() != len(ids):
            raise RuntimeError(
                f"the cache holds {cache.get_seq_length()} tokens after a prefill of {len(ids)}"
            )
        self._counters["prefills"] += 1
        self._counters["reused_tokens"] += reused
        self._counters["computed_tokens"] += len(ids) - reused
        self._seconds["load"] += t1 - t0
        self._seconds["compute"] += time.perf_counter() - t1
        return out.logits[:, -1, :], cache, reused

    def _load(self, keys: list[bytes]) -> tuple[DynamicCache, int]:
        g, bt = self.geometry, self.block_tokens
        if not keys:
            return self._new_cache(None), 0
        if not self.breaker.ok():
            self._counters["skipped_loads"] += 1
            return self._new_cache(None), 0
        try:
            # An unpinned lookup sizes the destination; the loads below pin what they read.
            found = self.client.lookup(keys)
        except KvtierError as e:
            self._counters["load_errors"] += 1
            log.warning("kvtier lookup failed; computing the whole prompt: %s", e)
            self.breaker.trip(e)
            return self._new_cache(None), 0
        n = found.prefix_len
        if n == 0:
            return self._new_cache(None), 0
        for tier in found.tiers[:n]:
            self._counters[f"found_{Tier(tier).name.lower()}_blocks"] += 1
        device = _model_device(self.model)
        shape = (1, g.num_kv_heads, n * bt, g.head_dim)
        ks = [torch.empty(shape, dtype=g.dtype, device=device) for _ in range(g.num_layers)]
        vs = [torch.empty(shape, dtype=g.dtype, device=device) for _ in range(g.num_layers)]
        loaded = 0
        try:
            while loaded < n:
                want = min(n - loaded, self.num_pages)
                chunk = keys[loaded : loaded + want]
                got = self.pool.load_keys(chunk, range(want), lease_ms=self.lease_ms)
                self._staging_to_tensors(ks, vs, loaded, loaded + got)
                loaded += got
                if got < want:
                    break  # evicted since the lookup: use what arrived
        except KvtierError as e:
            self._counters["load_errors"] += 1
            log.warning("kvtier load failed after %d blocks; computing the rest: %s", loaded, e)
            self._after_error(e)
            self.breaker.trip(e)
        self._counters["loaded_blocks"] += loaded
        if loaded == 0:
            return self._new_cache(None), 0
        tokens = loaded * bt
        if loaded < n:
            ks = [k[:, :, :tokens] for k in ks]
            vs = [v[:, :, :tokens] for v in vs]
        return self._new_cache(zip(ks, vs, strict=True)), tokens

    def _new_cache(
        self, layers: Iterable[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> DynamicCache:
        config = self.model.config
        if layers is None:
            return DynamicCache(config=config)
        return DynamicCache(list(layers), config=config)

    def _cache_to_staging(self, cache: DynamicCache, lo: int, hi: int) -> None:
        """Copy blocks ``lo..hi`` of ``cache`` into staging pages ``0..hi-lo``."""
        staging = self._live_staging()
        g, bt, m = self.geometry, self.block_tokens, hi - lo
        if len(cache.layers) != g.num_layers:
            raise ValueError(f"the cache has {len(cache.layers)} layers, the model {g.num_layers}")
        for layer_idx, layer in enumerate(cache.layers):
            if not isinstance(layer, DynamicLayer):
                raise ValueError(f"cache layer {layer_idx} is a {type(layer).__name__}")
            for kv, tensor in enumerate((layer.keys, layer.values)):
                if tensor is None or tensor.dtype != g.dtype or tensor.dim() != 4:
                    raise ValueError(f"cache layer {layer_idx} is not a {g.dtype} 4-D tensor")
                if (
                    tensor.shape[0] != 1
                    or tensor.shape[1] != g.num_kv_heads
                    or (tensor.shape[3] != g.head_dim)
                ):
                    raise ValueError(
                        f"cache layer {layer_idx} has shape {tuple(tensor.shape)}; expected "
                        f"[1, {g.num_kv_heads}, seq, {g.head_dim}]"
                    )
                # [heads, m*bt, dim] -> [m, heads, bt, dim]: one strided copy per tensor.
                src = tensor[0, :, lo * bt : hi * bt].unflatten(1, (m, bt)).transpose(0, 1)
                staging[:m, layer_idx, kv].copy_(src)

    def _staging_to_tensors(
        self, ks: list[torch.Tensor], vs: list[torch.Tensor], lo: int, hi: int
    ) -> None:
        """Copy staging pages ``0..hi-lo`` into blocks ``lo..hi`` of per-layer K/V tensors."""
        if hi <= lo:
            return
        staging = self._live_staging()
        bt, m = self.block_tokens, hi - lo
        for layer_idx in range(self.geometry.num_layers):
            for kv, dst in enumerate((ks[layer_idx], vs[layer_idx])):
                view = dst[0, :, lo * bt : hi * bt].unflatten(1, (m, bt))
                view.copy_(staging[:m, layer_idx, kv].transpose(0, 1))

    def _staging_view(self, shm: SharedMemoryPool) -> torch.Tensor:
        """[page, layer, kv, head, token, dim]: the staging layout, as a tensor view."""
        g = self.geometry
        shape = (self.num_pages, g.num_layers, 2, g.num_kv_heads, self.block_tokens, g.head_dim)
        return shm.tensor(g.dtype, shape)

    def _after_error(self, error: KvtierError) -> None:
        """Replace the staging memory when the failed transfer may still be copied by the
        daemon (see the module invariants). The old memory stays mapped by the daemon for as
        long as a copy uses it; the new one is registered by the next Put or Get."""
        if not unclean(error) or self._shm is None:
            return
        shm = SharedMemoryPool.for_layout(self.layout)
        with contextlib.suppress(KvtierError):
            self.client.unregister_pool_nowait(self.pool.binding)
        self._staging = None
        self._shm.close()
        self._shm, self._staging = shm, self._staging_view(shm)
        self.pool = RegisteredPool(self.client, PoolBinding(shm, self.layout, self.namespace))
        self._counters["staging_replaced"] += 1

    def _live_staging(self) -> torch.Tensor:
        if self._staging is None:
            raise RuntimeError("this KVTierPrefixCache is closed")
        return self._staging


# ----------------------------------------------------------------------- helpers


def _text_config(model: PreTrainedModel) -> Any:
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _model_dtype(model: PreTrainedModel) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    raise ValueError("the model has no floating-point parameters")


def _model_device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _check_supported(model: PreTrainedModel, geometry: KVGeometry) -> str:
    """The name of the forward argument that takes the cache; raises ValueError for models
    whose cache this integration cannot fill."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        arg = "cache"
    elif "past_key_values" in params:  # transformers < 5.x releases that renamed it
        arg = "past_key_values"
    else:
        raise ValueError(f"{type(model).__name__}.forward takes no cache argument")
    if "logits_to_keep" not in params or "position_ids" not in params:
        raise ValueError(f"{type(model).__name__} is not a supported causal LM")
    probe = DynamicCache(config=model.config)
    kinds = {type(layer).__name__ for layer in probe.layers}
    if len(probe.layers) != geometry.num_layers or kinds != {DynamicLayer.__name__}:
        raise ValueError(
            f"{type(model).__name__} uses cache layers {sorted(kinds)} for "
            f"{geometry.num_layers} layers; only plain full-attention DynamicLayer caches "
            "can be loaded from kvtier"
        )
    return arg


def _drop_ignored(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _drop_ignored(v) for k, v in value.items() if k not in _CONFIG_KEYS_IGNORED}
    if isinstance(value, list | tuple):
        return [_drop_ignored(v) for v in value]
    return value


def _token_array(input_ids: Any) -> np.ndarray:
    """Token ids as a 1-D int64 numpy array; refuses batches of more than one sequence."""
    if isinstance(input_ids, np.ndarray) and input_ids.ndim == 1 and input_ids.dtype == np.int64:
        return input_ids
    if isinstance(input_ids, torch.Tensor):
        arr = input_ids.detach().cpu().numpy()
    else:
        arr = np.asarray(input_ids)
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise ValueError(f"batch size {arr.shape[0]}; KVTierPrefixCache handles one sequence")
        arr = arr[0]
    if arr.ndim != 1:
        raise ValueError("input_ids must be 1-D or [1, n]")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, not {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _stop_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(t) for t in eos_token_id)
