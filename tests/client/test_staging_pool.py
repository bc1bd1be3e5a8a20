"""The vLLM connector's staging pool (``client/integrations/staging.py``) against a real
daemon: transfers hold it open once retired, and an empty transfer holds nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import shm_ipc
import torch
from harness import DaemonFactory, DaemonProcess, NamespacedDaemon

from kvtier.client import Client, Tier
from kvtier.client.integrations import staging
from kvtier.client.integrations.staging import StagingPool


def _pool(client: Client) -> StagingPool:
    return StagingPool(
        client,
        num_layers=2,
        num_pages=4,
        block_tokens=16,
        block_shape=(2, 16, 8),
        dtype=torch.float16,
    )


def test_an_empty_transfer_holds_the_pool_open_for_nobody(gpu_daemon):
    with gpu_daemon.client() as client:
        pool = _pool(client)
        held = pool.alloc(2)
        assert held is not None and len(held) == 2
        empty = pool.alloc(0)
        assert empty == []
        # Regression: free([]) counted a transfer ending that alloc(0) never counted, so the
        # pool closed while the first transfer still held its pages.
        pool.free(empty)
        pool.retire("test")
        assert not pool.closed
        pool.free(held)
        assert pool.closed
        assert pool.free_pages == 4


# ------------------------------------------------- staging in (stand-in) GPU memory

GPU_BLOCK = (2, 16, 8)  # float16: 512 bytes per layer block, 1 KiB per page of 2 layers


@pytest.fixture(scope="module")
def shared_gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon whose GPU tier runs on CpuOps and opens /dev/shm "IPC handles", shared by
    the module's tests (it imports torch: about 1.5 s a start)."""
    factory = DaemonFactory(tmp_path_factory.mktemp("gpu-daemon"))
    yield shm_ipc.start_daemon(factory, factory.workdir)
    factory.close()


@pytest.fixture
def gpu_daemon(shared_gpu_daemon: DaemonProcess) -> NamespacedDaemon:
    """The shared GPU daemon in a namespace of this test's own, once no pool of an earlier
    test is left; the test that kills its daemon takes ``own_gpu_daemon``."""
    return NamespacedDaemon.fresh(shared_gpu_daemon)


@pytest.fixture
def own_gpu_daemon(daemon_factory: DaemonFactory, tmp_path: Path) -> DaemonProcess:
    return shm_ipc.start_daemon(daemon_factory, tmp_path)


def _gpu_pool(client: Client, monkeypatch, num_pages: int = 4):
    made: list[shm_ipc.ShmGpuMemory] = []
    shm_ipc.use_shm_gpu_staging(monkeypatch, made)
    pool = StagingPool(
        client,
        num_layers=2,
        num_pages=num_pages,
        block_tokens=16,
        block_shape=GPU_BLOCK,
        dtype=torch.float16,
        device="cuda",
    )
    return pool, made[0]


def test_a_gpu_staging_pool_is_registered_over_cuda_ipc_and_round_trips_blocks(
    gpu_daemon, monkeypatch
):
    """Pages in GPU memory (the stand-in) are registered as a CUDA IPC pool: the daemon's
    GPU tier stores them and loads them back into other pages, byte-exact."""
    with gpu_daemon.client() as client:
        pool, memory = _gpu_pool(client, monkeypatch)
        engine = torch.randn((2, 2, *GPU_BLOCK)).to(torch.float16)  # [layers, blocks, ...]
        pages = pool.alloc(2)
        assert pages is not None
        for layer in range(2):
            pool.gather(layer, pages, engine[layer], torch.tensor([1, 0]))
        pool.ready()
        assert not memory.busy_pages()
        keys = [bytes([9, i]) * 16 for i in range(2)]
        assert pool.pool.store_keys(keys, pages) == 2
        assert client.lookup(keys).tiers == [Tier.L0_GPU] * 2
        pool.free(pages)
        back = pool.alloc(2)
        assert back is not None and set(back) == set(pages)  # waited for: nothing issued
        pool.tensor.zero_()
        assert pool.pool.load_keys(keys, back[::-1]) == 2
        out = torch.zeros_like(engine)
        for layer in range(2):
            pool.scatter(layer, back[::-1], out[layer], torch.tensor([1, 0]))
        assert torch.equal(out, engine)
        pool.retire("test", unclean=False)
        pool.free(back)
        assert pool.closed and memory.released == [False]


def test_pages_freed_before_the_copies_out_of_them_ran_are_taken_last(gpu_daemon, monkeypatch):
    """On a GPU the engine's copy out of a page runs later than it is issued: a page given
    back before then goes to another transfer only once that copy has run; other free
    pages come first, and when none is left ``alloc`` waits for the copies."""
    with gpu_daemon.client() as client:
        pool, memory = _gpu_pool(client, monkeypatch)
        kv = torch.zeros((4, *GPU_BLOCK), dtype=torch.float16)
        first = pool.alloc(2)
        assert first is not None
        for layer in range(2):
            pool.scatter(layer, first, kv, torch.tensor([0, 1]))
        pool.free(first)
        assert memory.busy_pages() == set(first)
        assert pool.free_pages == 4
        second = pool.alloc(2)
        assert second is not None and not set(second) & set(first)
        assert memory.busy_pages() == set(first)  # not waited for: other pages were free
        third = pool.alloc(2)
        assert third is not None and set(third) == set(first)
        assert not memory.busy_pages()  # waited for the copies out of them
        assert pool.alloc(1) is None  # every page taken
        pool.free(second)
        pool.free(third)


def test_a_retired_gpu_pool_is_released_as_unclean_after_a_transfer_without_an_answer(
    gpu_daemon, monkeypatch
):
    """GPU staging memory goes back to the engine's allocator only when no late copy can
    land in it: a pool retired for a transfer that ended without the daemon's answer is
    released as unclean (``CudaMemory`` then waits for the daemon to fence it)."""
    with gpu_daemon.client() as client:
        pool, memory = _gpu_pool(client, monkeypatch)
        pages = pool.alloc(1)
        assert pages is not None
        pool.retire("a job timed out")
        assert not pool.closed
        pool.free(pages)
        assert pool.closed and memory.released == [True]


def _fence_threads_done() -> None:
    for t in threading.enumerate():
        if t.name == "kvtier-staging-fence":
            t.join(30)


def test_unclean_gpu_staging_memory_is_freed_once_fenced_and_kept_when_it_cannot_be(
    own_gpu_daemon, monkeypatch
):
    """``CudaMemory.release`` (run here over the stand-in's memory): after a transfer that
    ended without an answer, the memory goes back to the allocator once the daemon has
    answered the unregistration, and is kept for the life of the process when the daemon
    cannot answer (it is gone), never handed back while a late copy could land in it."""
    gpu_daemon = own_gpu_daemon
    monkeypatch.setattr(staging, "_KEPT", [])
    monkeypatch.setattr(staging, "_fencing", 0)
    with gpu_daemon.client(timeout_s=2.0) as client:
        pool, memory = _gpu_pool(client, monkeypatch)
        cuda = staging.CudaMemory.__new__(staging.CudaMemory)
        cuda.tensor = memory.tensor
        cuda.release(client, pool.pool, unclean=True)
        _fence_threads_done()
        assert staging._KEPT == [] and staging.fencing_gpu_staging() == 0
        assert client.stats().gauges["pools"] == 0  # unregistered, and answered

        second, memory = _gpu_pool(client, monkeypatch)
        gpu_daemon.kill()
        cuda = staging.CudaMemory.__new__(staging.CudaMemory)
        cuda.tensor = memory.tensor
        cuda.release(client, second.pool, unclean=True)
        _fence_threads_done()
        assert len(staging._KEPT) == 1 and staging._KEPT[0] is memory.tensor
        # The fence has ended (kept): a worker may make a new pool (the daemon restarted).
        assert staging.fencing_gpu_staging() == 0


def test_a_slow_fence_is_waited_for_past_the_clients_timeout(gpu_daemon, monkeypatch):
    """The daemon answers the unregistration of an unclean pool once its last copy ended,
    which may be long after the transfer timed out: the fence waits ``FENCE_TIMEOUT_S``, not
    the client's timeout, and the memory goes back to the allocator when the answer
    comes (a worker makes no new pool until then)."""
    monkeypatch.setattr(staging, "_KEPT", [])
    monkeypatch.setattr(staging, "_fencing", 0)
    with gpu_daemon.client() as client:
        # Registered under the default timeout: 0.2 s throughout failed that registration
        # (DeadlineExceededError) on a loaded machine. The fence's is what is checked.
        pool, memory = _gpu_pool(client, monkeypatch)
        client.timeout_s = 0.2
        answer = threading.Event()
        fence_pool = client.fence_pool
        timeouts = []

        def slow_fence(binding, timeout_s=None):  # type: ignore[no-untyped-def]
            timeouts.append(timeout_s)
            answer.wait(30)  # a copy still running in the daemon
            return fence_pool(binding, timeout_s)

        monkeypatch.setattr(client, "fence_pool", slow_fence)
        cuda = staging.CudaMemory.__new__(staging.CudaMemory)
        cuda.tensor = memory.tensor
        cuda.release(client, pool.pool, unclean=True)
        assert staging.fencing_gpu_staging() == 1  # a worker makes no new GPU pool
        answer.set()
        _fence_threads_done()
        assert timeouts == [staging.FENCE_TIMEOUT_S] and staging.FENCE_TIMEOUT_S > 0.2
        assert staging._KEPT == [] and staging.fencing_gpu_staging() == 0


@pytest.mark.gpu
def test_on_a_gpu_staging_pages_in_device_memory_round_trip_through_kvtierd(daemon_factory):
    """On a GPU, through a kvtierd running its GPU tier: a staging pool in device memory
    (``CudaMemory``, registered over CUDA IPC) takes blocks gathered from strided per-layer
    views of one allocation (each block's layers together), the daemon stores them in L0
    and loads them into other pages, and they are scattered into views of another stride
    order: every block as it was, with the engine's copies ordered by events only."""
    d = daemon_factory(
        "tiers.l0.enabled=true", "tiers.l0.capacity_bytes=256MiB", "tiers.l0.segment_bytes=4MiB"
    )
    layers, blocks, shape = 4, 64, (8, 16, 128)  # [heads, tokens, K|V]: 32 KiB in bf16
    with d.client() as client:
        pool = StagingPool(
            client,
            num_layers=layers,
            num_pages=32,
            block_tokens=16,
            block_shape=shape,
            dtype=torch.bfloat16,
            device="cuda",
        )
        assert isinstance(pool.memory, staging.CudaMemory) and pool.tensor.is_cuda
        engine = torch.randn((blocks, layers, *shape), device="cuda").to(torch.bfloat16)
        kv = [engine[:, i] for i in range(layers)]  # strided
        src = torch.tensor([3, 17, 40, 63, 5, 9, 11, 12], device="cuda")
        pages = pool.alloc(8)
        assert pages is not None
        for layer in range(layers):
            pool.gather(layer, pages, kv[layer], src)
        pool.ready()
        keys = [bytes([7, i]) * 16 for i in range(8)]
        assert pool.pool.store_keys(keys, pages) == 8
        assert client.lookup(keys).tiers == [Tier.L0_GPU] * 8
        pool.free(pages)
        into = pool.alloc(8)
        assert into is not None
        pool.tensor.zero_()
        torch.cuda.synchronize()
        assert pool.pool.load_keys(keys, into[::-1]) == 8
        out = torch.zeros((layers, blocks, *shape), device="cuda", dtype=torch.bfloat16)
        dst = torch.tensor([0, 1, 2, 3, 60, 61, 62, 63], device="cuda")
        for layer in range(layers):
            pool.scatter(layer, into[::-1], out[layer], dst)
        pool.free(into)
        torch.cuda.synchronize()
        for layer in range(layers):
            assert torch.equal(out[layer][dst], kv[layer][src]), layer
        pool.retire("test", unclean=False)
        assert pool.closed


def _aten_ops(copy: Callable[[], None]) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        copy()
    return {event.name for event in prof.events()}


def test_regression_runs_of_consecutive_blocks_were_copied_with_an_indexed_copy(daemon):
    """The vLLM worker's copies between staging pages and its cache name block ids that are
    mostly runs (a request's fresh blocks): each run is one slice copy, a memory copy on the
    CPU. Every copy went through ``index_copy_``/``index_select``, about 4 times slower (0.19
    ms a layer of 16 blocks of 64 KiB: 1.2 ms of a 6-layer load, on every hit). Ids that
    pair up in more than ``MAX_RUN_COPIES`` runs still take one indexed copy; both ways
    are byte-exact, in any stride order of the cache."""
    layers, shape = 2, (2, 16, 8)
    with daemon.client() as client:
        pool = StagingPool(
            client,
            num_layers=layers,
            num_pages=32,
            block_tokens=16,
            block_shape=shape,
            dtype=torch.bfloat16,
        )
        try:
            engine = torch.randn((64, layers, *shape)).to(torch.bfloat16)
            kv = [engine[:, i] for i in range(layers)]  # strided, as vLLM's views may be
            scattered = list(range(0, 64, 4))  # 16 runs of one block
            cases = [
                ([3, 4, 5, 6, 10, 11], list(range(20, 26)), False),  # 2 runs
                (list(range(16)), scattered, True),
                (list(range(16, 32))[::-1], list(range(40, 56)), True),
            ]
            for pages, blocks, indexed in cases:
                ids = torch.tensor(blocks)
                ops = _aten_ops(partial(pool.gather, 0, pages, kv[0], ids))
                assert ("aten::index_select" in ops) == indexed, (pages, blocks)
                pool.gather(1, pages, kv[1], ids)
                out = [torch.zeros_like(k) for k in kv]
                for layer in range(layers):
                    ops = _aten_ops(partial(pool.scatter, layer, pages, out[layer], ids))
                    assert ("aten::index_copy_" in ops) == indexed, (pages, blocks)
                    assert torch.equal(out[layer][ids], kv[layer][ids]), (pages, blocks)
                    assert torch.equal(pool.layer(layer)[pages], kv[layer][ids])
            assert len(scattered) > staging.MAX_RUN_COPIES
        finally:
            pool.close()
