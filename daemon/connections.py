"""How many gRPC connections the daemon holds open, read from the kernel's socket tables.

``server.max_connections`` is enforced inside gRPC, which closes a connection past the bound
as it accepts it and tells the daemon nothing: a client that holds every connection kept new
clients out without a line in the log. ``ConnectionWatch`` counts the daemon's connections
every ``CHECK_INTERVAL_S`` from ``/proc/net/unix`` (the accepted sockets of the gRPC socket,
which carry the name it was bound at: its path plus ``unixsock.BIND_SUFFIX``) and
``/proc/net/tcp``/``tcp6`` (established sockets on the TCP port), shows the count as the
``connections`` gauge, and logs a WARNING, at most once per ``WARN_INTERVAL_S``, while the
count is at the bound.

The tables are the network namespace's: in a container, the container's. Where procfs is not
mounted the count is unknown (-1) and nothing is logged.

Thread-safety: ``check`` runs on one thread at a time (``run`` calls it on a worker
thread); ``count`` may be read from any.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvtier.daemon.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 5.0
WARN_INTERVAL_S = 60.0
_UNIX_CONNECTED = "03"  # SS_CONNECTED in /proc/net/unix
_TCP_ESTABLISHED = "01"


def unix_connections(path: str, proc: str = "/proc") -> int:
    """Connected sockets bound to ``path`` (a listener's accepted connections); OSError when
    the table cannot be read."""
    count = 0
    with open(f"{proc}/net/unix", encoding="utf-8", errors="replace") as table:
        next(table, None)  # the header
        for line in table:
            fields = line.split(None, 7)
            if len(fields) == 8 and fields[5] == _UNIX_CONNECTED and fields[7].rstrip("\n") == path:
                count += 1
    return count


def tcp_connections(port: int, proc: str = "/proc") -> int:
    """Established TCP sockets (IPv4 and IPv6) whose local port is ``port``; OSError when
    neither table can be read."""
    count = 0
    read = 0
    want = f":{port:04X}"
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{name}", encoding="ascii", errors="replace") as table:
                next(table, None)
                for line in table:
                    fields = line.split(None, 4)
                    if (
                        len(fields) >= 4
                        and fields[3] == _TCP_ESTABLISHED
                        and fields[1].endswith(want)
                    ):
                        count += 1
            read += 1
        except FileNotFoundError:  # a kernel without IPv6
            continue
    if not read:
        raise FileNotFoundError(f"{proc}/net/tcp")
    return count


class ConnectionWatch:
    """Counts the connections to ``unix_path`` (or none) and ``tcp_port`` (0: none)."""

    def __init__(
        self,
        unix_path: str,
        tcp_port: int,
        limit: int,
        proc: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.unix_path = unix_path
        self.tcp_port = tcp_port
        self.limit = limit
        self.proc = proc
        self.count = -1  # unknown until counted
        self._warn = RateLimitedLog(log, WARN_INTERVAL_S, clock)

    def check(self) -> int:
        """Count now, warn if at the bound; the count, -1 if the tables cannot be read."""
        try:
            count = 0
            if self.unix_path:
                count += unix_connections(self.unix_path, self.proc)
            if self.tcp_port:
                count += tcp_connections(self.tcp_port, self.proc)
        except OSError:
            self.count = -1
            return -1
        self.count = count
        if count >= self.limit:
            self._warn.warning(
                "at the bound",
                "%d gRPC connections open, server.max_connections is %d: new clients are "
                "refused (gRPC closes their connections as it accepts them) until some close; "
                "raise the bound or find who holds them (ss -xp for the Unix socket)",
                count,
                self.limit,
            )
        return count

    async def run(self) -> None:
        while True:
            # Off the loop: a host's table may hold tens of thousands of sockets (a line a
            # microsecond, parsed).
            await asyncio.to_thread(self.check)
            await asyncio.sleep(CHECK_INTERVAL_S)
