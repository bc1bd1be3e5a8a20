"""A circuit breaker for engine integrations: after a failed kvtier call, the engine runs
without kvtier for a while instead of paying a timeout on every request.

Invariant: while the breaker is open (``ok()`` is False) an integration sends nothing to the
daemon; it answers what it would answer with an empty cache.

Only failures that say the daemon is down, hung or overloaded open it. A NOT_FOUND answer (the
daemon restarted and no longer knows our session, pool or lease) comes from a daemon that is up
and fast: the next call opens a session again, so the first one does not pause. Another within
``retry_after_s`` does: something else is missing (the daemon cannot see our shared-memory
object, say), and retrying it at every step would only cost a registration each time.
"""

from __future__ import annotations

import logging
import time

from kvtier.client.errors import NotFoundError

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
        self._forgiven_at = -retry_after_s  # when a NOT_FOUND last passed without a pause
        self.trips = 0

    def ok(self) -> bool:
        return time.monotonic() >= self._closed_until

    def trip(self, error: BaseException, at: float | None = None) -> None:
        """Pause for ``retry_after_s`` from ``at`` (a ``time.monotonic()`` instant; now by
        default): a failure noticed late, e.g. a background job reaped later, pauses from when
        it happened, not from when it was seen."""
        now = time.monotonic()
        if isinstance(error, NotFoundError) and now - self._forgiven_at >= self.retry_after_s:
            self._forgiven_at = now
            log.info("kvtier %s: %s; the next call registers again", self.what, error)
            return
        self.trips += 1
        until = (now if at is None else at) + self.retry_after_s
        if until <= self._closed_until:
            return
        if self.ok() and until > now:
            log.warning(
                "kvtier %s failed (%s: %s); running without kvtier for %.1fs",
                self.what,
                type(error).__name__,
                error,
                until - now,
            )
        self._closed_until = until
