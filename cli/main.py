"""``kvtier``: the admin CLI (a client of a running daemon) and the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvtier.bench import BENCHMARKS
from kvtier.client import Client, KvtierError
from kvtier.sim.cli import add_replay_parser, add_trace_parser


def _stats(args: argparse.Namespace) -> int:
    with Client(args.address, timeout_s=args.timeout) as client:
        stats = client.stats()
    if args.json:
        print(
            json.dumps(
                {
                    "version": stats.version,
                    "uptime_s": stats.uptime_s,
                    "tiers": [
                        {
                            "tier": t.tier.name,
                            "capacity_bytes": t.capacity_bytes,
                            "used_bytes": t.used_bytes,
                            "blocks": t.blocks,
                            "state": t.state,
                        }
                        for t in stats.tiers
                    ],
                    "counters": stats.counters,
                    "gauges": stats.gauges,
                }
            )
        )
        return 0
    print(f"kvtierd {stats.version}, up {stats.uptime_s:.0f}s")
    for t in stats.tiers:
        pct = 100.0 * t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        print(
            f"  {t.tier.name:<10} {t.used_bytes / 2**30:8.2f} / {t.capacity_bytes / 2**30:.2f} GiB "
            f"({pct:5.1f}%)  {t.blocks} blocks  {t.state}"
        )
    for name, value in sorted(stats.gauges.items()):
        print(f"  {name} = {value:g}")
    for name, value in sorted(stats.counters.items()):
        print(f"  {name} = {value}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvtier.bench import run_bench

    return run_bench(args.what, args.extra, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier", description="kvtier admin CLI")
    p.add_argument(
        "--address", help="daemon address (default: $KVTIER_ADDRESS or unix:var/kvtierd.sock)"
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "stats", aliases=["status"], help="tier usage and counters of a running daemon"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_stats)

    # No -h of its own: `kvtier bench NAME --help` is the benchmark's help.
    b = sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks (each starts its own daemon)",
        description="Run a benchmark; `kvtier bench NAME --help` lists its options.",
    )
    b.add_argument("what", choices=sorted(BENCHMARKS), help="which benchmark")
    b.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    b.set_defaults(func=_bench)

    add_replay_parser(sub)
    add_trace_parser(sub)

    # Options after the benchmark's name belong to the benchmark.
    args, extra = p.parse_known_args(argv)
    if extra and args.command != "bench":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`kvtier stats | head`): end quietly, as other tools do.
        # Not by resetting SIGPIPE: main() also runs inside other programs (tests).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KvtierError as e:
        print(f"kvtier: {type(e).__name__}: {e.details}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
