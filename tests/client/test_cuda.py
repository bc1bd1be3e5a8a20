"""Client side of CUDA IPC pools: layouts of per-layer KV tensors, the protobuf encoding of
an export, and (on a GPU) real handles opened by a second process."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from kvtier.client.cuda import (
    CudaIpcExport,
    CudaPool,
    IpcBuffer,
    export_tensors,
    layout_for,
    pool_offsets,
)
from kvtier.kernels.layout import LayoutError
from kvtier.proto import kvtier_pb2 as pb

H = bytes(range(64))


def test_export_round_trips_through_protobuf_bytes():
    export = CudaIpcExport(
        (IpcBuffer(H, 512, 4096, 0), IpcBuffer(H[::-1], 0, 8192, 4096)), 1, b"\x07" * 16
    )
    data = export.to_bytes()
    assert CudaIpcExport.from_bytes(data) == export
    assert data == export.to_bytes()  # deterministic
    msg = pb.CudaIpcRegion.FromString(data)
    assert [b.alloc_offset for b in msg.buffers] == [512, 0]
    assert msg.device == 1 and not msg.handle  # the multi-buffer form only
    assert export.extent_bytes == 4096 + 8192


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xff\xff", "not a CudaIpcRegion"),
        (b"", "no buffers"),
        (
            pb.CudaIpcRegion(
                buffers=[pb.CudaIpcBuffer(handle=b"x", size_bytes=1)]
            ).SerializeToString(),
            "64 bytes",
        ),
        (pb.CudaIpcRegion(buffers=[pb.CudaIpcBuffer(handle=H)]).SerializeToString(), "bad size"),
        (
            pb.CudaIpcRegion(
                buffers=[pb.CudaIpcBuffer(handle=H, size_bytes=1)], device_uuid=b"u"
            ).SerializeToString(),
            "device_uuid",
        ),
    ],
)
def test_malformed_bytes_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        CudaIpcExport.from_bytes(data)


def test_pool_offsets_are_aligned_and_disjoint():
    assert pool_offsets([10, 4096, 1]) == [0, 4096, 8192]
    assert pool_offsets([8192, 8192], align=4096) == [0, 8192]


@pytest.mark.parametrize("kind", ["vllm", "flashinfer", "mla"])
def test_layout_for_matches_the_engines_tensor_indexing(kind):
    pages, tokens, heads, dim, layers = 5, 4, 2, 8, 3
    shape = {
        "vllm": (2, pages, tokens, heads, dim),
        "flashinfer": (pages, 2, tokens, heads, dim),
        "mla": (pages, tokens, heads * dim),
    }[kind]
    numel = int(np.prod(shape))
    offsets = pool_offsets([numel * 2] * layers, align=1 << 14)
    space = torch.zeros(offsets[-1] // 2 + numel, dtype=torch.float16)
    tensors = [space[o // 2 : o // 2 + numel].view(shape) for o in offsets]
    layout = layout_for(kind, [shape] * layers, "float16", offsets)
    layout.validate(space.numel() * 2)
    table = layout.chunk_table
    offs = table.pool_offsets(np.arange(pages)).reshape(pages, -1)
    for page in range(pages):
        c = 0
        for t in tensors:
            if kind == "vllm":
                views = [t[0, page], t[1, page]]
            elif kind == "flashinfer":
                views = [t[page, 0], t[page, 1]]
            else:
                views = [t[page]]
            for v in views:
                assert int(offs[page, c]) == v.data_ptr() - space.data_ptr()
                assert int(table.length[c]) == v.numel() * 2
                c += 1


def test_layout_for_refuses_unknown_shapes():
    with pytest.raises(LayoutError, match="unknown pool kind"):
        layout_for("paged", [(2, 2, 2, 2, 2)], "float16", [0])
    with pytest.raises(LayoutError, match="same shape"):
        layout_for("vllm", [(2, 4, 2, 2, 2), (2, 5, 2, 2, 2)], "float16", [0, 4096])
    with pytest.raises(LayoutError, match=r"\[2, pages"):
        layout_for("vllm", [(4, 2, 2, 2, 2)], "float16", [0])
    with pytest.raises(LayoutError, match="MLA"):
        layout_for("mla", [(4, 2, 2, 2)], "float16", [0])


def test_check_layout_is_the_daemons_rule():
    export = CudaIpcExport((IpcBuffer(H, 0, 2 * 4 * 64, 0),), 0, b"")
    good = layout_for("vllm", [(2, 4, 4, 2, 4)], "float16", [0])
    export.check_layout(good)
    too_many_pages = layout_for("vllm", [(2, 5, 4, 2, 4)], "float16", [0])
    with pytest.raises(LayoutError):
        export.check_layout(too_many_pages)


def test_export_refuses_tensors_it_cannot_share():
    t = torch.zeros((2, 4, 4, 2, 4), dtype=torch.float16)
    with pytest.raises(ValueError, match="not a CUDA device"):
        export_tensors([t], [0])
    with pytest.raises(ValueError, match="2 offsets for 1 tensors"):
        export_tensors([t], [0, 1])


# ------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_export_names_each_tensors_place_in_its_allocation():
    from kvtier.kernels.cudadrv import driver

    tensors = [torch.randn((2, 8, 16, 2, 64), device="cuda").half() for _ in range(3)]
    pool = CudaPool.from_tensors("vllm", tensors)
    drv = driver()
    for t, b in zip(tensors, pool.export.buffers, strict=True):
        rng = drv.address_range(t.data_ptr())
        assert len(b.handle) == 64
        assert rng.base + b.alloc_offset == t.data_ptr()
        assert b.alloc_offset + b.size_bytes <= rng.size
    uuid = torch.cuda.get_device_properties(0).uuid
    assert pool.export.device_uuid == bytes(uuid.bytes)  # a list of ints in torch 2.11


def _engine(conn) -> None:  # pragma: no cover - runs in the child process
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(3)
    tensors = [
        torch.randint(0, 256, (2, 6, 16, 2, 64), dtype=torch.uint8, device="cuda", generator=g)
        for _ in range(2)
    ]
    pool = CudaPool.from_tensors("vllm", [t.view(torch.float16) for t in tensors])
    conn.send((pool.export.to_bytes(), [t.cpu().numpy() for t in tensors]))
    conn.recv()  # hold the memory until the daemon side is done


@pytest.mark.gpu
def test_a_second_process_opens_the_handles_and_sees_the_bytes():
    from kvtier.daemon.cuda_pools import CudaPoolOpener, DriverMapper

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(theirs,))
    proc.start()
    try:
        data, expected = ours.recv()
        export = CudaIpcExport.from_bytes(data)
        # The engine's uint8 tensors of (2, 6, 16, 2, 64) seen as float16: 32 items a row.
        layout = layout_for(
            "vllm", [(2, 6, 16, 2, 32)] * 2, "float16", [b.pool_offset for b in export.buffers]
        )
        opener = CudaPoolOpener(DriverMapper(0))
        pool = opener.open(1, "s", export.region(), layout)
        for seg, want in zip(pool.segments, expected, strict=True):
            assert np.array_equal(seg.cpu().numpy(), want.reshape(-1))
        pool.close()
        assert len(opener.table) == 0
    finally:
        ours.send(None)
        proc.join(30)


def _short_lived_engine(conn) -> None:  # pragma: no cover - runs in the child process
    torch.cuda.set_device(0)
    t = torch.arange(4 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    pool = CudaPool.from_tensors("mla", [t.view(torch.float16).view(8, 16, -1)])
    conn.send(pool.export.to_bytes())
    conn.recv()  # killed while waiting here


@pytest.mark.gpu
def test_an_engine_that_dies_leaves_the_daemons_mapping_readable_until_closed():
    from kvtier.daemon.cuda_pools import CudaPoolOpener, DriverMapper

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_short_lived_engine, args=(theirs,))
    proc.start()
    export = CudaIpcExport.from_bytes(ours.recv())
    shape = (8, 16, (16 << 20) // 2 // 8 // 16)
    layout = layout_for("mla", [shape], "float16", [0])
    opener = CudaPoolOpener(DriverMapper(0))
    pool = opener.open(1, "s", export.region(), layout)
    proc.kill()  # no unregister, no goodbye
    proc.join(30)
    seg = pool.segments[0]
    want = torch.arange(4 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    assert torch.equal(seg, want)
    torch.cuda.synchronize()
    pool.close()
    assert len(opener.table) == 0
