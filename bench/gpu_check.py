"""``kvtier bench gpu``: the GPU data plane checked on a real GPU, in one run (< 5 minutes).

An *engine* (a child process that owns KV tensors on the GPU, exports them over CUDA IPC as
protobuf and checks its own pages), this process, and (stage 4) a real kvtierd. With random
data and poisoned destinations at every stage:

1. **module round trips** for every layout (vLLM, FlashInfer, MLA, staging), driving the
   daemon's own modules in this process (``daemon/cuda_pools``, ``tiers/device``,
   ``tiers/host``, ``tiers/disk``): engine pages -> L0 (one gather launch from the
   IPC-mapped pool) -> L1 (pinned host arena) -> L2 (disk tier, durable, checksummed) -> L1
   -> L0 -> other, poisoned engine pages; the engine checks its pages bit for bit, and the
   L1 and L2 bytes are checked against the engine's checksums (which no RPC can show);
2. **bandwidth ratios** against the device's own ceilings measured in the same run:
   engine pool <-> L0 vs a plain device-to-device copy of the same bytes (target >= 0.8x),
   L1 <-> L0 vs a pinned ``cudaMemcpy`` of the same bytes (target >= 0.9x), and L2 -> L0
   through pinned L1 and through GPUDirect Storage (when kvikio and GDS are usable), on the
   modules in this process (an RPC costs more than moving these bytes on the device);
3. **kernels**: the Triton executor against the torch one on the same pages, the block
   digest on the GPU against the CPU, int8/fp8 quantisation error and speed;
4. **round trips through a kvtierd** (``tiers.l0.enabled=true``, pinned L1, L2) for every
   layout, with its RPCs only: the engine's export registered over CUDA IPC, Put into L0,
   filler Puts pushing the blocks to L1 and then L2 (Lookup confirming each step), a Get
   from L2 into poisoned engine pages through L0 (L0 full), and after the filler
   is deleted a Get that promotes them into L0 first; the engine checks its pages after
   each Get (``daemon_round_trip``);
5. **concurrent clients through a kvtierd**: four client threads, each its own session and
   registration of one engine's pool, put and get their own pages at once while L0 demotes
   under them; every Get checked by the engine (``_concurrent_stage``);
6. **the vLLM connector's GPU staging through a kvtierd** (``_staging_stage``): a worker's
   staging pool in GPU memory registered over CUDA IPC, between a KV cache viewed as vLLM
   0.32 views it (strided per-layer views of one allocation) and the daemon's GPU tier:
   gather + Put, Get + scatter, bit-exact, with a device copy of the same bytes beside them.

Which paths go through a real kvtierd is printed with every result (``through_daemon``).

Without CUDA it stops at once with a message saying so (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvtier.bench import BenchUnavailable
from kvtier.bench.common import arg_parser
from kvtier.bench.jsonout import Emit

KINDS = ("vllm", "flashinfer", "mla", "staging")
POISON = 0xA5


# ----------------------------------------------------------------- the engine process


def _engine_tensors(kind: str, shape: dict[str, int], device: Any) -> list[Any]:
    import torch

    L, P, T, H, D = (shape[k] for k in ("layers", "pages", "tokens", "heads", "dim"))
    dt = torch.bfloat16
    if kind == "vllm":
        return [torch.empty((2, P, T, H, D), dtype=dt, device=device) for _ in range(L)]
    if kind == "flashinfer":
        return [torch.empty((P, 2, T, H, D), dtype=dt, device=device) for _ in range(L)]
    if kind == "mla":
        return [torch.empty((P, T, shape["latent"]), dtype=dt, device=device) for _ in range(L)]
    return [torch.empty((P, L, 2, T * H * D), dtype=dt, device=device)]


def _engine_block(kind: str, tensors: list[Any], page: int) -> Any:
    """A page's block from the engine's own indexing: chunks layer by layer, K before V."""
    import torch

    def b(t: Any) -> Any:
        return t.reshape(-1).view(torch.uint8)

    if kind == "staging":
        return b(tensors[0][page])
    parts = []
    for t in tensors:
        if kind == "vllm":
            parts += [b(t[0, page]), b(t[1, page])]
        elif kind == "flashinfer":
            parts += [b(t[page, 0]), b(t[page, 1])]
        else:
            parts.append(b(t[page]))
    return torch.cat(parts)


def _engine_main(conn: Connection) -> None:
    """The engine: owns KV tensors, exports them, checks its pages. Commands arrive as
    tuples of plain values; the pool's registration travels as protobuf bytes."""
    import torch
    import xxhash

    from kvtier.client.cuda import CudaPool, export_tensors
    from kvtier.client.types import layout_to_pb
    from kvtier.kernels.layout import PoolLayout
    from kvtier.proto import kvtier_pb2 as pb

    torch.cuda.set_device(0)
    pools: dict[str, tuple[str, list[Any]]] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            return
        try:
            if msg[0] == "alloc":
                _, name, kind, shape, src_pages, dst_pages, seed = msg
                tensors = _engine_tensors(kind, shape, "cuda")
                g = torch.Generator(device="cuda").manual_seed(seed)
                for t in tensors:
                    raw = t.view(-1).view(torch.uint8)
                    raw.copy_(
                        torch.randint(
                            0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=g
                        )
                    )
                if kind == "staging":
                    t = tensors[0]
                    chunk = shape["tokens"] * shape["heads"] * shape["dim"] * 2
                    layout = PoolLayout.staging(
                        num_layers=shape["layers"],
                        num_pages=shape["pages"],
                        block_tokens=shape["tokens"],
                        chunk_bytes=chunk,
                        dtype="bfloat16",
                    )
                    export = export_tensors([t], [0])
                    export.check_layout(layout)
                else:
                    pool = CudaPool.from_tensors(kind, tensors)
                    layout, export = pool.layout, pool.export
                for page in dst_pages:
                    _engine_block_fill(kind, tensors, page, POISON)
                torch.cuda.synchronize()
                digests = [
                    xxhash.xxh3_64_intdigest(
                        _engine_block(kind, tensors, p).cpu().numpy().tobytes()
                    )
                    for p in src_pages
                ]
                pools[name] = (kind, tensors)
                req = pb.RegisterPoolRequest(cuda_ipc=export.region(), layout=layout_to_pb(layout))
                conn.send(("pool", req.SerializeToString(), digests))
            elif msg[0] == "verify":
                _, name, src_pages, dst_pages = msg
                kind, tensors = pools[name]
                torch.cuda.synchronize()
                bad = [
                    int(d)
                    for s, d in zip(src_pages, dst_pages, strict=True)
                    if not torch.equal(
                        _engine_block(kind, tensors, s), _engine_block(kind, tensors, d)
                    )
                ]
                conn.send(("verified", bad))
            elif msg[0] == "poison":
                _, name, pages = msg
                kind, tensors = pools[name]
                for page in pages:
                    _engine_block_fill(kind, tensors, page, POISON)
                torch.cuda.synchronize()
                conn.send(("poisoned",))
            elif msg[0] == "free":
                pools.pop(msg[1], None)
                torch.cuda.empty_cache()
                conn.send(("freed",))
        except Exception as e:  # reported to the daemon side, which fails the check
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _engine_block_fill(kind: str, tensors: list[Any], page: int, value: int) -> None:
    import torch

    def fill(t: Any) -> None:
        t.reshape(-1).view(torch.uint8).fill_(value)  # every page view here is contiguous

    if kind == "staging":
        fill(tensors[0][page])
        return
    for t in tensors:
        if kind == "vllm":
            fill(t[0, page])
            fill(t[1, page])
        else:  # flashinfer [pages, 2, ...] and mla [pages, ...]: one contiguous page
            fill(t[page])


class Engine:
    """The daemon side's handle on the engine process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(theirs,), daemon=True)
        self.proc.start()

    def call(self, *msg: Any, timeout_s: float = 120.0) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the engine process did not answer {msg[0]} in {timeout_s}s")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"engine: {reply[1]}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("exit",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# -------------------------------------------------------------------- the daemon side


@dataclass
class Stack:
    """L0, L1 and L2 as the daemon would run them, in this process."""

    l0: Any
    l1: Any
    l2: Any | None
    opener: Any
    l2_dir: str

    def close(self) -> None:
        self.l0.close()
        self.l1.close()
        if self.l2 is not None:
            self.l2.close()


@dataclass
class Report:
    results: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        if not ok:
            self.failures.append(f"{name}: {detail}" if detail else name)


def _l2_write(l2: Any, slots: list[int], views: list[memoryview], nbytes: int) -> list[int | None]:
    """Durable L2 writes through the tier's batch verb; per block its checksum, or None."""
    from kvtier.tiers.base import BlockRef, HostBuffers, WriteBatch

    refs = [BlockRef(0, s.to_bytes(32, "little")) for s in slots]
    outs = l2.write(WriteBatch(slots, refs, nbytes, HostBuffers(views)))
    return [o.checksum if o.ok else None for o in outs]


def _l2_read(
    l2: Any, slots: list[int], views: list[memoryview], nbytes: int, sums: list[int]
) -> list[bool]:
    from kvtier.tiers.base import BlockRef, HostBuffers, ReadBatch

    refs = [BlockRef(0, s.to_bytes(32, "little")) for s in slots]
    return list(l2.read(ReadBatch(slots, refs, nbytes, HostBuffers(views), sums)))


def round_trip(
    stack: Stack,
    pool: Any,
    src_pages: list[int],
    dst_pages: list[int],
    expected: list[int],
    report: Report,
    name: str,
) -> None:
    """engine pages -> L0 -> L1 -> L2 -> L1 -> L0 -> other engine pages, with every
    destination poisoned first. ``expected``: the engine's xxh3 of each source block."""
    import xxhash

    from kvtier.tiers.base import BlockRef, HostBuffers, ReadBatch, WriteBatch

    n, nbytes = len(src_pages), pool.block_bytes
    refs = [BlockRef(0, i.to_bytes(32, "little")) for i in range(n)]
    l0, l1 = stack.l0, stack.l1

    def l0_slots() -> list[int]:
        slots = [l0.allocator.allocate(nbytes) for _ in range(n)]
        for s in slots:
            l0.slot_tensor(s, nbytes).fill_(POISON)
        l0.synchronize()  # the fills ran on the default stream; the verbs use their own
        return slots

    def l1_views() -> tuple[list[int], list[memoryview]]:
        slots = [l1.allocator.allocate(nbytes) for _ in range(n)]
        views = [l1.view(s, nbytes) for s in slots]
        for v in views:
            np.frombuffer(v, dtype=np.uint8)[:] = POISON
        return slots, views

    def digests(views: list[memoryview]) -> list[int]:
        return [xxhash.xxh3_64_intdigest(v) for v in views]

    with pool.use():
        a = l0_slots()
        ok = all(
            o.ok for o in l0.write(WriteBatch(a, refs, nbytes, pool.pages(np.array(src_pages))))
        )
        report.check(f"{name}: engine -> L0", ok)
        h1, v1 = l1_views()
        report.check(f"{name}: L0 -> L1", all(l0.read(ReadBatch(a, refs, nbytes, HostBuffers(v1)))))
        report.check(
            f"{name}: L1 bytes", digests(v1) == expected, "L1 holds other bytes than the engine's"
        )
        l0.remove(a)
        if stack.l2 is not None:
            d = [stack.l2.allocator.allocate(nbytes) for _ in range(n)]
            sums = _l2_write(stack.l2, d, v1, nbytes)
            report.check(f"{name}: L1 -> L2", all(s is not None for s in sums))
            for v in v1:  # the L1 copy is gone: evicted and overwritten
                np.frombuffer(v, dtype=np.uint8)[:] = POISON
            for s in h1:
                l1.allocator.free(s)
            h1, v1 = l1_views()
            read_ok = _l2_read(stack.l2, d, v1, nbytes, [int(s or 0) for s in sums])
            report.check(f"{name}: L2 -> L1", all(read_ok))
            report.check(f"{name}: L2 bytes", digests(v1) == expected, "L2 returned other bytes")
            stack.l2.remove(d)
        b = l0_slots()
        report.check(
            f"{name}: L1 -> L0",
            all(o.ok for o in l0.write(WriteBatch(b, refs, nbytes, HostBuffers(v1)))),
        )
        report.check(
            f"{name}: L0 -> engine",
            all(l0.read(ReadBatch(b, refs, nbytes, pool.pages(np.array(dst_pages))))),
        )
        l0.remove(b)
        for s in h1:
            l1.allocator.free(s)


def _median_s(fn: Callable[[], object], rounds: int, sync: Callable[[], None]) -> float:
    fn()
    sync()  # warm up: kernels compiled, memory touched
    times = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _ceilings(total: int, rounds: int) -> tuple[float, float, float]:
    """Seconds of a plain device-to-device copy and of pinned host-to-device and
    device-to-host copies of ``total`` contiguous bytes: the device's own ceilings."""
    import torch

    dev_a = torch.empty(total, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty_like(dev_a)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    sync = torch.cuda.synchronize
    return (
        _median_s(lambda: dev_b.copy_(dev_a), rounds, sync),
        _median_s(lambda: dev_a.copy_(pinned, non_blocking=True), rounds, sync),
        _median_s(lambda: pinned.copy_(dev_a, non_blocking=True), rounds, sync),
    )


def bandwidths(stack: Stack, pool: Any, batch: int, rounds: int, report: Report, gds: Any) -> None:
    import torch

    from kvtier.kernels.paged import copy_pages, copy_runs
    from kvtier.kernels.runs import gather_runs
    from kvtier.tiers.base import BlockRef, HostBuffers, ReadBatch, WriteBatch

    l0, l1 = stack.l0, stack.l1
    nbytes, total = pool.block_bytes, batch * pool.block_bytes
    refs = [BlockRef(0, i.to_bytes(32, "little")) for i in range(batch)]
    sync = torch.cuda.synchronize
    pages = np.random.default_rng(1).permutation(pool.layout.num_pages)[:batch]
    a = [l0.allocator.allocate(nbytes) for _ in range(batch)]
    r = report.results.setdefault("bandwidth", {})

    def gbps(seconds: float) -> float:
        return round(total / seconds / 1e9, 2)

    def ratio(name: str, tier_s: float, base_s: float, target: float, **extra: Any) -> None:
        value = round(base_s / tier_s, 3)
        r[name] = {
            "GB/s": gbps(tier_s),
            "ceiling GB/s": gbps(base_s),
            "ratio": value,
            "target": target,
            **extra,
        }
        report.check(f"bandwidth {name}", value >= target, f"{value}x < {target}x")

    d2d, h2d, d2h = _ceilings(total, rounds)

    with pool.use():
        src = pool.pages(pages)
        put = _median_s(lambda: l0.write(WriteBatch(a, refs, nbytes, src)), rounds, sync)
        get = _median_s(lambda: l0.read(ReadBatch(a, refs, nbytes, src)), rounds, sync)
        path = {"through_daemon": False, "path": "DeviceTier over an IPC-mapped engine pool"}
        ratio("engine pool -> L0", put, d2d, 0.8, **path)
        ratio("L0 -> engine pool", get, d2d, 0.8, **path)
        # The gather alone, host work included: the two executors of copy_pages (one launch
        # that makes the plan on the GPU; two passes), and the triton kernel of a plan made
        # on the host (copy_runs: a run per block and chunk, bounds-checked run by run).
        starts = l0.allocator.offsets(np.array(a)).astype(np.int64)
        for ex in ("triton", "torch"):
            launch = functools.partial(
                copy_pages,
                src.smap,
                src.segments,
                src.pages,
                l0.arena,
                starts,
                nbytes,
                gather=True,
                executor=ex,
            )
            s = _median_s(launch, rounds, sync)
            r[f"gather kernel ({ex})"] = {"GB/s": gbps(s), "ratio to d2d": round(d2d / s, 3)}
        runs = gather_runs(src.smap, src.pages, 0, starts)
        launch = functools.partial(copy_runs, runs, src.segments, [l0.arena], executor="triton")
        s = _median_s(launch, rounds, sync)
        r["gather kernel (triton, runs)"] = {"GB/s": gbps(s), "ratio to d2d": round(d2d / s, 3)}

    h = [l1.allocator.allocate(nbytes) for _ in range(batch)]
    views = HostBuffers([l1.view(s, nbytes) for s in h])
    path = {"through_daemon": False, "path": "DeviceTier <-> pinned HostArena slots"}
    up = _median_s(lambda: l0.write(WriteBatch(a, refs, nbytes, views)), rounds, sync)
    down = _median_s(lambda: l0.read(ReadBatch(a, refs, nbytes, views)), rounds, sync)
    ratio("L1 -> L0", up, h2d, 0.9, **path)
    ratio("L0 -> L1", down, d2h, 0.9, **path)

    if stack.l2 is not None:
        d = [stack.l2.allocator.allocate(nbytes) for _ in range(batch)]
        sums = _l2_write(stack.l2, d, list(views.views), nbytes)
        ints = [int(s or 0) for s in sums]

        def via_l1() -> None:
            assert all(_l2_read(stack.l2, d, list(views.views), nbytes, ints))
            assert all(o.ok for o in l0.write(WriteBatch(a, refs, nbytes, views)))

        s = _median_s(via_l1, max(3, rounds // 2), sync)
        r["L2 -> L0 via pinned L1"] = {
            "GB/s": gbps(s),
            "through_daemon": False,
            "path": "DiskTier.read -> L1 -> DeviceTier",
        }
        stack.l2.remove(d)
        r["L2 -> L0 via GDS"] = _gds_bandwidth(stack, a, nbytes, total, rounds, gds)
    l0.remove(a)
    for s in h:
        l1.allocator.free(s)


def _gds_bandwidth(
    stack: Stack, slots: list[int], nbytes: int, total: int, rounds: int, gds: Any
) -> dict[str, Any]:
    import torch

    from kvtier.tiers.gds import GdsFiles

    if not gds.active:
        return {"skipped": gds.reason}
    from pathlib import Path

    path = Path(stack.l2_dir) / "gds-check.bin"
    files = GdsFiles()
    try:
        tensors = [stack.l0.slot_tensor(s, nbytes) for s in slots]
        digests = files.write([(path, j * nbytes, t) for j, t in enumerate(tensors)])
        os.sync()
        items = [
            (path, j * nbytes, t, int(dg or 0))
            for j, (t, dg) in enumerate(zip(tensors, digests, strict=True))
        ]

        def read() -> None:
            assert all(files.read(items))

        def read_raw() -> None:
            for p, o, t, _ in items:
                files.read_raw(p, o, t)

        s = _median_s(read, max(3, rounds // 2), torch.cuda.synchronize)
        raw = _median_s(read_raw, max(3, rounds // 2), torch.cuda.synchronize)
        return {
            "GB/s": round(total / s / 1e9, 2),
            "GB/s without digest check": round(total / raw / 1e9, 2),
            "through_daemon": False,
            "path": "kvikio CuFile -> L0 slots, digest verified on the GPU",
        }
    finally:
        files.close()
        path.unlink(missing_ok=True)


def kernels(report: Report) -> None:
    import torch

    from kvtier.kernels.digest import block_digest
    from kvtier.kernels.quant import QuantSpec, dequantize_blocks, measure_error, quantize_blocks

    blocks = torch.randint(0, 256, (16, (2 << 20) + 6), dtype=torch.uint8)
    ok = block_digest(blocks.cuda()) == block_digest(blocks)
    report.results["digest gpu == cpu"] = ok
    report.check("block digest on the GPU", ok)
    q: dict[str, Any] = {}
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn((64, 32 * 2 * 16 * 8 * 128), device="cuda", generator=g)
    x[:, ::37] *= 20
    for dtype in ("bfloat16", "float16"):
        src = x.to(getattr(torch, dtype)).view(torch.uint8).view(64, -1)
        for kind in ("int8", "fp8_e4m3"):
            spec = QuantSpec(kind, dtype, 128)
            back = dequantize_blocks(quantize_blocks(src, spec), spec, src.shape[1])
            e = measure_error(src, back, spec)
            # Timed after a warm-up round (the first call of each pair compiles kernels).
            round_trip = functools.partial(_quant_round_trip, src, spec)
            seconds = _median_s(round_trip, 5, torch.cuda.synchronize)
            q[f"{dtype} {kind}"] = {
                "rel_rms": round(e.rel_rms, 5),
                "max/group amax": round(e.max_over_group_amax, 5),
                "size": round(e.compression, 3),
                "round trip GB/s": round(src.numel() / seconds / 1e9, 1),
            }
            bound = 1 / 254 if kind == "int8" else 1 / 16
            report.check(f"quantisation {dtype} {kind}", e.max_over_group_amax <= bound + 2**-7)
    report.results["quantisation"] = q


def _quant_round_trip(src: Any, spec: Any) -> Any:
    from kvtier.kernels.quant import dequantize_blocks, quantize_blocks

    return dequantize_blocks(quantize_blocks(src, spec), spec, src.shape[1])


FILL_BATCH = 64  # blocks per filler Put


def daemon_round_trip(
    client: Any,
    pool_id: int,
    block_bytes: int,
    src: list[int],
    dst: list[int],
    poison: Callable[[list[int]], None],
    verify: Callable[[list[int], list[int]], list[int]],
    report: Report,
    name: str,
) -> dict[str, Any]:
    """One layout's round trip through a running kvtierd, with its own RPCs only.

    Put ``src`` pages (into the top tier); push the blocks down the daemon's slot tiers one
    at a time with filler Puts of fresh keys (enough to fill every tier above the next one,
    from the capacities ``Stats`` reports), a Lookup confirming each step; Get them into
    poisoned ``dst`` pages while the top tier is full (they are read from the bottom tier
    straight into the pages, or promoted first where the top tier's blocks already had
    copies below: the daemon cleans them in the background); delete the filler and Get them
    into poisoned pages again (now promoted into the top tier first). After each Get the
    engine compares its pages (``verify``: the pages of ``dst`` that differ from ``src``).
    Needs policy ``lru``, no protection and watermarks at 1.0 (``daemon_overrides``), so
    the blocks move only when room is made."""
    from kvtier.client import PutStatus, Tier

    slot_tiers = [t for t in client.stats().tiers if t.tier != Tier.L3_REMOTE]
    keys = [os.urandom(32) for _ in src]
    filler: list[bytes] = []
    seen: list[str] = []

    def where(step: str, *want: Tier) -> None:
        kinds = sorted({Tier(t).name for t in client.lookup(keys).tiers})
        seen.append(f"{step}: {'/'.join(kinds)}")
        ok = any(kinds == [w.name] for w in want)
        report.check(f"{name}: {step}", ok, f"blocks in {kinds}")

    def fill(n: int) -> None:
        for start in range(0, n, FILL_BATCH):
            batch = [os.urandom(32) for _ in range(min(FILL_BATCH, n - start))]
            pages = [src[(start + j) % len(src)] for j in range(len(batch))]
            client.put(pool_id, batch, pages)
            filler.extend(batch)

    exact = [True]  # every Get loaded every block, and every page came back right

    def load(step: str) -> None:
        poison(dst)
        got = client.get(pool_id, keys, dst)
        report.check(f"{name}: {step}", all(got.loaded), f"{sum(got.loaded)} of {len(keys)}")
        bad = verify(src, dst)
        report.check(f"{name}: engine pages after {step}", not bad, f"pages {bad} differ")
        exact[0] = exact[0] and all(got.loaded) and not bad

    stored = client.put(pool_id, keys, src).statuses
    report.check(f"{name}: put", all(s == PutStatus.STORED for s in stored), f"{stored}")
    where("put", slot_tiers[0].tier)
    for k in range(1, len(slot_tiers)):
        fill(sum(-(-t.capacity_bytes // block_bytes) for t in slot_tiers[:k]) + len(src) + 8)
        where(f"pushed to {slot_tiers[k].tier.name}", slot_tiers[k].tier)
    load("get from the bottom tier")
    # Read from the bottom tier straight into the pages, or promoted into the top tier first
    # where its blocks had copies below by then (the daemon cleans them in the background,
    # and a promotion may take such room without waiting); the pages were checked either way.
    where("after that get", slot_tiers[-1].tier, slot_tiers[0].tier)
    for start in range(0, len(filler), FILL_BATCH):
        client.delete(filler[start : start + FILL_BATCH])
    load("get with room on top")
    where("after that get", slot_tiers[0].tier)
    return {"tiers seen": seen, "filler blocks": len(filler), "bit_exact": exact[0]}


def daemon_overrides(l2_dir: str) -> list[str]:
    """The kvtierd of the round trips: L0, pinned L1 and L2, small enough that a few hundred
    filler blocks push a block through every tier; blocks move only when room is made."""
    return [
        "tiers.l0.enabled=true",
        "tiers.l0.capacity_bytes=32MiB",
        "tiers.l0.segment_bytes=4MiB",
        "tiers.l0.high_watermark=1.0",
        "tiers.l1.capacity_bytes=64MiB",
        "tiers.l1.segment_bytes=4MiB",
        "tiers.l1.high_watermark=1.0",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={l2_dir}",
        "tiers.l2.capacity_bytes=1GiB",
        "tiers.l2.segment_bytes=4MiB",
        "tiers.l2.high_watermark=1.0",
        "tiers.l2.admission=always",
        "policy.name=lru",
        "policy.protect_s=0",
        "policy.warmup_s=0",
    ]


def _engine_poison(engine: Engine, name: str, pages: list[int]) -> None:
    engine.call("poison", name, pages)


def _engine_verify(engine: Engine, name: str, src: list[int], dst: list[int]) -> list[int]:
    return list(engine.call("verify", name, src, dst)[1])


def _daemon_stage(engine: Engine, report: Report, l2_dir: str, shape: dict[str, int]) -> None:
    """Every layout through a real kvtierd: the engine process exports its pool, this
    process registers it with the daemon (a third process) and drives Put/Lookup/Get/Delete;
    the daemon copies the engine's GPU pages itself."""
    from kvtier.bench.launcher import bench_daemon
    from kvtier.client import Client
    from kvtier.client.cuda import CudaIpcExport
    from kvtier.daemon.server import layout_from_pb
    from kvtier.proto import kvtier_pb2 as pb

    path = "engine -> L0 -> L1 -> L2 -> engine (via L0), and L2 -> L0 -> engine (kvtierd)"
    with (
        bench_daemon(*daemon_overrides(os.path.join(l2_dir, "daemon"))) as daemon,
        Client(daemon.address) as client,
    ):
        stats = client.stats()
        report.results["daemon"] = {
            "tiers": [t.tier.name for t in stats.tiers],
            "l0_gds_usable": stats.gauges.get("l0_gds_usable"),
            "l0_l2_gds": stats.gauges.get("l0_l2_gds"),
        }
        for i, kind in enumerate(KINDS):
            name = f"daemon {kind}"
            before = len(report.failures)
            src, dst = list(range(8)), list(range(8, 16))
            _, data, _ = engine.call("alloc", name, kind, shape, src, dst, 300 + i)
            out: dict[str, Any] = {"through_daemon": True, "path": path, "bit_exact": False}
            try:
                req = pb.RegisterPoolRequest.FromString(data)
                export = CudaIpcExport.from_region(req.cuda_ipc)
                pool = client.register_cuda_pool(export, layout_from_pb(req.layout))
                try:
                    out.update(
                        daemon_round_trip(
                            client,
                            pool.pool_id,
                            pool.block_bytes,
                            src,
                            dst,
                            functools.partial(_engine_poison, engine, name),
                            functools.partial(_engine_verify, engine, name),
                            report,
                            name,
                        )
                    )
                    out["block_bytes"] = pool.block_bytes
                finally:
                    pool.unregister()
            except Exception as e:  # this layout fails; the next ones still run
                report.failures.append(f"{name}: {type(e).__name__}: {e}")
                out["error"] = f"{type(e).__name__}: {e}"
            finally:
                engine.call("free", name)
                # Bytes apart from placement: a block in another tier than expected fails
                # the check, not bit_exact.
                out["all checks passed"] = len(report.failures) == before
                report.results.setdefault("round trips", {})[kind] = out
        if any(not v["all checks passed"] for v in report.results["round trips"].values()):
            # What the daemon said about it: its log goes with its temp folder on exit.
            report.results.setdefault("errors", {})["kvtierd log"] = daemon.log()[-8000:]


def _concurrent_stage(
    engine: Engine, report: Report, l2_dir: str, threads: int = 4, rounds: int = 25
) -> None:
    """Client threads, each its own session and registration of one engine's CUDA IPC pool,
    put and get their own pages at once (fresh keys each round) while the daemon's small L0
    demotes to L1 and L2 under them; every Get loads every block and the engine checks its
    pages after each."""
    import threading

    from kvtier.bench.launcher import bench_daemon
    from kvtier.client import Client, PutStatus
    from kvtier.client.cuda import CudaIpcExport
    from kvtier.daemon.server import layout_from_pb
    from kvtier.proto import kvtier_pb2 as pb

    shape = {"layers": 8, "pages": 32 * threads, "tokens": 16, "heads": 8, "dim": 128, "latent": 0}
    lock = threading.Lock()  # one engine, one pipe

    def call(*msg: Any) -> Any:
        with lock:
            return engine.call(*msg)

    _, data, _ = call("alloc", "conc", "vllm", shape, [], [], 7)
    req = pb.RegisterPoolRequest.FromString(data)
    export, layout = CudaIpcExport.from_region(req.cuda_ipc), layout_from_pb(req.layout)
    counts = {"puts": 0, "gets": 0, "not stored": 0, "not loaded": 0, "pages that differ": 0}
    errors: list[str] = []
    try:
        with bench_daemon(*daemon_overrides(os.path.join(l2_dir, "conc"))) as daemon:

            def worker(i: int) -> None:
                src = list(range(32 * i, 32 * i + 8))
                dst = list(range(32 * i + 16, 32 * i + 24))
                try:
                    with Client(daemon.address) as client:
                        pool = client.register_cuda_pool(export, layout)
                        for _ in range(rounds):
                            keys = [os.urandom(32) for _ in src]
                            stored = client.put(pool.pool_id, keys, src).statuses
                            call("poison", "conc", dst)
                            got = client.get(pool.pool_id, keys, dst)
                            bad = call("verify", "conc", src, dst)[1]
                            with lock:
                                counts["puts"] += 1
                                counts["gets"] += 1
                                counts["not stored"] += sum(s != PutStatus.STORED for s in stored)
                                counts["not loaded"] += sum(not ok for ok in got.loaded)
                                counts["pages that differ"] += len(bad)
                        pool.unregister()
                except Exception as e:  # reported below; the other threads go on
                    errors.append(f"thread {i}: {type(e).__name__}: {e}")

            workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if errors or any(counts[k] for k in ("not stored", "not loaded", "pages that differ")):
                report.results.setdefault("errors", {})["kvtierd log"] = daemon.log()[-8000:]
    finally:
        call("free", "conc")
    report.results["concurrent clients"] = {
        "threads": threads,
        "through_daemon": True,
        **counts,
        "errors": errors,
    }
    report.check("concurrent clients: no thread failed", not errors, "; ".join(errors))
    for k in ("not stored", "not loaded", "pages that differ"):
        report.check(f"concurrent clients: {k}", counts[k] == 0, f"{counts[k]}")


def _staging_stage(report: Report, l2_dir: str, blocks: int = 64, rounds: int = 5) -> None:
    """The vLLM connector's GPU data path through a kvtierd (``client/integrations/staging``):
    a staging pool in GPU memory (``CudaMemory``, registered over CUDA IPC) between a KV cache
    laid out as vLLM 0.32 views it (per-layer ``[blocks, heads, tokens, K|V]`` views of one
    allocation, each block's layers together, so strided) and the daemon's GPU tier. A save
    gathers every layer of ``blocks`` 2 MiB blocks into staging and Puts them; a load Gets
    them into other pages and scatters them into other, zeroed blocks: bit-exact each round,
    and the seconds of each step beside a device-to-device copy of the same bytes."""
    import torch

    from kvtier.bench.launcher import bench_daemon
    from kvtier.client import Client, Tier
    from kvtier.client.integrations.staging import CudaMemory, StagingPool

    layers, shape = 32, (8, 16, 256)  # bf16: 64 KiB per layer block, 2 MiB per block
    nbytes = blocks * layers * int(np.prod(shape)) * 2
    overrides = [
        *daemon_overrides(os.path.join(l2_dir, "staging")),
        f"tiers.l0.capacity_bytes={(rounds + 1) * nbytes >> 20}MiB",
        f"tiers.l1.capacity_bytes={(rounds + 1) * nbytes >> 20}MiB",
    ]
    steps: dict[str, list[float]] = {"gather": [], "put": [], "get": [], "scatter": []}
    sync = torch.cuda.synchronize
    with bench_daemon(*overrides) as daemon, Client(daemon.address) as client:
        pool = StagingPool(
            client,
            num_layers=layers,
            num_pages=2 * blocks,
            block_tokens=16,
            block_shape=shape,
            dtype=torch.bfloat16,
            device="cuda",
        )
        report.check("vllm staging: GPU memory over CUDA IPC", isinstance(pool.memory, CudaMemory))
        engine = torch.randn((2 * blocks, layers, *shape), device="cuda").to(torch.bfloat16)
        kv = [engine[:, i] for i in range(layers)]
        src = torch.arange(blocks, device="cuda")
        dst = torch.arange(blocks, 2 * blocks, device="cuda")
        for r in range(rounds + 1):  # the first round warms up
            keys = [os.urandom(32) for _ in range(blocks)]
            pages = pool.alloc(blocks)
            assert pages is not None
            sync()
            t0 = time.perf_counter()
            for layer in range(layers):
                pool.gather(layer, pages, kv[layer], src)
            pool.ready()
            t1 = time.perf_counter()
            stored = pool.pool.store_keys(keys, pages)
            t2 = time.perf_counter()
            pool.free(pages)
            where = client.lookup(keys).tiers
            into = pool.alloc(blocks)
            assert into is not None
            engine[blocks:].zero_()
            sync()
            t3 = time.perf_counter()
            loaded = pool.pool.load_keys(keys, into[::-1])
            t4 = time.perf_counter()
            for layer in range(layers):
                pool.scatter(layer, into[::-1], kv[layer], dst)
            sync()
            t5 = time.perf_counter()
            pool.free(into)
            exact = bool(torch.equal(engine[blocks:], engine[:blocks]))
            report.check(
                f"vllm staging round {r}: stored, in L0, loaded, bit-exact",
                stored == blocks and where == [Tier.L0_GPU] * blocks and loaded == blocks and exact,
                f"stored {stored}, tiers {sorted({t.name for t in where})}, loaded {loaded}, "
                f"bit-exact {exact}",
            )
            if r:
                for name, t in zip(steps, (t1 - t0, t2 - t1, t4 - t3, t5 - t4), strict=True):
                    steps[name].append(t)
        pool.retire("done", unclean=False)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy = torch.empty_like(flat)
    d2d = _median_s(lambda: copy.copy_(flat), rounds, sync)  # the ceiling: one device copy
    med = {name: statistics.median(ts) for name, ts in steps.items()}
    save_s, load_s = med["gather"] + med["put"], med["get"] + med["scatter"]
    report.results["vllm staging"] = {
        "through_daemon": True,
        "blocks": blocks,
        "bytes": nbytes,
        **{f"{name}_ms": round(v * 1e3, 3) for name, v in med.items()},
        "save_GBps": round(nbytes / save_s / 1e9, 1),
        "load_GBps": round(nbytes / load_s / 1e9, 1),
        "d2d_copy_GBps": round(nbytes / d2d / 1e9, 1),
        "save_vs_d2d": round(d2d / save_s, 3),
        "load_vs_d2d": round(d2d / load_s, 3),
    }


def _stage(report: Report, name: str, fn: Callable[..., None], *args: Any) -> None:
    """Run one stage; an exception fails it (with its traceback in the results) and the
    next stages still run, so one GPU session answers as much as it can."""
    import traceback

    try:
        fn(*args)
    except Exception as e:
        report.failures.append(f"{name}: {type(e).__name__}: {e}")
        report.results.setdefault("errors", {})[name] = traceback.format_exc()


def _round_trip_stage(
    stack: Stack, engine: Engine, report: Report, kind: str, i: int, shape: dict[str, int]
) -> None:
    from kvtier.daemon.server import layout_from_pb
    from kvtier.proto import kvtier_pb2 as pb

    rng = np.random.default_rng(i)
    order = rng.permutation(shape["pages"]).tolist()
    src, dst = order[:32], order[32:]
    before = len(report.failures)
    _, data, expected = engine.call("alloc", kind, kind, shape, src, dst, 100 + i)
    try:
        req = pb.RegisterPoolRequest.FromString(data)
        pool = stack.opener.open(i + 1, "gpu-check", req.cuda_ipc, layout_from_pb(req.layout))
        try:
            round_trip(stack, pool, src, dst, expected, report, kind)
        finally:
            pool.close()
        bad = engine.call("verify", kind, src, dst)[1]
        report.check(f"{kind}: engine pages after the round trip", not bad, f"pages {bad} differ")
    finally:
        engine.call("free", kind)
    report.results.setdefault("module round trips", {})[kind] = {
        "bit_exact": len(report.failures) == before,
        "blocks": len(src),
        "block_bytes": pool.block_bytes,
        "through_daemon": False,
        "path": "engine -> L0 -> L1 -> L2 -> L1 -> L0 -> engine (daemon modules, this process)",
    }


def _bandwidth_stage(
    stack: Stack, engine: Engine, report: Report, args: argparse.Namespace, gds: Any
) -> None:
    from kvtier.daemon.server import layout_from_pb
    from kvtier.proto import kvtier_pb2 as pb

    big = {"layers": 32, "pages": 2 * args.batch, "tokens": 16, "heads": 8, "dim": 128, "latent": 0}
    _, data, _ = engine.call("alloc", "bw", "vllm", big, [], [], 9)
    try:
        req = pb.RegisterPoolRequest.FromString(data)
        pool = stack.opener.open(99, "gpu-check", req.cuda_ipc, layout_from_pb(req.layout))
        try:
            bandwidths(stack, pool, args.batch, args.rounds, report, gds)
        finally:
            pool.close()
    finally:
        engine.call("free", "bw")


def run(args: argparse.Namespace) -> Report:
    import torch

    from kvtier.daemon.cuda_pools import CudaPoolOpener, DriverMapper
    from kvtier.tiers.device import DeviceTier
    from kvtier.tiers.gds import choose
    from kvtier.tiers.host import HostArena

    report = Report()
    props = torch.cuda.get_device_properties(0)
    report.results["device"] = (
        f"{props.name}, {props.total_memory >> 30} GiB, torch {torch.__version__}"
    )
    l2_dir = args.l2_dir or tempfile.mkdtemp(prefix="kvtier-gpu-check-", dir=os.getcwd())
    os.makedirs(l2_dir, exist_ok=True)
    block = 32 * 2 * 16 * 8 * 128 * 2  # the bandwidth pool's 2 MiB blocks
    room = args.batch * block + (256 << 20)
    l0 = DeviceTier(room, 64 << 20, device=0, streams=args.streams)
    l1 = HostArena(room, 64 << 20, pin_cuda=True)
    l2 = None
    if not args.skip_l2:
        from kvtier.tiers.disk import DiskTier

        l2 = DiskTier(l2_dir, room, 64 << 20, io_threads=4, file_bytes=room)
    gds = choose(args.gds, l2_dir, torch.device("cuda", 0))
    l0.l2_path = gds.path
    report.results["L2 <-> L0 path"] = {"path": gds.path, "reason": gds.reason}
    stack = Stack(l0, l1, l2, CudaPoolOpener(DriverMapper(0)), l2_dir)
    engine = Engine()
    try:
        # 1. Round trips, every layout, across the two processes.
        small = {"layers": 8, "pages": 64, "tokens": 16, "heads": 8, "dim": 128, "latent": 576}
        for i, kind in enumerate(KINDS):
            _stage(
                report,
                f"round trip {kind}",
                _round_trip_stage,
                stack,
                engine,
                report,
                kind,
                i,
                small,
            )
        # 2. Bandwidth, with 2 MiB blocks of a 32-layer vLLM pool.
        _stage(report, "bandwidth", _bandwidth_stage, stack, engine, report, args, gds)
        # 3. Kernels on the GPU.
        _stage(report, "kernels", kernels, report)
        # 4. Every layout through a real kvtierd (its GPU tier, pinned L1 and disk tier).
        if not args.skip_daemon:
            _stage(report, "daemon round trips", _daemon_stage, engine, report, l2_dir, small)
            # 5. Several clients at once through a kvtierd.
            _stage(report, "concurrent clients", _concurrent_stage, engine, report, l2_dir)
            # 6. The vLLM connector's GPU staging through a kvtierd.
            _stage(report, "vllm staging", _staging_stage, report, l2_dir)
    finally:
        engine.close()
        stack.close()
        if not args.l2_dir:
            shutil.rmtree(l2_dir, ignore_errors=True)
    return report


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    p = arg_parser("gpu", __doc__)  # its --help lists --json, as every benchmark's does
    p.add_argument("--batch", type=int, default=128, help="2 MiB blocks per bandwidth batch")
    p.add_argument("--rounds", type=int, default=9, help="timed repetitions of each transfer")
    p.add_argument("--streams", type=int, default=2, help="L0 pool streams")
    p.add_argument(
        "--l2-dir", default="", help="folder for the disk tier (default: a temp one here)"
    )
    p.add_argument("--gds", default="auto", choices=("auto", "true", "false"))
    p.add_argument("--skip-l2", action="store_true")
    p.add_argument("--skip-daemon", action="store_true")
    args = p.parse_args(argv)

    reason = cuda_missing()
    if reason:
        raise BenchUnavailable(f"kvtier bench gpu needs a CUDA GPU: {reason}")
    started = time.monotonic()
    report = run(args)
    report.results["seconds"] = round(time.monotonic() - started, 1)
    report.results["failures"] = report.failures
    report.results["ok"] = not report.failures
    _print_table(report)
    if emit is not None:
        emit(report.results)
    return 0 if not report.failures else 1


def cuda_missing() -> str:
    """Empty when this host can run the check; else why not. Cheap: no GPU work."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU, no driver, or a CPU build of torch)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (it ships with CUDA builds of torch)"
    from kvtier.kernels.cudadrv import CudaUnavailable, driver

    try:
        driver()
    except CudaUnavailable as e:
        return str(e)
    return ""


def _print_table(report: Report) -> None:
    r = report.results
    print(f"device: {r['device']}")
    print(f"L2 <-> L0: {r['L2 <-> L0 path']['path']} ({r['L2 <-> L0 path']['reason']})")
    for section in ("round trips", "module round trips"):
        for kind, v in r.get(section, {}).items():
            exact = "bit-exact" if v["bit_exact"] else "FAILED"
            print(
                f"{section[:-1]} {kind:10s} {exact:9s} {v.get('block_bytes', '?')} B blocks  "
                f"[through_daemon={v['through_daemon']}] {v['path']}"
            )
            for step in v.get("tiers seen", []):
                print(f"    {step}")
    for name, v in r.get("bandwidth", {}).items():
        print(f"{name:28s} {json.dumps(v)}")
    for name, v in r.get("quantisation", {}).items():
        print(f"quant {name:22s} {json.dumps(v)}")
    if "daemon" in r:
        print(f"daemon: {json.dumps(r['daemon'])}")
    if "concurrent clients" in r:
        print(f"concurrent clients: {json.dumps(r['concurrent clients'])}")
    for name, tb in r.get("errors", {}).items():
        print(f"--- {name} raised:\n{tb}", file=sys.stderr)
    print("OK" if not report.failures else "FAILED:\n  " + "\n  ".join(report.failures))
