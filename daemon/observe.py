"""What every RPC leaves behind: a latency observation per method and status, and the request
context its log lines carry.

``RpcObserver`` wraps every method handler generically when the services are registered
(the servicer's methods stay as they are): a unary call is timed from the moment its handler
starts until it returns or aborts, and filed as ``rpc_seconds{method, code}``; every call,
streaming ones included, runs inside ``logs.request_context`` with a request id (the client's
``x-request-id`` metadata when it sends a sane one, else a fresh one) and the session and pool
its request names. Session ids appear as their first 8 characters: enough to find the session
in the log, not enough to use it.

Thread-safety: runs on the server's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvtier.daemon import logs
from kvtier.daemon.latency import Histograms, Series
from kvtier.daemon.sessions import shown_id

RPC_HISTOGRAM = "rpc_seconds"
REQUEST_ID_HEADER = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_KVTIER_SERVICE = "/kvtier.v1.KVTier/"


def method_label(full_method: str) -> str:
    """``Lookup`` for kvtier's own methods, ``grpc.health.v1.Health/Check`` for others."""
    if full_method.startswith(_KVTIER_SERVICE):
        return full_method[len(_KVTIER_SERVICE) :]
    return full_method.lstrip("/")


_ID_BITS = 48
_ID_START = secrets.randbits(_ID_BITS)  # a random place in the id space per process
_ID_COUNTER = itertools.count(1)


def _new_id_start() -> None:
    """Draw a start of the child's own: a process forked after the import (the tests' fork
    server's daemons) counted from its parent's."""
    global _ID_START
    _ID_START = secrets.randbits(_ID_BITS)


os.register_at_fork(after_in_child=_new_id_start)


_ID_MASK = (1 << _ID_BITS) - 1


def new_request_id() -> int:
    """A 48-bit number counted from a random start per process (logged as 12 hex digits,
    ``logs.request_id_text``, only when a line is): no system call per request, unique within
    a process, and two processes collide only if their ranges overlap."""
    return (_ID_START + next(_ID_COUNTER)) & _ID_MASK


class RpcObserver:
    """Wraps a service's method handlers once, when they are registered (an interceptor would
    build new handler objects for every call: a measurable share of a small RPC's cost)."""

    def __init__(self, histograms: Histograms, clock: Callable[[], float] = time.perf_counter):
        self.histograms = histograms
        self._clock = clock
        # Each method's series for code OK, the common outcome, once a call has filed in it
        # (``Histograms.series``: no label handling per call).
        self._ok: dict[str, Series] = {}
        # Request message type -> whether it has a session_id and a pool_id field (``_ids``).
        self._id_fields: dict[type, tuple[bool, bool]] = {}

    def wrap(self, service: str, handlers: dict[str, Any]) -> dict[str, Any]:
        """``handlers`` (method name -> grpc.RpcMethodHandler) of ``service``, observed."""
        out: dict[str, Any] = {}
        for name, handler in handlers.items():
            method = method_label(f"/{service}/{name}")
            if handler.unary_unary is not None:
                out[name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(handler.unary_unary, method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
            elif handler.unary_stream is not None:
                out[name] = grpc.unary_stream_rpc_method_handler(
                    self._stream(handler.unary_stream),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
            else:
                raise ValueError(f"{method}: only unary requests are observed")
        return out

    def _unary(
        self, behavior: Callable[[Any, Any], Awaitable[Any]], method: str
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _ObservedCall(self.histograms, method, self._clock, context, self._ok)
            given = _request_id_from(context.invocation_metadata())
            session, pool = _ids(request, self._id_fields)
            token = logs.bind(given or new_request_id(), session, pool)
            try:
                try:
                    result = await behavior(request, call)
                finally:
                    logs.unbind(token)
            except asyncio.CancelledError:
                call.done("CANCELLED")
                raise
            except BaseException:
                call.done(_code_of(context))
                raise
            call.done("OK")
            return result

        return observed

    def _stream(
        self, behavior: Callable[[Any, Any], AsyncIterator[Any]]
    ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            given = _request_id_from(context.invocation_metadata())
            with logs.request_context(given or new_request_id(), *_ids(request, self._id_fields)):
                out = behavior(request, context)
                if hasattr(out, "__aiter__"):
                    async for item in out:
                        yield item
                else:
                    # A handler that writes its responses with context.write().
                    await out  # type: ignore[misc]

        return observed


class _ObservedCall:
    """The servicer's context, which files the call's latency as its status is decided: an
    abort sends the status to the client before the handler's frame unwinds, so a client that
    reads the metrics right after an error must already find the call counted."""

    __slots__ = ("_clock", "_context", "_done", "_histograms", "_method", "_ok", "_started")

    def __init__(
        self,
        histograms: Histograms,
        method: str,
        clock: Callable[[], float],
        context: grpc.aio.ServicerContext,
        ok: dict[str, Series],
    ) -> None:
        self._histograms = histograms
        self._method = method
        self._clock = clock
        self._context = context
        self._ok = ok  # the observer's OK series by method
        self._started = clock()
        self._done = False

    def done(self, code: str) -> None:
        if not self._done:
            self._done = True
            seconds = self._clock() - self._started
            if code != "OK":
                self._histograms.observe(RPC_HISTOGRAM, seconds, method=self._method, code=code)
                return
            series = self._ok.get(self._method)
            if series is None:
                series = self._ok[self._method] = self._histograms.series(
                    RPC_HISTOGRAM, method=self._method, code=code
                )
            series.add(seconds)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", *args: Any, **kwargs: Any
    ) -> None:
        self.done(str(code.name))
        await self._context.abort(code, details, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _ids(request: Any, fields: dict[type, tuple[bool, bool]]) -> tuple[str, int]:
    """The session (as shown) and pool ``request`` names. Which of the two fields its type has
    is looked up once per type in ``fields``: reading a field a protobuf message lacks raises
    an AttributeError inside getattr, which cost more than the rest of the call's observation
    (a Lookup names no pool, a health Check neither)."""
    has = fields.get(type(request))
    if has is None:
        has = fields[type(request)] = (
            hasattr(request, "session_id"),
            hasattr(request, "pool_id"),
        )
    session = request.session_id if has[0] else ""
    pool = request.pool_id if has[1] else 0
    return (shown_id(session) if isinstance(session, str) else "", int(pool or 0))


def _request_id_from(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str) and _SANE_ID.fullmatch(value):
            return value
    return ""


def _code_of(context: grpc.aio.ServicerContext) -> str:
    """The status an aborted call ended with (UNKNOWN for an escaped exception)."""
    try:
        code = context.code()
    except Exception:
        return "UNKNOWN"
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return str(status.name)
    return "UNKNOWN"
