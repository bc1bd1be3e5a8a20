"""A circuit breaker for engine integrations: after a failed kvtier call, the engine runs
without kvtier for a while instead of paying a timeout on every request.

Invariant: while the breaker is open (``ok()`` is False) an integration sends nothing to the
daemon; it answers what it would answer with an empty cache.

Only failures that say the daemon is down, hung or overloaded open it. A NOT_FOUND answer (the
daemon restarted and no longer knows our session, pool or lease) comes from a daemon that is up
and fast: the next call opens a session again, so the first one does not pause. Another within
``retry_after_s`` does: something else is missing (the daemon cannot see our shared-memory
object, say), and retrying it at every step would only cost a registration each time.

A daemon that did not answer (``UnavailableError``, ``DeadlineExceededError``, a transfer's
``TimeoutError``) is not asked again from the engine's thread when the pause ends: a breaker
given a ``probe`` (a health check) stays open until the probe, run on a thread of its own
every ``retry_after_s``, says the daemon serves. So a daemon that stays down or hung costs
the engine one timeout in all, not one per pause, and the log says once when kvtier went
and once when it came back. The probing thread ends when the breaker closes, and when
nothing holds the breaker any more (an integration dropped without closing it).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.client.errors import DeadlineExceededError, NotFoundError, UnavailableError

if TYPE_CHECKING:
    from kvtier.client.sync import Client

log = logging.getLogger(__name__)

# Failures after which the daemon is probed before the engine calls it again.
UNANSWERED = (UnavailableError, DeadlineExceededError, TimeoutError)


def daemon_answers(client: Client) -> Callable[[], bool]:
    """A probe of ``client``'s daemon: its session (opened again if it ended) and a health
    check. The session comes first because on a Unix socket it starts with the credential
    exchange, which fails at once while nothing listens, without a gRPC connection attempt:
    a health check alone made gRPC's channel try to connect at every probe of a daemon that
    was down and back off between tries, so an engine took up to a back-off period (tens of
    seconds) more to see the daemon back."""

    def probe() -> bool:
        _ = client.session_id
        return client.health()

    return probe


class Breaker:
    """Stops asking kvtier for ``retry_after_s`` after a failure, so a daemon that is down
    or slow costs one timeout per period, not one per request; with a ``probe``, a daemon
    that did not answer costs one timeout until it answers again (see the module docstring).

    Thread-safety: a race may let two callers through at the end of a pause; harmless. The
    probing thread only reads the clock and writes the pause's end and ``probing``; it and
    ``trip`` start and end probing, and note when the latest unanswered failure happened and
    when the daemon last answered a probe, under ``_lock``.
    """

    def __init__(
        self, retry_after_s: float, what: str, probe: Callable[[], bool] | None = None
    ) -> None:
        self.retry_after_s = retry_after_s
        self.what = what
        self._probe = probe
        self._closed_until = 0.0
        self._forgiven_at = -retry_after_s  # when a NOT_FOUND last passed without a pause
        self._probing = False  # a probing thread holds the breaker open
        # When the latest failure that said the daemon did not answer happened, and when the
        # probe that last found the daemon serving asked it (both under _lock).
        self._unanswered_at = float("-inf")
        self._answered_at = float("-inf")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.trips = 0
        self.probes = 0  # probes that found the daemon not serving (or not answering)

    def ok(self) -> bool:
        return not self._probing and time.monotonic() >= self._closed_until

    @property
    def probing(self) -> bool:
        """Whether the breaker waits for the daemon to answer a probe."""
        return self._probing

    def trip(self, error: BaseException, at: float | None = None) -> None:
        """Pause for ``retry_after_s`` from ``at`` (a ``time.monotonic()`` instant; now by
        default): a failure noticed late, e.g. a background job reaped later, pauses from when
        it happened, not from when it was seen. A failure that says the daemon did not answer
        pauses, with a probe, until the probe finds it serving, however late it was noticed;
        unless it happened before a probe that found the daemon serving asked it (the same
        hang's save jobs reaped one after another, the probe started by the first answering
        before the others are tripped): the daemon has answered since."""
        now = time.monotonic()
        if isinstance(error, NotFoundError) and now - self._forgiven_at >= self.retry_after_s:
            self._forgiven_at = now
            log.info("kvtier %s: %s; the next call registers again", self.what, error)
            return
        self.trips += 1
        until = (now if at is None else at) + self.retry_after_s
        if self._probe is not None and isinstance(error, UNANSWERED):
            # Probed however late it was noticed and whatever pause is already set: the
            # daemon may still hang, and once the pause ends the engine's next call would be
            # the one to find out (a late failure's pause is over: the probe runs at once).
            happened = now if at is None else at
            with self._lock:
                if happened < self._answered_at:
                    return
                self._closed_until = max(self._closed_until, until)
                self._unanswered_at = max(self._unanswered_at, happened)
                start = not self._probing and not self._stop.is_set()
                self._probing = self._probing or start
            if start:
                # A failure reaped late says when it happened: the outage may be long over.
                ago = now - at if at is not None else 0.0
                log.warning(
                    "kvtier %s failed%s (%s: %s); running without kvtier until the daemon "
                    "answers (asked every %.1fs)",
                    self.what,
                    f" {ago:.1f}s ago" if ago >= 1.0 else "",
                    type(error).__name__,
                    error,
                    self.retry_after_s,
                )
                threading.Thread(
                    target=_wait_for_daemon,
                    args=(weakref.ref(self), self._stop, now),
                    name=f"kvtier-{self.what}-probe",
                    daemon=True,
                ).start()
            return
        if until <= self._closed_until or until <= now:
            return
        was_ok = self.ok()
        self._closed_until = until
        if was_ok:
            log.warning(
                "kvtier %s failed (%s: %s); running without kvtier for %.1fs",
                self.what,
                type(error).__name__,
                error,
                until - now,
            )

    def _ask_daemon(self) -> bool:
        """One probe of the probing thread (see ``_wait_for_daemon``): whether the daemon
        served, with no call failing unanswered after it was asked (such a failure, on
        another thread, found this thread probing and started none: if this answer ended the
        probing, the engine's next call would be the one to ask a daemon that may hang
        again). A failure that happened before the daemon was asked, noticed while it
        answered (save jobs that timed out during a hang and were reaped together later), is
        older than the answer: it does not hold kvtier off for another ``retry_after_s``."""
        assert self._probe is not None
        asked = time.monotonic()
        try:
            serving = self._probe()
        except Exception as e:  # KvtierError: still not answering
            log.debug("kvtier %s: the daemon does not answer yet (%s)", self.what, e)
            serving = False
        if serving:
            with self._lock:
                if self._unanswered_at < asked:
                    self._answered_at = asked
                    self._probing = False
                    return True
        else:
            self.probes += 1
        self._closed_until = time.monotonic() + self.retry_after_s
        return False

    def close(self) -> None:
        """Stop probing (the integration shuts down)."""
        self._stop.set()


def _wait_for_daemon(breaker: weakref.ref[Breaker], stop: threading.Event, since: float) -> None:
    """A breaker's probing thread: asks the daemon every ``retry_after_s`` until it serves
    (``Breaker._ask_daemon``), the breaker closes, or nothing holds the breaker any more. It
    holds the breaker only while it asks: with a strong reference, an integration dropped
    without ``close()`` while the daemon was down kept its thread asking, and the client
    alive, for as long as the process lived (for good once the client was closed)."""
    while True:
        owner = breaker()
        if owner is None:
            return
        pause_s = max(0.0, owner._closed_until - time.monotonic())
        del owner
        if stop.wait(pause_s):
            return  # closed
        owner = breaker()
        if owner is None:
            return
        if owner._ask_daemon():
            log.info(
                "kvtier %s: the daemon answers again after %.1fs; kvtier is used again",
                owner.what,
                time.monotonic() - since,
            )
            return
        del owner
