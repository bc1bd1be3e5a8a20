"""Health probes over HTTP, on the metrics endpoint: ``/healthz`` and ``/readyz``.

An orchestrator that probes through ``kvtier health`` starts a Python process and opens a gRPC
connection to the daemon each time: about a third of a second of CPU per probe on the node
(its imports), and one of ``server.max_connections``, so a client that holds every
connection makes the liveness probe fail and the daemon be restarted (losing L1). These two
paths need neither: the HTTP server's own thread answers them, asking the event loop as a
scrape does.

- ``GET /healthz`` (liveness): 200 when the event loop runs a no-op within
  ``HEALTH_TIMEOUT_S``; 503 when it does not (a loop that stopped answering serves nobody).
  Draining or degraded is still alive.
- ``GET /readyz`` (readiness): 200 while the health service says SERVING, even with a tier
  degraded (as ``kvtier health --degraded-ok``); 503 while draining or stopping, or when the
  loop does not answer. The body names each tier's state either way.

Neither needs ``metrics.token_file``'s token: they tell whether the daemon serves and each
tier's state, nothing about tenants or traffic. Answers are reused for ``HEALTH_REUSE_S``, so
probes from whoever reaches the port cost the loop at most one snapshot per interval.

Thread-safety: ``HealthProbe`` is called on the HTTP server's threads; it touches daemon state
only on the event loop. Probes that come while one waits for the loop share its request, so
each answers within ``HEALTH_TIMEOUT_S`` and holds its thread no longer, however many come.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.daemon.health import SERVING

if TYPE_CHECKING:
    from kvtier.daemon.server import Daemon

# How long a probe waits for the event loop before answering 503. Below the probes'
# timeouts in deploy/kubernetes (5 s), so the orchestrator sees the 503, not its own timeout.
HEALTH_TIMEOUT_S = 2.0
# An answer is reused by the probes that come within this long of it.
HEALTH_REUSE_S = 0.2

PATHS = ("/healthz", "/readyz")

log = logging.getLogger(__name__)


class ProbeFailed(Exception):
    """The daemon's state could not be read (the message says why)."""


@dataclass(frozen=True, slots=True)
class ProbeState:
    """What the event loop answered: whether the daemon serves, and (tier, state) each."""

    serving: bool
    tiers: tuple[tuple[str, str], ...]


def probe_state(daemon: Daemon) -> ProbeState:
    """Read the daemon's state. Call on its event loop."""
    return ProbeState(
        serving=daemon.health.status("") == SERVING,
        # The state only: a tier's detail may name its files or its remote store's address,
        # and the probes answer whoever reaches the port.
        tiers=tuple((lv.kind.label, lv.tier.health().state.value) for lv in daemon.store.stack),
    )


class HealthProbe:
    """A WSGI app for ``PATHS``. ``ask`` returns the state, run on the event loop ``loop``."""

    def __init__(
        self,
        ask: Callable[[], ProbeState],
        loop: asyncio.AbstractEventLoop,
        timeout_s: float = HEALTH_TIMEOUT_S,
        reuse_s: float = HEALTH_REUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ask = ask
        self.loop = loop
        self.timeout_s = timeout_s
        self.reuse_s = reuse_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: ProbeState | None = None
        self._last_at = -float("inf")
        # The request to the loop that probes wait for now, if any.
        self._asking: concurrent.futures.Future[ProbeState] | None = None

    def state(self) -> ProbeState:
        """The daemon's state; ``ProbeFailed`` when its event loop did not answer in time,
        has stopped, or the reading failed. Probes that come while one waits for the loop
        wait for the same answer: each waits ``timeout_s`` at most, and the loop is asked
        once for them all."""
        with self._lock:
            if self._last is not None and self._clock() - self._last_at < self.reuse_s:
                return self._last
            future = self._asking
            if future is None:
                future = self._ask_loop()
                self._asking = future
        try:
            state = future.result(self.timeout_s)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            # Cancelled: the probe that asked first gave up waiting, for the same loop.
            future.cancel()
            self._done(future)
            raise ProbeFailed(
                f"the daemon's event loop did not answer within {self.timeout_s:g} s"
            ) from None
        except Exception as e:
            if self._done(future):
                log.warning("health probe failed: %r", e)
            # The type only: the message may name files, and the probes answer anyone.
            raise ProbeFailed(f"reading the daemon's state failed ({type(e).__name__})") from None
        with self._lock:
            if self._asking is future:
                self._asking = None
                self._last, self._last_at = state, self._clock()
        return state

    def _ask_loop(self) -> concurrent.futures.Future[ProbeState]:
        """A request to the event loop for the state. Call holding ``_lock``."""
        future: concurrent.futures.Future[ProbeState] = concurrent.futures.Future()

        def run() -> None:  # on the loop
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.ask())
                except Exception as e:
                    future.set_exception(e)

        try:
            self.loop.call_soon_threadsafe(run)
        except RuntimeError:
            raise ProbeFailed("the daemon's event loop has stopped") from None
        return future

    def _done(self, future: concurrent.futures.Future[ProbeState]) -> bool:
        """Forget ``future`` as the request in flight; False when another probe did."""
        with self._lock:
            if self._asking is not future:
                return False
            self._asking = None
            return True

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        """The WSGI answer to a GET of a probe path (``metrics.ProbeRouter`` takes the
        methods: a HEAD is this without the body, any other is 405)."""
        status, text = self.answer(environ.get("PATH_INFO", ""))
        return text_answer(start_response, status, text)

    def answer(self, path: str) -> tuple[str, str]:
        """The HTTP status and text for ``path`` (one of ``PATHS``)."""
        try:
            state = self.state()
        except ProbeFailed as e:
            return "503 Service Unavailable", f"{e}\n"
        tiers = ", ".join(f"{name} {health}" for name, health in state.tiers)
        if path == "/healthz":
            return "200 OK", f"alive; {tiers}\n"
        if not state.serving:
            return "503 Service Unavailable", f"not serving (draining or stopping); {tiers}\n"
        ok = all(health == "ok" for _, health in state.tiers)
        return "200 OK", f"{'ok' if ok else 'degraded'}: serving; {tiers}\n"


def text_answer(
    start_response: Any, status: str, text: str, extra: list[tuple[str, str]] | None = None
) -> list[bytes]:
    body = text.encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            *(extra or []),
        ],
    )
    return [body]
