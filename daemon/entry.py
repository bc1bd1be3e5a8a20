"""``kvtierd``'s entry point (the console script, ``python -m kvtier.daemon``, and through it
``python -m kvtier.daemon.main``): it holds SIGHUP, SIGINT and SIGTERM before anything heavy
is imported, and quiets gRPC's core before anything imports it.

The daemon's own handlers go in only once it serves (the reload's, and the stop's of
``Daemon.stop_on_signals``), and the imports of ``kvtier.daemon.main`` alone take ~240 ms.
Before this module held them, a reload sent just after a (re)start killed the daemon without
a word (SIGHUP's default action), a SIGTERM did too, leaving its sockets behind, and a SIGINT
raised KeyboardInterrupt wherever the daemon was (a traceback, or an event loop torn down
under a half-started server). This module imports nothing but ``signal`` and ``sys`` before it
notes them; one that arrives from then until the daemon serves is honoured once it does
(``kvtier.daemon.main``): a SIGHUP as a reload, a SIGINT or SIGTERM as the stop of a serving
daemon (drained, its sockets removed, exit status 0); a second SIGINT or SIGTERM takes the
signal's default action at once, for a start that hangs. Only the interpreter's own start,
before this module runs, is left to the signals' default actions.
"""

from __future__ import annotations

import os
import signal
import sys


class EarlySignals:
    """Notes, in place of their default actions, the signals that arrive before the daemon
    serves: a SIGHUP (``hangup``) and the first SIGINT or SIGTERM (``stop``); a second SIGINT
    or SIGTERM ends the process by its default action. Installed on
    construction; the daemon's own handlers replace it once it serves. Its handler runs on
    the main thread, between two bytecodes, and only sets an attribute."""

    HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.hangup = False
        self.stop: signal.Signals | None = None
        for signum in self.HELD:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            self.hangup = True
        elif self.stop is None:
            self.stop = signal.Signals(signum)
        else:
            # A second one: the operator will not wait for a start that may hang (Ctrl-C
            # twice). The signal's own action, now, as before this module held it.
            name = signal.Signals(signum).name
            os.write(2, f"kvtierd: a second {name} while starting: stopping at once\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def main(argv: list[str] | None = None) -> int:
    early_signals = EarlySignals()
    # gRPC's C core writes its log lines on stderr itself, outside the daemon's format and
    # rate limits, and any client causes one at will (a header value it cannot parse: 27,000
    # lines a second from one connection). It logs nothing unless the operator asks (read
    # once, as gRPC starts).
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from kvtier.daemon.main import main as run  # the heavy imports, the signals held

    return run(argv, early_signals=early_signals)


if __name__ == "__main__":
    sys.exit(main())
