"""``kvtier bench fair``: one tenant's small calls while another tenant's large batches run.

A kvtierd (L1 only) with two tenants, ``small`` and ``batch`` (token tenants, so that one
user acts as both), and two client processes:
- tenant ``batch`` makes ``--calls`` calls at once through one ``AsyncClient``, each a Lookup
  (``--op lookup``) or a Get into its pool (``--op get``) of ``--batch-keys`` blocks it
  stored, making the next as each one ends, for the whole run: an engine's batched loads. The
  client keeps ``--calls-open`` of them open at the daemon (its ``max_calls_open``, 32 by
  default) and queues the rest;
- tenant ``small``, this process, makes one-key calls of the same op back to back and times
  each: a scheduler's Lookup at every step, a one-block Get.

Three phases of ``--seconds`` each: tenant ``small``'s calls alone (its baseline, measured in
the same run), tenant ``batch``'s alone (its baseline), then both at once. Reported:
``small``'s p50, p99 and max in ms alone and beside the batches and the ratios beside/alone
(``p50_ratio``, ``p99_ratio``), and tenant ``batch``'s calls and keys per second alone and
beside ``small``'s calls.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvtier.bench.common import arg_parser, block_layout, latency_figures, ratio, sig
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import bench_daemon
from kvtier.client.slots import DEFAULT_MAX_CALLS_OPEN, MAX_CALLS_OPEN_LIMIT

BLOCK_BYTES = 4096
TENANTS = ("small", "batch")
_TIMEOUT_S = 120.0


def _pool(nkeys: int) -> tuple[Any, Any]:
    """A shared-memory pool of ``nkeys`` one-block pages of random bytes, and its layout."""
    from kvtier.client import SharedMemoryPool

    layout = block_layout(BLOCK_BYTES, nkeys, num_layers=1)
    shm = SharedMemoryPool.for_layout(layout)
    shm.array()[:] = np.frombuffer(os.urandom(layout.extent_bytes), np.uint8)
    return shm, layout


def _batches(
    conn: Connection,
    address: str,
    token_file: str,
    op: str,
    calls: int,
    nkeys: int,
    calls_open: int,
) -> None:
    """Tenant ``batch``: ``calls`` calls of ``nkeys`` keys open at once until told to stop,
    saying how many it has made whenever asked."""
    import asyncio

    from kvtier.client import AsyncClient

    keys = [os.urandom(32) for _ in range(nkeys)]
    pages = list(range(nkeys))
    shm, layout = _pool(nkeys)

    async def main() -> None:
        stop = asyncio.Event()
        done = 0
        async with AsyncClient(
            address, token_file=token_file, max_batch_blocks=nkeys, max_calls_open=calls_open
        ) as c:
            pool_id = (await c.register_pool(shm, layout)).pool_id
            if (await c.put(pool_id, keys, pages)).stored != nkeys:
                raise RuntimeError("tenant batch's put stored too few blocks")

            async def one() -> None:
                nonlocal done
                while not stop.is_set():
                    if op == "get":
                        found = (await c.get(pool_id, keys, pages)).prefix_len
                    else:
                        found = (await c.lookup(keys)).prefix_len
                    if found != nkeys:
                        raise RuntimeError(f"a batch found {found} of {nkeys} keys")
                    done += 1

            tasks = [asyncio.create_task(one()) for _ in range(calls)]
            conn.send("running")
            loop = asyncio.get_running_loop()
            # Each message asks for the count so far; None, to stop.
            while await loop.run_in_executor(None, conn.recv) is not None:
                conn.send((done, time.perf_counter()))
            stop.set()
            await asyncio.gather(*tasks)
            conn.send("stopped")

    with shm:
        asyncio.run(main())


def _small_calls(client: Any, op: str, pool_id: int, key: bytes, seconds: float) -> np.ndarray:
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        r = client.get(pool_id, [key], [0]) if op == "get" else client.lookup([key])
        lat.append(time.perf_counter() - t)
        if r.prefix_len != 1:
            raise RuntimeError("tenant small's block was not found")
    return np.asarray(lat)


class _Batcher:
    """Tenant batch's process, driven over a pipe."""

    def __init__(self, address: str, token_file: str, args: argparse.Namespace) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_batches,
            args=(
                child,
                address,
                token_file,
                args.op,
                args.calls,
                args.batch_keys,
                args.calls_open,
            ),
            daemon=True,
        )
        self._proc.start()
        self._recv("tenant batch did not start")

    def count(self) -> tuple[int, float]:
        """Its calls done so far, and when it counted them (time.perf_counter)."""
        self._conn.send("count")
        return self._recv("tenant batch did not answer")  # type: ignore[no-any-return]

    def stop(self) -> None:
        try:
            if self._proc.is_alive():
                self._conn.send(None)
                self._recv("tenant batch did not stop")
        finally:
            self._proc.join(_TIMEOUT_S)
            if self._proc.is_alive():
                self._proc.kill()

    def _recv(self, what: str) -> Any:
        if not self._conn.poll(_TIMEOUT_S):
            raise TimeoutError(what)
        return self._conn.recv()


def _rate(first: tuple[int, float], last: tuple[int, float]) -> float:
    return (last[0] - first[0]) / (last[1] - first[1])


def _phases(
    address: str, tokens: dict[str, str], args: argparse.Namespace, out: dict[str, Any]
) -> None:
    """Tenant small's calls alone, tenant batch's alone, then both together."""
    from kvtier.client import Client

    shm, layout = _pool(1)
    with shm, Client(address, token_file=tokens["small"]) as client:
        key = os.urandom(32)
        pool_id = client.register_pool(shm, layout).pool_id
        if client.put(pool_id, [key], [0]).stored != 1:
            raise RuntimeError("tenant small's put stored nothing")
        out["alone"] = latency_figures(_small_calls(client, args.op, pool_id, key, args.seconds))
        batcher = _Batcher(address, tokens["batch"], args)
        try:
            time.sleep(0.5)  # every batch call under way
            first = batcher.count()
            time.sleep(args.seconds)
            second = batcher.count()
            out["beside"] = latency_figures(
                _small_calls(client, args.op, pool_id, key, args.seconds)
            )
            third = batcher.count()
        finally:
            batcher.stop()
    for phase, rate in (
        ("batch_alone", _rate(first, second)),
        ("batch_beside", _rate(second, third)),
    ):
        out[phase] = {"calls_per_s": sig(rate), "keys_per_s": sig(rate * args.batch_keys)}


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    p = arg_parser("fair", __doc__)
    p.add_argument("--op", choices=("lookup", "get"), default="lookup", help="(lookup)")
    p.add_argument("--calls", type=int, default=8, help="batch calls made at once (8)")
    p.add_argument(
        "--calls-open",
        type=int,
        default=DEFAULT_MAX_CALLS_OPEN,
        help="of those, open at the daemon: the client's max_calls_open "
        f"({DEFAULT_MAX_CALLS_OPEN})",
    )
    p.add_argument("--batch-keys", type=int, default=4096, help="keys per batch call (4096)")
    p.add_argument("--seconds", type=float, default=10.0, help="small calls' time per phase (10)")
    p.add_argument("--set", action="append", default=[], help="daemon config override")
    args = p.parse_args(argv)
    if args.calls < 1 or args.seconds <= 0 or not 1 <= args.batch_keys <= 4096:
        p.error("--calls must be at least 1, --seconds above 0, --batch-keys 1 to 4096")
    if not 1 <= args.calls_open <= MAX_CALLS_OPEN_LIMIT:
        p.error(f"--calls-open must be 1 to {MAX_CALLS_OPEN_LIMIT}")
    out: dict[str, Any] = {
        "op": args.op,
        "calls": args.calls,
        "calls_open": min(args.calls, args.calls_open),
        "batch_keys": args.batch_keys,
    }
    scratch = tempfile.mkdtemp(prefix="kvtier-bench-fair-")
    try:
        tokens = {name: os.path.join(scratch, f"{name}.token") for name in TENANTS}
        for name, path in tokens.items():
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(f"{name}-{os.urandom(16).hex()}\n")
        tenants = ", ".join(f"{{name: {n}, token_file: {tokens[n]}}}" for n in TENANTS)
        with bench_daemon("tiers.l1.capacity_bytes=64MiB", f"tenants=[{tenants}]", *args.set) as d:
            _phases(d.address, tokens, args, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["p50_ratio"] = ratio(out["beside"]["p50_ms"], out["alone"]["p50_ms"])
    out["p99_ratio"] = ratio(out["beside"]["p99_ms"], out["alone"]["p99_ms"])
    for phase in ("alone", "beside"):
        f = out[phase]
        print(
            f"tenant small {args.op} {phase:6s}: p50 {f['p50_ms']:.3g} ms  "
            f"p99 {f['p99_ms']:.3g} ms  max {f['max_ms']:.3g} ms  ({f['calls']} calls of 1 key)"
        )
    print(f"beside/alone: p50 x{out['p50_ratio']}  p99 x{out['p99_ratio']}")
    for phase in ("alone", "beside"):
        f = out[f"batch_{phase}"]
        print(
            f"tenant batch {phase:6s}: {args.calls} {args.op}s of {args.batch_keys} keys at "
            f"once, {out['calls_open']} open, {f['calls_per_s']:.4g} calls/s "
            f"({f['keys_per_s']:.4g} keys/s)"
        )
    if emit is not None:
        emit(out)
    return 0
