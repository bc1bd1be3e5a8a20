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


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    @property
    def suppressed(self) -> int:
        """Lines counted but not (yet) logged."""
        return sum(self._suppressed.values())

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
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._suppressed[kind] += 1
            return False
        self._last[kind] = now
        skipped = self._suppressed.pop(kind, 0)
        if skipped and last is not None:
            msg += " (and %d more like it in the last %.0fs)"
            args = (*args, skipped, now - last)
        self._log.log(level, msg, *args, exc_info=exc)
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
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith(_LOST_ANSWER):
            return True
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        method = text.partition("[")[2].rstrip("]") or "an RPC"
        record.msg = "%s: an answer was not sent, its call had ended (the client's deadline)"
        record.args = (method,)
        if self.suppressed:
            record.msg += " (and %d more like it in the last %.0fs)"
            record.args = (method, self.suppressed, now - self._last)  # type: ignore[operator]
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        self._last = now
        self.suppressed = 0
        return True
