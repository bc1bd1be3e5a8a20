"""A circuit breaker for engine integrations: after a failed kvtier call, the engine runs
without kvtier for a while instead of paying a timeout on every request.

Invariant: while the breaker is open (``ok()`` is False) an integration sends nothing to the
daemon; it answers what it would answer with an empty cache.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Breaker:
    """Stops asking kvtier for ``retry_after_s`` after a failure, so a daemon that is down
    or slow costs one timeout per period, not one per request.

    Thread-safety: a race may let two callers through at the end of a pause; harmless.
    """

    def __init__(self, retry_after_s: float, what: str) -> None:
        self.retry_after_s = retry_after_s
        self.what = what
        self._closed_until = 0.0
        self.trips = 0

    def ok(self) -> bool:
        return time.monotonic() >= self._closed_until

    def trip(self, error: BaseException) -> None:
        self.trips += 1
        if self.ok():
            log.warning(
                "kvtier %s failed (%s: %s); running without kvtier for %.1fs",
                self.what,
                type(error).__name__,
                error,
                self.retry_after_s,
            )
        self._closed_until = time.monotonic() + self.retry_after_s
