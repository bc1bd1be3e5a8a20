"""``kvtierd``: run the daemon.

The effective config is the embedded defaults, then ``--config FILE`` (or ``$KVTIER_CONFIG``),
then ``KVTIER_*`` environment variables, then ``--set`` overrides. Before anything is
allocated the host checks of ``daemon/preflight.py`` run (memory, disk space, the socket), so a
config that cannot run here fails at once with the key named. SIGHUP loads the config again
the same way and applies what can change live (``daemon/reload.py``); SIGINT and SIGTERM stop
it (drained, its sockets removed; exit status 3 for a stop past its bound, ``Daemon.stop``,
or an exit that does not end after it, ``_exit_stalled``).
One that arrives while the daemon starts is held (from the entry point on,
``daemon/entry.py``) and honoured once it serves: a stop then wins over a reload.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # `python -m kvtier.daemon.main` starts as kvtierd does, through the entry point, before
    # this module's imports below (the heavy ones, ~240 ms): it holds the signals from then on
    # and quiets gRPC's core before anything imports it (read once, at that import). The entry
    # imports this module again under its own name, and this run ends with the daemon.
    from kvtier.daemon.entry import main as entry_main

    sys.exit(entry_main())

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import yaml

from kvtier import __version__
from kvtier.daemon import loops, preflight
from kvtier.daemon.config import Config, ids_from, load_config, not_rereadable
from kvtier.daemon.entry import EarlySignals
from kvtier.daemon.errors import ConfigError, UnknownName
from kvtier.daemon.logs import as_logged, setup_logging

log = logging.getLogger("kvtier.daemon")

# The cyclic garbage collector's first threshold (Python's default: 700). The daemon's state
# lives in numpy arrays, freed by reference counting; what the collector walks is the short-
# lived objects of requests in progress (a durable put of 4,096 blocks holds several per block
# until its batch ends) and, in full collections, everything else the process holds. With 700
# it collected thousands of times a second under durable 4 KiB puts and each full collection
# walked the ~40k objects of the loaded modules (22 full collections in a 200,000-block
# durable fill). With 5,000 young collections come about a tenth as often (2,680 -> 240-320 in
# that fill, full ones 1-2), and the modules are frozen once loaded (``gc.freeze``: never
# walked again; they live as long as the process). Cyclic garbage still goes at most this many
# allocations after it is made: the soak's RSS bound holds (thresholds of 50,000 broke it).
GC_FIRST_THRESHOLD = 5000

CONFIG_ENV = "KVTIER_CONFIG"

# Exit statuses past 0: a host check or the start failed (1: may pass when tried again, a
# socket or port still held); the config is wrong (2: trying again cannot help, and the unit
# does not); a user or group name the host does not know (4: a directory service that does
# not answer yet looks the same, and the unit tries again). 3 is a stop past its bound
# (``kvtier.daemon.server.EXIT_STOP_ABANDONED``).
EXIT_CANNOT_START = 1
EXIT_CONFIG_ERROR = 2
EXIT_UNKNOWN_NAME = 4
# How long the process may take to exit once the daemon has stopped (``_exit_stalled``): the
# metrics endpoint's close and the event loop's teardown take milliseconds.
EXIT_AFTER_STOP_S = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtierd",
        description="Tiered KV-cache storage daemon for LLM inference. The config is the "
        "embedded defaults, then --config, then KVTIER_* environment variables (one per key: "
        "tiers.l1.capacity_bytes is KVTIER_TIERS_L1_CAPACITY_BYTES), then --set.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=os.environ.get(CONFIG_ENV) or None,
        help=f"YAML config (default: ${CONFIG_ENV}); without it the embedded defaults apply",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one config value (repeatable), e.g. --set tiers.l1.capacity_bytes=4GiB",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (sizes in units) and exit",
    )
    p.add_argument(
        "--check-config",
        action="store_true",
        help="validate the config and check this host can run it (memory, disk space, the "
        "socket), then exit: 0 when it can, 1 when not, 2 for a bad config, 4 for a user or "
        "group name not found",
    )
    p.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    return p.parse_args(argv)


@contextlib.contextmanager
def _reader_may_leave() -> Iterator[None]:
    """Output for a reader that may go away (`kvtierd --print-config | head`): a closed pipe
    ends the output quietly, as `kvtier`'s commands do, not in BrokenPipeError's traceback
    (exit status 1, which --check-config's caller would read as a host that cannot run the
    config). stdout then goes to /dev/null, so that the exit's own flush does not raise."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None, early_signals: EarlySignals | None = None) -> int:
    """Run ``kvtierd``. ``early_signals``: the signal holder the entry point installed before
    importing this module (``kvtier.daemon.entry``); one is installed now without it."""
    if early_signals is None:
        early_signals = EarlySignals()
    args = parse_args(argv)

    def load() -> Config:
        return load_config(args.config, args.overrides, environ=os.environ)

    def load_again() -> Config:
        """``load`` at a SIGHUP: a config file that is no regular file cannot be read again
        (a pipe, ``--config <(...)``, is empty once read: the reload applied the defaults;
        a FIFO without a writer held the event loop until one came)."""
        if args.config is not None and (problem := not_rereadable(args.config)) is not None:
            raise ConfigError(problem)
        return load()

    # The uids and gids the config's user and group names resolve to now: a reload resolves
    # the same names to the same ids (see config.ids_from).
    known_ids: dict[tuple[str, str], int] = {}
    try:
        with ids_from(known_ids):
            config = load()
    except UnknownName as e:
        print(
            f"kvtierd: config error: {e} (or its directory service does not answer yet)",
            file=sys.stderr,
        )
        return EXIT_UNKNOWN_NAME
    except ConfigError as e:
        print(f"kvtierd: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.print_config:
        with _reader_may_leave():
            yaml.safe_dump(config.printable(), sys.stdout, sort_keys=False)
        return 0
    # The checks take the ids the config resolved to, as the daemon does (``_serve``): asked
    # again, a directory service that stopped answering meanwhile ended the start in a
    # traceback.
    with ids_from(known_ids):
        problems = preflight.check(config)
    if args.check_config:
        with _reader_may_leave():
            for line in preflight.summary(config):
                print(f"  {line}")
        for problem in problems:
            print(f"kvtierd: cannot start: {problem}", file=sys.stderr)
        if problems:
            return EXIT_CANNOT_START
        with _reader_may_leave():
            print("config ok")
        return 0
    if problems:
        for problem in problems:
            refused = f"kvtierd: cannot start: {problem}"
            print(as_logged(refused, config.logging.format, log.name, "ERROR"), file=sys.stderr)
        return EXIT_CANNOT_START
    setup_logging(config.logging.level, config.logging.format)
    from kvtier.tiers.base import TierError  # heavy imports after the config is known good

    # Started once the daemon has stopped; ended here, the event loop's teardown over.
    exit_guard = threading.Timer(EXIT_AFTER_STOP_S, _exit_stalled)
    exit_guard.daemon = True
    try:
        loops.run(
            _serve(config, load_again, early_signals, known_ids, exit_guard),
            config.server.event_loop,
        )
    except (OSError, TierError) as e:
        log.error("cannot start: %s", e)
        return EXIT_CANNOT_START
    except ConfigError as e:  # one only the start finds: a policy lacking protocol members
        log.error("config error: %s", e)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        pass
    finally:
        exit_guard.cancel()
    return 0


def _exit_stalled() -> None:
    """Run by ``main``'s exit guard: the daemon stopped, but what is left of the process's
    exit (the metrics endpoint's close, the event loop's teardown, which waits for every
    thread of its default executor, ``asyncio.to_thread``'s) has not ended. A call left in
    such a thread that does not return would hold the process, its stop's bound over,
    until the service manager killed it. Exit as that bound does."""
    from kvtier.daemon.server import EXIT_STOP_ABANDONED

    log.error(
        "kvtierd stopped but did not exit within %gs (a thread of its event loop's executor "
        "does not return: a call on a disk that stops answering): exiting with status %d",
        EXIT_AFTER_STOP_S,
        EXIT_STOP_ABANDONED,
    )
    logging.shutdown()  # flushes the handlers: os._exit skips it
    os._exit(EXIT_STOP_ABANDONED)


async def _serve(
    config: Config,
    load: Any,
    early_signals: EarlySignals,
    known_ids: dict[tuple[str, str], int],
    exit_guard: threading.Timer,
) -> None:
    """Run the daemon with its operations around it: the metrics endpoint and SIGHUP; a stop
    signal held while it started stops it as soon as it serves. Once it has stopped,
    ``exit_guard`` bounds the rest of the exit."""
    from kvtier.daemon.reload import Reloader
    from kvtier.daemon.server import Daemon, serve
    from kvtier.daemon.tenants import read_token_file

    if config.metrics.address:
        # Only a daemon that serves the endpoint imports it (prometheus_client, wsgiref,
        # http.server and email: 30-80 ms of every start on a loaded 2-core machine).
        from kvtier.daemon.metrics import MetricsServer

    _tune_collector()
    metrics: MetricsServer | None = None

    def ready(daemon: Daemon) -> None:
        nonlocal metrics
        # The daemon's stop handlers are in (``serve``): a stop signal is either held here
        # or the daemon's own.
        if early_signals.stop is not None:
            log.info(
                "%s arrived while starting; stopping now%s",
                early_signals.stop.name,
                " (a SIGHUP did too: no reload)" if early_signals.hangup else "",
            )
            daemon.request_stop()
            return
        if config.metrics.address:
            token = None
            if config.metrics.token_file:
                token = read_token_file(config.metrics.token_file)
            metrics = MetricsServer(daemon, config.metrics.address, token)
            metrics.start()
            daemon.service.metrics_url = metrics.url  # the port it took, for port 0
            if token is None and config.tenants:
                # The URL it listens on: metrics.address may be a port alone, or port 0.
                log.warning(
                    "metrics.address without metrics.token_file: anyone who reaches %s may "
                    "read every tenant's name, usage and traffic there",
                    metrics.url,
                )
        reloader = Reloader(daemon, load, known_ids, metrics)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.reload)
        where = ", ".join(daemon.addresses)
        extra = f"; metrics on {metrics.url}" if metrics is not None else ""
        started = (
            f"kvtierd {__version__} listening on {where}{extra} "
            f"({loops.describe(loops.running())} event loop)"
        )
        print(as_logged(started, config.logging.format, log.name), flush=True)
        if early_signals.hangup:
            log.info("SIGHUP arrived while starting; reading the config again now")
            reloader.reload()

    try:
        # The daemon's own use of the names (the sockets' group, tenants, admins, shm_share)
        # takes the ids the config was checked with.
        with ids_from(known_ids):
            await serve(config, on_ready=ready)
        exit_guard.start()
    finally:
        if metrics is not None:
            # Off the loop: a scrape in progress waits for the loop to answer it.
            await asyncio.to_thread(metrics.close)


def _tune_collector() -> None:
    """Freeze what the imports made and raise the first threshold (see GC_FIRST_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(GC_FIRST_THRESHOLD, second, third)
