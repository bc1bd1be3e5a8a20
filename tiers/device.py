"""L0: the GPU tier, a device arena of block slots.

The arena (``tiers.l0.capacity_bytes`` of device memory) is allocated once at start; slots
come from a SlabAllocator, exactly as in L1, so a slot is one contiguous device extent.
Blocks move in batches:

- **engine pool <-> L0** (``DevicePages``, a CUDA IPC pool): one gather or scatter launch
  for the whole batch (every block, every layer, every buffer), on one of ``streams`` pool
  streams taken in turn;
- **L1 <-> L0** (``HostBuffers``, e.g. L1 slot views): one async copy per block, on the
  dedicated host-to-device or device-to-host stream, so demotion to L1 never queues behind
  engine traffic (with L1 page-locked these are DMA copies at full PCIe speed);
- **shared-memory pool <-> L0** (``PoolPages``): gathered on the host into a (pinned)
  staging buffer, then as above;
- **engine pool <-> host memory** without an L0 slot (``pool_to_host``/``host_to_pool``):
  through a scratch device buffer, for a Get from L1 into a GPU pool or a Put that skips L0.

Every verb records an event on its stream after its last copy and blocks until the event
fires: when ``write``/``read`` return, the bytes are in place. Verbs run on worker threads;
two calls in flight never name the same slot (the store's in-flight marks guarantee it).

Invariants: a slot handed to a verb is allocated and at least ``nbytes`` long, checked
before any copy (a device kernel checks nothing). A CUDA fault inside a verb is a result,
not an exception: the batch fails, the tier reports DOWN with the error (a CUDA context
does not recover from most faults), and the daemon keeps serving its other tiers.

All CUDA calls sit behind ``DeviceOps`` (``CudaOps`` on a GPU). The tests run the tier on
``CpuOps``: the same slot, batch and plan logic with CPU tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.kernels.paged import copy_runs
from kvtier.kernels.runs import gather_runs, scatter_runs
from kvtier.tiers.base import (
    HEALTHY,
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
    TierStats,
    TierUnavailable,
    WriteBatch,
    WriteOutcome,
)
from kvtier.tiers.buffers import load_into, store_from
from kvtier.tiers.slab import SlabAllocator

log = logging.getLogger(__name__)

ALIGN = 4096  # slot alignment; also what GPUDirect Storage wants for direct transfers
H2D, D2H = "h2d", "d2h"


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

    def copy_runs(self, runs: Any, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> str:
        """Launch a plan on the current stream; the executor's name."""
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

    def copy_runs(self, runs: Any, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> str:
        return copy_runs(runs, src, dst)

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

    def copy_runs(self, runs: Any, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> str:
        return copy_runs(runs, src, dst, executor="torch")

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
        self.allocator = SlabAllocator(capacity_bytes, segment_bytes, ALIGN)
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
        log.info(
            "L0 device arena: %d MiB on %s in %d segments of %d MiB, %d pool streams",
            self.allocator.capacity_bytes >> 20,
            ops.device,
            self.allocator.num_segments,
            segment_bytes >> 20,
            streams,
        )

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
                    runs = gather_runs(src.smap, src.pages, 0, starts)
                    self._ops.copy_runs(runs, src.segments, [self.arena])
                    event = self._ops.record()
            elif isinstance(src, HostBuffers):
                direction = H2D
                hosts = [_host_tensor(v, batch.nbytes) for v in src.views]
                event = self._to_arena(hosts, starts, batch.nbytes)
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
            self._fault("write", e)
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
                    runs = scatter_runs(dest.smap, 0, starts, dest.pages)
                    self._ops.copy_runs(runs, [self.arena], dest.segments)
                    self._ops.wait(self._ops.record())
            elif isinstance(dest, HostBuffers):
                direction = D2H
                hosts = [_host_tensor(v, batch.nbytes, writable=True) for v in dest.views]
                self._ops.wait(self._from_arena(hosts, starts, batch.nbytes))
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
            self._fault("read", e)
            return [False] * n
        self._count({f"blocks_read_{direction}": n, f"bytes_read_{direction}": n * batch.nbytes})
        return [True] * n

    def remove(self, slots: Sequence[int]) -> bool:
        for slot in slots:
            self.allocator.free(slot)
        return True

    def recover_chunks(self, rows: int = 65536) -> Iterator[RecoveredBlocks]:
        return iter(())  # device memory does not survive a restart

    # ------------------------------------------- engine pool <-> host, no slot

    def pool_to_host(self, src: DevicePages, dest: HostBuffers, nbytes: int) -> bool:
        """Gather pool pages straight into host buffers (a Put from a GPU pool into L1).
        False: the device failed (the buffers' bytes are unspecified)."""
        n = len(src)
        if len(dest) != n:
            raise ValueError(f"{len(dest)} host buffers for {n} pages")
        if not self._health.serves_reads:
            return False
        try:
            scratch = self._ops.empty(n * nbytes)
            starts = np.arange(n, dtype=np.int64) * nbytes
            with self._ops.lane(self._pool_lane()):
                self._ops.copy_runs(
                    gather_runs(src.smap, src.pages, 0, starts), src.segments, [scratch]
                )
                gathered = self._ops.record()
            with self._ops.lane(D2H):
                self._ops.after(gathered)
                for j, view in enumerate(dest.views):
                    host = _host_tensor(view, nbytes, writable=True)
                    self._ops.copy(host, scratch[j * nbytes : (j + 1) * nbytes])
                self._ops.wait(self._ops.record())
        except RuntimeError as e:
            self._fault("pool_to_host", e)
            return False
        self._count({"blocks_pool_to_host": n, "bytes_pool_to_host": n * nbytes})
        return True

    def host_to_pool(self, src: HostBuffers, dest: DevicePages, nbytes: int) -> bool:
        """Scatter host buffers straight into pool pages (a Get from L1 into a GPU pool).
        False: the device failed (the pages' bytes are unspecified)."""
        n = len(dest)
        if len(src) != n:
            raise ValueError(f"{len(src)} host buffers for {n} pages")
        if not self._health.serves_reads:
            return False
        try:
            scratch = self._ops.empty(n * nbytes)
            with self._ops.lane(H2D):
                for j, view in enumerate(src.views):
                    self._ops.copy(
                        scratch[j * nbytes : (j + 1) * nbytes], _host_tensor(view, nbytes)
                    )
                copied = self._ops.record()
            starts = np.arange(n, dtype=np.int64) * nbytes
            with self._ops.lane(self._pool_lane()):
                self._ops.after(copied)
                self._ops.copy_runs(
                    scatter_runs(dest.smap, 0, starts, dest.pages), [scratch], dest.segments
                )
                self._ops.wait(self._ops.record())
        except RuntimeError as e:
            self._fault("host_to_pool", e)
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
        if len(arr) != len(set(arr.tolist())):
            raise ValueError("a batch names one slot twice")
        for slot in arr.tolist():
            if not self.allocator.is_allocated(slot):
                raise ValueError(f"L0 slot {slot} is not allocated")
        if len(arr) and int(self.allocator.slot_sizes(arr).min()) < nbytes:
            raise ValueError(f"a slot is smaller than the {nbytes}-byte block")
        return self.allocator.offsets(arr).astype(np.int64)

    def _pool_lane(self) -> str:
        return self._pool_lanes[next(self._next_lane) % len(self._pool_lanes)]

    def _to_arena(self, hosts: Sequence[torch.Tensor], starts: np.ndarray, nbytes: int) -> Any:
        with self._ops.lane(H2D):
            for host, start in zip(hosts, starts.tolist(), strict=True):
                self._ops.copy(self.arena[start : start + nbytes], host)
            return self._ops.record()

    def _from_arena(self, hosts: Sequence[torch.Tensor], starts: np.ndarray, nbytes: int) -> Any:
        with self._ops.lane(D2H):
            for host, start in zip(hosts, starts.tolist(), strict=True):
                self._ops.copy(host, self.arena[start : start + nbytes])
            return self._ops.record()

    def _stage_from_pool(self, src: PoolPages, nbytes: int) -> torch.Tensor:
        n = len(src)
        staging = self._ops.host_empty(n * nbytes)
        store_from(
            src, np.arange(n), staging.numpy(), np.arange(n, dtype=np.uint64) * nbytes, nbytes
        )
        return staging

    def _fault(self, verb: str, e: BaseException) -> None:
        log.error("L0 %s failed on %s: %s", verb, self._ops.device, e, exc_info=True)
        self._health = TierHealth(Health.DOWN, f"{verb} failed: {e}")
        self._count({"faults": 1})

    def _count(self, deltas: dict[str, int]) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._counters[name] = self._counters.get(name, 0) + value


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
