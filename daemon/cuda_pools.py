"""CUDA IPC pools: an engine's GPU KV memory, opened in the daemon.

A registration names one or more buffers, each a range of a CUDA allocation exported with
``cudaIpcGetMemHandle``, placed in a *pool space* that the layout descriptor (the same one
shared-memory pools use) addresses. Before any byte is copied the daemon:

1. parses the region (``parse_region``): handle lengths, sizes, offsets, the device UUID;
   malformed input is INVALID_ARGUMENT;
2. proves the layout against the buffers (``plan_region``): every chunk of every page lies
   inside the pool space, K and V chunks do not overlap, and each layer's K (or V) chunks
   stay inside one buffer (INVALID_ARGUMENT otherwise);
3. checks the device: the exporter's device UUID must be the GPU tier's device, and every
   opened allocation must really live there (FAILED_PRECONDITION otherwise);
4. opens each distinct allocation once (``HandleTable``; several buffers or several pools in
   one allocation share the mapping), then checks every buffer against the real size of its
   allocation (INVALID_ARGUMENT: a client cannot make the daemon touch memory outside the
   allocations its handles name). Which process exported a handle the daemon cannot tell: a
   handle opens its allocation for whoever holds it, the session that presents it included.
   A handle the driver cannot open (its process exited or freed it, or it is not a handle)
   is FAILED_PRECONDITION. Whatever fails, every handle opened so far is closed.

A pool belongs to its session; ``close()`` (unregister, session end, the engine's exit seen
as the end of its session stream) releases its allocations once no copy uses it. Opened
memory stays valid after the exporting process exits, so an engine that dies mid-copy
cannot fault the daemon.

All CUDA calls go through ``IpcMapper``: ``DriverMapper`` on a GPU host; tests put a CPU
implementation there. On a host without CUDA ``CudaPoolOpener`` has no mapper and every
registration is FAILED_PRECONDITION with the reason (the service has refused a malformed one
first with steps 1 and 2, INVALID_ARGUMENT on any host).

Thread-safety: the opener and its handle table are owned by the event loop; a pool's
``use()`` counts copies running on worker threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtier.daemon.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtier.daemon.poolchecks import PoolChecks
from kvtier.kernels.layout import MAX_LAYERS, LayoutError, PoolLayout
from kvtier.kernels.runs import Buffer, SegmentMap
from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.base import DevicePages

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64
UUID_BYTES = 16
MAX_BUFFERS = 2 * MAX_LAYERS
_MAX_OFFSET = 1 << 62  # far beyond any device; keeps sums of offsets inside int64


@dataclass(frozen=True, slots=True)
class BufferSpec:
    handle: bytes
    alloc_offset: int
    size: int
    pool_offset: int


@dataclass(frozen=True, slots=True)
class RegionSpec:
    buffers: tuple[BufferSpec, ...]
    device_uuid: bytes  # empty when the client did not send one
    device: int  # the exporter's index, for messages

    @property
    def extent(self) -> int:
        return max(b.pool_offset + b.size for b in self.buffers)


def parse_region(msg: pb.CudaIpcRegion) -> RegionSpec:
    """The region's buffers; InvalidArgument for anything malformed."""
    if msg.buffers:
        if msg.handle or msg.size_bytes:
            raise InvalidArgument(
                "cuda_ipc: set either handle and size_bytes (one allocation) or buffers, not both"
            )
        if len(msg.buffers) > MAX_BUFFERS:
            raise InvalidArgument(f"cuda_ipc: {len(msg.buffers)} buffers; at most {MAX_BUFFERS}")
        raw = [(b.handle, b.alloc_offset, b.size_bytes, b.pool_offset) for b in msg.buffers]
    else:
        raw = [(msg.handle, 0, msg.size_bytes, 0)]
    buffers = []
    for i, (handle, alloc_offset, size, pool_offset) in enumerate(raw):
        where = f"cuda_ipc buffer {i}"
        if len(handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(
                f"{where}: an IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}"
            )
        if size <= 0:
            raise InvalidArgument(f"{where}: size_bytes must be positive")
        if max(alloc_offset, size, pool_offset) >= _MAX_OFFSET:
            raise InvalidArgument(f"{where}: offsets and sizes must be below 2**62")
        buffers.append(BufferSpec(bytes(handle), alloc_offset, size, pool_offset))
    if msg.device_uuid and len(msg.device_uuid) != UUID_BYTES:
        raise InvalidArgument(
            f"cuda_ipc.device_uuid has {len(msg.device_uuid)} bytes, not {UUID_BYTES}"
        )
    return RegionSpec(tuple(buffers), bytes(msg.device_uuid), msg.device)


def plan_region(spec: RegionSpec, layout: PoolLayout) -> SegmentMap:
    """Prove ``layout`` against the buffers; the copy plan's segment map. InvalidArgument
    when a chunk falls outside pool space or a layer's chunks straddle two buffers."""
    try:
        layout.validate(spec.extent)
        return SegmentMap.build(layout, [Buffer(b.pool_offset, b.size) for b in spec.buffers])
    except LayoutError as e:
        raise InvalidArgument(f"layout does not fit the CUDA IPC pool: {e}") from None


# ------------------------------------------------------------------- the CUDA boundary


class IpcMapper(Protocol):
    """The CUDA calls a CUDA IPC pool needs, and nothing else."""

    @property
    def device(self) -> int:
        """This daemon's GPU tier device (its ordinal here)."""
        ...

    def device_uuid(self) -> bytes: ...

    def open(self, handle: bytes) -> tuple[int, int]:
        """Map an allocation: its ``(base address, size)`` here. Raises OSError when the
        handle cannot be opened."""
        ...

    def close(self, base: int) -> None: ...

    def device_of(self, address: int) -> int: ...

    def tensor(self, address: int, nbytes: int) -> Any:
        """A 1-D uint8 torch tensor over ``[address, address + nbytes)`` (no copy)."""
        ...


class DriverMapper:
    """``IpcMapper`` on a GPU: the driver binding and torch, on the GPU tier's device."""

    def __init__(self, device: int) -> None:
        import torch

        from kvtier.kernels.cudadrv import driver

        self._device = device
        self._torch = torch
        torch.cuda.set_device(device)  # the primary context, current in this thread
        self._drv = driver()

    @property
    def device(self) -> int:
        return self._device

    def device_uuid(self) -> bytes:
        return self._drv.device_uuid(self._device)

    def open(self, handle: bytes) -> tuple[int, int]:
        from kvtier.kernels.cudadrv import CudaError

        self._torch.cuda.set_device(self._device)
        try:
            base = self._drv.ipc_open(handle)
        except CudaError as e:
            raise OSError(str(e)) from None
        try:
            rng = self._drv.address_range(base)
        except CudaError as e:
            self._drv.ipc_close(base)
            raise OSError(str(e)) from None
        return base, rng.size

    def close(self, base: int) -> None:
        self._torch.cuda.set_device(self._device)
        self._drv.ipc_close(base)

    def device_of(self, address: int) -> int:
        return self._drv.pointer_device(address)

    def tensor(self, address: int, nbytes: int) -> Any:
        return self._torch.as_tensor(_CudaArray(address, nbytes), device=f"cuda:{self._device}")


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for torch to wrap device memory."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
            "strides": None,
        }


# --------------------------------------------------------------------------- handles


@dataclass(slots=True)
class _Opened:
    base: int
    size: int
    refs: int = 0


class HandleTable:
    """Each allocation opened once, however many buffers and pools name it (the driver
    refuses to map one allocation twice into a process); closed with its last user."""

    def __init__(self, mapper: IpcMapper) -> None:
        self._mapper = mapper
        self._open: dict[bytes, _Opened] = {}

    def __len__(self) -> int:
        return len(self._open)

    def acquire(self, handle: bytes) -> _Opened:
        entry = self._open.get(handle)
        if entry is None:
            base, size = self._mapper.open(handle)  # OSError propagates: nothing opened
            entry = self._open[handle] = _Opened(base, size)
        entry.refs += 1
        return entry

    def release(self, handle: bytes) -> None:
        entry = self._open[handle]
        entry.refs -= 1
        if entry.refs == 0:
            del self._open[handle]
            try:
                self._mapper.close(entry.base)
            except Exception:
                log.exception("closing a CUDA IPC mapping failed; it stays mapped")


# ----------------------------------------------------------------------------- pools


@dataclass(eq=False)
class CudaPool(PoolChecks):
    """A registered GPU pool. Same surface as a shared-memory pool (``daemon/pools.py``):
    ``block_bytes``, ``check_pages``, ``check_usable``, ``batch`` (``DevicePages``, which
    only the GPU tier reads and writes), ``use()`` while a copy runs, ``close()``."""

    pool_id: int
    session_id: str
    layout: PoolLayout
    smap: SegmentMap
    segments: list[Any]  # torch uint8 device tensors, one per buffer
    handles: list[bytes]  # one entry per acquire, released on close
    table: HandleTable
    _users: int = 0
    _closing: bool = False
    _closed: bool = field(default=False, repr=False)
    name: str = "cuda_ipc"
    # Not a memfd sealed against shrinking; the response's ``sealed`` says only that.
    sealed: bool = False
    # Opened IPC memory stays mapped until the daemon closes it, whatever the engine does:
    # a copy cannot fault on it, so a CUDA pool never breaks (a device fault is the GPU
    # tier's state, reported by its health).
    broken: str = ""

    def check_usable(self) -> None:
        """A CUDA pool cannot break (see ``broken``)."""

    def pages(self, pages: np.ndarray) -> DevicePages:
        """The batch buffer for the GPU tier's verbs."""
        pages = np.asarray(pages, dtype=np.int64)
        self.check_pages(pages)
        return DevicePages(self.smap, self.segments, pages)

    def batch(
        self, pages: np.ndarray, threads: int = 1, layers: tuple[int, int] | None = None
    ) -> DevicePages:
        """``pages`` as a batch buffer (the chunks of ``layers``, all when None), inside
        ``use()``; ``threads`` is for host pools' copies (the GPU copies in one launch)."""
        batch = self.pages(pages)
        if not layers:
            return batch
        return DevicePages(
            _layer_columns(self.smap, self.layout, layers), batch.segments, batch.pages
        )

    @contextlib.contextmanager
    def use(self) -> Iterator[CudaPool]:
        """Keep the mappings alive while a copy runs."""
        if self._closing:
            raise NotFound(f"pool {self.pool_id} is being unregistered")
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            if self._closing and self._users == 0:
                self._release()

    def close(self) -> None:
        self._closing = True
        if self._users == 0:
            self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._mark_released()
        self.segments = []
        for handle in self.handles:
            self.table.release(handle)
        self.handles = []


class CudaPoolOpener:
    """Turns ``RegisterPool`` requests with a ``cuda_ipc`` region into ``CudaPool``s.

    ``mapper`` is None where CUDA pools cannot be served; ``unavailable`` then says why
    (no CUDA on this host, or the GPU tier is not enabled)."""

    def __init__(self, mapper: IpcMapper | None, unavailable: str = "") -> None:
        self.mapper = mapper
        self.unavailable = unavailable
        self.table = HandleTable(mapper) if mapper is not None else None

    def open(
        self, pool_id: int, session_id: str, region: pb.CudaIpcRegion, layout: PoolLayout
    ) -> CudaPool:
        if self.mapper is None or self.table is None:
            raise FailedPrecondition(self.unavailable)
        spec = parse_region(region)
        smap = plan_region(spec, layout)
        mapper, table = self.mapper, self.table
        ours = mapper.device_uuid()
        if spec.device_uuid and spec.device_uuid != ours:
            raise FailedPrecondition(
                f"the pool is on device {spec.device} of the engine (UUID "
                f"{_uuid(spec.device_uuid)}); this daemon's GPU tier runs on device "
                f"{mapper.device} (UUID {_uuid(ours)}): register it with the daemon "
                "serving that GPU"
            )
        acquired: list[bytes] = []
        try:
            segments = [
                self._map_buffer(i, buf, table, mapper, acquired)
                for i, buf in enumerate(spec.buffers)
            ]
        except BaseException:
            for handle in acquired:
                table.release(handle)
            raise
        log.info(
            "pool %d registered: CUDA IPC on device %d, %d buffers in %d allocations, "
            "%d pages of %d-byte blocks, %d layers",
            pool_id,
            mapper.device,
            len(spec.buffers),
            len(set(acquired)),
            layout.num_pages,
            layout.block_bytes,
            len(layout.layers),
        )
        return CudaPool(pool_id, session_id, layout, smap, segments, acquired, table)

    @staticmethod
    def _map_buffer(
        i: int, buf: BufferSpec, table: HandleTable, mapper: IpcMapper, acquired: list[bytes]
    ) -> Any:
        try:
            opened = table.acquire(buf.handle)
        except OSError as e:
            raise FailedPrecondition(
                f"cuda_ipc buffer {i}: the handle cannot be opened ({e}); the exporting "
                "process may have freed the memory or exited, or the handle is not an IPC "
                "handle of this host"
            ) from None
        acquired.append(buf.handle)
        if buf.alloc_offset + buf.size > opened.size:
            raise InvalidArgument(
                f"cuda_ipc buffer {i}: bytes [{buf.alloc_offset}, {buf.alloc_offset + buf.size}) "
                f"reach beyond its allocation of {opened.size} bytes"
            )
        device = mapper.device_of(opened.base)
        if device != mapper.device:
            raise FailedPrecondition(
                f"cuda_ipc buffer {i} lives on device {device}; this daemon's GPU tier runs "
                f"on device {mapper.device}"
            )
        return mapper.tensor(opened.base + buf.alloc_offset, buf.size)


def _layer_columns(smap: SegmentMap, layout: PoolLayout, layers: tuple[int, int]) -> SegmentMap:
    """The chunk columns of layers ``[begin, end)``; offsets stay relative to the whole
    block (a block is layer-major), so copies address the same block slots."""
    begin, end = layers
    layout.layer_range_table(begin, end)  # LayoutError for an empty or out-of-range span
    first = sum(layer.kv_count for layer in layout.layers[:begin])
    stop = first + sum(layer.kv_count for layer in layout.layers[begin:end])
    return dataclasses.replace(
        smap,
        segment=smap.segment[first:stop],
        base=smap.base[first:stop],
        page_stride=smap.page_stride[first:stop],
        length=smap.length[first:stop],
        block_offset=smap.block_offset[first:stop],
    )


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def open_opener(enabled: bool, device: int) -> CudaPoolOpener:
    """The opener a daemon starts with: a real one when its GPU tier runs, else one that
    explains, in FAILED_PRECONDITION, why CUDA IPC pools are refused."""
    if not enabled:
        return CudaPoolOpener(
            None,
            "CUDA IPC pools need the GPU tier (L0), which this daemon does not run: set "
            "tiers.l0.enabled=true on a host with CUDA",
        )
    reason = cuda_unavailable_reason()
    if reason:
        return CudaPoolOpener(None, f"CUDA IPC pools are not served: {reason}")
    return CudaPoolOpener(DriverMapper(device))


def cuda_unavailable_reason() -> str:
    """Empty when this host can serve CUDA IPC pools; else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "this host has no CUDA device (torch.cuda.is_available() is False)"
    from kvtier.kernels.cudadrv import CudaUnavailable, driver

    try:
        driver()
    except CudaUnavailable as e:
        return str(e)
    return ""
