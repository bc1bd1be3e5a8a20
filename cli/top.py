"""``kvtier top``: a live terminal view of a running daemon, refreshed every second.

Each frame is built from two Stats snapshots one interval apart (``cli/figures.py``): tier
usage and state, hit ratios, transfer rates by direction, and RPC latency per method.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvtier.cli.figures import (
    WITHHELD,
    Figures,
    derive,
    human_bytes,
    human_seconds,
    percent,
    tier_ok,
)
from kvtier.client import Client
from kvtier.tiers.sizes import counted


def render(fig: Figures, address: str) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    counts = (
        ""
        if fig.withheld
        else f"sessions {fig.gauges.get('sessions', 0):.0f}, pools "
        f"{fig.gauges.get('pools', 0):.0f}, leases {fig.gauges.get('leases', 0):.0f}, pinned "
        f"{fig.gauges.get('blocks_pinned', 0):.0f}"
    )
    head = Text.assemble(
        (f"kvtierd {fig.version}", "bold"), f" at {address}, up {_uptime(fig.uptime_s)}  ", counts
    )
    tiers = Table(title="tiers", title_justify="left", expand=True)
    for col in ("tier", "used", "capacity", "fill", "blocks", "hits", "state"):
        tiers.add_column(col, justify="left" if col in ("tier", "state") else "right")
    for t in fig.tiers:
        fill = t.used_bytes / t.capacity_bytes if t.capacity_bytes else float("nan")
        style = "" if t.state == "ok" else "yellow" if tier_ok(t.state) else "bold red"
        tracked = t.capacity_bytes > 0  # a key-addressed tier's bytes are its store's own
        tiers.add_row(
            t.name,
            human_bytes(t.used_bytes) if tracked else "-",
            human_bytes(t.capacity_bytes) if tracked else "not tracked",
            f"{_bar(fill)} {percent(fill)}",
            f"{t.blocks:,}",
            percent(t.hit_ratio),
            Text(t.state, style=style),
        )
    misses = ", ".join(f"{k} {v:,}" for k, v in sorted(fig.misses.items()) if v) or "none"
    ratios = Text(
        f"hit ratio {percent(fig.hit_ratio)} of {counted(fig.lookups, 'key', spec=',')} in "
        f"the last {fig.window_s:.1f} s{' (since it restarted)' if fig.restarted else ''} "
        f"(lifetime {percent(fig.lifetime_hit_ratio)}); misses: {misses}"
    )
    rates = Table(title="transfers per second", title_justify="left", expand=True)
    rates.add_column("what")
    rates.add_column("rate", justify="right")
    rates.add_row("put (pool->store)", human_bytes(fig.put_bytes_per_s) + "/s")
    rates.add_row("get (store->pool)", human_bytes(fig.get_bytes_per_s) + "/s")
    rates.add_row("lookups", f"{fig.lookups_per_s:,.0f} keys/s")
    for direction, rate in fig.moved_bytes_per_s.items():
        rates.add_row(direction, human_bytes(rate) + "/s")
    lat = Table(title="RPC latency (last interval)", title_justify="left", expand=True)
    for col in ("method", "calls/s", "mean", "p50", "p99", "errors"):
        lat.add_column(col, justify="left" if col == "method" else "right")
    for row in fig.latency:
        lat.add_row(
            row.method,
            f"{row.calls_per_s:,.1f}",
            human_seconds(row.mean_s),
            human_seconds(row.p50_s),
            human_seconds(row.p99_s),
            str(row.errors),
        )
    if not fig.latency:
        lat.add_row("(no calls)", "", "", "", "", "")
    if fig.withheld:
        return Group(head, tiers, Text(f"hit ratio, transfers and RPC latency: {WITHHELD}"))
    return Group(head, tiers, ratios, rates, lat)


def run(client: Client, interval_s: float = 1.0, once: bool = False) -> int:
    from rich.console import Console
    from rich.live import Live

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own ends the process with status 1, which says the daemon went away or
            # turned top away; a reader gone (`kvtier top --once | head`) ends top as it ends
            # every kvtier command, quietly with 0 (cli/main.py).
            raise BrokenPipeError

    console = _Console()
    before, taken = client.stats(), time.monotonic()

    def frame() -> Figures:
        nonlocal before, taken
        now, at = client.stats(), time.monotonic()
        fig = derive(now, before, at - taken)
        before, taken = now, at
        return fig

    # Into a pipe or a file (whose width rich takes as 80 columns) the header and the ratio
    # line stay one line each, as long as they are, for grep and awk; the tables keep the width.
    soft_wrap = not console.is_terminal
    if once:
        time.sleep(interval_s)
        console.print(render(frame(), client.address), soft_wrap=soft_wrap)
        return 0
    with _until_ctrl_c() as stop:
        if not console.is_terminal:
            # A pipe or a file: one frame after another, each flushed as it is drawn (``Live``
            # redraws in place on a terminal only, and elsewhere prints nothing until it stops).
            while not stop.wait(interval_s):
                console.print(render(frame(), client.address), soft_wrap=True)
                console.file.flush()
        else:
            with Live(console=console, auto_refresh=False, screen=False) as live:
                while not stop.wait(interval_s):
                    live.update(render(frame(), client.address), refresh=True)
    return 0


@contextlib.contextmanager
def _until_ctrl_c() -> Iterator[threading.Event]:
    """An event Ctrl-C sets, for a loop that ends between frames: a KeyboardInterrupt raised
    wherever the main thread happens to be (inside a gRPC call or a half-written frame) is
    not the way to end a loop that Ctrl-C is the way to quit. A second Ctrl-C interrupts at
    once. Outside the main thread (where no signal handler can be set) the loop runs until
    its caller's KeyboardInterrupt, as before."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        with contextlib.suppress(KeyboardInterrupt):
            yield stop
        return

    def on_sigint(signum: int, frame: Any) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    except KeyboardInterrupt:  # the second Ctrl-C
        pass
    finally:
        if previous is not None:  # None: a handler not set from Python, not restorable
            signal.signal(signal.SIGINT, previous)


def _bar(fill: float, width: int = 10) -> str:
    if fill != fill:
        return " " * width
    n = max(0, min(width, round(fill * width)))
    return "#" * n + "." * (width - n)


def _uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"
