"""CUDA IPC pools in the daemon: parsing and validation of registrations, one mapping per
allocation, lifetimes, and the FAILED_PRECONDITION answer of a host without CUDA. The CUDA
calls are replaced by a CPU implementation at their one boundary (tests/cpu_ipc.py); the
copies that prove a mapping right are the real kernels."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from cpu_ipc import CpuMapper
from kv_pools import LAYOUTS, make_pool

from kvtier.client import FailedPreconditionError, PoolLayout
from kvtier.client.cuda import CudaIpcExport, IpcBuffer
from kvtier.daemon.cuda_pools import CudaPoolOpener, open_opener, parse_region
from kvtier.daemon.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtier.kernels.paged import copy_runs
from kvtier.kernels.runs import gather_runs
from kvtier.proto import kvtier_pb2 as pb

UUID = b"\x11" * 16


def export_pool(mapper: CpuMapper, pool, *, lead: int = 512, shared: bool = False):
    """Put each layer tensor of ``pool`` into a mapper allocation (at ``lead`` bytes in, so
    alloc offsets are not zero) and describe them as the client would."""
    buffers = []
    segs = pool.segments
    if shared:  # every layer in one allocation
        total = lead + sum(s.numel() + 256 for s in segs)
        handle, alloc = mapper.allocate(total)
        at = lead
        for seg, buf in zip(segs, pool.buffers, strict=True):
            alloc[at : at + seg.numel()] = seg
            buffers.append(IpcBuffer(handle, at, seg.numel(), buf.pool_offset))
            at += seg.numel() + 256
    else:
        for seg, buf in zip(segs, pool.buffers, strict=True):
            handle, alloc = mapper.allocate(lead + seg.numel())
            alloc[lead:] = seg
            buffers.append(IpcBuffer(handle, lead, seg.numel(), buf.pool_offset))
    return CudaIpcExport(tuple(buffers), 0, UUID)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_opened_pool_serves_the_engines_bytes(kind, shared):
    mapper = CpuMapper()
    opener = CudaPoolOpener(mapper)
    pool = make_pool(kind, dtype="bfloat16", gap=4096)
    pool.fill_random(4)
    export = export_pool(mapper, pool, shared=shared)
    cuda_pool = opener.open(7, "s", export.region(), pool.layout)
    assert mapper.opens == (1 if shared else len(pool.segments))
    assert len(opener.table) == mapper.opens
    pages = np.array([3, 0, 5])
    batch = cuda_pool.pages(pages)
    arena = torch.zeros(3 * pool.layout.block_bytes, dtype=torch.uint8)
    starts = np.arange(3) * pool.layout.block_bytes
    copy_runs(gather_runs(batch.smap, batch.pages, 0, starts), batch.segments, [arena])
    for j, p in enumerate(pages):
        blk = arena[starts[j] : starts[j] + pool.layout.block_bytes]
        assert torch.equal(blk, pool.block(int(p)))
    cuda_pool.close()
    assert not mapper.mapped and len(opener.table) == 0


def test_one_allocation_is_opened_once_across_pools_and_closed_with_the_last():
    mapper = CpuMapper()
    opener = CudaPoolOpener(mapper)
    pool = make_pool("vllm")
    export = export_pool(mapper, pool, shared=True)
    a = opener.open(1, "s1", export.region(), pool.layout)
    b = opener.open(2, "s2", export.region(), pool.layout)
    assert mapper.opens == 1
    a.close()
    assert len(mapper.mapped) == 1
    b.close()
    assert not mapper.mapped
    b.close()  # idempotent


def test_a_copy_in_flight_keeps_the_mapping_until_it_ends():
    mapper = CpuMapper()
    opener = CudaPoolOpener(mapper)
    pool = make_pool("mla")
    cuda_pool = opener.open(1, "s", export_pool(mapper, pool).region(), pool.layout)
    with cuda_pool.use():
        cuda_pool.close()  # the session ended (the engine exited) mid-copy
        assert len(mapper.mapped) == len(pool.segments)
        with pytest.raises(NotFound), cuda_pool.use():
            pass
    assert not mapper.mapped


def test_a_stale_handle_fails_and_leaves_nothing_open():
    mapper = CpuMapper()
    opener = CudaPoolOpener(mapper)
    pool = make_pool("vllm", layers=3)
    export = export_pool(mapper, pool)
    mapper.forget(export.buffers[2].handle)  # the engine freed its last layer
    with pytest.raises(FailedPrecondition, match="buffer 2: the handle cannot be opened"):
        opener.open(1, "s", export.region(), pool.layout)
    assert not mapper.mapped and len(opener.table) == 0


def test_buffers_beyond_their_allocation_are_refused():
    mapper = CpuMapper()
    opener = CudaPoolOpener(mapper)
    pool = make_pool("vllm", layers=2)
    export = export_pool(mapper, pool, lead=512)
    b = export.buffers[1]
    lying = CudaIpcExport(
        (export.buffers[0], IpcBuffer(b.handle, b.alloc_offset + 1, b.size_bytes, b.pool_offset)),
        0,
        UUID,
    )
    with pytest.raises(InvalidArgument, match="beyond its allocation"):
        opener.open(1, "s", lying.region(), pool.layout)
    assert not mapper.mapped


def test_other_devices_are_refused():
    mapper = CpuMapper(device=0)
    opener = CudaPoolOpener(mapper)
    pool = make_pool("flashinfer", layers=1)
    export = export_pool(mapper, pool)
    other = CudaIpcExport(export.buffers, 3, b"\x22" * 16)
    with pytest.raises(FailedPrecondition, match=r"device 3 of the engine .*GPU-22222222"):
        opener.open(1, "s", other.region(), pool.layout)
    assert not mapper.mapped
    # No UUID sent, but the memory itself lives on another device.
    handle, alloc = mapper.allocate(pool.segments[0].numel(), device=1)
    region = CudaIpcExport((IpcBuffer(handle, 0, alloc.numel(), 0),), 1, b"").region()
    with pytest.raises(FailedPrecondition, match="lives on device 1"):
        opener.open(1, "s", region, pool.layout)
    assert not mapper.mapped


def test_layouts_that_do_not_fit_the_buffers_are_refused_before_any_open():
    mapper = CpuMapper()
    opener = CudaPoolOpener(mapper)
    pool = make_pool("vllm", layers=2)
    export = export_pool(mapper, pool)
    bigger = make_pool("vllm", layers=2, pages=pool.layout.num_pages + 1)
    with pytest.raises(InvalidArgument, match="does not fit the CUDA IPC pool"):
        opener.open(1, "s", export.region(), bigger.layout)
    # Buffers that split layer 1's K chunks in two (K and V apart would be fine).
    b0, b1 = export.buffers
    q = b1.size_bytes // 4
    split = CudaIpcExport(
        (
            b0,
            IpcBuffer(b1.handle, b1.alloc_offset, q, b1.pool_offset),
            IpcBuffer(b1.handle, b1.alloc_offset + q, b1.size_bytes - q, b1.pool_offset + q),
        ),
        0,
        UUID,
    )
    with pytest.raises(InvalidArgument, match="not inside one buffer"):
        opener.open(1, "s", split.region(), pool.layout)
    assert mapper.opens == 0


@pytest.mark.parametrize(
    ("region", "message"),
    [
        (pb.CudaIpcRegion(handle=b"x" * 63, size_bytes=10), "64 bytes, not 63"),
        (pb.CudaIpcRegion(handle=b"x" * 64, size_bytes=0), "size_bytes must be positive"),
        (
            pb.CudaIpcRegion(
                handle=b"x" * 64, buffers=[pb.CudaIpcBuffer(handle=b"y" * 64, size_bytes=1)]
            ),
            "not both",
        ),
        (
            pb.CudaIpcRegion(buffers=[pb.CudaIpcBuffer(handle=b"y" * 64, size_bytes=1 << 62)]),
            "below 2\\*\\*62",
        ),
        (
            pb.CudaIpcRegion(handle=b"x" * 64, size_bytes=10, device_uuid=b"abc"),
            "device_uuid has 3 bytes",
        ),
        (
            pb.CudaIpcRegion(buffers=[pb.CudaIpcBuffer(handle=b"y" * 64, size_bytes=1)] * 8193),
            "at most 8192",
        ),
    ],
)
def test_malformed_regions_are_invalid_arguments(region, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_region(region)


def test_the_single_allocation_form_is_one_buffer_at_pool_offset_zero():
    spec = parse_region(pb.CudaIpcRegion(handle=b"h" * 64, size_bytes=4096, device=2))
    assert len(spec.buffers) == 1
    assert (spec.buffers[0].pool_offset, spec.buffers[0].alloc_offset) == (0, 0)
    assert spec.extent == 4096 and spec.device == 2


@pytest.mark.no_cuda
def test_without_cuda_or_the_gpu_tier_registration_is_a_failed_precondition():
    region = pb.CudaIpcRegion(handle=b"h" * 64, size_bytes=4096)
    layout = make_pool("mla", layers=1, pages=2).layout
    with pytest.raises(FailedPrecondition, match=r"tiers\.l0\.enabled=true"):
        open_opener(False, 0).open(1, "s", region, layout)
    assert not torch.cuda.is_available()  # this test describes a host without CUDA
    with pytest.raises(FailedPrecondition, match="this host has no CUDA device"):
        open_opener(True, 0).open(1, "s", region, layout)


def test_the_daemon_answers_failed_precondition_and_keeps_serving(daemon):
    """Through the real server and client: a CUDA IPC registration on this host."""
    from kvtier.client import Client, SharedMemoryPool

    pool = make_pool("vllm", layers=2, pages=4)
    export = CudaIpcExport(
        tuple(IpcBuffer(b"\x01" * 64, 0, b.size, b.pool_offset) for b in pool.buffers), 0, UUID
    )
    layout: PoolLayout = pool.layout
    with Client(daemon.address) as client:
        with pytest.raises(
            FailedPreconditionError, match=r"CUDA IPC pools need the GPU tier.*tiers\.l0\.enabled"
        ):
            client.register_cuda_pool(export, layout)
        with SharedMemoryPool.for_layout(layout) as shm:
            assert client.register_pool(shm, layout).pool_id


# ------------------------------------------------------- registration through the service


def _service(tmp_path, *, l0: bool = True, sets: tuple[str, ...] = (), ops=None):
    """A KVService over a real store (L0 on ``ops``, CpuOps by default, when ``l0``; L1)
    whose pool registry opens CUDA IPC pools through the CPU stand-in."""
    from kvtier.daemon.config import load_config
    from kvtier.daemon.credentials import FdCloser, TicketBook
    from kvtier.daemon.pools import PoolRegistry
    from kvtier.daemon.service import KVService
    from kvtier.daemon.sessions import SessionRegistry
    from kvtier.daemon.store import BlockStore
    from kvtier.tiers.device import CpuOps, DeviceTier
    from kvtier.tiers.host import HostArena

    config = load_config(None, list(sets))
    tiers: list[object] = [HostArena(4 << 20, 1 << 20)]
    if l0:
        tiers.append(DeviceTier(4 << 20, 256 << 10, ops=ops or CpuOps()))
    store = BlockStore(config, tiers=tiers)
    mapper = CpuMapper()
    tickets = TicketBook(FdCloser())
    registry = PoolRegistry(str(tmp_path), cuda=CudaPoolOpener(mapper))
    service = KVService(config, store, registry, SessionRegistry(), tickets)
    return service, tickets, mapper


def _session(service, tickets, uid: int = 1000) -> str:
    from kvtier.daemon.credentials import TicketKind
    from kvtier.daemon.sessions import PeerCred

    ticket = tickets.issue(TicketKind.SESSION, PeerCred(pid=1, uid=uid, gid=uid))
    return service.open_session("engine", ticket, unix_socket=True).session_id


def _export(mapper: CpuMapper, pool) -> pb.CudaIpcRegion:
    buffers = tuple(
        IpcBuffer(mapper.adopt(t), 0, seg.numel(), b.pool_offset)
        for t, seg, b in zip(pool.tensors, pool.segments, pool.buffers, strict=True)
    )
    return CudaIpcExport(buffers, 0, UUID).region()


async def test_a_registered_gpu_pool_serves_puts_and_gets_and_dies_with_its_session(tmp_path):
    service, tickets, mapper = _service(tmp_path)
    session = _session(service, tickets)
    engine = make_pool("vllm", layers=2, pages=8, dtype="bfloat16", gap=4096)
    engine.fill_random(11)
    pool = service.register_cuda_ipc_pool(session, _export(mapper, engine), engine.layout)
    assert pool.block_bytes == engine.layout.block_bytes and not pool.sealed
    assert len(mapper.mapped) == 2
    keys = [bytes([i]) * 32 for i in range(3)]
    want = [engine.block(p).clone() for p in (0, 1, 2)]
    results, _ = await service.put(session, pool.pool_id, keys, [0, 1, 2], b"")
    assert results.tolist() == [0, 0, 0]
    outcome = await service.lookup(session, keys, False, 0)
    assert outcome.prefix_len == 3 and outcome.tiers.tolist() == [pb.TIER_L0_GPU] * 3
    for t in engine.tensors:
        t.view(torch.uint8)[:, 5:8] = 0xA5
    loaded = await service.get(session, pool.pool_id, keys, [5, 6, 7], 0)
    assert loaded.tolist() == [True] * 3
    for p, w in zip((5, 6, 7), want, strict=True):
        assert torch.equal(engine.block(p), w)
    snap = service.stats(session)
    assert snap.gauges["pools"] == 1 and snap.gauges["l0_blocks"] == 3
    with pytest.raises(InvalidArgument, match="page index -1"):
        await service.get(session, pool.pool_id, keys[:1], [-1], 0)
    with pytest.raises(InvalidArgument, match="page index 8"):
        await service.put(session, pool.pool_id, keys[:1], [8], b"")
    service.close_session(session)  # the engine exited without unregistering
    assert not mapper.mapped and len(service.pools) == 0
    service.store.close()


async def test_a_gpu_tier_that_is_down_refuses_gpu_pools_naming_its_state(tmp_path):
    """After a CUDA fault L0 serves no GPU pool until the daemon restarts: a registration is
    FAILED_PRECONDITION naming L0's state, before anything is opened (it was registered, on
    a GPU through the faulted context, and every Put and Get of it failed)."""
    from kvtier.tiers.base import Health
    from kvtier.tiers.device import CpuOps

    class FaultingOps(CpuOps):
        broken = False

        def copy_pages(self, pages, slots, starts, *, gather):  # type: ignore[no-untyped-def]
            if self.broken:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().copy_pages(pages, slots, starts, gather=gather)

    ops = FaultingOps()
    service, tickets, mapper = _service(tmp_path, ops=ops)
    session = _session(service, tickets)
    engine = make_pool("mla", layers=2, pages=4)
    pool = service.register_cuda_ipc_pool(session, _export(mapper, engine), engine.layout)
    ops.broken = True
    results, _ = await service.put(session, pool.pool_id, [b"k" * 32], [0], b"")
    assert results.tolist() != [0]  # not stored: the copy into L0 faulted
    assert service.store.stack.device.tier.health().state is Health.DOWN
    opens = mapper.opens
    other = make_pool("mla", layers=2, pages=4)
    with pytest.raises(FailedPrecondition, match=r"GPU tier .*down: .*illegal memory access"):
        service.register_cuda_ipc_pool(session, _export(mapper, other), other.layout)
    assert mapper.opens == opens and len(service.pools) == 1
    await service.unregister_pool(session, pool.pool_id)
    service.store.close()


@pytest.mark.parametrize("opened", [True, False], ids=["opened", "open_failed"])
async def test_a_gpu_tier_going_down_while_a_pool_is_opened_refuses_it(tmp_path, opened):
    """L0 faults (a copy on a worker thread) while a registration opens its handles, past
    the check before them: the registration is FAILED_PRECONDITION naming L0's state, with
    nothing left open (it was registered on a tier that serves no GPU pool, or, where the
    open failed in the faulted context, answered that the exporting process may have
    exited)."""
    from kvtier.tiers.base import BlockRef, Health, HostBuffers, WriteBatch
    from kvtier.tiers.device import CpuOps

    class FaultingOps(CpuOps):
        broken = False

        def copy(self, dst, src):  # type: ignore[no-untyped-def]
            if self.broken:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super().copy(dst, src)

    ops = FaultingOps()
    service, tickets, mapper = _service(tmp_path, ops=ops)
    session = _session(service, tickets)
    engine = make_pool("mla", layers=2, pages=4)
    region = _export(mapper, engine)
    tier = service.store.stack.device.tier
    nbytes = engine.layout.block_bytes
    slots = [tier.allocator.allocate(nbytes)]
    batch = WriteBatch(slots, [BlockRef(0, b"k" * 32)], nbytes, HostBuffers([bytes(nbytes)]))
    open_handle = mapper.open

    def open_as_l0_faults(handle: bytes) -> tuple[int, int]:
        if not ops.broken:  # another request's copy, on a worker thread meanwhile
            ops.broken = True
            assert not tier.write(batch)[0].ok
        if not opened:
            raise OSError("cuIpcOpenMemHandle failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)")
        return open_handle(handle)

    mapper.open = open_as_l0_faults  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match=r"GPU tier .*down: .*illegal memory access"):
        service.register_cuda_ipc_pool(session, region, engine.layout)
    assert tier.health().state is Health.DOWN
    assert len(service.pools) == 0
    await service.pools.stop()
    assert mapper.mapped == {}
    service.store.close()


def test_gpu_pools_follow_the_rules_of_every_pool(tmp_path):
    from kvtier.daemon.errors import PermissionDenied, ResourceExhausted

    service, tickets, mapper = _service(tmp_path, sets=("server.max_pools_per_session=1",))
    engine = make_pool("mla", layers=2, pages=4)
    owner, other = _session(service, tickets), _session(service, tickets, uid=1001)
    pool = service.register_cuda_ipc_pool(owner, _export(mapper, engine), engine.layout)
    with pytest.raises(ResourceExhausted, match="max_pools_per_session"):
        service.register_cuda_ipc_pool(owner, _export(mapper, engine), engine.layout)
    with pytest.raises(PermissionDenied, match="another session"):
        asyncio.run(service.unregister_pool(other, pool.pool_id))
    # A TCP session (a token's tenant, no peer credentials) registers no memory.
    from kvtier.daemon.tenants import Tenant, TenantDirectory, _digest

    service.tenants = TenantDirectory([Tenant("remote", token_digest=_digest(b"t" * 16))])
    remote = service.open_session("tcp", b"", unix_socket=False, token=b"t" * 16).session_id
    with pytest.raises(PermissionDenied, match="no peer credentials"):
        service.register_cuda_ipc_pool(remote, _export(mapper, engine), engine.layout)
    # A block larger than an L0 slot is refused, naming the key that limits it.
    big = make_pool("vllm", layers=64, pages=2, tokens=16, heads=4, head_dim=32)
    with pytest.raises(InvalidArgument, match=r"raise tiers\.l0\.segment_bytes"):
        service.register_cuda_ipc_pool(other, _export(mapper, big), big.layout)
    # Refused registrations left nothing open: only the one pool's two layers.
    assert len(mapper.mapped) == 2 and len(service.pools) == 1
    asyncio.run(service.unregister_pool(owner, pool.pool_id))
    assert not mapper.mapped and len(service.pools) == 0
    service.store.close()


def test_a_daemon_without_a_gpu_tier_refuses_gpu_pools_whatever_it_could_open(tmp_path):
    service, tickets, mapper = _service(tmp_path, l0=False)
    engine = make_pool("flashinfer", layers=1, pages=4)
    with pytest.raises(FailedPrecondition, match=r"tiers\.l0\.enabled=true"):
        service.register_cuda_ipc_pool(
            _session(service, tickets), _export(mapper, engine), engine.layout
        )
    assert mapper.opens == 0 and len(service.pools) == 0
    service.store.close()


async def test_unregister_answers_once_no_copy_uses_the_pool(tmp_path):
    """A copy still running when its pool is unregistered keeps the memory mapped; the
    UnregisterPool answer waits for it, so the engine may then reuse the pages."""
    from kvtier.daemon.errors import NotFound

    service, tickets, mapper = _service(tmp_path)
    engine = make_pool("mla", layers=2, pages=4)
    owner = _session(service, tickets)
    pool = service.register_cuda_ipc_pool(owner, _export(mapper, engine), engine.layout)
    with pool.use():
        done = asyncio.ensure_future(service.unregister_pool(owner, pool.pool_id))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not done.done() and len(mapper.mapped) == 2
        with pytest.raises(NotFound, match="being unregistered"), pool.use():
            pass
    await asyncio.wait_for(done, 5)
    assert not mapper.mapped
    service.store.close()


async def test_a_shared_memory_pool_is_released_after_its_last_copy():
    import mmap

    from kvtier.daemon.pools import Pool
    from kvtier.kernels.layout import PoolLayout

    layout = PoolLayout.staging(
        num_layers=1, num_pages=4, block_tokens=1, chunk_bytes=4096, kv_count=1
    )
    pool = Pool(1, "s", "test", layout, mmap.mmap(-1, layout.extent_bytes))
    with pool.use():
        pool.close()
        released = asyncio.ensure_future(pool.released())
        await asyncio.sleep(0)
        assert not released.done() and len(pool.array) == layout.extent_bytes
    await asyncio.wait_for(released, 5)
    assert len(pool.array) == 0
