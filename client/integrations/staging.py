"""Shared-memory staging for engines whose KV cache lives in private memory.

The daemon copies blocks only into and out of memory the client registered, and an engine
on the CPU allocates its KV cache itself (ordinary, unshared memory). A ``StagingPool`` is a
registered shared-memory region of ``num_pages`` pages laid out layer-major
(``[layers, pages, layer_block]``): the engine copies a block's layers between its own cache
and a page with plain tensor copies, and the daemon copies between the page and its tiers.
One page holds one whole block (every layer), so a block of layer ``l`` is the chunk
``(l, page)``, and a Get of a layer range fills exactly those layers' chunks.

Invariants:
- A page belongs to at most one transfer at a time (``alloc``/``free``).
- The region's name exists only until the daemon has mapped it, so it cannot outlive the
  engine; a daemon that lost the pool (restart) cannot map it again, and the pool is
  replaced (``registered``).
- A pool whose transfer ended uncleanly (the daemon may still be copying: see
  ``kvtier.client.jobs``) is *retired*: it takes no new transfer, and it is unregistered and
  unmapped once its last transfer has ended on the client's side. Its memory is never reused
  for other blocks, so a late copy can neither corrupt a block the engine reads nor store a
  wrong block under a key.

Thread-safety: ``alloc``, ``free`` and ``retire`` take a lock; the tensor copies are the
caller's (one engine thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.client.errors import KvtierError
from kvtier.client.keys import Namespace
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.sync import Client, RegisteredPool
from kvtier.kernels.layout import LayerLayout, PoolLayout

log = logging.getLogger(__name__)


def layer_major_layout(
    num_layers: int, num_pages: int, block_tokens: int, layer_block_bytes: int, dtype: str
) -> PoolLayout:
    """``[layers, pages, layer_block]``: one chunk (``kv_count`` 1) per layer and page."""
    layers = tuple(
        LayerLayout(
            offset=i * num_pages * layer_block_bytes,
            kv_count=1,
            kv_stride=0,
            page_stride=layer_block_bytes,
            chunk_bytes=layer_block_bytes,
        )
        for i in range(num_layers)
    )
    return PoolLayout(layers, num_pages, block_tokens, dtype)


class StagingPool:
    """One registered staging region; see the module docstring."""

    def __init__(
        self,
        client: Client,
        *,
        num_layers: int,
        num_pages: int,
        block_tokens: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        namespace: Namespace | None = None,
        generation: int = 0,
    ) -> None:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.block_shape = block_shape
        self.layer_block_bytes = int(np.prod(block_shape)) * itemsize
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.generation = generation
        dtype_name = str(dtype).removeprefix("torch.")
        self.layout = layer_major_layout(
            num_layers, num_pages, block_tokens, self.layer_block_bytes, dtype_name
        )
        self._client = client
        self.shm = SharedMemoryPool.for_layout(self.layout)
        try:
            self.pool: RegisteredPool = client.register_pool(self.shm, self.layout, namespace)
        except BaseException:
            self.shm.close()
            raise
        # The daemon has mapped it: drop the name now, so that an engine killed before it
        # can clean up (vLLM kills workers that outlive its shutdown grace period) leaves
        # no region behind in /dev/shm. A daemon that loses the pool (restart) gets a new one.
        self.shm.unlink()
        # [layers, pages, *block_shape] over the shared memory.
        self.tensor = self.shm.tensor(dtype, (num_layers, num_pages, *block_shape))
        self._lock = threading.Lock()
        self._free = np.ones(num_pages, dtype=bool)
        self._users = 0  # transfers holding pages
        self.retired = False
        self.closed = False

    def registered(self) -> bool:
        """Whether the daemon still holds this pool in the client's live session (no RPC)."""
        return self._client.live_ids(self.pool.binding) is not None

    @property
    def free_pages(self) -> int:
        with self._lock:
            return int(self._free.sum())

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free pages (a contiguous run when there is one), or None."""
        with self._lock:
            if self.retired or n > int(self._free.sum()):
                return None
            if n == 0:
                return []
            pages = _first_run(self._free, n)
            if pages is None:
                pages = np.flatnonzero(self._free)[:n]
            self._free[pages] = False
            self._users += 1
            return [int(p) for p in pages]

    def free(self, pages: Sequence[int]) -> None:
        """Give back one transfer's pages; closes a retired pool after its last transfer.
        No pages is no transfer (``alloc(0)`` counts none)."""
        if not len(pages):
            return
        with self._lock:
            self._free[list(pages)] = True
            self._users -= 1
            close = self.retired and self._users == 0
        if close:
            self.close()

    def retire(self, why: str) -> None:
        """Take no new transfers; close once the transfers holding pages have ended."""
        with self._lock:
            if self.retired:
                return
            self.retired = True
            close = self._users == 0
        log.warning(
            "kvtier staging pool generation %d retired (%s); a fresh one replaces it",
            self.generation,
            why,
        )
        if close:
            self.close()

    def close(self) -> None:
        """Unregister (without waiting: a hung daemon must not stall the engine; the
        session's end unregisters it anyway) and unmap."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(KvtierError):
            self._client.unregister_pool_nowait(self.pool.binding)
        del self.tensor
        self.shm.close()

    # ------------------------------------------------------------ tensor copies

    def layer(self, layer: int) -> torch.Tensor:
        """``[pages, *block_shape]`` of one layer."""
        return self.tensor[layer]

    def gather(
        self, layer: int, pages: Sequence[int], src: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """``staging[layer][pages] = src[blocks]`` (engine cache to staging)."""
        dst = self.tensor[layer]
        run = _as_run(pages)
        if run is not None:
            torch.index_select(src, 0, blocks, out=dst[run[0] : run[1]])
        else:
            dst.index_copy_(
                0, torch.as_tensor(pages, dtype=torch.long), src.index_select(0, blocks)
            )

    def scatter(
        self, layer: int, pages: Sequence[int], dst: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """``dst[blocks] = staging[layer][pages]`` (staging to engine cache)."""
        src = self.tensor[layer]
        run = _as_run(pages)
        if run is not None:
            dst.index_copy_(0, blocks, src[run[0] : run[1]])
        else:
            dst.index_copy_(
                0, blocks, src.index_select(0, torch.as_tensor(pages, dtype=torch.long))
            )


def _first_run(free: np.ndarray, n: int) -> np.ndarray | None:
    """The first ``n`` consecutive free pages, or None."""
    if n == 1:
        idx = np.flatnonzero(free)
        return idx[:1] if len(idx) else None
    # Free pages in each window of n: a difference of running counts.
    running = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
    hits = np.flatnonzero(running[n:] - running[:-n] == n)
    if not len(hits):
        return None
    start = int(hits[0])
    return np.arange(start, start + n)


def _as_run(pages: Sequence[int]) -> tuple[int, int] | None:
    if not len(pages):
        return None
    first = pages[0]
    if all(p == first + i for i, p in enumerate(pages)):
        return first, first + len(pages)
    return None
