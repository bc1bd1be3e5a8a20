"""``kvtier replay`` and ``kvtier trace gen``: the simulator's commands, registered on the
admin CLI's subparsers by ``kvtier.cli.main``.

Errors in what the user gave (a bad trace, an unknown policy, a missing option) end the
command with exit status 2 and one line on stderr naming the problem, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from kvtier.daemon.policy.heat import DEFAULT_HALF_LIFE_S
from kvtier.daemon.policy.registry import policy_names
from kvtier.sim import COMMAND_HELP, tracegen
from kvtier.sim.cluster import (
    DAEMON_L3_ADMISSION,
    DAEMON_L3_TTL_S,
    MAX_NODES,
    ROUTE_DOCS,
    ROUTES,
    ClusterConfig,
    l3_admission_names,
)
from kvtier.sim.engine import WRITE_POLICIES, StackConfig, replay
from kvtier.sim.report import (
    SWEEP_PERCENTS,
    SWEEP_POLICIES,
    PlotUnavailable,
    describe_cluster,
    format_result,
    format_sweep,
    plot_run,
    plot_sweep,
    require_plotting,
    sweep,
)
from kvtier.sim.trace import DEFAULT_BLOCK_TOKENS, SEMANTICS, TraceError, load_trace, write_jsonl

DEFAULT_POLICY = "heat"


def add_replay_parser(subparsers: Any) -> None:
    """Register ``kvtier replay``."""
    p = subparsers.add_parser(
        "replay",
        help=COMMAND_HELP["replay"],
        description=(
            "Replay a trace (JSONL: timestamp ms, input_length, hash_ids) through the daemon's "
            "tier stack and eviction policies on the trace's clock, and report block hit "
            "ratios. No daemon is involved. With --json, stdout holds the JSON object alone "
            "and the text report goes to stderr."
        ),
    )
    p.add_argument("trace", help="trace file, one JSON object a line")
    p.add_argument(
        "--policy",
        choices=policy_names(),
        help=f"eviction policy (default {DEFAULT_POLICY}; --sweep takes --policies)",
    )
    p.add_argument("--l1-blocks", type=_count(1), help="L1 capacity in blocks (>= 1)")
    p.add_argument("--l2-blocks", type=_count(0), default=0, help="L2 capacity in blocks")
    p.add_argument("--admission", help="L1 admission rule (default: the policy's own)")
    p.add_argument("--l2-admission", help="L2 admission rule (default: the policy's own)")
    p.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        help="how blocks reach L2 (default write_back; needs --l2-blocks)",
    )
    p.add_argument(
        "--protect-s",
        type=_non_negative_float,
        default=0.0,
        help="protection period in seconds of trace time after a block's read or write (0)",
    )
    p.add_argument(
        "--queue-window",
        metavar="S",
        type=_non_negative_float,
        default=0.0,
        help="model an engine's waiting queue of S seconds: each request's blocks are "
        "hinted S seconds before it arrives, protected until it does (0: no hints)",
    )
    p.add_argument(
        "--l1-watermarks",
        metavar="HIGH,LOW",
        type=_watermarks,
        help="empty L1 down to LOW after a request leaves it above HIGH (fractions; the "
        "daemon's defaults are 0.95,0.90; default: evict only at a full tier)",
    )
    p.add_argument(
        "--semantics",
        choices=SEMANTICS,
        default="full",
        help="full: a request's partial last block is never stored nor counted, as in the "
        "daemon (default); all: every block counts (the replayer before the tier stack)",
    )
    p.add_argument(
        "--block-tokens",
        type=_count(1),
        default=DEFAULT_BLOCK_TOKENS,
        help=f"tokens per block of the trace (default {DEFAULT_BLOCK_TOKENS}, Mooncake's)",
    )
    p.add_argument(
        "--forget-dropped",
        action="store_true",
        help="policies forget a block that has no copy left once --history-factor times the "
        "blocks held were dropped after it, as the daemon does (default: never forget)",
    )
    p.add_argument(
        "--history-factor",
        type=_non_negative_float,
        help="with --forget-dropped: how much history of dropped blocks is kept, times the "
        "blocks held (default 2, the daemon's policy.history_factor; 0: none)",
    )
    p.add_argument(
        "--half-life",
        type=_positive_float,
        help=f"the heat policy's half-life in seconds (default {DEFAULT_HALF_LIFE_S:g}, the "
        "daemon's policy.half_life_s); refused where heat is not replayed",
    )
    c = p.add_argument_group(
        "cluster",
        "N nodes, each with the tiers above (--l1-blocks, --l2-blocks are per node), "
        "requests spread over them by a routing rule, and one shared L3",
    )
    c.add_argument(
        "--nodes",
        type=_count(1, MAX_NODES),
        default=1,
        help=f"number of nodes (1; at most {MAX_NODES})",
    )
    c.add_argument(
        "--route",
        choices=ROUTES,
        default="prefix",
        help="which node serves each request (default prefix): "
        + "; ".join(f"{name}: {doc}" for name, doc in ROUTE_DOCS.items()),
    )
    c.add_argument("--route-seed", type=_count(0), help="seed of --route random (0)")
    c.add_argument(
        "--l3-blocks",
        type=_count(0),
        default=0,
        help="capacity in blocks of the L3 the nodes share (Redis maxmemory, allkeys-lru); "
        "0: no L3 (default)",
    )
    c.add_argument(
        "--l3-ttl-s",
        type=_non_negative_float,
        help="an L3 entry expires this long after its last write, in seconds of trace time "
        f"(reads do not extend it; 0: never; default {DAEMON_L3_TTL_S:g}, the daemon's)",
    )
    c.add_argument(
        "--l3-admission",
        choices=l3_admission_names(),
        help="each node's rule for writing a block to L3 (default "
        f"{DAEMON_L3_ADMISSION}, the daemon's: a block the node saw twice)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="one tier at 1, 2, 5, 10, 20%% of the trace's unique blocks, for the policies "
        f"of --policies (default {','.join(SWEEP_POLICIES)}); with the cluster options, "
        "each node's L1 at those sizes, the cluster the same in every run",
    )
    p.add_argument("--policies", type=_policy_list, help="comma-separated policies of --sweep")
    p.add_argument(
        "--percents", type=_percent_list, help="comma-separated capacities of --sweep, in %%"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout, and nothing else there: the text report "
        "goes to stderr",
    )
    p.add_argument("--plot", metavar="PNG", help="draw the result (needs matplotlib)")
    p.set_defaults(func=_run_replay)


def add_trace_parser(subparsers: Any) -> None:
    """Register ``kvtier trace gen``."""
    p = subparsers.add_parser("trace", help=COMMAND_HELP["trace"])
    sub = p.add_subparsers(dest="trace_command", required=True)
    g = sub.add_parser(
        "gen",
        help="write a synthetic trace in the Mooncake format",
        description=(
            "Write a synthetic trace (conversations, shared system prompts, one-off "
            "requests) in the Mooncake format. A scenario names a mix; options override "
            "single parameters of it. Deterministic per seed."
        ),
        epilog="scenarios: "
        + "; ".join(f"{name}: {doc}" for name, doc in tracegen.SCENARIO_DOCS.items()),
    )
    g.add_argument("-o", "--output", required=True, help="file to write ('-' for stdout)")
    g.add_argument(
        "--scenario", default="chat", choices=sorted(tracegen.SCENARIOS), help="the mix (chat)"
    )
    g.add_argument("--seed", type=_count(0), default=0, help="random seed (0)")
    defaults = tracegen.SyntheticTraceConfig()
    for f in fields(tracegen.SyntheticTraceConfig):
        doc = tracegen.PARAMETER_DOCS[f.name]
        g.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=type(getattr(defaults, f.name)),
            metavar=f.name.split("_")[-1].upper(),
            help=f"{doc} (chat: {getattr(defaults, f.name)})",
        )
    g.set_defaults(func=_run_trace_gen)


def _run_replay(args: argparse.Namespace) -> int:
    try:
        return _replay_command(args)
    except (TraceError, ValueError, PlotUnavailable) as e:
        print(f"kvtier replay: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # the reader of stdout went away (`| head`): kvtier's main ends quietly
    except OSError as e:  # writing the report (stdout on a full device)
        print(f"kvtier replay: error: {e}", file=sys.stderr)
        return 1


def _replay_command(args: argparse.Namespace) -> int:
    if args.sweep:
        # Ignored, they would print one tier's figures as if they were what was asked for.
        for given, flag in (
            (args.l1_blocks is not None, "--l1-blocks"),
            (args.l2_blocks > 0, "--l2-blocks"),
            (args.admission is not None, "--admission"),
            (args.l2_admission is not None, "--l2-admission"),
            (args.policy is not None, "--policy"),
            (args.write_policy is not None, "--write-policy"),
        ):
            if given:
                raise ValueError(
                    f"{flag} does not apply to --sweep, which replays one tier at --percents "
                    "of the trace's unique blocks for each of --policies"
                )
    else:
        for given, flag in ((args.policies, "--policies"), (args.percents, "--percents")):
            if given is not None:
                raise ValueError(
                    f"{flag} needs --sweep; a single run replays --policy at --l1-blocks"
                )
        if args.l1_blocks is None:
            raise ValueError("--l1-blocks is required (or use --sweep)")
        if args.l2_admission is not None and not args.l2_blocks:
            # Without an L2 it was ignored unread, a misspelt rule included.
            raise ValueError("--l2-admission needs an L2: give --l2-blocks")
        if args.write_policy is not None and not args.l2_blocks:
            # How blocks reach L2: without one it was ignored unread.
            raise ValueError("--write-policy needs an L2: give --l2-blocks")
    replayed = (args.policies or SWEEP_POLICIES) if args.sweep else [args.policy or DEFAULT_POLICY]
    if args.half_life is not None and "heat" not in replayed:
        # Every other policy takes it and drops it unread: the run would be one without it.
        raise ValueError(
            f"--half-life is the heat policy's, and heat is not replayed here "
            f"({', '.join(replayed)}): replay heat, or leave it out"
        )
    if args.history_factor is not None and not args.forget_dropped:
        # Policies forget nothing without it, so the factor would go unread.
        raise ValueError("--history-factor needs --forget-dropped")
    params = {"half_life_s": args.half_life} if args.half_life else {}
    stack = StackConfig(
        write_policy=args.write_policy or StackConfig().write_policy,
        protect_s=args.protect_s,
        queue_window_s=args.queue_window,
        l1_watermarks=args.l1_watermarks,
        forget_dropped=args.forget_dropped,
        history_factor=(
            StackConfig().history_factor if args.history_factor is None else args.history_factor
        ),
    )
    cluster = _cluster(args)
    if args.plot:
        # Before the replay, which may take minutes: its figure would have nowhere to go.
        if args.plot.endswith(os.sep) or os.path.isdir(args.plot):
            # matplotlib would save "<folder>/.png", a hidden file nobody asked for.
            raise ValueError(f"--plot {args.plot}: is a folder; name the image file")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--plot {args.plot}: {folder} is not a folder this user can write")
        try:
            require_plotting(args.plot)  # matplotlib missing, or not writing that format
        except ValueError as e:
            raise ValueError(f"--plot {args.plot}: {e}") from None
    trace = load_trace(args.trace, args.block_tokens)
    cacheable = trace.cacheable(args.semantics)  # the same trace once more if nothing is dropped
    # Nothing to replay is an error, not a report of 0% hits (and a sweep's sizes, percents
    # of the trace's blocks, would divide by zero).
    if trace.requests == 0:
        raise ValueError(f"{trace.name}: the trace holds no requests")
    if trace.accesses == 0:
        raise ValueError(
            f"{trace.name}: no request has any hash_ids, so there is nothing to replay"
        )
    if cacheable.accesses == 0:
        raise ValueError(
            f"{trace.name}: no request holds a full block of {args.block_tokens} tokens, so "
            f"nothing is cacheable under --semantics {args.semantics} (the daemon stores full "
            "blocks only); is --block-tokens right? (--semantics all counts partial blocks)"
        )
    # With --json, stdout is the JSON object alone (a script parses it); the report goes
    # to stderr, where a person running the command still reads it.
    report = sys.stderr if args.json else sys.stdout
    print(
        f"{trace.name}: {trace.requests} requests over {_duration(trace.span_s)} "
        f"(timestamps read as ms), {cacheable.accesses} cacheable block accesses "
        f"({cacheable.unique_blocks} unique) of {trace.accesses} ({trace.unique_blocks} "
        f"unique); semantics {args.semantics}",
        file=report,
    )
    if args.sweep:
        percents = args.percents or SWEEP_PERCENTS
        results = sweep(
            trace,
            args.policies or SWEEP_POLICIES,
            percents,
            policy_params=params,
            semantics=args.semantics,
            stack=stack,
            cluster=cluster,
        )
        if not cluster.single:
            print(describe_cluster(cluster), file=report)
        print(format_sweep(results, trace.unique_blocks, percents), file=report)
        if args.plot:
            _saved(plot_sweep, results, trace, args.plot)
        if args.json:
            print(json.dumps({"sweep": [r.as_dict() for r in results]}))
        return 0
    result = replay(
        trace,
        args.policy or DEFAULT_POLICY,
        args.l1_blocks,
        args.l2_blocks,
        admission=args.admission,
        l2_admission=args.l2_admission,
        policy_params=params,
        semantics=args.semantics,
        stack=stack,
        cluster=cluster,
    )
    print(format_result(result), file=report)
    if args.plot:
        _saved(plot_run, result, trace, args.plot)
    if args.json:
        print(json.dumps(result.as_dict()))
    return 0


def _saved(plot: Callable[..., None], *args: Any) -> None:
    """``plot(*args)`` (its last argument: the path), a failed save an error naming it."""
    try:
        plot(*args)
    except OSError as e:  # after the check above: a full disk, a folder gone meanwhile
        raise ValueError(f"--plot {args[-1]}: {e}") from None


def _cluster(args: argparse.Namespace) -> ClusterConfig:
    if not args.l3_blocks:
        for given, flag in ((args.l3_ttl_s, "--l3-ttl-s"), (args.l3_admission, "--l3-admission")):
            if given is not None:
                raise ValueError(f"{flag} needs an L3: give --l3-blocks")
    if args.route_seed is not None and args.route != "random":
        # Only the random route draws: another seed would change nothing.
        raise ValueError("--route-seed needs --route random")
    return ClusterConfig(
        nodes=args.nodes,
        route=args.route,
        route_seed=args.route_seed or 0,
        l3_blocks=args.l3_blocks,
        l3_ttl_s=DAEMON_L3_TTL_S if args.l3_ttl_s is None else args.l3_ttl_s,
        l3_admission=args.l3_admission or DAEMON_L3_ADMISSION,
    )


def _run_trace_gen(args: argparse.Namespace) -> int:
    overrides = {
        f.name: getattr(args, f.name)
        for f in fields(tracegen.SyntheticTraceConfig)
        if getattr(args, f.name) is not None
    }
    try:
        requests = tracegen.scenario(args.scenario, args.seed, **overrides)
        if args.output == "-":
            for r in requests:
                sys.stdout.write(json.dumps(r, separators=(", ", ": ")) + "\n")
            return 0
        n = write_jsonl(args.output, requests)
    except BrokenPipeError:
        raise  # the reader of stdout went away (`| head`): kvtier's main ends quietly
    except (ValueError, OSError) as e:
        print(f"kvtier trace gen: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {n} requests ({args.scenario}, seed {args.seed})", file=sys.stderr)
    return 0


def _count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return value


def _watermarks(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected HIGH,LOW, got {text!r}")
    high, low = (_float(x) for x in parts)
    if not 0 <= low <= high <= 1:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH <= 1, got {text!r}")
    return high, low


def _policy_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = policy_names()
    for n in names:
        if n not in known:
            raise argparse.ArgumentTypeError(f"unknown policy {n!r}; one of {', '.join(known)}")
    if not names:
        raise argparse.ArgumentTypeError("expected at least one policy")
    return names


def _percent_list(text: str) -> list[float]:
    values = [_float(x) for x in text.split(",") if x.strip()]
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected percentages in (0, 100], got {text!r}")
    return values


def _duration(seconds: float) -> str:
    """A trace's span as a person reads it. Shown because a trace whose timestamps are in
    seconds replays as one a thousand times shorter (protect_s, queue windows and TTLs then
    span a thousand times more of it), which only the span gives away."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
