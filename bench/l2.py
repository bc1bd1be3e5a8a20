"""``kvtier bench l2``: L2 tier bandwidth next to raw file I/O of the same shape.

Measured in one run, on one directory, with the same block size, batch size and number of
threads:
- raw write: ``pwritev`` of each block (``O_DIRECT``) from ``io_threads`` threads, then one
  ``fdatasync`` per batch; raw read: ``preadv`` of each block from ``io_threads`` threads.
- tier write: ``DiskTier.persist`` per batch (checksums, vectored writes, ``fdatasync``, one
  SQLite commit with ``synchronous=FULL``); tier read: ``DiskTier.read`` per batch (vectored
  reads and verification of every checksum). Source and destination buffers are L1 host-arena
  slots, the way the store moves blocks.

The two sides are timed batch by batch, alternating which goes first, so that both see the same
disk and the same neighbours (shared machines are noisy); a round covers the working set once,
after one unmeasured fill pass (the first write into preallocated space also converts its
extents, which costs both sides alike). Before each write round the tier's blocks are removed
(eviction, not timed) and slots allocated afresh. Reads are cold:
``O_DIRECT`` bypasses the page cache; in buffered mode (a filesystem that refuses O_DIRECT) the
page cache is dropped before every read pass when ``/proc/sys/vm/drop_caches`` is writable, and
the output says when it was not. Figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier.tiers.disk import CHECKSUM_NAME, DiskTier, PersistItem, ReadItem, checksum
from kvtier.tiers.host import HostArena

MiB = 1 << 20


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench l2", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="var", help="where to make the scratch folder (var)")
    p.add_argument("--block-bytes", type=int, default=2 * MiB, help="block size (2 MiB)")
    p.add_argument("--blocks", type=int, default=256, help="blocks in the working set (256)")
    p.add_argument("--batch", type=int, default=64, help="blocks per call (64)")
    p.add_argument("--io-threads", type=int, default=4, help="I/O threads, both sides (4)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (5)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    return p.parse_args(argv)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class _Raw:
    """The reference: one preallocated file and the plainest parallel I/O on it."""

    def __init__(self, path: Path, nbytes: int, block_bytes: int, threads: int, direct: bool):
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.block_bytes = block_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-io")
        self.threads = threads

    def _spread(
        self, fn: Callable[[int, list[memoryview], int], int], first: int, bufs: list[memoryview]
    ) -> None:
        """Block ``first + j`` from ``bufs[j]``, the blocks shared out evenly over the threads,
        one system call per block."""
        share = -(-len(bufs) // self.threads)

        def work(lo: int) -> None:
            for j in range(lo, min(lo + share, len(bufs))):
                fn(self.fd, [bufs[j]], (first + j) * self.block_bytes)

        list(self.pool.map(work, range(0, len(bufs), share)))

    def write(self, first: int, bufs: list[memoryview]) -> None:
        self._spread(os.pwritev, first, bufs)
        os.fdatasync(self.fd)

    def read(self, first: int, bufs: list[memoryview]) -> None:
        self._spread(os.preadv, first, bufs)

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def _checksum_gbps(buf: memoryview, block_bytes: int, threads: int) -> tuple[float, float]:
    """xxh3-64 throughput over a buffer larger than the caches: one thread, and ``threads``."""
    blocks = [buf[i : i + block_bytes] for i in range(0, len(buf), block_bytes)]
    t0 = time.perf_counter()
    for b in blocks:
        checksum(b)
    one = len(buf) / (time.perf_counter() - t0) / 1e9
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(checksum, blocks))
        many = len(buf) / (time.perf_counter() - t0) / 1e9
    return one, many


def main(argv: list[str], as_json: bool = False) -> int:
    args = _parse(argv)
    as_json = as_json or args.json
    B, n, batch = args.block_bytes, args.blocks, min(args.batch, args.blocks)
    if B % 4096:
        raise SystemExit("--block-bytes must be a multiple of 4096")
    n -= n % batch
    per_seg = max(1, (64 * MiB) // B)
    segment = per_seg * B
    capacity = -(-n // per_seg) * segment
    base = Path(args.dir)
    made_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-l2-", dir=args.dir))
    tier: DiskTier | None = None
    raw: _Raw | None = None
    try:
        tier = DiskTier(work / "tier", capacity, segment, io_threads=args.io_threads)
        direct = tier.direct_io
        raw = _Raw(work / "raw.bin", n * B, B, args.io_threads, direct)
        arena = HostArena(batch * B, batch * B)
        l1 = [arena.allocator.allocate(B) for _ in range(batch)]
        views = [arena.view(s, B) for s in l1 if s is not None]
        arena.array[:] = np.frombuffer(np.random.default_rng(0).bytes(batch * B), np.uint8)
        keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest() for i in range(n)]
        slots: list[int] = []
        sums: list[int] = [0] * n

        def fresh_slots() -> None:
            # Eviction before a demotion pass: not part of the measured write.
            if slots:
                tier.remove(slots)
                slots.clear()
            for _ in range(n):
                slot = tier.allocator.allocate(B)
                assert slot is not None
                slots.append(slot)

        def tier_write(b: int) -> None:
            items = [PersistItem(1, keys[b + j], slots[b + j], views[j], B) for j in range(batch)]
            outs = tier.persist(items)
            if not all(o.ok for o in outs):
                raise RuntimeError(f"L2 write failed: {tier.health()}")
            for j, o in enumerate(outs):
                sums[b + j] = o.checksum

        def tier_read(b: int) -> None:
            items = [
                ReadItem(slots[b + j], views[j], B, sums[b + j], keys[b + j]) for j in range(batch)
            ]
            if not all(tier.read_items(items)):
                raise RuntimeError(f"L2 read failed verification: {tier.stats()}")

        cache_note = "O_DIRECT (page cache bypassed)"
        if not direct:
            cache_note = "buffered I/O, page cache dropped before each read pass"
            if not _drop_caches():
                cache_note = "buffered I/O and drop_caches not writable: reads may be cached"

        def paired(
            raw_fn: Callable[[int], None], tier_fn: Callable[[int], None], r: int
        ) -> tuple[float, float]:
            """GB/s of both sides over the working set, batch by batch, alternating which
            side goes first, so that both see the same disk and the same neighbours."""
            spent = [0.0, 0.0]
            for k, b in enumerate(range(0, n, batch)):
                sides = [(0, raw_fn), (1, tier_fn)]
                for side, fn in sides if (r + k) % 2 == 0 else sides[::-1]:
                    t0 = time.perf_counter()
                    fn(b)
                    spent[side] += time.perf_counter() - t0
            return n * B / spent[0] / 1e9, n * B / spent[1] / 1e9

        emit = print
        emit(
            f"L2 bench: {n} blocks of {B / MiB:g} MiB ({n * B / MiB:.0f} MiB), batches of {batch},"
            f" {args.io_threads} I/O threads, {('O_DIRECT' if tier.direct_io else 'buffered')} I/O, in {work}"
        )
        fresh_slots()
        fill_raw, fill_tier = paired(lambda b: raw.write(b, views), tier_write, 0)
        emit(f"  first fill (unmeasured): raw {fill_raw:.2f} GB/s, tier {fill_tier:.2f} GB/s")
        res: dict[str, list[float]] = {"rw": [], "tw": [], "rr": [], "tr": []}
        for r in range(args.rounds):
            fresh_slots()
            rw, tw = paired(lambda b: raw.write(b, views), tier_write, r)
            if not direct:
                _drop_caches()
            rr, tr = paired(lambda b: raw.read(b, views), tier_read, r)
            for name, v in (("rw", rw), ("tw", tw), ("rr", rr), ("tr", tr)):
                res[name].append(v)
            emit(
                f"  round {r + 1}: write raw {rw:.2f} tier {tw:.2f} GB/s"
                f" | read raw {rr:.2f} tier {tr:.2f} GB/s"
            )
        med = {k: statistics.median(v) for k, v in res.items()}
        ck_one, ck_many = _checksum_gbps(memoryview(arena.buffer), B, args.io_threads)
        stats = tier.stats()
        out = {
            "block_bytes": B,
            "blocks": n,
            "batch": batch,
            "io_threads": args.io_threads,
            "rounds": args.rounds,
            "io_mode": "o_direct" if tier.direct_io else "buffered",
            "cold_cache": cache_note,
            "write_gbps": round(med["tw"], 3),
            "raw_write_gbps": round(med["rw"], 3),
            "write_ratio": round(med["tw"] / med["rw"], 3),
            "read_gbps": round(med["tr"], 3),
            "raw_read_gbps": round(med["rr"], 3),
            "read_ratio": round(med["tr"] / med["rr"], 3),
            "checksum_gbps": round(ck_one, 2),
            "checksum_gbps_threads": round(ck_many, 2),
            "checksum": CHECKSUM_NAME,
            "first_fill_write_gbps": round(fill_tier, 3),
            "first_fill_raw_write_gbps": round(fill_raw, 3),
            "checksum_failures": stats.counters["checksum_failures"],
        }
        emit(
            f"write: tier {out['write_gbps']:.2f} GB/s, raw pwritev+fdatasync "
            f"{out['raw_write_gbps']:.2f} GB/s, ratio {out['write_ratio']:.2f}"
        )
        emit(
            f"read:  tier {out['read_gbps']:.2f} GB/s, raw preadv {out['raw_read_gbps']:.2f} "
            f"GB/s, ratio {out['read_ratio']:.2f}  ({cache_note})"
        )
        emit(
            f"checksum {out['checksum']}: {ck_one:.1f} GB/s on one thread, {ck_many:.1f} GB/s on "
            f"{args.io_threads} ({ck_one / max(med['tr'], 1e-9):.1f}x the tier's read bandwidth)"
        )
        for view in views:
            view.release()
        arena.close()
        if as_json:
            print(json.dumps(out))
        return 0
    finally:
        if raw is not None:
            raw.close()
        if tier is not None:
            tier.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        if made_base:
            with contextlib.suppress(OSError):
                base.rmdir()
