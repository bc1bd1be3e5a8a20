"""``kvtier bench restart``: how long kvtierd takes to serve after a start, with a large L2
index and with a large L1, next to the same start without them; and durable put rates.

Setup (through the daemon, untimed except where said):
- fill: a daemon with an L2 tier, once it has faulted in its L1 (as every bench's daemon,
  unless said otherwise), takes ``--rows`` blocks of 4 KiB in durable puts
  (``Client.put(..., durable=True)``) of ``--batch`` keys each, so its L2 index holds that
  many rows. The fill is timed as the durable 4 KiB put rate (blocks/s), each batch next to a
  raw ``O_DIRECT`` write of the same bytes (one contiguous write per thread,
  ``--io-threads`` threads, ``fdatasync``) into a fresh preallocated file;
- durable 2 MiB puts: another daemon takes ``--big-blocks`` blocks of 2 MiB in durable puts
  of 64, each batch next to raw ``O_DIRECT`` writes of the same blocks (one per block, the
  same threads, ``fdatasync``) into a fresh preallocated file (``kvtier bench l2`` measures
  this in more depth);
- an L2 folder of the same capacity with no rows (opened once, so its files exist).

Timed, ``--repeats`` times in turn (medians reported), each start a new process measured from
spawning it to its first SERVING answer to a gRPC health check (polled every 5 ms):
- ``empty``: L1 of 64 MiB, the L2 folder with no rows;
- ``full``: L1 of 64 MiB, the L2 folder with ``--rows`` rows; also the time until a Lookup
  of 256 keys spread over the fill finds every one (a daemon that serves before its index is
  loaded is SERVING earlier than it can answer), and the L2 block count the daemon reports;
- ``l1``: L1 of ``--l1`` bytes, no L2; next to a bare first touch of as many bytes of
  anonymous memory in this process (one write per 4 KiB page, one thread), timed right after.

With ``--cold`` the page cache is dropped before every timed start (where this process may);
otherwise starts find the cache as the previous step left it, as a daemon restarted in place
would.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import (
    PAGE,
    MiB,
    arg_parser,
    block_layout,
    drop_page_cache,
    fmt_list,
    median,
    parse_size,
    ratio,
    scratch_dir,
    sig,
)
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import BenchDaemon, bench_daemon
from kvtier.bench.rawio import RawFile, aligned_buffer, block_items, split_items
from kvtier.client import Client, SharedMemoryPool, Tier

SMALL, BIG = 4096, 2 * MiB
SEGMENT_BYTES = 64 * MiB
SAMPLE_KEYS = 256
BIG_BATCH = 64
POLL_S = 0.005
# L1 of the filling daemon: the whole fill where it fits, else blocks are evicted from L1
# (they are on L2 already) as the fill goes.
FILL_L1_MAX = 2 << 30


def _parse(argv: list[str]) -> argparse.Namespace:
    p = arg_parser("restart", __doc__)
    p.add_argument("--rows", type=int, default=150_000, help="L2 index rows (150000)")
    p.add_argument("--batch", type=int, default=4096, help="keys per durable put (4096)")
    p.add_argument("--l1", default="1GiB", help="L1 size of the 'l1' start (1GiB), e.g. 4GiB")
    p.add_argument("--repeats", type=int, default=3, help="timed starts of each kind (3)")
    p.add_argument("--big-blocks", type=int, default=128, help="2 MiB blocks put durably (128)")
    p.add_argument("--io-threads", type=int, default=4, help="tiers.l2.io_threads, raw too (4)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each start")
    p.add_argument("--dir", default=None, help="scratch folder parent (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = p.parse_args(argv)
    try:
        args.l1_bytes = parse_size(args.l1)
    except ValueError as e:
        p.error(str(e))
    if min(args.rows, args.batch, args.repeats, args.big_blocks, args.io_threads) < 1:
        p.error("counts must be at least 1")
    if args.l1_bytes < 64 * MiB:
        p.error("--l1 must be at least 64MiB (one L1 segment)")
    return args


def _l2_overrides(path: Path, data_bytes: int, threads: int) -> list[str]:
    # Headroom so that the fill stays under the tier's high watermark.
    segments = -(-int(data_bytes / 0.85) // SEGMENT_BYTES) + 1
    return [
        "tiers.l2.enabled=true",
        f"tiers.l2.path={path}",
        f"tiers.l2.capacity_bytes={segments * SEGMENT_BYTES}",
        f"tiers.l2.segment_bytes={SEGMENT_BYTES}",
        f"tiers.l2.io_threads={threads}",
    ]


def _durable_put(client: Client, pool_id: int, keys: list[bytes], pages: list[int]) -> None:
    res = client.put(pool_id, keys, pages, durable=True)
    if res.stored != len(keys) or res.persisted is None or not all(res.persisted):
        raise RuntimeError(
            f"durable put stored {res.stored} and persisted {sum(res.persisted or [])} of "
            f"{len(keys)} blocks"
        )


def _paired_puts(
    client: Client,
    work: Path,
    name: str,
    block_bytes: int,
    blocks: int,
    batch: int,
    threads: int,
    raw_items: Callable[[int, memoryview], list[tuple[int, memoryview]]],
) -> tuple[float, float, list[bytes]]:
    """Durable puts of ``blocks`` fresh keys, ``batch`` per call, each batch next to a raw
    write of as many bytes into a fresh preallocated file (alternating which goes first).
    Returns (daemon seconds, raw seconds, every key)."""
    layout = block_layout(block_bytes, batch)
    all_keys: list[bytes] = []
    spent = [0.0, 0.0]
    raw_buf = aligned_buffer(batch * block_bytes)
    with (
        SharedMemoryPool.for_layout(layout) as shm,
        RawFile(work / f"raw-{name}.bin", blocks * block_bytes, threads) as raw,
    ):
        shm.array()[:] = np.frombuffer(os.urandom(layout.extent_bytes), np.uint8)
        raw_buf[:] = os.urandom(len(raw_buf))
        pool_id = client.register_pool(shm, layout).pool_id
        pages = list(range(batch))
        for i, first in enumerate(range(0, blocks, batch)):
            n = min(batch, blocks - first)
            keys = [os.urandom(32) for _ in range(n)]
            items = raw_items(first * block_bytes, raw_buf[: n * block_bytes])
            sides: list[tuple[int, Callable[[], None]]] = [
                (0, partial(_durable_put, client, pool_id, keys, pages[:n])),
                (1, partial(raw.write, items)),
            ]
            for side, fn in sides if i % 2 == 0 else sides[::-1]:
                t = time.perf_counter()
                fn()
                spent[side] += time.perf_counter() - t
            all_keys += keys
            del items, sides
        client.unregister_pool(pool_id)
    os.unlink(work / f"raw-{name}.bin")
    return spent[0], spent[1], all_keys


def _first_touch_s(nbytes: int) -> float:
    """Seconds to write one byte into every 4 KiB page of a fresh anonymous mapping."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arr = np.frombuffer(buf, dtype=np.uint8)
        t = time.perf_counter()
        arr[::PAGE] = 1
        spent = time.perf_counter() - t
        del arr
    finally:
        buf.close()
    return spent


def _index_ready_s(daemon: BenchDaemon, client: Client, sample: list[bytes]) -> float:
    """Seconds from spawning ``daemon`` until one Lookup finds every key of ``sample``."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if client.lookup(sample).prefix_len == len(sample):
            return time.perf_counter() - daemon.spawned_at
        time.sleep(POLL_S)
    raise TimeoutError("the daemon never found the stored keys after a restart")


def _l2_blocks(client: Client) -> int:
    return sum(t.blocks for t in client.stats().tiers if t.tier == Tier.L2_DISK)


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    args = _parse(argv)
    small_l1 = "tiers.l1.capacity_bytes=64MiB"
    dropped: list[bool] = []
    times: dict[str, list[float]] = {k: [] for k in ("empty", "full", "full_index", "l1", "touch")}
    recovered: list[int] = []

    def maybe_drop() -> None:
        if args.cold:
            dropped.append(drop_page_cache())

    with scratch_dir(args.dir, "kvtier-bench-restart-", keep=args.keep) as work:
        full = _l2_overrides(work / "l2-full", args.rows * SMALL, args.io_threads)
        empty = _l2_overrides(work / "l2-empty", args.rows * SMALL, args.io_threads)
        big = _l2_overrides(work / "l2-big", args.big_blocks * BIG, args.io_threads)
        fill_l1 = min(args.rows * SMALL + 256 * MiB, FILL_L1_MAX)

        print(
            f"filling an L2 index with {args.rows} rows: durable puts of {args.batch} x 4 KiB "
            f"blocks, {args.io_threads} I/O threads ..."
        )
        with (
            bench_daemon(f"tiers.l1.capacity_bytes={fill_l1}", "policy.protect_s=0", *full) as d,
            d.client() as client,
        ):
            put_s, raw_s, keys = _paired_puts(
                client,
                work,
                "small",
                SMALL,
                args.rows,
                args.batch,
                args.io_threads,
                lambda off, buf: split_items(off, buf, args.io_threads),
            )
            step = max(1, len(keys) // SAMPLE_KEYS)
            sample = keys[::step][:SAMPLE_KEYS]
            sample[-1] = keys[-1]
            del keys
        small_rate, small_raw_rate = args.rows / put_s, args.rows / raw_s

        with (
            bench_daemon(f"tiers.l1.capacity_bytes={args.big_blocks * BIG + 256 * MiB}", *big) as d,
            d.client() as client,
        ):
            big_s, big_raw_s, _ = _paired_puts(
                client,
                work,
                "big",
                BIG,
                args.big_blocks,
                BIG_BATCH,
                args.io_threads,
                lambda off, buf: block_items(off, BIG, buf, len(buf) // BIG),
            )
        big_gbps = args.big_blocks * BIG / big_s / 1e9
        big_raw_gbps = args.big_blocks * BIG / big_raw_s / 1e9

        with bench_daemon(small_l1, *empty):
            pass  # creates the empty tier's files; the timed starts reopen them

        print(f"timing {args.repeats} starts of each kind ...")
        for _ in range(args.repeats):
            maybe_drop()
            with bench_daemon(small_l1, *empty, poll_s=POLL_S, wait_recovered=False) as d:
                times["empty"].append(d.start_s)
            maybe_drop()
            with (
                bench_daemon(small_l1, *full, poll_s=POLL_S, wait_recovered=False) as d,
                d.client() as client,
            ):
                times["full"].append(d.start_s)
                times["full_index"].append(_index_ready_s(d, client, sample))
                recovered.append(_l2_blocks(client))
            maybe_drop()
            with bench_daemon(
                f"tiers.l1.capacity_bytes={args.l1_bytes}", poll_s=POLL_S, wait_recovered=False
            ) as d:
                times["l1"].append(d.start_s)
            times["touch"].append(_first_touch_s(args.l1_bytes))

    med = {k: median(v) for k, v in times.items()}
    out: dict[str, Any] = {
        "rows": args.rows,
        "batch": args.batch,
        "io_threads": args.io_threads,
        "repeats": args.repeats,
        "cold": args.cold,
        "page_cache_dropped": bool(dropped) and all(dropped),
        "start_empty_s": sig(med["empty"]),
        "start_full_s": sig(med["full"]),
        "full_vs_empty": ratio(med["full"], med["empty"]),
        "index_ready_s": sig(med["full_index"]),
        "l2_blocks_after_restart": recovered,
        "l1_bytes": args.l1_bytes,
        "start_l1_s": sig(med["l1"]),
        "first_touch_s": sig(med["touch"]),
        "l1_start_vs_touch": ratio(med["l1"], med["touch"]),
        "durable_4k_blocks_s": sig(small_rate),
        "raw_4k_blocks_s": sig(small_raw_rate),
        "durable_4k_ratio": ratio(small_rate, small_raw_rate),
        "durable_2m_gbps": sig(big_gbps),
        "raw_2m_gbps": sig(big_raw_gbps),
        "durable_2m_ratio": ratio(big_gbps, big_raw_gbps),
        "all_s": {k: [sig(x) for x in v] for k, v in times.items()},
    }
    if any(n != args.rows for n in recovered):
        print(f"WARNING: the restarted daemon reported {recovered} L2 blocks, not {args.rows}")
    cache = (
        "page cache dropped before each start"
        if out["page_cache_dropped"]
        else ("page cache NOT dropped (not allowed here)" if args.cold else "page cache left warm")
    )
    print(f"start to SERVING, medians of {args.repeats} ({cache}):")
    print(f"  empty L2 index        {med['empty']:7.3f} s   {fmt_list(times['empty'])}")
    print(
        f"  {args.rows:>7} L2 rows        {med['full']:7.3f} s   ({out['full_vs_empty']}x empty;"
        f" all sampled keys found at {med['full_index']:.3f} s; L2 blocks {recovered})"
    )
    print(
        f"  L1 {args.l1_bytes / 2**30:.2f} GiB           {med['l1']:7.3f} s   (a bare first "
        f"touch of as many bytes: {med['touch']:.3f} s, ratio {out['l1_start_vs_touch']})"
    )
    print(
        f"durable puts: 4 KiB {small_rate:,.0f} blocks/s (raw O_DIRECT write+fdatasync of "
        f"the same bytes: {small_raw_rate:,.0f} blocks/s, ratio {out['durable_4k_ratio']}); "
        f"2 MiB {big_gbps:.2f} GB/s (raw {big_raw_gbps:.2f} GB/s, ratio "
        f"{out['durable_2m_ratio']})"
    )
    if emit is not None:
        emit(out)
    return 0
