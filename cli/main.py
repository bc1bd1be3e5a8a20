"""``kvtier``: the admin CLI (a client of a running daemon) and the benchmarks.

Commands that talk to a daemon (``stats``, ``top``, ``health``) find it as every client does
(``--address``, else ``$KVTIER_ADDRESS``, else the default socket of ``kvtier.paths``) and,
when it cannot be reached, say which address they tried and how to change it. One that goes
away after answering (under ``top``, ``stats --interval``, ``drain --wait``) is told in one
line of the command's own; the client's session-end warning is not shown.

``kvtier health`` is meant for probes; its exit status says what it found:
0 serving with every tier ok (or serving, with tier states this user may not read, as one in
no tenant), 1 serving with a tier degraded or down (0 with ``--degraded-ok``), 2 the daemon
answers but is not serving (starting, stopping or draining), 3 unreachable. A draining daemon
is alive but not ready: ``--draining-ok`` counts it as serving (liveness checks, such as the
image's HEALTHCHECK), without it is 2 (readiness checks).

The admin commands need an admin session (root, the daemon's user, ``server.admin_uids``,
or an admin tenant's ``--token-file``): ``kvtier check`` exits 0 when every invariant holds,
1 with the list of what is broken (``--list``: with the keys and slots each names), 2 when the
daemon refused (it answered and did not check: not an admin, or it is stopping), 3 when it
cannot be reached, as ``health``; ``kvtier drain`` stops the daemon taking new sessions
(``--wait S``: until the open ones have ended, exit 1 if some remain; 0 if the daemon stops
meanwhile, which ends them all, so a rollout's next step may follow) and
``kvtier drain --resume`` takes them again; either exits 2 when the daemon refuses (it
answered and did not drain: not an admin, or it is stopping; or, during ``--wait``, it drains
but ended the command's session and opens it no new one, as after a reload that took its
admin right) and 3 when it cannot be reached, as ``health``.
``kvtier quarantine`` lists the slots L2 holds out of use after failed reads and, with
``--release``, gives them back first, each once a write and read back of its extent succeed:
exit 1 when slots are left for the next run (with no ``--slot``, slots no release has tried
yet; or slots it was to give back and left held, unchecked or not handed back, for a read in
flight or a free not done), 4 when a slot it was to give back failed that check (and none is
left for the next run), 2 when the
daemon refused (not an admin, no L2, L2 degraded by a fault other than a failed read, or
recovering, a slot it does not hold), 3 unreachable.
"""

from __future__ import annotations

import argparse
import dataclasses
import grp
import json
import logging
import math
import os
import stat
import sys
import time
from collections.abc import Callable

import grpc

from kvtier.client import (
    Client,
    DeadlineExceededError,
    KvtierError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from kvtier.client.credentials import SESSION_LOGGER
from kvtier.client.types import (
    MAX_CHECK_LIST,
    MAX_CHECK_SETTLE_S,
    DrainResult,
    Stats,
    address_hint,
    build_request,
    drain_result,
    resolve_address,
    unix_socket_path,
)
from kvtier.proto import kvtier_pb2 as pb
from kvtier.sim import COMMAND_HELP as SIM_COMMAND_HELP
from kvtier.tiers.sizes import counted

HEALTHY, DEGRADED, NOT_SERVING, UNREACHABLE = 0, 1, 2, 3
# Ended by Ctrl-C (SIGINT), as shells report a command that SIGINT ended.
INTERRUPTED = 130
# kvtier check: 0 every invariant holds, 1 some broken, 2 refused (the daemon answered and
# did not check: not an admin, or stopping), 3 (health's UNREACHABLE) no answer.
CHECK_REFUSED = 2
# kvtier drain: 0 draining (with --wait: drained, or the daemon stopped), 1 sessions still
# open after --wait, 2 refused (the daemon answered and did not drain, as check's 2; or,
# during --wait, it drains but ended this command's session and opens it no new one: a
# reload took its admin right), 3 (health's UNREACHABLE) no answer: no daemon at the
# address, or none in --timeout.
DRAIN_BUSY, DRAIN_REFUSED = 1, 2
# kvtier quarantine: 0 listed (with --release: every slot asked is back in use), 1 a --release
# left slots for the next run (naming none, slots no release has tried yet; or slots it left
# held for a read in flight or a free not done: run it again), 4 a slot --release was to give
# back failed its check and stays quarantined (none left for the next run), 2 refused (the daemon
# answered and did nothing: not an admin, no L2, L2 degraded by a fault other than a failed
# read or still reading its index, a slot it does not hold, or stopping), 3 (health's
# UNREACHABLE) no answer.
QUARANTINE_AGAIN, QUARANTINE_REFUSED, QUARANTINE_KEPT = 1, 2, 4


# The most seconds any option takes (a week). Values past about 1e9 s overflow the sleeps,
# socket timeouts and gRPC deadlines they become: `--timeout 1e10` was "cannot reach kvtierd:
# Deadline Exceeded" (or an OverflowError traceback), `stats --interval 1e10` a traceback.
MAX_SECONDS = 7 * 86400
# kvtier check --list: how many blocks and slots of each broken invariant it lists without a
# number (at most MAX_CHECK_LIST, the daemon's own bound).
CHECK_LIST_DEFAULT = 32


def _seconds(*, zero: bool, most: float = MAX_SECONDS) -> Callable[[str], float]:
    """An argparse type for a number of seconds: finite, not negative, and above 0 unless
    ``zero`` (a NaN or negative timeout would reach the client as "cannot reach"), at most
    ``most`` (a bound of the daemon's, such as a Check's longest settle, is refused as
    ``check --list``'s is, not cut short unsaid)."""
    least = "a non-negative" if zero else "a positive"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero) or value > most:
            raise argparse.ArgumentTypeError(
                f"expected {least} number of seconds up to {most:g}, got {text!r}"
            )
        return value

    return parse


def _list_limit(text: str) -> int:
    """An argparse type for ``check --list N``: 1 to ``MAX_CHECK_LIST``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_CHECK_LIST:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from 1 to {MAX_CHECK_LIST}, got {text!r}"
        )
    return value


def _readable_file(text: str) -> str:
    """An argparse type for a file the client reads later (``--token-file``): one it cannot
    open is a usage error naming it, not a traceback from the client's constructor."""
    try:
        with open(text, "rb"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {e.strerror}") from None
    return text


def _client(args: argparse.Namespace) -> Client:
    return Client(
        args.address,
        timeout_s=args.timeout,
        client_name="kvtier-cli",
        token_file=args.token_file,
    )


def _probe_client(args: argparse.Namespace) -> Client | None:
    """``_client`` for the commands whose exit status tells an unreachable daemon apart
    (health, check, drain): None, said on stderr, for an address no daemon can have."""
    try:
        return _client(args)
    except KvtierError as e:
        print(f"kvtier: {e.details}", file=sys.stderr)
        return None


def _reached(error: KvtierError) -> bool:
    """Whether the daemon was reached and turned the call away: it said why (draining,
    stopping), or its gRPC server took the call and ended it unanswered (stopping, or too
    busy)."""
    answered = isinstance(error, UnavailableError) and error.answered
    return answered or error.code == grpc.StatusCode.CANCELLED


def _kept_out(args: argparse.Namespace, error: KvtierError) -> bool:
    """Whether ``error`` is the socket's refusal of this user, not the daemon's: a session
    opens through the credential socket, whose refusal the client raises as
    PermissionDeniedError, so that ``stats`` or ``check`` said the daemon turned them away
    where ``health`` (no session) said it could not be reached. Where the socket (or its
    folder) keeps this user out, no error can have come from the daemon."""
    return isinstance(error, PermissionDeniedError) and (
        _socket_refusal(resolve_address(args.address)) is not None
    )


def _unreachable(args: argparse.Namespace, error: KvtierError) -> str:
    address = resolve_address(args.address)
    if _reached(error):
        return f"kvtier: kvtierd at {address} is unavailable: {error.details}"
    hint = (
        _socket_refusal(address)
        or _no_answer(args, error)
        or (
            "Is the daemon running? Start it with `kvtierd` (or `make run`); point kvtier at "
            "another one with --address unix:/path/to.sock or KVTIER_ADDRESS."
        )
    )
    return (
        f"kvtier: cannot reach kvtierd at {address} ({address_hint(args.address)}): "
        f"{error.details}\n  {hint}"
    )


def _no_answer(args: argparse.Namespace, error: KvtierError) -> str | None:
    """What a call that ran out of time tells: something took the connection (a daemon's
    socket accepts it in the kernel even while the daemon is stopped or its event loop is
    blocked) and gave no answer. Advice to start a daemon would send the operator to start a
    second one beside the one that hangs. None for any other error."""
    if not isinstance(error, DeadlineExceededError):
        return None
    return (
        f"Something there took the connection but gave no answer within --timeout "
        f"{args.timeout:g}s: the daemon may be stopped (SIGSTOP: state T in `ps -o stat`), "
        "stuck or overloaded (its log says which); over TCP, the host may drop the "
        "connection. A longer --timeout waits for a slow one."
    )


def _socket_refusal(address: str) -> str | None:
    """Why this user may not connect to the Unix socket of ``address``, where that keeps it
    from the daemon (a socket whose mode and group leave this user out, or a folder it may
    not enter): gRPC says only "Permission denied", and a daemon runs there. None otherwise."""
    if (path := unix_socket_path(address)) is None:
        return None
    try:
        st = os.stat(path)
    except PermissionError:
        return (
            f"this user may not enter the folder of {path}: the daemon's socket folder lets "
            "through those its sockets admit (server.socket_mode and server.socket_group)"
        )
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or os.access(path, os.W_OK):
        return None
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return (
        f"{path} is there, but its mode ({stat.S_IMODE(st.st_mode):04o}) and group ({group}) "
        "do not let this user connect: the daemon's server.socket_mode and "
        "server.socket_group say who may (join that group, or ask for the daemon's "
        "socket_group to be one of yours)"
    )


def _stats(args: argparse.Namespace) -> int:
    from kvtier.cli.figures import (
        NOT_TRACKED,
        WITHHELD,
        derive,
        human_bytes,
        human_seconds,
        is_histogram,
        percent,
    )

    with _client(args) as client:
        before, taken = None, 0.0
        if args.interval > 0:
            before = client.stats()
            taken = time.monotonic()
            time.sleep(args.interval)
            try:
                stats = client.stats()
            except (UnavailableError, DeadlineExceededError) as e:
                print(_went_away(client.address, "stats", e), file=sys.stderr)
                return 1
        else:
            stats = client.stats()
        elapsed = time.monotonic() - taken
        address = client.address
    fig = derive(stats, before, elapsed)
    if args.json:
        print(
            json.dumps(
                {
                    "version": stats.version,
                    "address": address,
                    "addresses": stats.addresses,
                    "metrics_url": stats.metrics_url,
                    "uptime_s": stats.uptime_s,
                    "tiers": [
                        {
                            "tier": t.tier.label,
                            "capacity_bytes": t.capacity_bytes,
                            "used_bytes": t.used_bytes,
                            "blocks": t.blocks,
                            "state": t.state,
                        }
                        for t in stats.tiers
                    ],
                    "tenants": [
                        {
                            "tenant": x.tenant,
                            "sessions": x.sessions,
                            # By label, as the tiers above: asdict gave the enum's number.
                            "tiers": [
                                {**dataclasses.asdict(u), "tier": u.tier.label} for u in x.tiers
                            ],
                        }
                        for x in stats.tenants
                    ],
                    "derived": _finite(dataclasses.asdict(fig)),
                    "counters": stats.counters,
                    "gauges": stats.gauges,
                }
            )
        )
        return 0
    if fig.restarted:
        span = f"since it restarted during the interval, {fig.window_s:.1f} s ago"
    else:
        span = f"over the last {fig.window_s:.1f} s" if before else "since start"
    print(f"kvtierd {stats.version} at {address}, up {stats.uptime_s:.0f}s")
    if where := _listening(stats):
        print(where)
    print("tiers:")
    for t in fig.tiers:
        if t.capacity_bytes:
            size = (
                f"{human_bytes(t.used_bytes):>10} / {human_bytes(t.capacity_bytes)} "
                f"({100.0 * t.used_bytes / t.capacity_bytes:5.1f}%)"
            )
        else:
            size = NOT_TRACKED
        print(
            f"  {t.name:<10} {size}  {counted(t.blocks, 'block')}  hits {percent(t.hit_ratio):>6}  "
            f"{t.state}"
        )
    misses = ", ".join(f"{k} {v}" for k, v in sorted(fig.misses.items()) if v) or "none"
    if fig.withheld:
        print(f"lookups, rates and latency: {WITHHELD} (this tenant's usage: below)")
    else:
        print(
            f"lookups {span}: {counted(fig.lookups, 'key')}, hit ratio {percent(fig.hit_ratio)} "
            f"(lifetime {percent(fig.lifetime_hit_ratio)}); misses: {misses}"
        )
        moved = "".join(f", {d} {human_bytes(r)}/s" for d, r in fig.moved_bytes_per_s.items() if r)
        print(
            f"rates {span}: put {human_bytes(fig.put_bytes_per_s)}/s, get "
            f"{human_bytes(fig.get_bytes_per_s)}/s, lookups {fig.lookups_per_s:.1f} keys/s{moved}"
        )
    if fig.latency:
        print(f"latency {span}:")
        w = max(16, *(len(row.method) for row in fig.latency))
        print(f"  {'method':<{w}} {'calls':>8} {'errors':>7} {'mean':>10} {'p50':>10} {'p99':>10}")
        for row in fig.latency:
            print(
                f"  {row.method:<{w}} {row.calls:>8} {row.errors:>7} "
                f"{human_seconds(row.mean_s):>10} {human_seconds(row.p50_s):>10} "
                f"{human_seconds(row.p99_s):>10}"
            )
    if stats.tenants:
        print("tenants:")
        for tenant in stats.tenants:
            usage = "  ".join(
                f"{u.tier.label} {human_bytes(u.used_bytes)}"
                + (f"/{human_bytes(u.quota_bytes)}" if u.quota_bytes else "")
                + f" ({counted(u.blocks, 'block')})"
                for u in tenant.tiers
            )
            sessions = counted(tenant.sessions, "session", spec=">4")
            print(f"  {tenant.tenant:<16} {sessions:<13}  {usage}")  # as wide as "   2 sessions"
    print("gauges:")
    for name, value in sorted(stats.gauges.items()):
        print(f"  {name} = {value:g}")
    print("counters:")
    for name, value in sorted(stats.counters.items()):
        if not is_histogram(name):
            print(f"  {name} = {value}")
    return 0


def _listening(stats: Stats) -> str:
    """Where the daemon listens, as it bound them (the port it took for a port 0), and its
    metrics endpoint; '' from a daemon that does not say."""
    if not stats.addresses:
        return ""
    metrics = f" (metrics: {stats.metrics_url})" if stats.metrics_url else ""
    return f"listening on {', '.join(stats.addresses)}{metrics}"


def _finite(obj: object) -> object:
    """NaN (a ratio of nothing) as null, so the JSON is standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _top(args: argparse.Namespace) -> int:
    from kvtier.cli.top import run

    with _client(args) as client:
        client.stats()  # fail fast, with the address, before the screen is taken
        try:
            return run(client, args.interval, once=args.once)
        except (UnavailableError, DeadlineExceededError) as e:
            print(_went_away(client.address, "top", e), file=sys.stderr)
            return 1


def _went_away(address: str, command: str, error: KvtierError) -> str:
    """The one line for a daemon that answered this command and then stopped answering (it
    stopped, or can no longer be reached): not the unreachable message's advice to start
    one."""
    return f"kvtier {command}: kvtierd at {address} went away (stopped or unreachable): " + (
        error.details
    )


def _health(args: argparse.Namespace) -> int:
    from kvtier.cli.figures import tier_ok

    client = _probe_client(args)
    if client is None:
        return UNREACHABLE
    try:
        try:
            serving = client.health()
        except (UnavailableError, DeadlineExceededError) as e:
            print(_unreachable(args, e), file=sys.stderr)
            return UNREACHABLE
        if not serving and not args.draining_ok:
            # Whether it drains or stops makes no difference here: asking (a session that a
            # drain refuses, counted and logged by the daemon) would be for nothing.
            print(_not_serving(client.address))
            return NOT_SERVING
        try:
            stats = client.stats()
        except (UnavailableError, DeadlineExceededError) as e:
            # Not serving, or serving a moment ago: it drains (it turned this new session
            # away, saying so), it stops (it said so, or its server ended the call), or it
            # went away.
            if isinstance(e, UnavailableError) and e.draining:
                return _draining(args, client.address, "it opens this user no session")
            if isinstance(e, UnavailableError) and _reached(e):
                print(f"not serving: kvtierd at {client.address}: {e.details}")
                return NOT_SERVING
            if not serving:
                print(_not_serving(client.address))
                return NOT_SERVING
            print(_unreachable(args, e), file=sys.stderr)
            return UNREACHABLE
        except (PermissionDeniedError, UnauthenticatedError, ResourceExhaustedError) as e:
            # It serves, but opens this user no session (in no tenant, at its tenant's
            # session limit): its tiers' states are not this probe's to read, and 1 would
            # say that a tier is degraded.
            if not serving:
                print(_not_serving(client.address))
                return NOT_SERVING
            print(
                f"ok: kvtierd at {client.address} serving; its tiers' states unread: "
                f"{type(e).__name__}: {e.details}"
            )
            return HEALTHY
    finally:
        client.close()
    bad = [t for t in stats.tiers if not tier_ok(t.state)]
    tiers = ", ".join(f"{t.tier.label} {t.state}" for t in stats.tiers)
    # Before the tiers, which end the line as they end /readyz's.
    where = f", {listening}" if (listening := _listening(stats)) else ""
    if not serving:
        # Not serving, yet it opened a session: a draining daemon opens admins' (a stopping
        # one opens none, and ends every call with UNAVAILABLE).
        code = _draining(args, client.address, tiers)
        return DEGRADED if code == HEALTHY and bad and not args.degraded_ok else code
    if bad:
        print(f"degraded: kvtierd {stats.version} at {client.address} serving{where}; {tiers}")
        return HEALTHY if args.degraded_ok else DEGRADED
    print(f"ok: kvtierd {stats.version} at {client.address} serving{where}; {tiers}")
    return HEALTHY


def _not_serving(address: str) -> str:
    return f"not serving: kvtierd at {address} is starting, stopping or draining"


def _draining(args: argparse.Namespace, address: str, detail: str) -> int:
    """The exit status for a daemon that drains: alive (0) with ``--draining-ok``, for
    liveness checks, else not serving (2), for readiness checks."""
    if args.draining_ok:
        print(f"alive: kvtierd at {address} draining (takes no new sessions); {detail}")
        return HEALTHY
    print(f"not serving: kvtierd at {address} draining (takes no new sessions); {detail}")
    return NOT_SERVING


def _admin(
    args: argparse.Namespace, command: str, refused: int, run: Callable[[Client], int]
) -> int:
    """An admin command's exit status: ``run``'s with a client of the daemon, ``refused``
    when the daemon answered with an error (or is stopping), ``UNREACHABLE`` when it could
    not be reached."""
    client = _probe_client(args)
    if client is None:
        return UNREACHABLE
    try:
        with client:
            return run(client)
    except (UnavailableError, DeadlineExceededError) as e:
        print(_unreachable(args, e), file=sys.stderr)
        return refused if _reached(e) else UNREACHABLE
    except KvtierError as e:
        if _kept_out(args, e):
            print(_unreachable(args, e), file=sys.stderr)
            return UNREACHABLE
        print(f"kvtier {command}: {type(e).__name__}: {e.details}", file=sys.stderr)
        return refused


def _check(args: argparse.Namespace) -> int:
    return _admin(args, "check", CHECK_REFUSED, lambda client: _check_with(args, client))


def _check_with(args: argparse.Namespace, client: Client) -> int:
    result = client.check(settle_s=args.settle, list_limit=args.list)
    address = client.address
    if args.json:
        report = dataclasses.asdict(result)
        for detail in report["details"]:
            detail["keys"] = [key.hex() for key in detail["keys"]]
        print(json.dumps(report))
    else:
        counts = zip(
            (result.blocks, result.sessions, result.leases, result.pools),
            ("block", "session", "lease", "pool"),
            strict=True,
        )
        what = ", ".join(counted(n, noun) for n, noun in counts)
        if not result.strict:
            what += "; transfers were in flight"
        if result.ok:
            print(f"ok: kvtierd at {address}: every invariant holds ({what})")
        else:
            problems = counted(len(result.problems), "problem")
            print(f"broken: kvtierd at {address}: {problems} ({what})")
            details = {d.problem: d for d in result.details}
            for i, problem in enumerate(result.problems):
                print(f"  {problem}")
                if (detail := details.get(i)) is not None:
                    _print_listed("key", [key.hex() for key in detail.keys], detail.keys_total)
                    _print_listed("slot", [str(slot) for slot in detail.slots], detail.slots_total)
    return 0 if result.ok else 1


def _print_listed(what: str, listed: list[str], total: int) -> None:
    """The blocks' keys or the slots a problem names, one a line under it, then how many
    more it names than ``--list`` asked for."""
    for item in listed:
        print(f"    {what} {item}")
    if total > len(listed):
        print(f"    ... and {counted(total - len(listed), f'more {what}')}")


def _quarantine(args: argparse.Namespace) -> int:
    if args.slot and not args.release:
        print("kvtier quarantine: --slot names what --release gives back", file=sys.stderr)
        return QUARANTINE_REFUSED
    return _admin(
        args, "quarantine", QUARANTINE_REFUSED, lambda client: _quarantine_with(args, client)
    )


def _quarantine_with(args: argparse.Namespace, client: Client) -> int:
    from kvtier.cli.figures import human_bytes

    result = client.quarantine(release=args.release, slots=args.slot or ())
    address = client.address
    # A release's failures are the slots it was to give back that it neither gave back nor
    # left for a later release (``deferred``: a read in flight, a free not done); each slot
    # named was held, or the daemon refused them all, and the list may not reach them. One
    # naming none tries at most server.max_batch_blocks: of the slots it left, those no
    # release tried (the deferred among them) are the next run's, and once none is left
    # another run would only try the failed ones again.
    deferred = len(result.deferred)
    kept = untried = 0
    if args.release and args.slot:
        kept = len(set(args.slot) - set(result.released) - set(result.deferred))
    elif args.release:
        untried = max(result.untried_count - deferred, 0)
        kept = result.held_count - result.untried_count
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    else:
        if args.release:
            said = [
                f"released: {len(result.released)} slot(s) back in use at kvtierd at {address}",
                f"{kept} failed their check and stay quarantined",
            ]
            if deferred:
                said.append(
                    f"{deferred} left held for a later release (a read of it was in flight, or "
                    "its free was not done yet)"
                )
            if untried:
                said.append(f"{untried} not tried yet (at most server.max_batch_blocks a call)")
            again = ": run it again for the rest" if deferred or untried else ""
            print("; ".join(said) + again)
        print(
            f"L2 of kvtierd at {address}: {result.held_count} slot(s) quarantined "
            f"({human_bytes(result.held_bytes)})"
        )
        for q in result.held:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(q.at)) if q.at else "-"
            print(
                f"  slot {q.slot:<8} {human_bytes(q.slot_bytes):>10}  {q.file}+{q.offset}  "
                f"{when}  {q.reason}"
            )
        if len(result.held) < result.held_count:
            print(
                f"  ... {result.held_count - len(result.held)} more not listed (one reply "
                "holds the first that fit in the daemon's server.max_message_bytes)"
            )
    if untried or deferred:
        return QUARANTINE_AGAIN
    return QUARANTINE_KEPT if kept else 0


def _drain(args: argparse.Namespace) -> int:
    if args.resume and args.wait > 0:
        print(
            "kvtier drain: --wait waits for a drain's sessions to end; --resume ends it",
            file=sys.stderr,
        )
        return DRAIN_REFUSED
    return _admin(args, "drain", DRAIN_REFUSED, lambda client: _drain_with(args, client))


def _drain_with(args: argparse.Namespace, client: Client) -> int:
    """``kvtier drain`` once the client is made; a call the daemon refuses or cannot be
    reached for raises (``_admin`` gives its exit status)."""
    # The session the drain is asked in, and the polls after it: read again later, the
    # property would open another one if the daemon had stopped meanwhile.
    session = client.session_id
    asked = time.monotonic()  # the daemon that answers started before this
    state = client.drain(resume=args.resume)
    if args.resume:
        print(f"resumed: kvtierd at {client.address} takes new sessions again")
        return 0
    print(
        f"draining: kvtierd at {client.address} takes no new sessions (but admins'); "
        f"{counted(state.sessions, 'other session')} open"
    )
    if args.wait <= 0:
        return 0
    deadline = time.monotonic() + args.wait
    while state.sessions and time.monotonic() < deadline:
        try:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            print(
                f"interrupted: kvtierd at {client.address} is still draining "
                "(`kvtier drain --resume` takes new sessions again)",
                file=sys.stderr,
            )
            return INTERRUPTED
        try:
            state = _drain_state(client, session)
        except UnavailableError as e:
            # It answered a moment ago: it is stopping (SIGTERM ends every session
            # first) or gone, and no session is open on it either way.
            print(f"stopped: kvtierd at {client.address} went away while draining ({e.details})")
            return 0
        except NotFoundError as e:
            if not e.session_gone:
                raise
            # The session that drained is gone: the daemon restarted, or a reload of its
            # tenants ended the session. Only the daemon that was drained is drained again;
            # one that started after it answered is another.
            try:
                restarted = _started_at(client) > asked
            except UnavailableError as gone:
                if gone.draining:
                    # It runs, and drains, but no longer opens this user a session (a
                    # reload took its admin right).
                    print(
                        f"kvtier: kvtierd at {client.address} ended this command's "
                        f"session and, draining, opens it no new one: {gone.details}",
                        file=sys.stderr,
                    )
                    return DRAIN_REFUSED
                print(
                    f"stopped: kvtierd at {client.address} went away while draining "
                    f"({gone.details})"
                )
                return 0
            if restarted:
                print(
                    f"stopped: kvtierd at {client.address} restarted while draining; the "
                    "daemon serving there now was not drained"
                )
                return 0
            session = client.session_id  # the one _started_at opened
            state = _drain_state(client, session)
    if state.sessions:
        print(f"{counted(state.sessions, 'session')} still open after {args.wait:g}s")
        return DRAIN_BUSY
    print("drained: no other session is open")
    return 0


def _started_at(client: Client) -> float:
    """When the daemon at the client's address started, on this host's monotonic clock (a
    little later: its answer's way back counts as uptime it did not have)."""
    return time.monotonic() - client.stats().uptime_s


def _drain_state(client: Client, session_id: str) -> DrainResult:
    """Drain again and return the state, asked in the session ``session_id`` only:
    ``Client.drain`` sends a call whose session is gone again in a new one, which drains
    whatever daemon now serves the address."""
    request = build_request(pb.DrainRequest, session_id=session_id)
    try:
        return drain_result(client.call("Drain", request, client.timeout_s))
    except grpc.RpcError as e:
        raise client.error_of(e) from None


def _bench(args: argparse.Namespace) -> int:
    from kvtier.bench import run_bench

    if args.what is None:
        if {"-h", "--help"} & set(args.extra):
            args.parser.print_help()
            return 0
        args.parser.error("name a benchmark")
    return run_bench(args.what, args.extra, as_json=args.json)


def _parser(simulator: bool) -> argparse.ArgumentParser:
    """The CLI's parser; the simulator's commands (``kvtier.sim.cli``) registered with their
    options where ``simulator``, else by name and help line alone (each a parser that takes
    any arguments): ``main`` builds that one first, and this one again for those commands."""
    from kvtier.bench import BENCHMARKS
    from kvtier.bench.jsonout import JSON_HELP

    p = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier admin CLI: inspect a running kvtierd, replay traces, run benchmarks.",
    )
    p.add_argument(
        "--address",
        help="daemon address, e.g. unix:/run/kvtier/kvtierd.sock (default: $KVTIER_ADDRESS, "
        "else the default socket: /run/kvtier/kvtierd.sock for a system service, "
        "$XDG_RUNTIME_DIR/kvtier/kvtierd.sock for a user's daemon)",
    )
    p.add_argument(
        "--timeout", type=_seconds(zero=False), default=10.0, help="seconds per call (default 10)"
    )
    p.add_argument(
        "--token-file",
        type=_readable_file,
        metavar="FILE",
        help="a tenant's token file, to act as that tenant (needed over TCP; an admin "
        "tenant's for the admin commands when this user is not an admin)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "stats",
        aliases=["status"],
        help="tier usage, hit ratios, rates, latency and counters of a running daemon",
        description="Tier usage, hit ratios, transfer rates, RPC latency and every counter. "
        "Without --interval, ratios and rates cover the daemon's lifetime.",
    )
    s.add_argument("--json", action="store_true", help="one JSON object (raw and derived)")
    s.add_argument(
        "--interval",
        type=_seconds(zero=True),
        default=0.0,
        metavar="S",
        help="measure ratios, rates and latency over S seconds instead of since start",
    )
    s.set_defaults(func=_stats)

    t = sub.add_parser(
        "top",
        help="live view of a running daemon, refreshed every second",
        description="Tiers, hit ratios, transfer rates and RPC latency, refreshed every "
        "interval. Ctrl-C quits.",
    )
    t.add_argument(
        "--interval", type=_seconds(zero=False), default=1.0, metavar="S", help="refresh (1 s)"
    )
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.set_defaults(func=_top)

    h = sub.add_parser(
        "health",
        help="probe a running daemon; the exit status says what it found",
        description="Exit status: 0 serving and every tier ok (or serving, with tier states "
        "this user may not read: no session for it); 1 serving with a tier degraded or down; 2 "
        "answering but not serving (starting, stopping or draining; draining counts as "
        "serving with --draining-ok); 3 unreachable.",
    )
    h.add_argument(
        "--degraded-ok",
        action="store_true",
        help="exit 0 while serving even with a tier degraded (for liveness/readiness probes)",
    )
    h.add_argument(
        "--draining-ok",
        action="store_true",
        help="count a draining daemon as alive: 0 (1 with a tier degraded, unless "
        "--degraded-ok) instead of 2; for liveness checks (Docker's HEALTHCHECK), not "
        "readiness ones: a draining daemon takes no new sessions",
    )
    h.set_defaults(func=_health)

    c = sub.add_parser(
        "check",
        help="check a running daemon's invariants (admin)",
        description="The daemon's invariant check: every slot owned by one block and "
        "allocated, allocators consistent, policies and index agree with the copies, "
        "per-tenant usage adds up, pins match live leases, every lease and pool has an open "
        "session. Exit status: 0 all hold, 1 some broken (listed), 2 the daemon refused (it "
        "answered and did not check: not an admin, or it is stopping), 3 unreachable (no "
        "daemon at the address, or no answer in --timeout), as health's 3.",
    )
    c.add_argument(
        "--settle",
        type=_seconds(zero=True, most=MAX_CHECK_SETTLE_S),
        default=1.0,
        metavar="S",
        help=f"wait up to S seconds (at most {MAX_CHECK_SETTLE_S:g}) for transfers in flight "
        "before the last steps (default 1)",
    )
    c.add_argument(
        "--list",
        type=_list_limit,
        nargs="?",
        const=CHECK_LIST_DEFAULT,
        default=0,
        metavar="N",
        help="under each broken invariant that names blocks or slots, list the first N "
        f"(default {CHECK_LIST_DEFAULT}, at most {MAX_CHECK_LIST}) of each: the blocks' keys in "
        "hex and the slots of the tier it names, then how many more",
    )
    c.add_argument("--json", action="store_true", help="one JSON object")
    c.set_defaults(func=_check)

    d = sub.add_parser(
        "drain",
        help="stop a daemon taking new sessions, e.g. before maintenance (admin)",
        description="The daemon refuses new sessions (but admins') and reports NOT_SERVING "
        "to health checks; open sessions carry on. Exit status with --wait: 0 once no other "
        "session is open, or once the daemon stops (SIGTERM ends every session: 'stopped: "
        "... went away while draining'); 1 if some still are open after S seconds. Exit "
        "status with or without --wait: 2 the daemon refused (it answered and did not "
        "drain, e.g. not an admin, or it is stopping; or, during --wait, it drains but ended "
        "this command's session and opens it no new one: a reload took its admin right), 3 "
        "it could not be reached.",
    )
    d.add_argument(
        "--wait",
        type=_seconds(zero=True),
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the open sessions to end",
    )
    d.add_argument(
        "--resume", action="store_true", help="take new sessions again (refused with --wait)"
    )
    d.set_defaults(func=_drain)

    q = sub.add_parser(
        "quarantine",
        help="list the L2 slots held out of use after failed reads, or release them (admin)",
        description="The slots L2 holds out of use after reads of them failed (checksum "
        "mismatch or I/O error), with the data file and offset of each, when and why (as many "
        "as one reply holds; the count covers every one). With "
        "--release, gives them back to use first (those --slot names, or with none named up "
        "to server.max_batch_blocks of them a call: run it again for the rest): each once its "
        "extent takes a write of random bytes, a sync and a read back; one that fails stays "
        "quarantined, its reason saying why. Refused while L2 is degraded (but by a failed read, "
        "which a release whose every check passes clears) or still reading its index. Exit "
        "status: 0 listed (with --release: every slot asked is back in use), "
        "1 slots are left for the next run (with no --slot, slots no release has tried yet; "
        "or slots it left held for a read in flight or a free not done): run it again, "
        "4 some slot --release was to give back failed its check and stays quarantined (none "
        "left for the next run), 2 the daemon refused (it answered and did nothing: not an admin, no L2, "
        "L2 degraded by another fault or recovering, a slot it does not hold, or it is "
        "stopping), 3 unreachable, as health's 3.",
    )
    q.add_argument(
        "--release",
        action="store_true",
        help="give the slots back to use (it writes, syncs and reads back each extent: give "
        "many a longer --timeout)",
    )
    q.add_argument(
        "--slot",
        type=int,
        action="append",
        metavar="N",
        help=(
            "release only slot N (repeat for more; default: up to server.max_batch_blocks "
            "of the slots held)"
        ),
    )
    q.add_argument("--json", action="store_true", help="one JSON object")
    q.set_defaults(func=_quarantine)

    # No -h of its own: `kvtier bench NAME --help` is the benchmark's help.
    b = sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks (each but l3 and policy_memory starts its own daemon)",
        description="Run a benchmark; `kvtier bench NAME --help` lists its options.",
    )
    b.add_argument("what", nargs="?", choices=sorted(BENCHMARKS), help="which benchmark")
    b.add_argument("--json", action="store_true", help=JSON_HELP)
    b.set_defaults(func=_bench, parser=b)

    if simulator:
        from kvtier.sim.cli import add_replay_parser, add_trace_parser

        add_replay_parser(sub)
        add_trace_parser(sub)
    else:
        for name, line in SIM_COMMAND_HELP.items():
            sub.add_parser(name, help=line, add_help=False).set_defaults(func=None)
    return p


def main(argv: list[str] | None = None) -> int:
    # Options after the benchmark's name belong to the benchmark.
    p = _parser(simulator=False)
    args, extra = p.parse_known_args(argv)
    if args.func is None:  # a simulator's command: read again with its options
        p = _parser(simulator=True)
        args, extra = p.parse_known_args(argv)
    if extra and args.command != "bench":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    # The client logs a WARNING when its session ends other than by close() (the daemon
    # stopped or restarted under `top`, `stats --interval` or `drain --wait`), which Python
    # prints on stderr where no logging is set up: the commands say in a line of their own what
    # became of the daemon.
    session_log = logging.getLogger(SESSION_LOGGER)
    quiet = session_log.disabled
    session_log.disabled = True
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        # Ctrl-C (`stats --interval`, a slow call): a line, not a traceback.
        print("kvtier: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`kvtier stats | head`): end quietly, as other tools do.
        # Not by resetting SIGPIPE: main() also runs inside other programs (tests).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UnavailableError, DeadlineExceededError) as e:
        print(_unreachable(args, e), file=sys.stderr)
        # Not reached at all: health's 3, as check and drain (a daemon that answered and
        # turned the call away, e.g. draining, is 1).
        return 1 if _reached(e) else UNREACHABLE
    except KvtierError as e:
        if _kept_out(args, e):
            print(_unreachable(args, e), file=sys.stderr)
            return UNREACHABLE
        print(f"kvtier: {type(e).__name__}: {e.details}", file=sys.stderr)
        return 1
    finally:
        session_log.disabled = quiet


if __name__ == "__main__":
    sys.exit(main())
