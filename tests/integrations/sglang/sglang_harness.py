"""Helpers for the SGLang tests: SGLang's real host KV pools on the CPU, its real storage
config and backend factory, and its cache controller's own storage calls.

A live SGLang server does not run on this CPU-only machine (its CPU engine needs a CPU build
of sgl-kernel, which PyPI does not have), so the tests drive what the server would: the
``HiCacheController`` methods that call a storage backend, run on a stand-in for the
controller (the real one needs torch.distributed groups, a device pool and a scheduler).
"""

from __future__ import annotations

import queue
from functools import partial
from typing import Any

import torch
from sglang.srt.managers.cache_controller import (
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

MODULE = "kvtier.client.integrations.sglang"
CLASS = "KVTierHiCacheStorage"
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def mha_host_pool(
    layout: str,
    allocator: str = "shm",
    *,
    dtype: torch.dtype = torch.float16,
    page: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    layers: int = 3,
    tokens: int = 256,
    draft_layers: int = 0,
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (twice the device pool's tokens) on the CPU; with
    ``draft_layers``, the one-layer device pools of an MTP draft packed after the target's
    layers, as SGLang packs them (``HiCacheDraftMode.PACKED``)."""
    device = MHATokenToKVPool(
        tokens, page, dtype, heads, head_dim, layers, "cpu", False, start_layer=0
    )
    drafts = [
        MHATokenToKVPool(tokens, page, dtype, heads, head_dim, 1, "cpu", False, start_layer=layers)
        for _ in range(draft_layers)
    ]
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers - 1,
        draft_buffer_infos=tuple(d.get_device_pool_infos()[0].buffer_info for d in drafts),
        write_back_staging=device.hicache_write_back_staging,
    )


def mla_host_pool(
    layout: str,
    allocator: str = "shm",
    *,
    dtype: torch.dtype = torch.bfloat16,
    page: int = 4,
    kv_lora_rank: int = 16,
    rope_dim: int = 8,
    layers: int = 3,
    tokens: int = 256,
) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool on the CPU."""
    device = MLATokenToKVPool(
        tokens, page, dtype, kv_lora_rank, rope_dim, layers, "cpu", False, start_layer=0
    )
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers - 1,
        target_layer_num=layers,
    )


def storage_config(
    address: str,
    *,
    model: str = "tiny-llama",
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    interface_v1: bool = True,
    **options: Any,
) -> HiCacheStorageConfig:
    """What SGLang's controller builds for the dynamic backend: the extra config as the user
    passes it (with SGLang's own keys), plus the backend's options."""
    extra: dict[str, Any] = {
        "backend_name": "kvtier",
        "module_path": MODULE,
        "class_name": CLASS,
        "allocator": "shm",
        "address": address,
        **options,
    }
    if interface_v1:
        extra["interface_v1"] = 1
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=False,
        model_name=model,
        extra_config=extra,
    )


def attach(host: Any, config: HiCacheStorageConfig) -> Any:
    """The backend as ``HiCacheController.attach_storage_backend`` sets it up."""
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


def fill(host: Any, indices: torch.Tensor, seed: int) -> list[bytes]:
    """Write random bytes into every page ``indices`` names; returns each page's bytes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for start in page_starts(host, indices):
        page = host.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (page.numel() * page.element_size(),), generator=gen)
        page = raw.to(torch.uint8).view(page.dtype)
        host.set_from_flat_data_page(start, page)
        out.append(page_bytes(host, start))
    return out


def page_starts(host: Any, indices: torch.Tensor) -> list[int]:
    return [int(s) for s in indices[:: host.page_size]]


def page_bytes(host: Any, start: int) -> bytes:
    """A page's flat data page, as bytes (NaN-proof comparisons)."""
    return bytes(host.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy())


def pages_bytes(host: Any, indices: torch.Tensor) -> list[bytes]:
    return [page_bytes(host, s) for s in page_starts(host, indices)]


def page_hashes(token_ids: list[int], page: int) -> list[str]:
    """SGLang's own page hashes of a token sequence (what its radix tree keys storage by)."""
    hashes = get_storage_hash_str(token_ids, None, page_size=page)
    assert isinstance(hashes, list)
    return hashes


class ControllerCalls:
    """SGLang's ``HiCacheController`` storage code (hit query, backup, prefetch transfer)
    run against one backend and host pool."""

    def __init__(self, backend: Any, host: Any, *, zero_copy: bool = True) -> None:
        c = HiCacheController
        self.storage_backend = backend
        self.storage_host_pool = host
        self.mem_pool_host = host
        self.page_size = host.page_size
        self.prefetch_sync_queue: queue.Queue[Any] = queue.Queue()
        get, put = (
            (c._page_get_zero_copy, c._page_set_zero_copy)
            if zero_copy
            else (c._generic_page_get, c._generic_page_set)
        )
        self.page_get_func = partial(get, self)
        self.page_set_func = partial(put, self)
        self._page_transfer_kv_batch = partial(c._page_transfer_kv_batch, self)

    def backup(self, token_ids: list[int], host_indices: torch.Tensor) -> int:
        """Write the pages back to storage as the backup thread does; tokens stored."""
        op = StorageOperation(
            host_indices, token_ids, hash_value=page_hashes(token_ids, self.page_size)
        )
        HiCacheController._page_backup(self, op)
        return op.completed_tokens

    def hit_query(self, token_ids: list[int]) -> tuple[list[str], int]:
        """The prefetch thread's storage query: (hashes of the hit, tokens hit)."""
        op = PrefetchOperation("request", token_ids)
        return HiCacheController._storage_hit_query(self, op)  # type: ignore[no-any-return]

    def prefetch(self, token_ids: list[int], host_indices: torch.Tensor) -> int:
        """Query, then load the hit into ``host_indices`` as the prefetch I/O thread does;
        pages loaded."""
        op = PrefetchOperation("request", token_ids)
        hashes, _ = HiCacheController._storage_hit_query(self, op)
        op.hash_value = hashes
        op.host_indices = host_indices[: len(hashes) * self.page_size]
        return HiCacheController._page_transfer(self, op)  # type: ignore[no-any-return]
