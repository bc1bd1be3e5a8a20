"""``kvtierd``'s entry point (the console script, ``python -m kvtier.daemon``): it holds SIGHUP
before anything heavy is imported.

SIGHUP's default action ends the process, and the daemon's reload handler goes in only once it
serves; the imports of ``kvtier.daemon.main`` alone take ~240 ms, so a reload sent just after a
(re)start killed the daemon without a word. This module imports nothing but ``signal`` and
``sys`` before it notes SIGHUP; a SIGHUP that arrives from then until the daemon serves is
honoured as a reload once it does (``kvtier.daemon.main``). Only the interpreter's own start,
before this module runs, is left to SIGHUP's default action.
"""

from __future__ import annotations

import signal
import sys


class EarlyHangup:
    """Notes a SIGHUP that arrives before the daemon serves (``seen``), in place of its
    default action. Installed on construction; the daemon's reload handler replaces it."""

    def __init__(self) -> None:
        self.seen = False
        signal.signal(signal.SIGHUP, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.seen = True


def main(argv: list[str] | None = None) -> int:
    early_hangup = EarlyHangup()
    from kvtier.daemon.main import main as run  # the heavy imports, SIGHUP held

    return run(argv, early_hangup=early_hangup)


if __name__ == "__main__":
    sys.exit(main())
