"""``kvtier bench rpc``: the cost of one small request, next to a bare gRPC ping.

Single-block requests (4 KiB blocks, one key per call) against a real kvtierd over its Unix
socket, from 1 and from 4 client processes (``--clients``), each process with its own
``kvtier.client.Client`` and registered shared-memory pool:
- ``put``: ``Client.put`` of one new key from one pool page;
- ``get``: ``Client.get`` of one key that process stored (in L1) into one page;
- ``lookup``: ``Client.lookup`` of one stored key.

Baselines, measured in the same run by the same client processes, one call at a time:
- ``ping``: a minimal ``grpc.aio`` server in a process of its own with one unary echo RPC
  (64 bytes each way, about the size of a one-key request) on a Unix socket of the same kind,
  called through a plain gRPC channel: the floor any unary RPC over this transport pays (the
  issue's baseline: on asyncio's own event loop);
- ``ping_uv``: the same server on uvloop, the daemon's default event loop
  (``server.event_loop``): what the loop alone is worth, so that the daemon's figures can be
  read against a floor on either loop;
- ``health``: the daemon's own gRPC health Check on its socket (``Client.health``).

Each phase runs one kind of call: the client processes (real processes, spawned) warm up,
meet at a barrier, then each makes ``--ops`` calls back to back, timing each. Latency
percentiles pool every call of every round; ops/s is all the calls of a phase over the time
from the barrier to the last one finishing (median over rounds). A round runs every phase
for every client count (ping, health, put, get, lookup); ``--rounds`` rounds alternate.

Reported ratios (the issue's targets: p50 <= 1.3x, throughput >= 0.7x):
``<op>_p50_vs_ping`` is the op's p50 over ping's p50 with the same number of clients;
``<op>_ops_vs_ping`` is the op's ops/s with the most clients over ping's ops/s with as many;
``<op>_p50_vs_ping_uvloop`` and ``<op>_ops_vs_ping_uvloop`` the same against ``ping_uv``.

CPU per call, on both sides of the socket (median over rounds), because on a small host the
client processes and the server share the cores: a microsecond either spends beyond ping's is
taken from the other. ``client_cpu_us``: the client processes' CPU time (every thread, gRPC's
included) over their timed calls, per call; ``server_cpu_us``: the serving process's (the ping
server for ping, else the daemon) from the barrier to the last call's end, per call, read
from ``/proc`` (None where there is none). Both count in the kernel's clock ticks (10 ms at
100 Hz), so a phase needs some hundreds of calls for them to mean much.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import arg_parser, median, pct_ms, ratio, scratch_dir, sig
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import bench_daemon
from kvtier.bench.ping import PING_METHOD, serve
from kvtier.daemon.config import ServerConfig
from kvtier.daemon.loops import EVENT_LOOPS
from kvtier.paths import unix_address

BLOCK_BYTES = 4096
PING_PAYLOAD = 64
OPS = ("ping", "ping_uv", "health", "put", "get", "lookup")
# The baselines, and the event loop each ping server runs on.
PINGS = {"ping": "asyncio", "ping_uv": "uvloop"}
DAEMON_OPS = ("put", "get", "lookup")
_TIMEOUT_S = 300.0


def _parse(argv: list[str]) -> argparse.Namespace:
    p = arg_parser("rpc", __doc__)
    p.add_argument("--ops", type=int, default=1000, help="timed calls per client per phase (1000)")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls before each phase (50)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every phase (2)")
    p.add_argument("--clients", default="1,4", help="client process counts, comma separated (1,4)")
    p.add_argument("--pages", type=int, default=64, help="pages of each client's pool (64)")
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=ServerConfig.event_loop,
        help=f"the daemon's server.event_loop ({ServerConfig.event_loop})",
    )
    args = p.parse_args(argv)
    try:
        args.client_counts = sorted({int(c) for c in args.clients.split(",")})
    except ValueError:
        p.error(f"--clients {args.clients!r}: expected numbers such as 1,4")
    if min([args.ops, args.rounds, args.pages, *args.client_counts]) < 1 or args.warmup < 0:
        p.error("counts must be at least 1 (--warmup at least 0)")
    return args


# ---------------------------------------------------------------- client processes


def _worker(
    conn: Connection,
    barrier: Barrier,
    daemon_address: str,
    ping_addresses: dict[str, str],
    pages: int,
) -> None:
    """A client process: connects to both servers, then runs the phases it is sent."""
    try:
        import grpc

        from kvtier.bench.common import block_layout
        from kvtier.client import Client, SharedMemoryPool

        layout = block_layout(BLOCK_BYTES, pages, num_layers=1)
        with (
            Client(daemon_address) as client,
            SharedMemoryPool.for_layout(layout) as shm,
            contextlib.ExitStack() as channels,
        ):
            shm.array()[:] = np.frombuffer(os.urandom(layout.extent_bytes), np.uint8)
            pool_id = client.register_pool(shm, layout).pool_id
            echoes = {
                op: channels.enter_context(grpc.insecure_channel(address)).unary_unary(PING_METHOD)
                for op, address in ping_addresses.items()
            }
            payload = os.urandom(PING_PAYLOAD)
            stored: list[bytes] = []

            def call(op: str, i: int, keys: list[bytes]) -> None:
                page = i % pages
                if op in echoes:
                    if len(echoes[op](payload, timeout=30)) != PING_PAYLOAD:
                        raise RuntimeError("ping echoed a short reply")
                elif op == "health":
                    if not client.health():
                        raise RuntimeError("the daemon is not SERVING")
                elif op == "put":
                    if client.put(pool_id, [keys[i]], [page]).stored != 1:
                        raise RuntimeError("put stored nothing")
                elif op == "get":
                    key = stored[i % len(stored)]
                    if client.get(pool_id, [key], [page]).prefix_len != 1:
                        raise RuntimeError("get found nothing")
                elif op == "lookup":
                    if client.lookup([stored[i % len(stored)]]).prefix_len != 1:
                        raise RuntimeError("lookup found nothing")
                else:
                    raise ValueError(op)

            conn.send(("ready", None))
            while (msg := conn.recv()) is not None:
                op, nops, warmup = msg
                warm_keys = [os.urandom(32) for _ in range(warmup)]
                for i in range(warmup):
                    call(op, i, warm_keys)
                keys = [os.urandom(32) for _ in range(nops)] if op == "put" else []
                lat = np.empty(nops, dtype=np.float64)
                barrier.wait(_TIMEOUT_S)
                t0, cpu0 = time.monotonic(), time.process_time()
                for i in range(nops):
                    t = time.perf_counter()
                    call(op, i, keys)
                    lat[i] = time.perf_counter() - t
                t1, cpu1 = time.monotonic(), time.process_time()
                if op == "put":
                    stored = keys
                conn.send(("done", (lat.tobytes(), t0, t1, cpu1 - cpu0)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        # Leave the others waiting no longer.
        barrier.abort()


def _cpu_s(pid: int) -> float | None:
    """CPU time (user and system, every thread) process ``pid`` has used; None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class _Phase:
    lat: np.ndarray  # every call's latency, s
    ops_s: float  # calls per second over the phase
    client_cpu_us: float  # the client processes' CPU per call
    server_cpu_us: float | None  # the serving process's CPU per call


class _Clients:
    """``count`` spawned client processes, driven phase by phase."""

    def __init__(
        self, count: int, daemon_address: str, ping_addresses: dict[str, str], pages: int
    ) -> None:
        ctx = mp.get_context("spawn")
        self.count = count
        # The driving process is a party too: it reads the server's CPU time as calls start.
        self.barrier = ctx.Barrier(count + 1)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(child, self.barrier, daemon_address, ping_addresses, pages),
                name=f"kvtier-bench-rpc-{count}-{i}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def _recv(self, conn: Connection) -> Any:
        if not conn.poll(_TIMEOUT_S):
            raise TimeoutError(f"a client process sent nothing for {_TIMEOUT_S:.0f} s")
        kind, value = conn.recv()
        if kind == "error":
            raise RuntimeError(f"a client process failed:\n{value}")
        return value

    def wait_ready(self) -> None:
        for conn in self.conns:
            self._recv(conn)

    def phase(self, op: str, nops: int, warmup: int, server_pid: int) -> _Phase:
        """Latencies of every call, calls per second over the phase, and CPU per call of the
        clients and of the server (process ``server_pid``)."""
        for conn in self.conns:
            conn.send((op, nops, warmup))
        # A client that fails breaks the barrier; its error comes with its answer below.
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait(_TIMEOUT_S)
        server0 = _cpu_s(server_pid)
        results = [self._recv(conn) for conn in self.conns]
        server1 = _cpu_s(server_pid)
        lat = np.concatenate([np.frombuffer(r[0], dtype=np.float64) for r in results])
        span = max(r[2] for r in results) - min(r[1] for r in results)
        calls = len(lat)
        server = None if server0 is None or server1 is None else (server1 - server0) / calls
        return _Phase(
            lat,
            calls / span,
            sum(r[3] for r in results) / calls * 1e6,
            None if server is None else server * 1e6,
        )

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()


# ---------------------------------------------------------------------------- main


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    args = _parse(argv)
    counts: list[int] = args.client_counts
    per_round = sum(counts) * (args.ops + args.warmup)
    l1_bytes = args.rounds * per_round * BLOCK_BYTES + (128 << 20)
    lat: dict[tuple[int, str], list[np.ndarray]] = {(k, op): [] for k in counts for op in OPS}
    rate: dict[tuple[int, str], list[float]] = {(k, op): [] for k in counts for op in OPS}
    cpu: dict[tuple[int, str], list[tuple[float, float | None]]] = {
        (k, op): [] for k in counts for op in OPS
    }

    ctx = mp.get_context("spawn")
    with (
        scratch_dir(None, "kvtier-bench-rpc-") as work,
        bench_daemon(
            f"tiers.l1.capacity_bytes={l1_bytes}", f"server.event_loop={args.event_loop}"
        ) as daemon,
    ):
        servers: dict[str, Any] = {}
        addresses: dict[str, str] = {}
        pools: list[_Clients] = []
        try:
            for op, loop in PINGS.items():
                path = str(Path(work) / f"{op}.sock")
                ready = ctx.Event()
                servers[op] = ctx.Process(target=serve, args=(path, loop, ready.set), daemon=True)
                servers[op].start()
                if not ready.wait(120):
                    raise RuntimeError(f"the {op} server did not start")
                addresses[op] = unix_address(path)
            for k in counts:
                pools.append(_Clients(k, daemon.address, addresses, args.pages))
            for pool in pools:
                pool.wait_ready()
            for _ in range(args.rounds):
                for pool in pools:
                    for op in OPS:
                        pid = servers[op].pid if op in servers else daemon.proc.pid
                        assert pid is not None
                        got = pool.phase(op, args.ops, args.warmup, pid)
                        lat[pool.count, op].append(got.lat)
                        rate[pool.count, op].append(got.ops_s)
                        cpu[pool.count, op].append((got.client_cpu_us, got.server_cpu_us))
            # What the daemon says it ran on, not what it was asked to.
            announced = re.search(r"\((\w+)[^()]* event loop\)", daemon.log())
            if announced is None:
                raise RuntimeError(f"the daemon did not name its event loop:\n{daemon.log()}")
            daemon_loop = announced.group(1)
        finally:
            for pool in pools:
                pool.close()
            for server in servers.values():
                server.terminate()
                server.join(30)

    top = counts[-1]
    figures: dict[str, Any] = {
        "block_bytes": BLOCK_BYTES,
        "ops_per_client": args.ops,
        "rounds": args.rounds,
        "clients": counts,
        "ping_payload_bytes": PING_PAYLOAD,
        "targets": {"p50_vs_ping_max": 1.3, "ops_vs_ping_min": 0.7},
    }
    for k in counts:
        per_op: dict[str, Any] = {}
        for op in OPS:
            calls = np.concatenate(lat[k, op])
            server_cpu = [s for _, s in cpu[k, op] if s is not None]
            per_op[op] = {
                "p50_ms": sig(pct_ms(calls, 50)),
                "p99_ms": sig(pct_ms(calls, 99)),
                "ops_s": sig(median(rate[k, op])),
                "client_cpu_us": sig(median([c for c, _ in cpu[k, op]])),
                "server_cpu_us": sig(median(server_cpu)) if server_cpu else None,
            }
        figures[f"clients_{k}"] = per_op
    ratios: dict[str, float | None] = {}
    for base, name in (("ping", "ping"), ("ping_uv", "ping_uvloop")):
        for k in counts:
            ping = figures[f"clients_{k}"][base]
            for op in ("health", *DAEMON_OPS):
                suffix = "" if k == counts[0] else f"_{k}clients"
                ratios[f"{op}_p50_vs_{name}{suffix}"] = ratio(
                    figures[f"clients_{k}"][op]["p50_ms"], ping["p50_ms"]
                )
        ping_top = figures[f"clients_{top}"][base]["ops_s"]
        for op in ("health", *DAEMON_OPS):
            ratios[f"{op}_ops_vs_{name}"] = ratio(figures[f"clients_{top}"][op]["ops_s"], ping_top)
    figures["ratios"] = ratios
    figures["daemon_event_loop"] = daemon_loop

    print(
        f"single-block RPCs, {BLOCK_BYTES} B blocks: {args.ops} timed calls per client process "
        f"per phase, {args.rounds} rounds, client processes: {', '.join(map(str, counts))}; "
        f"the daemon on {daemon_loop}"
    )
    print(
        f"{'clients':>7}  {'rpc':<8}{'p50 ms':>8}{'p99 ms':>9}{'ops/s':>10}"
        f"{'p50/ping':>10}{'p50/uv':>8}{f'ops/ping({top})':>15}{f'ops/uv({top})':>13}"
        f"{'client us':>11}{'server us':>11}"
    )
    for k in counts:
        row = figures[f"clients_{k}"]
        for op in OPS:
            f = row[op]
            p50r = [ratio(f["p50_ms"], row[b]["p50_ms"]) for b in PINGS]
            opsr = [
                f"{ratio(f['ops_s'], figures[f'clients_{top}'][b]['ops_s']):.2f}"
                if k == top
                else ""
                for b in PINGS
            ]
            server_us = f["server_cpu_us"]
            print(
                f"{k:>7}  {op:<8}{f['p50_ms']:8.3f}{f['p99_ms']:9.3f}{f['ops_s']:10.0f}"
                f"{p50r[0]:10.2f}{p50r[1]:8.2f}{opsr[0]:>15}{opsr[1]:>13}"
                f"{f['client_cpu_us']:11.0f}{'-' if server_us is None else f'{server_us:.0f}':>11}"
            )
    print(
        "ping: a bare grpc.aio unary echo server on a Unix socket, on asyncio's event loop (the "
        "floor any unary call over this transport pays: the ratios' baseline); ping_uv (uv): the same on uvloop; health: the daemon's gRPC health "
        f"Check. Targets: p50 <= 1.3x ping, ops/s with {top} clients >= 0.7x ping's. "
        "client/server us: CPU per call of the client processes and of the serving process"
    )
    if emit is not None:
        emit(figures)
    return 0
