"""Typed client exceptions, one per gRPC status the daemon returns, and
``UntrustedSocketError``, the client's own refusal of a credential socket (a
PermissionDeniedError).

Every error raised by a client call is a KvtierError; callers that only want "use the cache if
it works" catch that one type and treat it as a miss. That includes wrong arguments: a value
the request's protobuf message refuses (``kvtier.client.types.build_request``) and the
client's own checks raise InvalidArgumentError before anything is sent.
"""

from __future__ import annotations

import time

import grpc

from kvtier.proto.wire import ANSWERED_KEY, DRAINING_KEY, SESSION_GONE_KEY, TICKET_REFUSED_KEY


class KvtierError(Exception):
    """Base of every client error. ``code`` is the gRPC status, ``details`` the daemon's text."""

    code: grpc.StatusCode | None = None

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgumentError(KvtierError, ValueError):
    """The daemon refused an argument, or the client did before sending the request (a
    ``SharedMemoryPool`` used after its ``close()``, by a call or by its own ``array()`` and
    ``tensor()``, included). Also a ValueError, as the client's own argument checks raised
    before they raised this."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(KvtierError):
    """What the call names does not exist; ``session_gone``: its session (the daemon ended
    it, or restarted), and nothing of the call was done (the clients then send it again in
    a new session, up to three times: ``flows.SendAgain``)."""

    code = grpc.StatusCode.NOT_FOUND
    session_gone = False


class UnauthenticatedError(KvtierError):
    """The request had no valid credential: a missing, spent or expired ticket, or a token
    no tenant has; ``ticket_refused``: the ticket it carried (unknown, spent or expired),
    where a new one may do."""

    code = grpc.StatusCode.UNAUTHENTICATED
    ticket_refused = False


class PermissionDeniedError(KvtierError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UntrustedSocketError(PermissionDeniedError):
    """Raised by the client itself, never answered by a daemon: the process listening on the
    daemon's credential socket runs as another user than the one who owns the daemon's
    gRPC socket beside it (the daemon binds both), or the sockets' folder may be written by
    users other than root and that owner, so another user may have taken the daemon's place.
    The client sent it nothing: no ticket request, no memory file."""


class FailedPreconditionError(KvtierError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(KvtierError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(KvtierError):
    """The daemon is not reachable (not started, restarting, or shutting down), or it
    answered that it takes no such call now (draining, stopping, or a part it needs is
    down): then ``answered`` is True."""

    code = grpc.StatusCode.UNAVAILABLE
    answered = False
    # The daemon turned a new session away because it is draining: it runs.
    draining = False
    # The close of a channel the blocking client gave up ended the call once sent: the daemon
    # may have run it (``kvtier.client.sync.cut_off_error``).
    cut_off = False


class DeadlineExceededError(KvtierError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(KvtierError):
    code = grpc.StatusCode.INTERNAL


# Statuses the daemon answers after deciding a request: nothing of it is still running.
_ANSWERED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def unclean(error: BaseException) -> bool:
    """Whether a failed transfer may have left the daemon still copying its pages."""
    return not (isinstance(error, KvtierError) and error.code in _ANSWERED)


_BY_CODE: dict[grpc.StatusCode, type[KvtierError]] = {
    cls.code: cls  # type: ignore[misc]
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        InternalError,
    )
}


def error_for_code(code: grpc.StatusCode, details: str) -> KvtierError:
    """The typed exception for a status code."""
    return _BY_CODE.get(code, KvtierError)(details, code)


def ended_by_daemon(error: grpc.RpcError | None) -> bool:
    """Whether a session's stream ended (``error``: how, None for its plain end) because the
    daemon ended the session itself, which it does only when a reload of its tenants would
    bind it otherwise (PERMISSION_DENIED, saying so)."""
    return error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED


def session_end(error: grpc.RpcError | None) -> str:
    """Why a session's stream ended (see ``ended_by_daemon``), for the client's log line."""
    if ended_by_daemon(error):
        assert error is not None
        return f"the daemon ended it: {error.details()}"
    return "daemon stopped or unreachable"


def closed_error() -> UnavailableError:
    """What a call gets once another thread closed its client."""
    return UnavailableError("the client was closed")


def from_rpc_error(err: grpc.RpcError) -> KvtierError:
    """The typed exception for a failed call."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    if code is None:
        return KvtierError(details)
    if code == grpc.StatusCode.CANCELLED:
        # The client's own cancels end jobs and tasks without turning the call's error into an
        # exception, and a call its close() ended is closed_error() (Client.error_of), so the
        # server's gRPC ended this one unanswered: it is shutting down (calls it holds but
        # has not handed to the daemon end so at SIGTERM), or it dropped the call past its
        # queue. Either way, try again later.
        return UnavailableError(
            f"the daemon's gRPC server ended the call unanswered ({details}): the daemon is "
            "stopping, or too many calls were waiting",
            code,
        )
    error = error_for_code(code, details)
    if isinstance(error, UnavailableError):
        error.answered = _has_key(err, ANSWERED_KEY)
        error.draining = _has_key(err, DRAINING_KEY)
    elif isinstance(error, NotFoundError):
        error.session_gone = _has_key(err, SESSION_GONE_KEY)
    elif isinstance(error, UnauthenticatedError):
        error.ticket_refused = _has_key(err, TICKET_REFUSED_KEY)
    return error


# A refused call is sent again after the first pause, doubling up to the second, within
# its timeout: the daemon's other calls on that connection end within milliseconds.
REFUSED_PAUSE_S = (0.001, 0.05)


class Resends:
    """The time of one call that may be sent again while the daemon's gRPC refuses it unrun
    (``refused_stream``): every send of it shares the call's one timeout, and the pauses
    between them double from ``REFUSED_PAUSE_S[0]`` up to ``REFUSED_PAUSE_S[1]``. The
    blocking and asyncio clients' calls, their session streams, the transfer jobs' parts and
    the unanswered unregistrations all pace their resends with it.

    Thread-safety: none; one call's sends run one after another."""

    __slots__ = ("_pause", "deadline")

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self._pause = REFUSED_PAUSE_S[0]

    def left_s(self) -> float:
        """The call's time left: the timeout of its next send."""
        return self.deadline - time.monotonic()

    def pause_s(self) -> float | None:
        """The pause before sending the refused call again, or None when its time would end
        first (the refusal is then the call's answer)."""
        pause = self._pause
        if self.left_s() <= pause:
            return None
        self._pause = min(2 * pause, REFUSED_PAUSE_S[1])
        return pause


def refused_stream(err: grpc.RpcError) -> bool:
    """Whether the server's HTTP/2 layer refused the call before running it (REFUSED_STREAM:
    its connection had ``MAX_STREAMS_PER_CONNECTION`` calls open), so that sending it again
    cannot do anything twice. gRPC reports it only as UNAVAILABLE with these words."""
    try:
        if err.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
            return False
        details = err.details() or ""  # type: ignore[attr-defined]
    except Exception:  # an error that is no call
        return False
    return "RST_STREAM" in details and "error code 7" in details


def _has_key(err: grpc.RpcError, key: str) -> bool:
    """Whether the daemon marked this status with trailing metadata ``key`` (``ANSWERED_KEY``:
    it sent the status itself; ``SESSION_GONE_KEY``: the session the call named is not
    open; ``TICKET_REFUSED_KEY``: the ticket the call carried was no good)."""
    try:
        trailing = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # an error that is no call: no metadata
        return False
    return any(item[0] == key for item in trailing)
