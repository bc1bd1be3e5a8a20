"""L0: the GPU tier, a device arena of block slots.

The arena (``tiers.l0.capacity_bytes`` of device memory) is allocated once at start; slots
come from a SlabAllocator, exactly as in L1, so a slot is one contiguous device extent.
Blocks move in batches:

- **engine pool <-> L0** (``DevicePages``, a CUDA IPC pool): one gather or scatter launch
  for the whole batch (every block, every layer, every buffer), on one of ``streams`` pool
  streams taken in turn;
- **L1 <-> L0** (``HostBuffers``, e.g. L1 slot views): async copies on the dedicated
  host-to-device or device-to-host stream, so demotion to L1 never queues behind engine
  traffic (with L1 page-locked these are DMA copies at full PCIe speed), launched
  ``HOST_GROUP`` blocks at a time so that Python's work on the next group overlaps the DMA
  of the last; blocks whose host and device slots both follow each other go as one copy
  (``_coalesced``: fewer, longer DMA transfers);
- **shared-memory pool <-> L0** (``PoolPages``): gathered on the host into a (pinned)
  staging buffer, then as above;
- **engine pool <-> host memory** without an L0 slot (``pool_to_host``/``host_to_pool``):
  through device scratch of at most ``BRIDGE_SCRATCH_BYTES`` (or one block, a larger one),
  a group of blocks at a time, for a Get from L1 into a GPU pool or a Put that skips L0.

Every verb records an event on its stream after its last copy and blocks until the event
fires: when ``write``/``read`` return, the bytes are in place. Verbs run on worker threads;
two calls in flight never name the same slot (the store's in-flight marks guarantee it).

Invariants: a slot handed to a verb is allocated and at least ``nbytes`` long, checked
before any copy (a device kernel checks nothing). A CUDA fault inside a verb is a result,
not an exception: the batch fails, once what it launched before has run (a failed launch
may leave the context intact), the tier reports DOWN with the error (a CUDA context
does not recover from most faults), and the daemon keeps serving its other tiers. A device
allocation that fails (``torch.cuda.OutOfMemoryError``: scratch, or a launch's plan, on a
GPU the engine fills; or cudaErrorMemoryAllocation from a CUDA call outside torch's
allocator, such as page-locked staging) is no fault: the context is intact, so only that
batch fails (a write's outcomes; ``read`` and the bridge verbs raise
``TierMemoryExhausted``, as a False from ``read`` would have its intact blocks dropped),
once what it launched has run, and the tier stays as it was.

All CUDA calls sit behind ``DeviceOps`` (``CudaOps`` on a GPU). The tests run the tier on
``CpuOps``: the same slot, batch and plan logic with CPU tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.kernels.paged import copy_pages
from kvtier.kernels.runs import SegmentMap
from kvtier.tiers.base import (
    HEALTHY,
    BlockRef,
    DeviceBridge,
    DevicePages,
    Health,
    HostBuffers,
    PoolPages,
    ReadBatch,
    RecoveredBlocks,
    SlotTier,
    TierHealth,
    TierKind,
    TierMemoryExhausted,
    TierStats,
    TierUnavailable,
    WriteBatch,
    WriteOutcome,
)
from kvtier.tiers.buffers import load_into, store_from
from kvtier.tiers.sizes import format_size
from kvtier.tiers.slab import LockedSlab

log = logging.getLogger(__name__)

ALIGN = 4096  # slot alignment; also what GPUDirect Storage wants for direct transfers
# Host copies are prepared and launched this many blocks at a time, so the DMA of one group
# runs while Python prepares the next (prepared all at once, a batch of 2 MiB blocks moved
# 0.81x of PCIe's bandwidth on an H200, Python's share not overlapped).
HOST_GROUP = 16
# The bridge's copies between a GPU pool's pages and host memory pass through device scratch
# of at most this many bytes, in two halves that groups of blocks take in turn (one group's
# DMA overlaps the next one's gather or scatter): device memory the daemon holds past its
# arena, which torch's allocator keeps once used and the engine on that GPU cannot have,
# stays bounded whatever the batch. Blocks larger than a half go one at a time through one
# block of scratch, never two of them held (a gather or scatter in device memory runs tens
# of times faster than the PCIe DMA of its bytes, so little overlap is lost).
BRIDGE_SCRATCH_BYTES = 64 << 20
H2D, D2H = "h2d", "d2h"
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation; never a sticky error


class DeviceOps(Protocol):
    """The CUDA part of the tier: memory, streams, events and the copy launches."""

    device: torch.device
    pinned: bool  # host staging buffers are page-locked

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device memory, uint8."""
        ...

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """Host staging memory, uint8 (page-locked where it can be)."""
        ...

    def lane(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Make stream ``name`` (``pool0``.., ``h2d``, ``d2h``) current in this thread."""
        ...

    def copy_pages(
        self, pages: DevicePages, slots: torch.Tensor, starts: np.ndarray, *, gather: bool
    ) -> str:
        """Launch a gather of ``pages`` into blocks of ``slots`` at byte ``starts`` (or the
        scatter back) on the current stream; the executor's name."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Launch one copy (any direction) on the current stream."""
        ...

    def record(self) -> Any:
        """An event after everything launched on the current stream so far."""
        ...

    def wait(self, event: Any) -> None:
        """Block this thread until ``event`` has fired."""
        ...

    def after(self, event: Any) -> None:
        """Order the current stream after ``event`` (no wait in this thread)."""
        ...

    def synchronize(self) -> None: ...


class CudaOps:
    """``DeviceOps`` on a CUDA device with torch streams and events."""

    def __init__(self, device: int, streams: int) -> None:
        self.device = torch.device("cuda", device)
        self.pinned = True
        torch.cuda.set_device(self.device)
        self._streams = {f"pool{i}": torch.cuda.Stream(self.device) for i in range(streams)}
        self._streams[H2D] = torch.cuda.Stream(self.device)
        self._streams[D2H] = torch.cuda.Stream(self.device)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @contextlib.contextmanager
    def lane(self, name: str) -> Iterator[None]:
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self._streams[name]):
            yield

    def copy_pages(
        self, pages: DevicePages, slots: torch.Tensor, starts: np.ndarray, *, gather: bool
    ) -> str:
        return _copy_pages(pages, slots, starts, gather, "auto")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()

    def after(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def _copy_pages(
    pages: DevicePages, slots: torch.Tensor, starts: np.ndarray, gather: bool, executor: str
) -> str:
    return copy_pages(
        pages.smap,
        pages.segments,
        pages.pages,
        slots,
        starts,
        pages.smap.block_bytes,
        gather=gather,
        executor=executor,
    )


class CpuOps:
    """``DeviceOps`` on CPU tensors: every copy completes when launched. For the tests (the
    tier's logic without a GPU); a daemon never runs L0 on it."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.pinned = False
        self.lanes_used: list[str] = []

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    @contextlib.contextmanager
    def lane(self, name: str) -> Iterator[None]:
        self.lanes_used.append(name)
        yield

    def copy_pages(
        self, pages: DevicePages, slots: torch.Tensor, starts: np.ndarray, *, gather: bool
    ) -> str:
        return _copy_pages(pages, slots, starts, gather, "torch")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def after(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DeviceTier:
    """The L0 tier (``SlotTier``). Thread-safety: data verbs may run concurrently on worker
    threads for distinct slots; the allocator is the owning store's to serialise."""

    kind = TierKind.GPU
    persistent = False
    checksummed = False
    device_memory = True  # slots are device memory; it is the stack's ``DeviceBridge``

    def __init__(
        self,
        capacity_bytes: int,
        segment_bytes: int,
        *,
        device: int = 0,
        streams: int = 2,
        ops: DeviceOps | None = None,
    ) -> None:
        """Allocate the arena. Raises TierUnavailable when there is no CUDA device or the
        device cannot hold the capacity."""
        if streams < 1:
            raise ValueError("streams must be at least 1")
        if ops is None:
            if not torch.cuda.is_available():
                raise TierUnavailable("tiers.l0 is enabled but this host has no CUDA device")
            if device >= torch.cuda.device_count():
                raise TierUnavailable(
                    f"tiers.l0.device is {device}, but this host has "
                    f"{torch.cuda.device_count()} CUDA devices"
                )
            ops = CudaOps(device, streams)
        self._ops = ops
        # Locked: the store allocates and frees on its thread while the verbs check their
        # slots (``_starts``) on worker threads.
        self.allocator = LockedSlab(capacity_bytes, segment_bytes, ALIGN)
        try:
            self.arena = ops.empty(self.allocator.capacity_bytes)
        except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
            raise TierUnavailable(
                f"the GPU tier cannot allocate {self.allocator.capacity_bytes >> 20} MiB on "
                f"{ops.device}: {e}"
            ) from None
        self._pool_lanes = [f"pool{i}" for i in range(streams)]
        self._next_lane = itertools.count()
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        self._health = HEALTHY
        # How L2 <-> L0 transfers go, set once by the daemon at start: whether GPUDirect
        # Storage is usable (tiers/gds.py ``choose``), the path transfers take and why.
        self.gds_usable = False
        self.l2_path = "pinned_l1"
        self.l2_path_reason = "not chosen"
        started = time.monotonic()
        executor = self._self_test()
        log.info(
            "L0 device arena: %s on %s in %d segments of %s, %d pool streams; "
            "its copy kernel (%s) passed its self-test in %.2f s",
            format_size(self.allocator.capacity_bytes),
            ops.device,
            self.allocator.num_segments,
            format_size(self.allocator.segment_bytes),
            streams,
            executor,
            time.monotonic() - started,
        )

    def _self_test(self) -> str:
        """Gather a page into the arena and scatter it back into another buffer, checking the
        bytes, for two pool shapes (2 and 16 chunk columns: Triton compiles an integer
        argument divisible by 16 as its own variant). On a GPU the first launch of each
        variant compiles it (and, the first time on a host, Triton's launcher, which needs
        a C compiler): here at start rather than in the first request, and a kernel that
        cannot compile or copies wrong stops the start with the reason instead of taking
        the tier down at its first batch. Runs before any slot is handed out; returns the
        executor's name."""
        chunk = ALIGN  # whole 4 KiB chunks: 16-byte words, as real pools have
        executor = "none"
        for columns in (2, 16):
            block = columns * chunk
            if block > self.arena.numel():
                continue
            cols = np.arange(columns, dtype=np.int64)
            # Column-major like a pool of per-layer tensors: page p's chunk of column c at
            # c * 2 * chunk + p * chunk; in a block, column c at c * chunk.
            smap = SegmentMap(
                segment=np.zeros(columns, dtype=np.int64),
                base=cols * 2 * chunk,
                page_stride=np.full(columns, chunk, dtype=np.int64),
                length=np.full(columns, chunk, dtype=np.int64),
                block_offset=cols * chunk,
                num_pages=2,
                block_bytes=block,
            )
            pattern = np.random.default_rng(columns).integers(0, 256, 2 * block, dtype=np.uint8)
            try:
                src, back = self._ops.empty(2 * block), self._ops.empty(2 * block)
                host = self._ops.host_empty(2 * block)
                at = np.zeros(1, dtype=np.int64)
                with self._ops.lane(self._pool_lanes[0]):
                    self._ops.copy(src, torch.from_numpy(pattern))
                    page1 = DevicePages(smap, [src], np.ones(1, dtype=np.int64))
                    executor = self._ops.copy_pages(page1, self.arena, at, gather=True)
                    page0 = DevicePages(smap, [back], np.zeros(1, dtype=np.int64))
                    self._ops.copy_pages(page0, self.arena, at, gather=False)
                    self._ops.copy(host, back)
                    self._ops.wait(self._ops.record())
                got = host.numpy().reshape(columns, 2, chunk)[:, 0]
                ok = np.array_equal(got, pattern.reshape(columns, 2, chunk)[:, 1])
            except Exception as e:  # a compiler's error, a launch's, a CUDA fault: all stop
                raise TierUnavailable(
                    f"the GPU tier's copy kernel failed its self-test on {self._ops.device} "
                    f"({columns} columns): {type(e).__name__}: {e}"
                ) from None
            if not ok:
                raise TierUnavailable(
                    f"the GPU tier's copy kernel ({executor}) copied wrong bytes in its "
                    f"self-test on {self._ops.device} ({columns} columns)"
                )
        return executor

    # ----------------------------------------------------------- capabilities

    @property
    def device(self) -> torch.device:
        return self._ops.device

    # ------------------------------------------------------------------ verbs

    def write(self, batch: WriteBatch) -> list[WriteOutcome]:
        starts = self._starts(batch.slots, batch.nbytes)
        n = len(batch.slots)
        if len(batch.src) != n:
            raise ValueError(f"{len(batch.src)} source blocks for {n} slots")
        if not self._health.accepts_writes:
            return [WriteOutcome(s, False) for s in batch.slots]
        src = batch.src
        try:
            if isinstance(src, DevicePages):
                direction = "d2d"
                with self._ops.lane(self._pool_lane()):
                    self._ops.copy_pages(src, self.arena, starts, gather=True)
                    event = self._ops.record()
            elif isinstance(src, HostBuffers):
                direction = H2D
                event = self._to_arena(src.views, starts, batch.nbytes)
            else:
                direction = H2D
                staging = self._stage_from_pool(src, batch.nbytes)
                event = self._to_arena(
                    [staging[j * batch.nbytes : (j + 1) * batch.nbytes] for j in range(n)],
                    starts,
                    batch.nbytes,
                )
            self._ops.wait(event)
        except RuntimeError as e:
            self._failed("write", e)
            return [WriteOutcome(s, False) for s in batch.slots]
        self._count(
            {f"blocks_written_{direction}": n, f"bytes_written_{direction}": n * batch.nbytes}
        )
        return [WriteOutcome(s, True) for s in batch.slots]

    def read(self, batch: ReadBatch) -> list[bool]:
        starts = self._starts(batch.slots, batch.nbytes)
        n = len(batch.slots)
        if len(batch.dest) != n:
            raise ValueError(f"{len(batch.dest)} destination blocks for {n} slots")
        if not self._health.serves_reads:
            return [False] * n
        dest = batch.dest
        try:
            if isinstance(dest, DevicePages):
                direction = "d2d"
                with self._ops.lane(self._pool_lane()):
                    self._ops.copy_pages(dest, self.arena, starts, gather=False)
                    self._ops.wait(self._ops.record())
            elif isinstance(dest, HostBuffers):
                direction = D2H
                self._ops.wait(self._from_arena(dest.views, starts, batch.nbytes))
            else:
                direction = D2H
                staging = self._ops.host_empty(n * batch.nbytes)
                parts = [staging[j * batch.nbytes : (j + 1) * batch.nbytes] for j in range(n)]
                self._ops.wait(self._from_arena(parts, starts, batch.nbytes))
                load_into(
                    dest,
                    np.arange(n),
                    staging.numpy(),
                    np.arange(n, dtype=np.uint64) * batch.nbytes,
                    batch.nbytes,
                )
        except RuntimeError as e:
            # Short of memory, not False: that would tell the caller the blocks are lost,
            # and they are intact.
            if (short := self._failed("read", e)) is not None:
                raise short from None
            return [False] * n
        self._count({f"blocks_read_{direction}": n, f"bytes_read_{direction}": n * batch.nbytes})
        return [True] * n

    def remove(self, slots: Sequence[int]) -> bool:
        for slot in slots:
            self.allocator.free(slot)
        return True

    def removing(self, slots: Sequence[int], refs: Sequence[BlockRef] | None = None) -> None:
        pass  # no rows: nothing survives a restart

    def rows_left(self, refs: Sequence[BlockRef]) -> bool:
        return False

    def drop_rows_left(self, refs: Sequence[BlockRef]) -> bool:
        return True

    def recover_chunks(self, rows: int = 65536) -> Iterator[RecoveredBlocks]:
        return iter(())  # device memory does not survive a restart

    # ------------------------------------------- engine pool <-> host, no slot

    def pool_to_host(self, src: DevicePages, dest: HostBuffers, nbytes: int) -> bool:
        """Gather pool pages straight into host buffers (a Put from a GPU pool into L1).
        False: the device failed (the buffers' bytes are unspecified). Raises
        TierMemoryExhausted when the device has no memory for the scratch or a group's
        plan (the buffers' bytes are unspecified too)."""
        n = len(src)
        if len(dest) != n:
            raise ValueError(f"{len(dest)} host buffers for {n} pages")
        if not self._health.serves_reads:
            return False
        if not n:
            return True
        try:
            group, halves = self._scratch(n, nbytes)
            lane = self._pool_lane()
            hosts = _host_tensors(dest.views, nbytes, writable=True)
            freed: list[Any] = [None] * len(halves)  # after the last copy out of each
            last: Any = None
            for k, first in enumerate(range(0, n, group)):
                m = min(group, n - first)
                h = k % len(halves)
                half = halves[h]
                with self._ops.lane(lane):
                    if freed[h] is not None:
                        self._ops.after(freed[h])
                    pages = DevicePages(src.smap, src.segments, src.pages[first : first + m])
                    self._ops.copy_pages(pages, half, _starts_in(m, nbytes), gather=True)
                    gathered = self._ops.record()
                with self._ops.lane(D2H):
                    self._ops.after(gathered)
                    parts = [half[j * nbytes : (j + 1) * nbytes] for j in range(m)]
                    pairs = list(zip(hosts[first : first + m], parts, strict=True))
                    for dst, src_part in _coalesced(pairs):
                        self._ops.copy(dst, src_part)
                    freed[h] = last = self._ops.record()
            self._ops.wait(last)  # on one stream: after every group's copies
        except RuntimeError as e:
            if (short := self._failed("pool_to_host", e)) is not None:
                raise short from None
            return False
        self._count({"blocks_pool_to_host": n, "bytes_pool_to_host": n * nbytes})
        return True

    def host_to_pool(self, src: HostBuffers, dest: DevicePages, nbytes: int) -> bool:
        """Scatter host buffers straight into pool pages (a Get from L1 into a GPU pool).
        False: the device failed (the pages' bytes are unspecified). Raises
        TierMemoryExhausted when the device has no memory for the scratch or a group's
        plan (the pages' bytes are unspecified too)."""
        n = len(dest)
        if len(src) != n:
            raise ValueError(f"{len(src)} host buffers for {n} pages")
        if not self._health.serves_reads:
            return False
        if not n:
            return True
        try:
            group, halves = self._scratch(n, nbytes)
            lane = self._pool_lane()
            hosts = _host_tensors(src.views, nbytes)
            freed: list[Any] = [None] * len(halves)  # after the last scatter out of each
            last: Any = None
            for k, first in enumerate(range(0, n, group)):
                m = min(group, n - first)
                h = k % len(halves)
                half = halves[h]
                with self._ops.lane(H2D):
                    if freed[h] is not None:
                        self._ops.after(freed[h])
                    parts = [half[j * nbytes : (j + 1) * nbytes] for j in range(m)]
                    pairs = list(zip(parts, hosts[first : first + m], strict=True))
                    for dst, src_part in _coalesced(pairs):
                        self._ops.copy(dst, src_part)
                    copied = self._ops.record()
                with self._ops.lane(lane):
                    self._ops.after(copied)
                    pages = DevicePages(dest.smap, dest.segments, dest.pages[first : first + m])
                    self._ops.copy_pages(pages, half, _starts_in(m, nbytes), gather=False)
                    freed[h] = last = self._ops.record()
            self._ops.wait(last)  # on one stream: after every group's scatter
        except RuntimeError as e:
            if (short := self._failed("host_to_pool", e)) is not None:
                raise short from None
            return False
        self._count({"blocks_host_to_pool": n, "bytes_host_to_pool": n * nbytes})
        return True

    def host_buffers(self, n: int, nbytes: int) -> HostBuffers:
        """Host staging for ``n`` blocks, page-locked where the device has it (a transfer
        between a GPU pool and a tier without host slots: disk, remote). Each buffer starts
        on a page and is ``nbytes`` rounded up to pages long."""
        stride = -(-nbytes // ALIGN) * ALIGN
        raw = self._ops.host_empty(max(1, n) * stride).numpy()
        return HostBuffers([raw[j * stride : (j + 1) * stride].data for j in range(n)])

    def synchronize(self) -> None:
        """Wait for everything launched on the device (work outside the verbs, e.g. a fill
        of a slot view, must be complete before a verb's stream reads the slot)."""
        self._ops.synchronize()

    def slot_tensor(self, slot: int, nbytes: int) -> torch.Tensor:
        """The device bytes of an allocated slot (for GPUDirect Storage transfers)."""
        start = int(self._starts([slot], nbytes)[0])
        return self.arena[start : start + nbytes]

    # ------------------------------------------------------------ state

    def health(self) -> TierHealth:
        return self._health

    def stats(self) -> TierStats:
        with self._lock:
            counters = dict(self._counters)
        return TierStats(
            kind=self.kind,
            health=self._health,
            capacity_bytes=self.allocator.capacity_bytes,
            used_bytes=self.allocator.used_bytes,
            counters=counters,
            gauges={
                "blocks": float(self.allocator.used_slots),
                "streams": float(len(self._pool_lanes)),
                "l2_gds": 1.0 if self.l2_path == "gds" else 0.0,
                "gds_usable": 1.0 if self.gds_usable else 0.0,
            },
        )

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._ops.synchronize()
        self.arena = self._ops.empty(0)

    # ---------------------------------------------------------- internals

    def _starts(self, slots: Sequence[int], nbytes: int) -> np.ndarray:
        """Byte offsets of ``slots`` in the arena; ValueError unless each is allocated and
        holds ``nbytes`` (checked before any launch: a kernel checks nothing)."""
        arr = np.asarray(slots, dtype=np.int64)
        if len(arr) != len(np.unique(arr)):
            raise ValueError("a batch names one slot twice")
        allocated = self.allocator.allocated(arr)
        if not allocated.all():
            raise ValueError(f"L0 slot {int(arr[np.argmin(allocated)])} is not allocated")
        if len(arr) and int(self.allocator.slot_sizes(arr).min()) < nbytes:
            raise ValueError(f"a slot is smaller than the {nbytes}-byte block")
        return self.allocator.offsets(arr).astype(np.int64)

    def _scratch(self, n: int, nbytes: int) -> tuple[int, list[torch.Tensor]]:
        """Device scratch for a bridge copy of ``n`` blocks: how many blocks a group takes,
        and the halves the groups take in turn (one buffer, when one group takes them all
        or a block is larger than a half: every group then takes it after the last)."""
        group = max(1, min(n, BRIDGE_SCRATCH_BYTES // 2 // nbytes))
        if group >= n:
            return n, [self._ops.empty(n * nbytes)]
        if 2 * nbytes > BRIDGE_SCRATCH_BYTES:
            return 1, [self._ops.empty(nbytes)]
        scratch = self._ops.empty(2 * group * nbytes)
        return group, [scratch[: group * nbytes], scratch[group * nbytes :]]

    def _pool_lane(self) -> str:
        return self._pool_lanes[next(self._next_lane) % len(self._pool_lanes)]

    def _to_arena(self, hosts: Sequence[object], starts: np.ndarray, nbytes: int) -> Any:
        """Copy host blocks (views or tensors) into the slots at ``starts``; an event."""
        maps: dict[int, tuple[torch.Tensor, int]] = {}
        with self._ops.lane(H2D):
            for g in range(0, len(hosts), HOST_GROUP):
                src = _host_tensors(hosts[g : g + HOST_GROUP], nbytes, maps=maps)
                dst = [self.arena[s : s + nbytes] for s in starts[g : g + HOST_GROUP].tolist()]
                for d, s in _coalesced(list(zip(dst, src, strict=True))):
                    self._ops.copy(d, s)
            return self._ops.record()

    def _from_arena(self, hosts: Sequence[object], starts: np.ndarray, nbytes: int) -> Any:
        """Copy the slots at ``starts`` out into host blocks (views or tensors); an event."""
        maps: dict[int, tuple[torch.Tensor, int]] = {}
        with self._ops.lane(D2H):
            for g in range(0, len(hosts), HOST_GROUP):
                dst = _host_tensors(hosts[g : g + HOST_GROUP], nbytes, writable=True, maps=maps)
                src = [self.arena[s : s + nbytes] for s in starts[g : g + HOST_GROUP].tolist()]
                for d, s in _coalesced(list(zip(dst, src, strict=True))):
                    self._ops.copy(d, s)
            return self._ops.record()

    def _stage_from_pool(self, src: PoolPages, nbytes: int) -> torch.Tensor:
        n = len(src)
        staging = self._ops.host_empty(n * nbytes)
        store_from(
            src, np.arange(n), staging.numpy(), np.arange(n, dtype=np.uint64) * nbytes, nbytes
        )
        return staging

    def _failed(self, verb: str, e: RuntimeError) -> TierMemoryExhausted | None:
        """A verb's CUDA error: the error to raise when the device was short of memory
        (``_short_of_memory``), else None, the tier DOWN (``_fault``)."""
        if _is_out_of_memory(e):
            return self._short_of_memory(verb, e)
        self._fault(verb, e)
        return None

    def _fault(self, verb: str, e: BaseException) -> None:
        """Mark the tier DOWN, once what the verb launched before the failure has run: a
        launch can fail with the context intact and the copies before it still running,
        into the caller's host buffers (L1 slots it frees when the batch fails) and out of
        scratch that goes back to torch's allocator when the verb returns. After a fault
        that broke the context, the wait fails at once."""
        with contextlib.suppress(RuntimeError):
            self._ops.synchronize()
        log.error("L0 %s failed on %s: %s", verb, self._ops.device, e, exc_info=True)
        self._health = TierHealth(Health.DOWN, f"{verb} failed: {e}")
        self._count({"faults": 1})

    def _short_of_memory(self, verb: str, e: BaseException) -> TierMemoryExhausted | None:
        """Count a failed device allocation and return the error that says so; the health
        stays as it is (see the module docstring). The copies the verb launched before it
        are waited for first: the scratch they use goes back to torch's allocator when the
        verb returns, and another verb's allocation must not get it while they still run.
        None when that wait fails: one of those copies faulted, and the tier is DOWN."""
        try:
            self._ops.synchronize()
        except RuntimeError as fault:
            self._fault(verb, fault)
            return None
        log.warning("L0 %s: no device memory to spare on %s: %s", verb, self._ops.device, e)
        self._count({"out_of_memory": 1})
        return TierMemoryExhausted(f"L0 {verb}: the device is out of memory: {e}")

    def _count(self, deltas: dict[str, int]) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._counters[name] = self._counters.get(name, 0) + value


def _is_out_of_memory(e: RuntimeError) -> bool:
    """Whether a CUDA error is memory that could not be had, which leaves the context
    intact: torch's caching allocator raises OutOfMemoryError, while a CUDA call it checks
    outside that allocator (cudaHostAlloc for page-locked staging, say) raises an
    AcceleratorError carrying the call's error code."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        getattr(e, "error_code", None) == CUDA_ERROR_MEMORY_ALLOCATION
    )


def _starts_in(m: int, nbytes: int) -> np.ndarray:
    """Where ``m`` blocks of ``nbytes`` lie in scratch: one after another."""
    return np.arange(m, dtype=np.int64) * nbytes


def _coalesced(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` copies of 1-D uint8 tensors, fewer: pairs whose destination and source
    both continue the previous pair's, in the same storages, become one longer copy. The
    pairs are independent (distinct destinations), so their order is free: they are sorted
    by where their sources lie first."""
    if len(pairs) < 2:
        return pairs
    pairs = sorted(pairs, key=lambda p: (p[1].untyped_storage().data_ptr(), p[1].storage_offset()))
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    dst0, src0 = pairs[0]
    length = dst0.numel()
    for dst, src in pairs[1:]:
        if _continues(dst0, length, dst) and _continues(src0, length, src):
            length += dst.numel()
            continue
        out.append(_extent(dst0, src0, length))
        dst0, src0, length = dst, src, dst.numel()
    out.append(_extent(dst0, src0, length))
    return out


def _continues(first: torch.Tensor, length: int, t: torch.Tensor) -> bool:
    """Whether ``t`` starts where ``length`` bytes from ``first`` end and ends inside
    ``first``'s storage. Storages are told apart by address, and two may share one (a
    tensor over the first bytes of a map, and one over the whole map): the joined copy is a
    view of ``first``'s storage, so it must hold ``t``'s bytes too."""
    storage = first.untyped_storage()
    return (
        t.untyped_storage().data_ptr() == storage.data_ptr()
        and t.storage_offset() == first.storage_offset() + length
        and t.storage_offset() + t.numel() <= storage.nbytes()
        and t.device == first.device
    )


def _extent(dst: torch.Tensor, src: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    if length == dst.numel():
        return dst, src
    return (
        dst.as_strided((length,), (1,), dst.storage_offset()),
        src.as_strided((length,), (1,), src.storage_offset()),
    )


def _host_tensors(
    views: Sequence[object],
    nbytes: int,
    *,
    writable: bool = False,
    maps: dict[int, tuple[torch.Tensor, int]] | None = None,
) -> list[torch.Tensor]:
    """A tensor on the first ``nbytes`` of each view (tensors pass as they are). Views into
    one memory map (L1's arena) become slices of one tensor over the whole map, so that
    ``_coalesced`` can join neighbours; other views get a tensor each. ``maps`` keeps the
    tensors over whole maps from one call to the next (a batch's groups share them)."""
    out: list[torch.Tensor] = []
    maps = {} if maps is None else maps
    for v in views:
        if isinstance(v, torch.Tensor):
            out.append(v)
            continue
        if (
            not isinstance(v, memoryview)
            or not isinstance(v.obj, mmap.mmap)
            or v.nbytes < nbytes
            or (writable and v.readonly)
        ):
            out.append(_host_tensor(v, nbytes, writable=writable))  # or its error
            continue
        obj = v.obj
        if id(obj) not in maps:
            whole = _host_tensor(obj, len(obj), writable=writable)
            maps[id(obj)] = (whole, whole.data_ptr())
        whole, base = maps[id(obj)]
        start = int(np.frombuffer(v, dtype=np.uint8).__array_interface__["data"][0]) - base
        out.append(whole[start : start + nbytes])
    return out


def _host_tensor(view: object, nbytes: int, *, writable: bool = False) -> torch.Tensor:
    mv = memoryview(view).cast("B")  # type: ignore[arg-type]
    if len(mv) < nbytes:
        raise ValueError(f"a host buffer of {len(mv)} bytes is shorter than the block")
    if writable and mv.readonly:
        raise ValueError("a destination host buffer is read-only")
    with warnings.catch_warnings():
        # Sources may be read-only (bytes); the tier only reads them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8, count=nbytes)


def _conforms(tier: DeviceTier) -> tuple[SlotTier, DeviceBridge]:
    """mypy checks here that DeviceTier is a SlotTier and a DeviceBridge."""
    return tier, tier
