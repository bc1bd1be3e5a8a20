"""Registering an engine's GPU KV cache with the daemon over CUDA IPC.

The engine keeps its KV tensors; the client exports a CUDA IPC handle for each tensor's
allocation (with where the tensor starts inside it and its size), places the tensors one
after another in a *pool space*, and describes them with the same layout descriptor as a
shared-memory pool. The daemon maps the allocations once and copies pages itself: after
registration no byte of KV passes through the engine's process or through gRPC.

The export is plain protobuf (``CudaIpcRegion``); nothing is pickled. Handles name whole
allocations: tensors that share one (the caching allocator packs small tensors together)
repeat its handle, and the daemon opens it once.

Requirements on the engine's side: every tensor contiguous and on one device, allocated by
``cudaMalloc`` (torch's default caching allocator; ``expandable_segments`` memory cannot be
exported with legacy CUDA IPC), and alive for as long as the pool is registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.kernels.layout import LayerLayout, LayoutError, PoolLayout
from kvtier.kernels.runs import Buffer, SegmentMap
from kvtier.proto import kvtier_pb2 as pb

if TYPE_CHECKING:
    import torch

IPC_HANDLE_BYTES = 64
UUID_BYTES = 16
POOL_ALIGN = 4096  # where each buffer starts in pool space
KINDS = ("vllm", "flashinfer", "mla")


@dataclass(frozen=True, slots=True)
class IpcBuffer:
    handle: bytes  # of the allocation that holds the buffer
    alloc_offset: int  # where the buffer starts in that allocation
    size_bytes: int
    pool_offset: int  # where it starts in pool space


@dataclass(frozen=True)
class CudaIpcExport:
    """A pool's GPU memory as the daemon will map it. Encodes to and from protobuf bytes."""

    buffers: tuple[IpcBuffer, ...]
    device: int
    device_uuid: bytes

    def __post_init__(self) -> None:
        if not self.buffers:
            raise ValueError("an export needs at least one buffer")
        for i, b in enumerate(self.buffers):
            if len(b.handle) != IPC_HANDLE_BYTES:
                raise ValueError(f"buffer {i}: an IPC handle has {IPC_HANDLE_BYTES} bytes")
            if b.size_bytes <= 0 or b.alloc_offset < 0 or b.pool_offset < 0:
                raise ValueError(f"buffer {i}: bad size or offset")
        if self.device_uuid and len(self.device_uuid) != UUID_BYTES:
            raise ValueError(f"device_uuid has {UUID_BYTES} bytes")

    @property
    def extent_bytes(self) -> int:
        return max(b.pool_offset + b.size_bytes for b in self.buffers)

    def region(self) -> pb.CudaIpcRegion:
        return pb.CudaIpcRegion(
            device=self.device,
            device_uuid=self.device_uuid,
            buffers=[
                pb.CudaIpcBuffer(
                    handle=b.handle,
                    alloc_offset=b.alloc_offset,
                    size_bytes=b.size_bytes,
                    pool_offset=b.pool_offset,
                )
                for b in self.buffers
            ],
        )

    def to_bytes(self) -> bytes:
        return self.region().SerializeToString(deterministic=True)

    @classmethod
    def from_region(cls, msg: pb.CudaIpcRegion) -> CudaIpcExport:
        """Raises ValueError for a region this client would not have sent."""
        if not msg.buffers:
            raise ValueError("region has no buffers")
        return cls(
            tuple(
                IpcBuffer(bytes(b.handle), b.alloc_offset, b.size_bytes, b.pool_offset)
                for b in msg.buffers
            ),
            msg.device,
            bytes(msg.device_uuid),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> CudaIpcExport:
        from google.protobuf.message import DecodeError

        msg = pb.CudaIpcRegion()
        try:
            msg.ParseFromString(data)
        except DecodeError as e:
            raise ValueError(f"not a CudaIpcRegion: {e}") from None
        return cls.from_region(msg)

    def check_layout(self, layout: PoolLayout) -> None:
        """Raise LayoutError unless ``layout`` fits these buffers (the daemon's own check)."""
        layout.validate(self.extent_bytes)
        SegmentMap.build(layout, [Buffer(b.pool_offset, b.size_bytes) for b in self.buffers])


def pool_offsets(sizes: Sequence[int], align: int = POOL_ALIGN) -> list[int]:
    """Buffers one after another in pool space, each starting on ``align``."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at = -(-(at + size) // align) * align
    return out


def layout_for(
    kind: str, shapes: Sequence[Sequence[int]], dtype: str, offsets: Sequence[int]
) -> PoolLayout:
    """The layout of per-layer KV tensors placed at ``offsets`` in pool space.

    ``vllm``: ``[2, pages, tokens, heads, dim]``; ``flashinfer``: ``[pages, 2, tokens,
    heads, dim]``; ``mla``: ``[pages, tokens, latent]``. Every layer has the same shape.
    """
    from kvtier.kernels.layout import DTYPE_ITEMSIZE

    if kind not in KINDS:
        raise LayoutError(f"unknown pool kind {kind!r}; one of {', '.join(KINDS)}")
    if not shapes or any(tuple(s) != tuple(shapes[0]) for s in shapes):
        raise LayoutError("every layer tensor must have the same shape")
    shape = tuple(shapes[0])
    item = DTYPE_ITEMSIZE[dtype]
    if kind == "mla":
        if len(shape) != 3:
            raise LayoutError(f"an MLA layer is [pages, tokens, latent], not {list(shape)}")
        pages, tokens, latent = shape
        chunk = tokens * latent * item
        layers = tuple(LayerLayout(off, 1, 0, chunk, chunk) for off in offsets)
        return PoolLayout(layers, pages, tokens, dtype)
    if len(shape) != 5 or (shape[0] if kind == "vllm" else shape[1]) != 2:
        want = (
            "[2, pages, tokens, heads, dim]" if kind == "vllm" else "[pages, 2, tokens, heads, dim]"
        )
        raise LayoutError(f"a {kind} layer is {want}, not {list(shape)}")
    pages = shape[1] if kind == "vllm" else shape[0]
    tokens, heads, dim = shape[2:]
    chunk = tokens * heads * dim * item
    kv_stride, page_stride = (pages * chunk, chunk) if kind == "vllm" else (chunk, 2 * chunk)
    layers = tuple(LayerLayout(off, 2, kv_stride, page_stride, chunk) for off in offsets)
    return PoolLayout(layers, pages, tokens, dtype)


@dataclass(frozen=True)
class CudaPool:
    """An engine's per-layer KV tensors, exported. Register with
    ``client.register_cuda_pool(pool.export, pool.layout, namespace)``."""

    tensors: tuple[torch.Tensor, ...]
    kind: str
    layout: PoolLayout
    export: CudaIpcExport

    @classmethod
    def from_tensors(cls, kind: str, tensors: Sequence[torch.Tensor]) -> CudaPool:
        """Export ``tensors`` (one per layer, laid out as ``kind``)."""
        if not tensors:
            raise ValueError("no tensors")
        dtype = _dtype_name(tensors[0])
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = pool_offsets(sizes)
        layout = layout_for(kind, [tuple(t.shape) for t in tensors], dtype, offsets)
        export = export_tensors(tensors, offsets)
        export.check_layout(layout)
        return cls(tuple(tensors), kind, layout, export)


def export_tensors(tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> CudaIpcExport:
    """IPC handles of ``tensors`` (contiguous, one device), placed at ``offsets``."""
    from kvtier.kernels.cudadrv import CudaError, driver

    if len(offsets) != len(tensors):
        raise ValueError(f"{len(offsets)} offsets for {len(tensors)} tensors")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if not t.is_cuda:
            raise ValueError(f"tensor {i} is on {t.device}, not a CUDA device")
        if t.device != device:
            raise ValueError(f"tensor {i} is on {t.device}; the pool's tensors are on {device}")
        if not t.is_contiguous():
            raise ValueError(f"tensor {i} is not contiguous; export the tensor it views")
    drv = driver()
    buffers = []
    for i, (t, off) in enumerate(zip(tensors, offsets, strict=True)):
        ptr = t.data_ptr()
        try:
            rng = drv.address_range(ptr)
            handle = drv.ipc_get_handle(rng.base)
        except CudaError as e:
            raise ValueError(
                f"tensor {i} cannot be exported over CUDA IPC ({e}); memory from "
                "expandable_segments or a custom allocator cannot be: allocate the KV cache "
                "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
            ) from None
        buffers.append(IpcBuffer(handle, ptr - rng.base, t.numel() * t.element_size(), off))
    index = device.index if device.index is not None else 0
    return CudaIpcExport(tuple(buffers), index, drv.device_uuid(index))


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    from kvtier.kernels.layout import DTYPE_ITEMSIZE

    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"KV tensors of {t.dtype} are not supported")
    return name
