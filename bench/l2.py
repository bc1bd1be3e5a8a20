"""``kvtier bench l2``: durable puts and cold gets of 2 MiB blocks THROUGH THE DAEMON, next to
raw file I/O of the same sizes, on the same directory, with the same parallelism.

Daemon side (a real kvtierd with an L2 tier in a scratch folder, ``tiers.l2.io_threads`` =
``--io-threads``; the client talks to it over its socket):
- durable put: ``Client.put(..., durable=True)`` of ``--batch`` blocks per call, from a
  registered shared-memory pool; the call returns once the daemon reports the blocks durable
  on L2 (in L1 too).
- cold get: after a daemon restart (L1 empty) and a dropped page cache, ``Client.get`` of the
  same blocks, ``--batch`` per call, into the pool; every block read back is checked (a tag
  per block).

Raw side: ``pwrite`` of each block from ``--io-threads`` threads, then one ``fdatasync``
per batch; ``pread`` of each block from as many threads; ``O_DIRECT`` where the filesystem
allows it (the output says which), from and into page-aligned memory.
- first fill: writes into freshly preallocated (``posix_fallocate``) extents, which the
  filesystem converts from unwritten on the way, as a daemon's first writes into its
  preallocated data files do;
- overwrite: writes over extents written before.

Rounds (``--rounds``): the first write pass goes into a fresh daemon (its preallocated files
untouched: a first fill) and each later one follows the deletion of the previous pass's
blocks, in an L2 only one segment larger than the working set, so the daemon writes mostly
over extents it wrote before (an overwrite). In every pass each batch is timed three times
back to back: raw first fill (a new file each pass), daemon durable put, raw overwrite, the
order rotating from batch to batch. Each read pass pairs the daemon's cold gets with raw reads
of the same bytes, batch by batch, alternating which goes first. Figures are per pass (total
bytes over summed seconds), and medians over passes.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import (
    MiB,
    arg_parser,
    block_layout,
    drop_page_cache,
    median,
    ratio,
    read_tags,
    scratch_dir,
    sig,
    tag_pages,
)
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import bench_daemon
from kvtier.bench.rawio import RawFile, aligned_buffer, block_items
from kvtier.client import Client, SharedMemoryPool, Tier

SEGMENT_BYTES = 64 * MiB  # the daemon's default tiers.l2.segment_bytes


def _parse(argv: list[str]) -> argparse.Namespace:
    p = arg_parser("l2", __doc__)
    p.add_argument(
        "--dir", default=None, help="where to make the scratch folder (default: system temp)"
    )
    p.add_argument("--block-bytes", type=int, default=2 * MiB, help="block size (2 MiB)")
    p.add_argument("--blocks", type=int, default=256, help="blocks in the working set (256)")
    p.add_argument("--batch", type=int, default=64, help="blocks per call (64)")
    p.add_argument(
        "--io-threads", type=int, default=4, help="tiers.l2.io_threads and raw I/O threads (4)"
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="write+restart+read passes; the first fills (5)"
    )
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="do not drop the page cache before cold reads (they may then hit it)",
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    return p.parse_args(argv)


class _Pass:
    """Summed seconds per side over one pass; GB/s on demand."""

    def __init__(self, nbytes: int, sides: tuple[str, ...]) -> None:
        self.nbytes = nbytes
        self.spent = dict.fromkeys(sides, 0.0)

    def timed(self, side: str, fn: Callable[[], object]) -> None:
        t = time.perf_counter()
        fn()
        self.spent[side] += time.perf_counter() - t

    def gbps(self, side: str) -> float:
        return self.nbytes / self.spent[side] / 1e9


class _Runner:
    """The state of one run: the scratch folder, the shared pool, the raw files and buffer."""

    def __init__(self, args: argparse.Namespace, work: Path, block_bytes: int, batch: int) -> None:
        self.B, self.batch = block_bytes, batch
        self.n = args.blocks - args.blocks % batch
        self.threads = args.io_threads
        self.work = work
        self.layout = block_layout(block_bytes, batch)
        self.pages = list(range(batch))
        rng = np.random.default_rng(0)
        self.raw_view = aligned_buffer(batch * block_bytes)
        self.raw_view[:] = rng.bytes(batch * block_bytes)
        self.shm = SharedMemoryPool.for_layout(self.layout)
        self.pool_arr = self.shm.array()
        self.pool_arr[:] = np.frombuffer(rng.bytes(self.layout.extent_bytes), np.uint8)
        self.over = RawFile(work / "raw-overwrite.bin", self.n * block_bytes, self.threads)
        # Written once, untimed, so that every timed pass over it is an overwrite.
        for b in range(0, self.n, batch):
            self.over.write(self._items(b))
        self._order = 0

    def _items(self, first_block: int) -> list[tuple[int, memoryview]]:
        return block_items(first_block * self.B, self.B, self.raw_view, self.batch)

    def write_pass(self, client: Client, pool_id: int, r: int) -> tuple[_Pass, list[list[bytes]]]:
        """One pass of durable puts over the working set, each batch next to a raw first
        fill (a file preallocated for this pass) and a raw overwrite of the same bytes."""
        p = _Pass(self.n * self.B, ("fill", "daemon", "overwrite"))
        keys_of_pass = []
        with RawFile(self.work / "raw-fill.bin", self.n * self.B, self.threads) as fill:
            for b in range(0, self.n, self.batch):
                keys = [os.urandom(32) for _ in range(self.batch)]
                tags = [(r << 32) | (b + j) for j in range(self.batch)]
                tag_pages(self.pool_arr, self.layout, self.pages, tags)
                items = self._items(b)
                steps: list[tuple[str, Callable[[], object]]] = [
                    ("fill", partial(fill.write, items)),
                    ("daemon", partial(_durable_put, client, pool_id, keys, self.pages)),
                    ("overwrite", partial(self.over.write, items)),
                ]
                k = self._order % 3
                self._order += 1
                for side, fn in steps[k:] + steps[:k]:
                    p.timed(side, fn)
                keys_of_pass.append(keys)
                del items, steps
        os.unlink(self.work / "raw-fill.bin")
        return p, keys_of_pass

    def read_pass(
        self, client: Client, pool_id: int, keys_of_pass: list[list[bytes]], r: int
    ) -> _Pass:
        """Cold gets of one pass's blocks, each batch paired with a raw read of the same
        bytes; every block read back is checked by its tag."""
        # The daemon serves while it reads its disk index back: wait until every pass's last
        # block is indexed (an unpinned lookup moves nothing).
        probe = [keys[-1] for keys in keys_of_pass]
        deadline = time.monotonic() + 120
        while (where := client.lookup(probe[:1])).prefix_len != 1 or not all(
            client.lookup([k]).prefix_len == 1 for k in probe
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not index its L2 blocks within 120 s")
            time.sleep(0.05)
        if where.tiers[0] != Tier.L2_DISK:
            raise RuntimeError(f"after a restart the first block is in {where.tiers}, not L2")
        p = _Pass(len(keys_of_pass) * self.batch * self.B, ("daemon", "raw"))
        for i, keys in enumerate(keys_of_pass):
            b = i * self.batch
            items = self._items(b)
            steps: list[tuple[str, Callable[[], object]]] = [
                ("daemon", partial(_get_all, client, pool_id, keys, self.pages)),
                ("raw", partial(self.over.read, items)),
            ]
            for side, fn in steps if i % 2 == 0 else steps[::-1]:
                p.timed(side, fn)
            del items, steps
            want = [(r << 32) | (b + j) for j in range(self.batch)]
            if read_tags(self.pool_arr, self.layout, self.pages) != want:
                raise RuntimeError("cold get returned blocks other than the ones stored")
        return p

    def close(self) -> None:
        self.over.close()
        self.shm.close()


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    args = _parse(argv)
    B, batch = args.block_bytes, min(args.batch, args.blocks)
    if B < 4096 or B % 4096:
        raise SystemExit("kvtier bench l2: --block-bytes must be a positive multiple of 4096")
    if min(args.blocks, batch, args.io_threads, args.rounds) < 1:
        raise SystemExit("kvtier bench l2: every count must be at least 1")
    n = args.blocks - args.blocks % batch
    per_segment = max(1, SEGMENT_BYTES // B)
    # One segment more than the working set: after a pass is deleted, the next one must
    # mostly reuse the extents it occupied.
    l2_capacity = (-(-n // per_segment) + 1) * SEGMENT_BYTES

    puts: list[_Pass] = []
    gets: list[_Pass] = []
    dropped: list[bool] = []
    start_s: list[float] = []
    with scratch_dir(args.dir, "kvtier-bench-l2-", keep=args.keep) as work:
        overrides = (
            f"tiers.l1.capacity_bytes={n * B + 128 * MiB}",
            "tiers.l2.enabled=true",
            f"tiers.l2.path={work / 'l2'}",
            f"tiers.l2.capacity_bytes={l2_capacity}",
            f"tiers.l2.segment_bytes={SEGMENT_BYTES}",
            f"tiers.l2.io_threads={args.io_threads}",
            # Nothing may be read ahead of the timed call that asks for it.
            "policy.readahead_blocks=0",
        )
        run = _Runner(args, work, B, batch)
        direct = run.over.direct
        try:
            previous: list[list[bytes]] = []
            # Daemon r reads pass r-1 cold, deletes it and writes pass r; the last only reads.
            for r in range(args.rounds + 1):
                with bench_daemon(*overrides) as daemon, daemon.client() as client:
                    start_s.append(daemon.start_s)
                    pool_id = client.register_pool(run.shm, run.layout).pool_id
                    if previous:
                        gets.append(run.read_pass(client, pool_id, previous, r - 1))
                        for keys in previous:
                            client.delete(keys)
                    if r < args.rounds:
                        p, previous = run.write_pass(client, pool_id, r)
                        puts.append(p)
                # Stopped: the next daemon starts with an empty L1, reading a cold disk.
                if r < args.rounds:
                    dropped.append(not args.keep_cache and drop_page_cache())
        finally:
            run.close()

    io_mode = "O_DIRECT" if direct else "buffered (the filesystem refused O_DIRECT)"
    cache = (
        "page cache dropped before every cold read"
        if all(dropped)
        else "page cache NOT dropped ("
        + ("--keep-cache" if args.keep_cache else "drop_caches not writable")
        + "): cold reads may hit it"
    )
    first, rest = puts[0], puts[1:]
    out: dict[str, Any] = {
        "block_bytes": B,
        "blocks": n,
        "batch": batch,
        "io_threads": args.io_threads,
        "rounds": args.rounds,
        "raw_io": "o_direct" if direct else "buffered",
        "page_cache_dropped": all(dropped),
        "put_first_fill_gbps": sig(first.gbps("daemon")),
        "raw_write_first_fill_gbps": sig(first.gbps("fill")),
        "put_first_fill_ratio": ratio(first.gbps("daemon"), first.gbps("fill")),
        "put_gbps": None,
        "raw_write_gbps": None,
        "put_ratio": None,
        "raw_write_fill_gbps_all": [sig(p.gbps("fill")) for p in puts],
        "raw_write_overwrite_gbps_all": [sig(p.gbps("overwrite")) for p in puts],
        "put_gbps_all": [sig(p.gbps("daemon")) for p in puts],
        "get_cold_gbps": sig(median([g.gbps("daemon") for g in gets])),
        "raw_read_gbps": sig(median([g.gbps("raw") for g in gets])),
        "get_cold_ratio": None,
        "daemon_start_s": [sig(s) for s in start_s],
    }
    out["get_cold_ratio"] = ratio(out["get_cold_gbps"], out["raw_read_gbps"])
    if rest:
        put = median([p.gbps("daemon") for p in rest])
        raw = median([p.gbps("overwrite") for p in rest])
        out.update(put_gbps=sig(put), raw_write_gbps=sig(raw), put_ratio=ratio(put, raw))

    print(
        f"L2 through the daemon: {n} blocks of {B / MiB:g} MiB ({n * B / MiB:.0f} MiB), "
        f"batches of {batch}, {args.io_threads} I/O threads (daemon and raw), raw {io_mode}; "
        f"{args.rounds} write passes, {len(gets)} cold read passes; {cache}"
    )
    for i, p in enumerate(puts):
        what = "first fill" if i == 0 else "overwrite "
        g = f" | cold get {gets[i].gbps('daemon'):.2f}, raw read {gets[i].gbps('raw'):.2f}"
        print(
            f"  pass {i + 1} ({what}): durable put {p.gbps('daemon'):.2f} GB/s, raw first fill "
            f"{p.gbps('fill'):.2f}, raw overwrite {p.gbps('overwrite'):.2f}{g}"
        )
    print(
        f"durable put, first fill: {out['put_first_fill_gbps']:.2f} GB/s, raw write+fdatasync "
        f"into fresh extents {out['raw_write_first_fill_gbps']:.2f} GB/s, ratio "
        f"{out['put_first_fill_ratio']} (one pass)"
    )
    if rest:
        print(
            f"durable put, overwrite:  {out['put_gbps']:.2f} GB/s, raw write+fdatasync over "
            f"written extents {out['raw_write_gbps']:.2f} GB/s, ratio {out['put_ratio']} "
            f"(median of {len(rest)} passes)"
        )
    print(
        f"cold get after restart:  {out['get_cold_gbps']:.2f} GB/s, raw read "
        f"{out['raw_read_gbps']:.2f} GB/s, ratio {out['get_cold_ratio']} "
        f"(median of {len(gets)} passes)"
    )
    if emit is not None:
        emit(out)
    return 0


def _durable_put(client: Client, pool_id: int, keys: list[bytes], pages: list[int]) -> None:
    res = client.put(pool_id, keys, pages, durable=True)
    if res.stored != len(keys) or res.persisted is None or not all(res.persisted):
        persisted = sum(res.persisted or [])
        raise RuntimeError(
            f"durable put stored {res.stored} and persisted {persisted} of {len(keys)} blocks"
        )


def _get_all(client: Client, pool_id: int, keys: list[bytes], pages: list[int]) -> None:
    got = client.get(pool_id, keys, pages)
    if got.prefix_len != len(keys):
        raise RuntimeError(f"cold get loaded {got.prefix_len} of {len(keys)} blocks")
