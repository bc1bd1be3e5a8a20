"""Logging setup: plain text for people, one JSON object per line for log pipelines; and the
request context every log line carries.

The RPC layer (``daemon/observe.py``) binds a request id, and the session and pool the request
names, in one context variable for the duration of each request; ``RequestContextFilter`` copies
them onto every record, so any line a request causes (in the servicer, the store, a background
task it started, a transfer or disk thread, or a pool's mapping thread; asyncio tasks, the
tiers' worker threads (``tiers/executor.py``) and the mapping threads (``fairthreads``) copy
the context) names them without a single call site passing them along.

Thread-safety: context variables are per task and per thread; the handlers are the logging
module's own.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

# The ids of the request running now: (request id, session id as shown, pool id). A request id
# is the client's (a string), or a number of the daemon's own, written as 12 hex digits only
# when a line is logged: most requests log nothing. One variable, not one per id: every
# request sets and resets it.
RequestIds = tuple[str | int, str, int]
request_ids: contextvars.ContextVar[RequestIds] = contextvars.ContextVar(
    "request_ids", default=("", "", 0)
)

# Record attributes (and JSON keys) the filter sets, in output order.
CONTEXT_FIELDS = ("request_id", "session_id", "pool_id")


Bound = contextvars.Token[RequestIds]


def bind(rid: str | int, session: str = "", pool: int = 0) -> Bound:
    """Bind the ids of one request; ``unbind`` what this returns when it ends (the unary
    RPC path calls the two itself: a context manager's generator costs as much again)."""
    return request_ids.set((rid, session, pool))


def unbind(token: Bound) -> None:
    # try, not contextlib.suppress: every request ends here, and a context manager costs more.
    try:  # noqa: SIM105
        request_ids.reset(token)
    except ValueError:
        # A streaming handler's generator closed by asyncio's finalizer runs in another
        # context, where these values were never set: nothing to undo there.
        pass


def request_id_text(rid: str | int) -> str:
    """A request id as logged: the client's as it sent it, the daemon's own in hex."""
    return rid if isinstance(rid, str) else f"{rid:012x}"


def current_request_id() -> str:
    """The bound request id as logged ("" outside a request)."""
    return request_id_text(request_ids.get()[0])


@contextmanager
def request_context(rid: str | int, session: str = "", pool: int = 0) -> Iterator[None]:
    """Bind the ids of one request for the code that runs inside."""
    token = bind(rid, session, pool)
    try:
        yield
    finally:
        unbind(token)


class RequestContextFilter(logging.Filter):
    """Copies the bound ids onto each record (empty strings / 0 outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid, record.session_id, record.pool_id = request_ids.get()
        record.request_id = request_id_text(rid)
        return True


def _context_text(record: logging.LogRecord) -> str:
    parts = []
    if rid := getattr(record, "request_id", ""):
        parts.append(f"req={rid}")
    if sid := getattr(record, "session_id", ""):
        parts.append(f"session={sid}")
    if pid := getattr(record, "pool_id", 0):
        parts.append(f"pool={pid}")
    return f" [{' '.join(parts)}]" if parts else ""


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        context = _context_text(record)
        if not context:
            return text
        # After the message's first line, so a traceback keeps its shape.
        first, nl, rest = text.partition("\n")
        return first + context + nl + rest


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def as_logged(message: str, fmt: str, logger: str, level: str = "INFO") -> str:
    """``message``, a line kvtierd writes itself rather than through ``logging`` (the start
    line, which shows at any log level; a start refused before logging is set up), in the
    log's format: as is for ``text``, else one JSON object with the log's keys, so that a
    pipeline that parses the JSON log (a pod's, where stdout and stderr are one stream)
    takes every line."""
    if fmt != "json":
        return message
    record = logging.makeLogRecord(
        {"name": logger, "levelname": level, "levelno": logging.getLevelName(level)}
    )
    record.msg = message
    return JsonFormatter().format(record)


# Loggers kept at INFO or above whatever the level: grpc's Python layer logs every call at
# DEBUG ("Loaded running loop"), which buried the daemon's own DEBUG lines.
QUIET_AT_DEBUG = ("grpc",)


def setup_logging(level: str, fmt: str) -> None:
    """Install the one stderr handler (replacing any), at ``level`` (any case)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in QUIET_AT_DEBUG:
        logging.getLogger(name).setLevel(max(root.level, logging.INFO))
