"""``kvtier bench instructions``: the daemon's instructions per single-block call, counted
with valgrind's callgrind.

The timings of ``kvtier bench rpc`` move 20-40% from run to run on a small shared host; the
number of instructions a call makes the daemon execute does not depend on what else runs, so
it shows a change of a few percent. It counts work, not time: cache misses, system calls'
time in the kernel and waits are not in it.

kvtierd runs under ``valgrind --tool=callgrind --instr-atstart=no`` (not instrumented until it
serves, so it starts in seconds), with 4 KiB blocks in L1 as in ``kvtier bench rpc``; then
``callgrind_control --instr=on`` starts counting. One client in this process makes one call at
a time, phase by phase, in this order:
- ``health``: the daemon's gRPC health Check (``Client.health``);
- ``put``: ``Client.put`` of one new key from one page of a registered shared-memory pool;
- ``get``: ``Client.get`` of one key stored by this repeat's put phase into one page;
- ``lookup``: ``Client.lookup`` of one such key.
Each phase makes ``--warmup`` calls, zeroes callgrind's counters, makes ``--calls`` calls and
dumps them: the dump's total (every thread of the daemon: the event loop, gRPC's threads, copy
threads), less the idle instructions of the span counted (below), over ``--calls``.
``ping``: the bare ``grpc.aio`` echo server of ``kvtier bench rpc`` (bench/ping.py), on the
daemon's event loop, under callgrind in the same way and called with the same 64-byte payload:
what any unary call over this transport costs a Python server.
``idle``: instructions a server executes per second with no call coming (the daemon's timers),
counted over ``--idle-s`` the way a phase is (zeroed, slept, dumped) and divided by that
span's wall seconds, each server's own. The span is two periods of the daemon's slowest timers
by default (``IDLE_S``): a span of one second held one of their checks or none, so the rate
came out about 370k or 800k a second on a 2-core host, and every phase's count, less it, moved
by the difference times its wall time (4k a call of 10 ms) with where the checks fell. A
phase's dump holds them too, for as long as it ran: under callgrind a call takes 10 to 40 ms
(``ms_per_call``), more on a busier host, so they made a call's count grow with the host's
load (a daemon idling at 640k a second adds 6.4k to a call of 10 ms, 13k to one of 20 ms).
Each phase's count is taken less the idle rate times its span's seconds; ``idle_per_call``
says how much that was, median over repeats.

Each repeat starts both servers afresh: the count per call of one process stays within about
1% from phase to phase, but another process of the same code may settle some 30k instructions
a call higher or lower (gRPC's and the interpreter's state; health and ping move alike), so
repeats within one process would agree on a figure that the next run does not. Figures are
medians over ``--repeats`` repeats (``per_repeat`` in the JSON lists each); ``spread`` is
(max - min) / median over them.
Ratios: each call's count over health's and over ping's. ``above_health``: a call's count less
health's in the same daemon process, median over repeats: the daemon's own work for the call
beyond a health Check's, free of the offset between processes.

Needs valgrind (with its callgrind_control); a host without it gets exit status 2 and what to
install.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvtier.bench import BenchUnavailable
from kvtier.bench.common import arg_parser, block_layout, median, ratio, scratch_dir, sig
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import bench_daemon, stop
from kvtier.bench.ping import PING_METHOD
from kvtier.bench.rpc import BLOCK_BYTES, PING_PAYLOAD
from kvtier.client import Client, SharedMemoryPool
from kvtier.daemon import connections, memtrim
from kvtier.daemon.config import ServerConfig
from kvtier.daemon.loops import EVENT_LOOPS
from kvtier.paths import unix_address

OPS = ("ping", "health", "put", "get", "lookup")
DAEMON_OPS = ("health", "put", "get", "lookup")
_PAGES = 64
# Under callgrind a Python process starts and answers tens of times slower than natively.
_START_TIMEOUT_S = 600.0
_CONTROL_TIMEOUT_S = 120.0

# The idle span's default: two periods of the daemon's slowest timers (the connections' check
# and the allocator's trim check), so that it holds as many of their checks as its length
# says, give or take one, rather than one or none.
IDLE_S = 2 * max(connections.CHECK_INTERVAL_S, memtrim.CHECK_INTERVAL_S)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = arg_parser("instructions", __doc__)
    p.add_argument("--calls", type=int, default=200, help="counted calls per phase (200)")
    p.add_argument("--warmup", type=int, default=20, help="uncounted calls before each (20)")
    p.add_argument("--repeats", type=int, default=5, help="repeats of every phase (5)")
    p.add_argument(
        "--idle-s",
        type=float,
        default=IDLE_S,
        help=f"seconds the idle daemon is counted ({IDLE_S:g}: two periods of its slowest timers)",
    )
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=ServerConfig.event_loop,
        help=f"the daemon's server.event_loop, and the ping server's ({ServerConfig.event_loop})",
    )
    args = p.parse_args(argv)
    if min(args.calls, args.repeats) < 1 or args.warmup < 0 or not args.idle_s > 0:
        p.error("counts must be at least 1 (--warmup at least 0, --idle-s above 0)")
    return args


def _tools() -> tuple[str, str]:
    """Paths of valgrind and callgrind_control; BenchUnavailable naming what is missing."""
    found = [shutil.which(name) for name in ("valgrind", "callgrind_control")]
    if None in found:
        raise BenchUnavailable(
            "kvtier bench instructions needs valgrind and its callgrind_control, which this "
            "host lacks (Debian: apt-get install valgrind)"
        )
    return found[0] or "", found[1] or ""


def _callgrind(valgrind: str, out_file: Path) -> list[str]:
    """The command line prefix that runs a process under callgrind, not counting until told."""
    return [
        valgrind,
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_file}",
    ]


class _Counter:
    """Counts the instructions of one process running under callgrind, phase by phase."""

    def __init__(self, control: str, pid: int, out_file: Path) -> None:
        self._control_path = control
        self._pid = pid
        self._out_file = out_file
        self._dumps = 0

    def _control(self, *args: str) -> None:
        done = subprocess.run(
            [self._control_path, *args, str(self._pid)],
            capture_output=True,
            text=True,
            timeout=_CONTROL_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"callgrind_control {' '.join(args)} {self._pid} failed "
                f"({done.returncode}): {done.stdout}{done.stderr}"
            )

    def start(self) -> None:
        self._control("--instr=on")

    def count(self, work: Callable[[], None]) -> tuple[int, float]:
        """Instructions the process executes while ``work`` runs, and the wall seconds of the
        span counted (from before the counters are zeroed until they are dumped)."""
        t0 = time.perf_counter()
        self._control("--zero")
        work()
        self._control("--dump")
        seconds = time.perf_counter() - t0
        # Callgrind numbers its dumps .1, .2, ... after the output file's name.
        self._dumps += 1
        path = Path(f"{self._out_file}.{self._dumps}")
        try:
            with path.open() as f:
                for line in f:
                    if line.startswith("summary:"):
                        return int(line.split()[1]), seconds
        finally:
            path.unlink(missing_ok=True)
        raise RuntimeError(f"callgrind's dump {path} has no summary line")

    def idle_rate(self, seconds: float) -> float:
        """Instructions per second the process executes with nothing asked of it, counted
        as ``count`` counts a phase."""
        n, spent = self.count(lambda: time.sleep(seconds))
        return n / spent


def less_idle(count: int, seconds: float, idle_per_s: float) -> float:
    """A phase's ``count`` (over ``seconds``) less what its process executes idle in that
    time: the timers' share grows with the phase's wall time, and so with the host's load."""
    return max(0.0, count - idle_per_s * seconds)


@contextlib.contextmanager
def _ping_server(valgrind: str, work: Path, loop: str) -> Iterator[tuple[int, str]]:
    """The ping server under callgrind, answering; yields its process id and address."""
    sock = work / "ping.sock"
    log_path = work / "ping.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                *_callgrind(valgrind, work / "ping.callgrind"),
                sys.executable,
                "-m",
                "kvtier.bench.ping",
                str(sock),
                loop,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the ping server did not start:\n{log_path.read_text()}")
            time.sleep(0.05)
        yield proc.pid, unix_address(str(sock))
    finally:
        stop(proc)


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    args = _parse(argv)
    valgrind, control = _tools()
    l1_bytes = (args.calls + args.warmup) * BLOCK_BYTES + (64 << 20)
    # Each phase's count less its idle instructions, per repeat.
    counts: dict[str, list[float]] = {op: [] for op in OPS}
    seconds: dict[str, list[float]] = {op: [] for op in OPS}
    idle_shares: dict[str, list[float]] = {op: [] for op in OPS}
    idle: list[float] = []
    ping_idle: list[float] = []

    def measure(
        counter: _Counter, ops: Sequence[str], calls: Sequence[Callable[[int], None]]
    ) -> float:
        """Each phase of one server: call ``call(i)`` for the warm-up's i, then count the
        calls of the i after them; then count the server idle, and file each phase's count
        less its idle share. Returns the idle rate."""
        spans = [phase(counter, op, call) for op, call in zip(ops, calls, strict=True)]
        rate = counter.idle_rate(args.idle_s)
        for op, (n, spent) in zip(ops, spans, strict=True):
            counts[op].append(less_idle(n, spent, rate))
            idle_shares[op].append(rate * spent)
        return rate

    def phase(counter: _Counter, op: str, call: Callable[[int], None]) -> tuple[int, float]:
        for i in range(args.warmup):
            call(i)

        def counted() -> None:
            t0 = time.perf_counter()
            for i in range(args.warmup, args.warmup + args.calls):
                call(i)
            seconds[op].append((time.perf_counter() - t0) / args.calls)

        return counter.count(counted)

    def repeat(work: Path) -> None:
        """One repeat: every phase, each server a fresh process."""
        with (
            _ping_server(valgrind, work, args.event_loop) as (ping_pid, ping_address),
            grpc.insecure_channel(ping_address) as channel,
        ):
            echo = channel.unary_unary(PING_METHOD)
            payload = os.urandom(PING_PAYLOAD)

            def ping(i: int) -> None:
                if len(echo(payload, timeout=60, wait_for_ready=True)) != PING_PAYLOAD:
                    raise RuntimeError("ping echoed a short reply")

            ping(0)
            pinger = _Counter(control, ping_pid, work / "ping.callgrind")
            pinger.start()
            ping_idle.append(measure(pinger, ("ping",), (ping,)))

        daemon_out = work / "daemon.callgrind"
        layout = block_layout(BLOCK_BYTES, _PAGES, num_layers=1)
        with (
            bench_daemon(
                f"tiers.l1.capacity_bytes={l1_bytes}",
                f"server.event_loop={args.event_loop}",
                wrapper=_callgrind(valgrind, daemon_out),
                start_timeout_s=_START_TIMEOUT_S,
            ) as daemon,
            Client(daemon.address, timeout_s=60) as client,
            SharedMemoryPool.for_layout(layout) as shm,
        ):
            shm.array()[:] = 1
            pool_id = client.register_pool(shm, layout).pool_id
            counter = _Counter(control, daemon.proc.pid, daemon_out)
            counter.start()
            # Put stores these keys; get and lookup then find them.
            keys = [os.urandom(32) for _ in range(args.warmup + args.calls)]

            def health(i: int) -> None:
                if not client.health():
                    raise RuntimeError("the daemon is not SERVING")

            def put(i: int) -> None:
                if client.put(pool_id, [keys[i]], [i % _PAGES]).stored != 1:
                    raise RuntimeError("put stored nothing")

            def get(i: int) -> None:
                if client.get(pool_id, [keys[i]], [i % _PAGES]).prefix_len != 1:
                    raise RuntimeError("get found nothing")

            def lookup(i: int) -> None:
                if client.lookup([keys[i]]).prefix_len != 1:
                    raise RuntimeError("lookup found nothing")

            idle.append(measure(counter, DAEMON_OPS, (health, put, get, lookup)))

    for _ in range(args.repeats):
        with scratch_dir(None, "kvtier-bench-instructions-") as work:
            repeat(work)

    per_call = {op: sig(median(counts[op]) / args.calls) for op in OPS}
    figures: dict[str, Any] = {
        "block_bytes": BLOCK_BYTES,
        "calls": args.calls,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "event_loop": args.event_loop,
        "instructions_per_call": per_call,
        "per_repeat": {op: [sig(n / args.calls) for n in counts[op]] for op in OPS},
        "above_health": {
            op: sig(
                median([n - h for n, h in zip(counts[op], counts["health"], strict=True)])
                / args.calls
            )
            for op in DAEMON_OPS
            if op != "health"
        },
        "spread": {op: sig((max(counts[op]) - min(counts[op])) / median(counts[op])) for op in OPS},
        "ms_per_call": {op: sig(median(seconds[op]) * 1e3) for op in OPS},
        "idle_instructions_per_s": sig(median(idle)),
        "ping_idle_instructions_per_s": sig(median(ping_idle)),
        "idle_per_call": {op: sig(median(idle_shares[op]) / args.calls) for op in OPS},
        "ratios": {
            **{
                f"{op}_vs_health": ratio(per_call[op], per_call["health"])
                for op in OPS
                if op != "health"
            },
            **{f"{op}_vs_ping": ratio(per_call[op], per_call["ping"]) for op in DAEMON_OPS},
        },
    }
    print(
        f"daemon instructions per single-block call (callgrind, {BLOCK_BYTES} B blocks, one "
        f"client, one call at a time, {args.event_loop}): {args.calls} counted calls per phase "
        f"after {args.warmup}, medians of {args.repeats} repeats, each with fresh servers"
    )
    print(
        f"{'rpc':<8}{'instr/call':>12}{'/health':>9}{'/ping':>7}{'above health':>14}"
        f"{'spread':>8}{'ms/call':>9}{'idle/call':>11}"
    )
    for op in OPS:
        r = figures["ratios"]
        vs_health = "1" if op == "health" else f"{r[f'{op}_vs_health']:.3f}"
        vs_ping = "1" if op == "ping" else f"{r[f'{op}_vs_ping']:.3f}"
        above = figures["above_health"].get(op)
        print(
            f"{op:<8}{per_call[op]:12,.0f}{vs_health:>9}{vs_ping:>7}"
            f"{'' if above is None else f'{above:,.0f}':>14}"
            f"{figures['spread'][op]:8.3f}{figures['ms_per_call'][op]:9.2f}"
            f"{figures['idle_per_call'][op]:11,.0f}"
        )
    print(
        f"idle daemon: {figures['idle_instructions_per_s']:,.0f} instructions/s (ping server: "
        f"{figures['ping_idle_instructions_per_s']:,.0f}), taken out of every count as idle/call "
        "(a phase's idle rate times its wall time, which grows with the host's load, per "
        "call). ping: a bare grpc.aio echo server "
        "under callgrind on the same event loop; above health: the call's count less health's "
        "in the same daemon process (median over repeats); spread: (max - min) / median over "
        "repeats"
    )
    if emit is not None:
        emit(figures)
    return 0
