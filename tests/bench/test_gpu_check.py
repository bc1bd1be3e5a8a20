"""``kvtier bench gpu``: without CUDA it stops at once and says why; its round-trip stage,
run here on the GPU tier's CPU stand-in, passes on a correct data plane and reports a wrong
one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from benchjson import only_json
from cpu_ipc import CpuMapper
from kv_pools import make_pool

from kvtier.bench.gpu_check import KINDS, Report, Stack, round_trip
from kvtier.client.cuda import CudaIpcExport, IpcBuffer
from kvtier.daemon.cuda_pools import CudaPoolOpener
from kvtier.tiers.device import CpuOps, DeviceTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostArena


@pytest.mark.no_cuda
def test_without_cuda_it_fails_fast_with_the_reason(capsys):
    # In this process: a fresh interpreter spent its seconds importing torch, which this
    # module has imported already. JsonStdout writes the object to this capture and sends
    # everything else to stderr, as it does in a process of its own.
    from kvtier.cli.main import main

    assert not torch.cuda.is_available()
    code = main(["bench", "gpu", "--json"])
    out = capsys.readouterr()
    assert code == 2, out.err
    error = only_json(out.out)  # the error object, alone on stdout
    assert error["ok"] is False and "needs a CUDA GPU" in error["error"]
    assert "torch.cuda.is_available() is False" in out.err


@pytest.mark.no_cuda
def test_kvtier_bench_runs_it_as_gpu():
    from kvtier.bench import BENCHMARKS, run_bench

    assert BENCHMARKS["gpu"] == "kvtier.bench.gpu_check"
    assert run_bench("gpu", [], as_json=True) == 2


@pytest.fixture
def stack(tmp_path):
    mapper = CpuMapper()
    s = Stack(
        DeviceTier(16 << 20, 4 << 20, streams=2, ops=CpuOps()),
        HostArena(16 << 20, 4 << 20),
        DiskTier(tmp_path / "l2", 16 << 20, 4 << 20, io_threads=2),
        CudaPoolOpener(mapper),
        str(tmp_path),
    )
    yield s, mapper
    s.close()


def _open(stack, mapper, pool, pool_id):
    buffers = tuple(
        IpcBuffer(mapper.adopt(t), 0, seg.numel(), b.pool_offset)
        for t, seg, b in zip(pool.tensors, pool.segments, pool.buffers, strict=True)
    )
    region = CudaIpcExport(buffers, 0, b"").region()
    return stack.opener.open(pool_id, "s", region, pool.layout)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_stage_is_bit_exact_on_a_correct_stack(stack, kind):
    s, mapper = stack
    pool = make_pool(kind, layers=3, pages=16, dtype="bfloat16", gap=4096)
    pool.fill_random(21)
    src, dst = [3, 9, 0, 14, 6], [1, 2, 4, 5, 7]
    expected = [xxhash.xxh3_64_intdigest(pool.block(p).numpy().tobytes()) for p in src]
    originals = [pool.block(p) for p in src]
    for t in pool.tensors:  # poison the destination pages
        if kind == "vllm":
            t.view(torch.uint8)[:, dst] = 0xA5
        else:
            t.view(torch.uint8)[dst] = 0xA5
    cuda_pool = _open(s, mapper, pool, 1)
    report = Report()
    round_trip(s, cuda_pool, src, dst, expected, report, kind)
    cuda_pool.close()
    assert report.failures == []
    for p, want in zip(dst, originals, strict=True):
        assert torch.equal(pool.block(p), want)
    # Every slot went back: nothing leaked in any tier.
    assert s.l0.allocator.used_slots == 0 and s.l1.allocator.used_slots == 0
    assert s.l2.allocator.used_slots == 0


def test_round_trip_stage_reports_wrong_bytes(stack):
    s, mapper = stack
    pool = make_pool("vllm", layers=2, pages=8)
    pool.fill_random(3)
    cuda_pool = _open(s, mapper, pool, 2)
    report = Report()
    wrong = [0] * 4
    round_trip(s, cuda_pool, [0, 1, 2, 3], [4, 5, 6, 7], wrong, report, "vllm")
    cuda_pool.close()
    assert "vllm: L1 bytes: L1 holds other bytes than the engine's" in report.failures
    assert "vllm: L2 bytes: L2 returned other bytes" in report.failures
    assert np.array_equal(pool.block(4).numpy(), pool.block(0).numpy())


def test_daemon_round_trip_pushes_blocks_down_every_tier_and_loads_them_back(
    daemon_factory, tmp_path
):
    """The GPU check's stage 4 (through a kvtierd, its RPCs only) run here against a real
    daemon with L1 and L2 and a shared-memory pool: the same Put, filler, Lookup, Get and
    Delete sequence walks the blocks down the stack and back, byte-exact."""
    from kvtier.bench.gpu_check import daemon_overrides, daemon_round_trip
    from kvtier.client import Client, PoolLayout, SharedMemoryPool

    sized = ("tiers.l0.", "tiers.l1.capacity", "tiers.l1.segment", "tiers.l2.capacity")
    overrides = [o for o in daemon_overrides(str(tmp_path / "l2")) if not o.startswith(sized)]
    d = daemon_factory(
        *overrides,
        "tiers.l1.segment_bytes=1MiB",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=16MiB",
        l1_bytes="2MiB",
    )
    layout = PoolLayout.staging(
        num_layers=4, num_pages=32, block_tokens=16, chunk_bytes=8192, dtype="uint8"
    )
    n = layout.block_bytes
    with Client(d.address) as client, SharedMemoryPool.for_layout(layout) as shm:
        data = shm.array()
        data[:] = np.random.default_rng(5).integers(0, 256, len(data), dtype=np.uint8)
        pool = client.register_pool(shm, layout)
        checked: list[list[int]] = []

        def poison(pages: list[int]) -> None:
            for p in pages:
                data[p * n : (p + 1) * n] = 0xA5

        def verify(src: list[int], dst: list[int]) -> list[int]:
            bad = [
                d
                for s, d in zip(src, dst, strict=True)
                if data[s * n : (s + 1) * n].tobytes() != data[d * n : (d + 1) * n].tobytes()
            ]
            checked.append(bad)
            return bad

        report = Report()
        out = daemon_round_trip(
            client,
            pool.pool_id,
            n,
            list(range(6)),
            list(range(20, 26)),
            poison,
            verify,
            report,
            "staging",
        )
        assert report.failures == []
        assert checked == [[], []]  # both Gets were checked, and both were exact
        assert out["tiers seen"] == [
            "put: L1_HOST",
            "pushed to L2_DISK: L2_DISK",
            "after that get: L2_DISK",
            "after that get: L1_HOST",
        ]
        # A wrong page is reported, not missed.
        report = Report()
        daemon_round_trip(
            client, pool.pool_id, n, [0, 1], [20, 21], poison, lambda s, d: [21], report, "x"
        )
        assert (
            "x: engine pages after get from the bottom tier: pages [21] differ" in report.failures
        )
        pool.unregister()
