"""Staging pages for engines whose KV cache the daemon cannot address directly.

The daemon copies blocks only into and out of memory the client registered, and an engine
allocates its KV cache itself. A ``StagingPool`` is a registered region of ``num_pages``
pages laid out layer-major (``[layers, pages, layer_block]``): the engine copies a block's
layers between its own cache and a page with plain tensor copies, and the daemon copies
between the page and its tiers. One page holds one whole block (every layer), so a block of
layer ``l`` is the chunk ``(l, page)``, and a Get of a layer range fills exactly those
layers' chunks. The region is shared memory for a KV cache in host memory, and GPU memory
on the cache's device, exported over CUDA IPC, for a KV cache on a GPU (``new_memory``):
the daemon's GPU tier copies into and out of it, and the engine's copies are device copies
on its current stream.

Invariants:
- A page belongs to at most one transfer at a time (``alloc``/``free``).
- On a GPU the engine's copies run later than they are issued: a page read by a copy into
  the engine's cache goes back to the free pages only once that copy has run (``free``
  records an event; ``alloc`` takes such pages once their event has fired, waiting for it
  when no other page is free), and the daemon reads pages the engine filled only after
  ``ready()`` (the engine's copies so far have run).
- A host region cannot outlive the engine: it is a memory file (memfd), which has no name in
  ``/dev/shm``, or a named object whose name is removed once the daemon has mapped it. A
  daemon that lost the pool (a restart) can be handed a memory file's descriptor again (the
  SGLang backend registers the same pool in its next session) but cannot map a named one
  again; the vLLM worker replaces a pool its session no longer holds (``registered``).
- A pool whose transfer ended uncleanly (the daemon may still be copying: see
  ``kvtier.client.jobs``) is *retired*: it takes no new transfer, and it is unregistered and
  unmapped once its last transfer has ended on the client's side. Its memory is never reused
  for other blocks, so a late copy can neither corrupt a block the engine reads nor store a
  wrong block under a key. GPU memory would go back to the engine's allocator, so it is
  freed only once the daemon has answered the unregistration (which it does once no copy
  uses the pool; waited for up to ``FENCE_TIMEOUT_S``); without that answer it is kept
  until the process exits. While the daemon's answer is awaited, the vLLM worker makes no
  new GPU pool (``fencing_gpu_staging``), so a slow daemon holds one pool's GPU memory, not
  one more per retirement.

Thread-safety: ``alloc``, ``free`` and ``retire`` take a lock; the tensor copies are the
caller's (one engine thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KvtierError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from kvtier.client.keys import Namespace
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.sync import Client, RegisteredPool
from kvtier.kernels.layout import LayerLayout, PoolLayout, layer_numbers

log = logging.getLogger(__name__)


# Answers to a staging pool's registration that say the daemon will not take it as asked,
# from a daemon that is up and fast: a limit (``server.max_pool_bytes_per_tenant``, the
# session's or tenant's pool counts), a layout it cannot hold (blocks larger than a tier
# slot), a pool it cannot use (CUDA IPC without the GPU tier), a session that may not
# register memory (over TCP). See ``RegistrationRefusals``.
REFUSALS: tuple[type[KvtierError], ...] = (
    ResourceExhaustedError,
    InvalidArgumentError,
    FailedPreconditionError,
    PermissionDeniedError,
)
# The longest wait between two tries at registering a staging pool the daemon refused.
REFUSED_RETRY_MAX_S = 300.0


class RegistrationRefusals:
    """When to try again at registering a staging pool the daemon refused (``REFUSALS``).

    Such a refusal changes only when the daemon restarts with another config (no setting
    that refuses a pool is applied by a SIGHUP), or, for a tenant's pool counts and bytes,
    when other pools of the same tenant go; the engine sees none of that without asking.
    Each try costs a new region of the pool's whole size (hundreds of MiB of shared or GPU
    memory) and an RPC, and the memory of a refused try is given back at once rather than
    held for a later try (it would be held while kvtier cannot use it). So tries back off
    exponentially: ``retry_after_s`` after the first refusal, twice that after the second,
    and so on up to ``max_s``; a daemon fixed meanwhile is used again within ``max_s``, and
    one that never changes costs one allocation per ``max_s`` (a handful in the first
    minutes).
    ``clock`` is ``time.monotonic`` unless a test drives it.
    """

    def __init__(
        self,
        retry_after_s: float,
        max_s: float = REFUSED_RETRY_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retry_after_s = max(retry_after_s, 0.001)
        self.max_s = max(max_s, self.retry_after_s)
        self._clock = clock
        self.count = 0  # refusals in a row
        self.error: KvtierError | None = None  # the last one, while refused
        self._next_try = 0.0

    @property
    def refused(self) -> bool:
        """Whether the last try was refused (no pool since)."""
        return self.error is not None

    def due(self) -> bool:
        """Whether a new try may be made now."""
        return self._clock() >= self._next_try

    def standing(self) -> bool:
        """Whether the daemon refused the pool and the next try is not due yet: meanwhile
        the engine neither registers it nor offers hits that only it could load."""
        return self.refused and not self.due()

    def news(self, error: KvtierError) -> bool:
        """Whether refusal ``error`` is worth an ERROR: the first one, or one of another kind
        than the last (its cause changed). The same refusal again is not: its tries are
        already rate-limited by the back-off. Ask before ``refuse``."""
        return self.error is None or type(self.error) is not type(error)

    def refuse(self, error: KvtierError) -> float:
        """Count a refusal; returns how long until the next try. ``error`` is kept without
        its traceback (as are log records that name it): its frames hold the refused try's
        pool, and with it the whole region, which must go at once."""
        # The exponent stops growing once past the cap: a float power past 2 ** 1023 raises.
        wait = min(self.retry_after_s * 2.0 ** min(self.count, 64), self.max_s)
        self.count += 1
        self.error = error.with_traceback(None)
        self.error.__context__ = self.error.__cause__ = None
        self._next_try = self._clock() + wait
        return wait

    def accepted(self) -> int:
        """A pool registered: forget the refusals; returns how many there were."""
        count = self.count
        self.forget()
        return count

    def forget(self) -> None:
        """Forget the refusals, with no pool registered: the pool they refused is gone (the
        engine replaced it), and the next try, of another pool, is due at once."""
        self.count, self.error, self._next_try = 0, None, 0.0


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
        for i in layer_numbers(num_layers)
    )
    return PoolLayout(layers, num_pages, block_tokens, dtype)


class StagingMemory:
    """Where a staging pool's pages live: the tensor the engine copies with, how the daemon
    is given it, and how the engine's copies are ordered with the daemon's."""

    tensor: torch.Tensor  # [layers, pages, *block_shape]

    def register(
        self, client: Client, layout: PoolLayout, namespace: Namespace | None
    ) -> RegisteredPool:
        raise NotImplementedError

    def mark(self) -> object | None:
        """A mark after the engine's copies issued so far, or None when they have all run."""
        return None

    def passed(self, mark: object) -> bool:
        """Whether the copies before ``mark`` have run."""
        return True

    def wait(self, mark: object) -> None:
        """Block until the copies before ``mark`` have run."""

    def release(self, client: Client, pool: RegisteredPool, unclean: bool) -> None:
        """Unregister and give the memory back; ``unclean``: the daemon may still copy."""
        raise NotImplementedError


class HostMemory(StagingMemory):
    """A shared-memory region (the engine's copies are synchronous CPU copies)."""

    def __init__(self, layout: PoolLayout, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self._dtype = dtype
        self._shape = shape
        self.shm = SharedMemoryPool.for_layout(layout)

    def register(
        self, client: Client, layout: PoolLayout, namespace: Namespace | None
    ) -> RegisteredPool:
        try:
            pool = client.register_pool(self.shm, layout, namespace)
        except BaseException:
            self.shm.close()
            raise
        # The daemon has mapped it: a named region drops its name now, so that an engine
        # killed before it can clean up (vLLM kills workers that outlive its shutdown grace
        # period) leaves nothing behind in /dev/shm (a memory file, the default, has none).
        self.shm.unlink()
        self.tensor = self.shm.tensor(self._dtype, self._shape)
        return pool

    def release(self, client: Client, pool: RegisteredPool, unclean: bool) -> None:
        # Without waiting: a hung daemon must not stall the engine; the session's end
        # unregisters it anyway. The daemon keeps its own mapping of the region until then,
        # so a late copy lands in memory nothing else uses.
        with contextlib.suppress(KvtierError):
            client.unregister_pool_nowait(pool.binding)
        del self.tensor
        self.shm.close()


# GPU staging memory the daemon may still write into (its unregistration was not answered):
# kept until the process exits rather than handed back to the caching allocator.
_KEPT: list[torch.Tensor] = []
# How long the daemon may take to answer the unregistration of a pool released as unclean:
# it answers once no copy uses the pool, and a copy that outlived the transfer's timeout is
# slow, not necessarily stuck. Past this the memory is kept (``_KEPT``).
FENCE_TIMEOUT_S = 120.0
# GPU staging regions released as unclean whose fence is under way.
_fencing = 0
_fencing_lock = threading.Lock()


def fencing_gpu_staging() -> int:
    """GPU staging regions whose fence is under way (the daemon has not answered yet, and
    may still copy into them). A worker makes no new GPU pool while there is one, so a slow
    daemon holds one pool's memory, not one more per retirement. A fence that failed (no
    answer in time; the session gone, e.g. the daemon restarted) ends it too: that memory
    is kept, and a new pool may be made."""
    return _fencing


def _count_fencing(delta: int) -> None:
    global _fencing
    with _fencing_lock:
        _fencing += delta


class CudaMemory(StagingMemory):
    """GPU memory on the engine's device, exported over CUDA IPC (``kvtier.client.cuda``);
    the engine's copies run on its current stream, ordered with the daemon's by events."""

    def __init__(
        self, layout: PoolLayout, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
    ) -> None:
        from kvtier.client.cuda import export_tensors

        self.device = device
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.export = export_tensors([self.tensor], [0])
        self.export.check_layout(layout)

    def register(
        self, client: Client, layout: PoolLayout, namespace: Namespace | None
    ) -> RegisteredPool:
        return client.register_cuda_pool(self.export, layout, namespace)

    def mark(self) -> object | None:
        # Blocking: a thread waiting for it sleeps instead of spinning on a CPU core.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def passed(self, mark: object) -> bool:
        return bool(mark.query())  # type: ignore[attr-defined]

    def wait(self, mark: object) -> None:
        mark.synchronize()  # type: ignore[attr-defined]

    def release(self, client: Client, pool: RegisteredPool, unclean: bool) -> None:
        tensor = self.tensor
        del self.tensor
        if not unclean:
            with contextlib.suppress(KvtierError):
                client.unregister_pool_nowait(pool.binding)
            return

        # The daemon may still copy into this memory: hand it back to the allocator only
        # once the daemon has answered the unregistration (it answers once no copy uses
        # the pool). Off the engine's thread: a hung daemon must not stall it.
        _count_fencing(1)

        def fence() -> None:
            try:
                fenced = client.fence_pool(pool.binding, FENCE_TIMEOUT_S)
            except KvtierError:
                fenced = False
            finally:
                _count_fencing(-1)
            if not fenced:
                _KEPT.append(tensor)
                log.warning(
                    "kvtier staging: the daemon did not confirm it stopped using %d MiB of "
                    "GPU staging memory; kept until the process exits",
                    tensor.numel() * tensor.element_size() >> 20,
                )

        threading.Thread(target=fence, name="kvtier-staging-fence", daemon=True).start()


def new_memory(
    layout: PoolLayout, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> StagingMemory:
    """Staging memory for an engine cache on ``device``: shared memory for host memory, GPU
    memory over CUDA IPC for a CUDA device."""
    if device.type == "cpu":
        return HostMemory(layout, dtype, shape)
    if device.type == "cuda":
        return CudaMemory(layout, dtype, shape, device)
    raise ValueError(f"kvtier staging: a KV cache on {device} is not supported (cpu or cuda)")


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
        device: torch.device | str = "cpu",
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
        self.memory = new_memory(
            self.layout, dtype, (num_layers, num_pages, *block_shape), torch.device(device)
        )
        self.pool: RegisteredPool = self.memory.register(client, self.layout, namespace)
        self.tensor = self.memory.tensor
        self._lock = threading.Lock()
        self._free = np.ones(num_pages, dtype=bool)
        # Pages given back while engine copies that read them may not have run yet.
        self._pending: list[tuple[object, list[int]]] = []
        self._users = 0  # transfers holding pages
        self.retired = False
        self._unclean = False
        self.closed = False

    def registered(self) -> bool:
        """Whether the daemon still holds this pool in the client's live session (no RPC)."""
        return self._client.live_ids(self.pool.binding) is not None

    @property
    def free_pages(self) -> int:
        """Pages ``alloc`` can hand out (some perhaps once the engine's copies have run)."""
        with self._lock:
            return int(self._free.sum()) + sum(len(p) for _, p in self._pending)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free pages (a contiguous run when there is one), or None."""
        with self._lock:
            if self.retired:
                return None
            self._settle(n)
            if n > int(self._free.sum()):
                return None
            if n == 0:
                return []
            pages = _first_run(self._free, n)
            if pages is None:
                pages = np.flatnonzero(self._free)[:n]
            self._free[pages] = False
            self._users += 1
            return [int(p) for p in pages]

    def _settle(self, n: int) -> None:
        """Free the pending pages whose copies have run, and wait for the oldest others
        while fewer than ``n`` pages are free. Holds the lock."""
        still = []
        for mark, pages in self._pending:
            if self.memory.passed(mark):
                self._free[pages] = True
            else:
                still.append((mark, pages))
        while still and int(self._free.sum()) < n:
            mark, pages = still.pop(0)
            self.memory.wait(mark)
            self._free[pages] = True
        self._pending = still

    def mark(self) -> object | None:
        """A mark after the engine's copies issued so far (None in host memory, where they
        have all run): the daemon may read pages they filled once it has ``passed``."""
        return self.memory.mark()

    def passed(self, mark: object) -> bool:
        return self.memory.passed(mark)

    def wait(self, mark: object) -> None:
        self.memory.wait(mark)

    def ready(self) -> None:
        """Wait until the engine's copies into pages so far have run."""
        mark = self.memory.mark()
        if mark is not None:
            self.memory.wait(mark)

    def free(self, pages: Sequence[int]) -> None:
        """Give back one transfer's pages; closes a retired pool after its last transfer.
        No pages is no transfer (``alloc(0)`` counts none)."""
        if not len(pages):
            return
        mark = self.memory.mark()
        with self._lock:
            if mark is None:
                self._free[list(pages)] = True
            else:
                self._pending.append((mark, list(pages)))
            self._users -= 1
            close = self.retired and self._users == 0
        if close:
            self.close()

    def retire(self, why: str, *, unclean: bool = True, said: bool = False) -> None:
        """Take no new transfers; close once the transfers holding pages have ended.
        ``unclean``: a transfer ended without the daemon's answer, so a copy may still run
        (False when the pool goes for another reason, e.g. the daemon dropped it). ``said``:
        the caller has logged why, and whether a fresh pool follows (a refusal's ERROR: none
        does while it stands), so the retirement is an INFO line, not a WARNING."""
        with self._lock:
            self._unclean |= unclean
            if self.retired:
                return
            self.retired = True
            close = self._users == 0
        if said:
            log.info("kvtier staging pool generation %d retired (%s)", self.generation, why)
        else:
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
        del self.tensor
        self.memory.release(self._client, self.pool, self._unclean)

    # ------------------------------------------------------------ tensor copies

    def layer(self, layer: int) -> torch.Tensor:
        """``[pages, *block_shape]`` of one layer."""
        return self.tensor[layer]

    def gather(
        self, layer: int, pages: Sequence[int], src: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """``staging[layer][pages] = src[blocks]`` (engine cache to staging; ``src`` in any
        stride order, the page gets the block in its logical order). ``blocks`` on the CPU
        lets runs of consecutive blocks copy as slices (``MAX_RUN_COPIES``)."""
        dst = self.tensor[layer]
        runs = _paired_runs(pages, blocks)
        if runs is not None:
            for page, block, n in runs:
                dst[page : page + n].copy_(src[block : block + n])
            return
        blocks = blocks.to(dst.device)
        run = _as_run(pages)
        if run is not None:
            torch.index_select(src, 0, blocks, out=dst[run[0] : run[1]])
        else:
            index = torch.as_tensor(pages, dtype=torch.long, device=dst.device)
            dst.index_copy_(0, index, src.index_select(0, blocks))

    def scatter(
        self, layer: int, pages: Sequence[int], dst: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """``dst[blocks] = staging[layer][pages]`` (staging to engine cache; ``blocks`` as for
        ``gather``)."""
        src = self.tensor[layer]
        runs = _paired_runs(pages, blocks)
        if runs is not None:
            for page, block, n in runs:
                dst[block : block + n].copy_(src[page : page + n])
            return
        blocks = blocks.to(src.device)
        run = _as_run(pages)
        if run is not None:
            dst.index_copy_(0, blocks, src[run[0] : run[1]])
        else:
            index = torch.as_tensor(pages, dtype=torch.long, device=src.device)
            dst.index_copy_(0, blocks, src.index_select(0, index))


MAX_RUN_COPIES = 8
"""A copy whose pages and blocks pair up in at most this many runs (consecutive pages to
consecutive blocks, as an engine's fresh blocks mostly are) is one plain slice copy per run:
on the CPU a memory copy, several times faster than an indexed copy of the same blocks
(into a bf16 cache of 64 KiB blocks, ``index_copy_`` of 16 blocks took 0.19 ms, one slice
copy of them 0.045 ms). More runs take one indexed copy (on a GPU, one kernel rather than
one per run), and so do block ids on a GPU."""


def _paired_runs(pages: Sequence[int], blocks: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """``(first page, first block, count)`` of each run of ``pages`` and ``blocks`` that are
    consecutive together; None past ``MAX_RUN_COPIES`` runs, or for block ids on a GPU
    (reading them would wait for the device)."""
    if blocks.device.type != "cpu" or len(pages) != len(blocks):
        return None
    ids = blocks.tolist()
    runs: list[tuple[int, int, int]] = []
    for page, block in zip(pages, ids, strict=True):
        if runs:
            first_page, first_block, n = runs[-1]
            if page == first_page + n and block == first_block + n:
                runs[-1] = (first_page, first_block, n + 1)
                continue
            if len(runs) == MAX_RUN_COPIES:
                return None
        runs.append((page, block, 1))
    return runs


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
