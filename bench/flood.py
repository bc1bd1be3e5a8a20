"""``kvtier bench flood``: one client's calls while another floods the daemon with large requests.

A kvtierd (defaults but a small L1) and two client processes:
- the flooder keeps ``--calls`` calls open at once, each a Put of ``--request-bytes`` that
  names no session (refused NOT_FOUND once parsed: a broken or hostile engine), sending the
  next as each one ends, for the whole run;
- the victim, another process with its own session, looks up ``--victim-keys`` keys (one:
  an engine's fast path; 4,096: a batch, a request parsed in its turn) at a time, back to
  back, and times each call.

Baseline, measured in the same run: the victim's lookups with no flood. Reported: the victim's
p50, p99 and max in ms with and without the flood, and the flood's calls per second over its
whole run with the status codes they ended with (RESOURCE_EXHAUSTED: gRPC's own for a
request past ``server.max_message_bytes``, or the daemon's for one not parsed, with 64
times that many bytes of the flood waiting already; else the daemon's NOT_FOUND).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvtier.bench.common import arg_parser, latency_figures, parse_size, sig
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import bench_daemon

PUT_METHOD = "/kvtier.v1.KVTier/Put"
_TIMEOUT_S = 120.0


def _flood(conn: Connection, address: str, calls: int, request_bytes: int) -> None:
    """The flooder: ``calls`` Puts open at once, each sent again as it ends, until told."""
    import asyncio

    import grpc

    from kvtier.proto import kvtier_pb2 as pb

    # Packed page numbers of one byte each make up the size; one key, so nothing but the
    # parse tells the daemon the request is useless.
    head = pb.PutRequest(session_id="no-such-session", pool_id=1, keys=[b"k" * 32])
    pages = max(0, request_bytes - head.ByteSize() - 8)
    request = pb.PutRequest(
        session_id="no-such-session", pool_id=1, keys=[b"k" * 32], pages=[0] * pages
    ).SerializeToString()

    async def main() -> None:
        codes: dict[str, int] = {}
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(
            address, options=[("grpc.max_send_message_length", -1)]
        ) as channel:
            put = channel.unary_unary(PUT_METHOD)

            async def one() -> None:
                while not stop.is_set():
                    try:
                        await put(request, timeout=_TIMEOUT_S)
                        code = "OK"
                    except grpc.aio.AioRpcError as e:
                        code = e.code().name
                    codes[code] = codes.get(code, 0) + 1

            started = time.perf_counter()
            tasks = [asyncio.create_task(one()) for _ in range(calls)]
            conn.send(("flooding", None))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, conn.recv)  # told to stop
            stop.set()
            await asyncio.gather(*tasks)
        conn.send((codes, time.perf_counter() - started))

    asyncio.run(main())


def _victim_lookups(address: str, seconds: float, nkeys: int) -> np.ndarray:
    from kvtier.client import Client

    with Client(address) as client:
        keys = [os.urandom(32) for _ in range(nkeys)]
        client.lookup(keys)  # the session opens
        lat: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            client.lookup(keys)
            lat.append(time.perf_counter() - t)
    return np.asarray(lat)


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    p = arg_parser("flood", __doc__)
    p.add_argument("--calls", type=int, default=128, help="flood calls open at once (128)")
    p.add_argument("--request-bytes", default="3.8MB", help="size of each flood request (3.8MB)")
    p.add_argument("--seconds", type=float, default=10.0, help="victim time per phase (10)")
    p.add_argument("--victim-keys", type=int, default=1, help="keys per victim lookup (1)")
    p.add_argument("--set", action="append", default=[], help="daemon config override")
    args = p.parse_args(argv)
    try:
        request_bytes = parse_size(args.request_bytes)
    except ValueError as e:
        p.error(f"--request-bytes: {e}")
    if args.calls < 1 or args.seconds <= 0 or not 1 <= args.victim_keys <= 4096:
        p.error("--calls must be at least 1, --seconds above 0, --victim-keys 1 to 4096")
    out: dict[str, Any] = {
        "calls": args.calls,
        "request_bytes": request_bytes,
        "victim_keys": args.victim_keys,
    }
    with bench_daemon("tiers.l1.capacity_bytes=64MiB", *args.set) as daemon:
        out["quiet"] = latency_figures(
            _victim_lookups(daemon.address, args.seconds, args.victim_keys)
        )
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        flooder = ctx.Process(
            target=_flood, args=(child, daemon.address, args.calls, request_bytes), daemon=True
        )
        flooder.start()
        try:
            if not parent.poll(_TIMEOUT_S):
                raise TimeoutError("the flooder did not start")
            parent.recv()
            time.sleep(1.0)  # every flood call under way
            out["flooded"] = latency_figures(
                _victim_lookups(daemon.address, args.seconds, args.victim_keys)
            )
            parent.send(None)
            if not parent.poll(_TIMEOUT_S):
                raise TimeoutError("the flooder did not stop")
            codes, elapsed = parent.recv()
        finally:
            flooder.join(_TIMEOUT_S)
            if flooder.is_alive():
                flooder.kill()
        out["flood_codes"] = codes
        out["flood_calls_per_s"] = sig(sum(codes.values()) / elapsed)
    for phase in ("quiet", "flooded"):
        f = out[phase]
        print(
            f"victim lookup {phase:8s}: p50 {f['p50_ms']:.3g} ms  p99 {f['p99_ms']:.3g} ms  "
            f"max {f['max_ms']:.3g} ms  ({f['calls']} calls of {args.victim_keys} keys)"
        )
    print(
        f"flood: {args.calls} calls of {request_bytes} bytes open at once, "
        f"{out['flood_calls_per_s']:.3g} calls/s, {codes}"
    )
    if emit is not None:
        emit(out)
    return 0
