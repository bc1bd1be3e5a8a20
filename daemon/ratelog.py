"""Log lines that clients can cause, at a bounded rate.

A malformed request or an unexpected failure is worth one line to an operator, not one line
per request: a broken or hostile client could otherwise fill the disk with the log. Each
*kind* (a fixed label chosen by the daemon, never text from a request) logs at most one line
per ``interval_s``; the lines in between are counted, and the next line of that kind says
how many there were.

``LostAnswerFilter`` does the same for a line grpc itself logs when a client makes it.

Thread-safety: none; used from the server's event loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

# Appended to the line that ends a quiet interval, with the count and the interval's length.
_SKIPPED = " (and %d more like it in the last %.0fs)"


class IntervalGate:
    """At most one pass per kind per ``interval_s``; the attempts in between are counted."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    @property
    def suppressed(self) -> int:
        """Attempts counted but not (yet) reported by a pass."""
        return sum(self._suppressed.values())

    def passes(self, kind: str) -> tuple[int, float] | None:
        """None inside the kind's quiet interval (counted); else how many attempts were
        counted since the last pass and how long ago that was (0 and 0.0 for the first)."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._suppressed[kind] += 1
            return None
        self._last[kind] = now
        return self._suppressed.pop(kind, 0), (now - last if last is not None else 0.0)


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._gate = IntervalGate(interval_s, clock)

    @property
    def interval_s(self) -> float:
        return self._gate.interval_s

    @property
    def suppressed(self) -> int:
        """Lines counted but not (yet) logged."""
        return self._gate.suppressed

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        return self._emit(logging.WARNING, kind, msg, args, False)

    def exception(self, kind: str, msg: str, *args: object) -> bool:
        """An ERROR with the traceback of the exception being handled."""
        return self._emit(logging.ERROR, kind, msg, args, True)

    def error(self, kind: str, msg: str, *args: object, exc_info: BaseException) -> bool:
        """An ERROR with the traceback of ``exc_info`` (raised elsewhere, e.g. in a task)."""
        return self._emit(logging.ERROR, kind, msg, args, exc_info)

    def _emit(
        self,
        level: int,
        kind: str,
        msg: str,
        args: tuple[object, ...],
        exc: bool | BaseException,
    ) -> bool:
        passed = self._gate.passes(kind)
        if passed is None:
            return False
        skipped, since = passed
        if skipped:
            msg += _SKIPPED
            args = (*args, skipped, since)
        self._log.log(level, msg, *args, exc_info=exc)
        return True


class BurstGate:
    """Per key, up to ``burst`` passes at once and ``rate_s`` a second after that (a token
    bucket); the attempts beyond are counted, and the next pass of that key says how many.
    For lines that every client causes in normal use (a session opened), where one line per
    interval would hide most of a burst of engines starting, yet one client must not fill
    the log: keys are a client's uid or tenant, never text from a request. At most
    ``max_keys`` keys are kept; beyond, the ones whose bucket is full again are forgotten
    (they would pass anyway), or all of them."""

    def __init__(
        self,
        burst: int,
        rate_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
    ) -> None:
        self.burst = burst
        self.rate_s = rate_s
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, as of)
        self._suppressed: Counter[str] = Counter()

    @property
    def suppressed(self) -> int:
        """Attempts counted but not (yet) reported by a pass."""
        return sum(self._suppressed.values())

    def passes(self, key: str) -> int | None:
        """None when ``key`` is over its budget (counted); else how many of its attempts were
        counted since its last pass."""
        now = self._clock()
        tokens, then = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            self._suppressed[key] += 1
            return None
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            self._forget(now)
        self._buckets[key] = (tokens - 1.0, now)
        return self._suppressed.pop(key, 0)

    def _forget(self, now: float) -> None:
        full = [
            k
            for k, (tokens, then) in self._buckets.items()
            if tokens + (now - then) * self.rate_s >= self.burst and k not in self._suppressed
        ]
        for k in full or list(self._buckets):
            del self._buckets[k]


class BurstLog:
    """INFO lines through a ``BurstGate`` per key: a line over its key's budget is counted,
    and the next one of that key that passes ends with ``suffix`` (formatted with ``count``
    and ``key``). Thread-safety: as ``BurstGate``."""

    def __init__(
        self,
        logger: logging.Logger,
        gate: BurstGate,
        suffix: str = " ({count} more lines of {key} left out before this one)",
    ) -> None:
        self._log = logger
        self.gate = gate
        self.suffix = suffix

    def info(self, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` is over its budget; whether it was logged."""
        left_out = self.gate.passes(key)
        if left_out is None:
            return False
        if left_out:
            msg += self.suffix.format(count=left_out, key=key).replace("%", "%%")
        self._log.info(msg, *args)
        return True


# The logger of grpc's asyncio server core, and what it logs, with a traceback, when sending
# an answer fails because the call ended meanwhile without grpc seeing the client leave: a
# deadline that passes just as the answer goes out.
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
_LOST_ANSWER = "ExecuteBatchError raised in core"


class LostAnswerFilter(logging.Filter):
    """Turns grpc's ERROR-with-traceback for an answer that could not be sent into one
    WARNING line, without the traceback, per ``interval_s``: any client can cause it at will
    (76 a second from one client whose deadlines end as answers go out). Every other record
    passes unchanged. Install on ``GRPC_CORE_LOGGER``."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._gate = IntervalGate(interval_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith(_LOST_ANSWER):
            return True
        passed = self._gate.passes("lost answer")
        if passed is None:
            return False
        skipped, since = passed
        method = text.partition("[")[2].rstrip("]") or "an RPC"
        record.msg = "%s: an answer was not sent, its call had ended (the client's deadline)"
        record.args = (method,)
        if skipped:
            record.msg += _SKIPPED
            record.args = (method, skipped, since)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True
