"""The client side of the daemon's credential socket.

The daemon learns who a client is from the kernel (SO_PEERCRED), which gRPC does not expose,
so a client first asks the credential socket (the gRPC socket's path plus ``.cred``) for a
one-time ticket and passes it in ``OpenSession``; memory goes over the same socket as a file
descriptor, answered by a ticket for ``RegisterPool``. Each request is one short-lived
connection::

    "KVTIER-CRED/1 SESSION\\n"                      -> "OK <64 hex digits>\\n"
    "KVTIER-CRED/1 POOL\\n" + one fd (SCM_RIGHTS)   -> "OK <64 hex digits>\\n"
    on refusal                                     -> "ERR <STATUS> <text>\\n"

Before it sends anything, the client checks who listens there: SO_PEERCRED on its connection
must name the uid that owns the gRPC socket (the daemon binds both, so that is the daemon's
user, root's for a daemon run as root), and the socket's folder (as named, and where the
path leads) may be written by no one but root and that owner, else ``UntrustedSocketError``.
The daemon refuses a socket folder that others may write, but a client cannot know that the
folder it finds is one a daemon checked; a process of another user that took the credential
socket's place, or both sockets' in a folder he may write (/tmp while the daemon is stopped),
would otherwise receive the engine's memory files. A root client of another user's daemon
passes: what counts is who owns the socket, not who connects. Left: in a folder of his own,
another user's sockets are his daemon's, whatever address the client was given.

Thread-safety: the functions share nothing; call them from any thread.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time

import grpc

from kvtier.client.errors import (
    DeadlineExceededError,
    KvtierError,
    PermissionDeniedError,
    UnavailableError,
    UntrustedSocketError,
    ended_by_daemon,
    error_for_code,
    session_end,
)
from kvtier.client.types import unix_socket_path
from kvtier.paths import writers_problem

PROTOCOL = b"KVTIER-CRED/1"
CRED_SUFFIX = ".cred"
_MAX_REPLY_BYTES = 1024
# The daemon keeps a ticket for 10 s (its TICKET_TTL_S). An OpenSession that the daemon's gRPC
# keeps refusing unrun is sent again for up to the client's timeout (30 s by default), ticket
# and all: one held this long is replaced before the next send, leaving the daemon the rest of
# its 10 s to redeem the ticket it gets.
TICKET_REUSE_S = 5.0
# A session id is the session's secret: any request naming it acts as that session, whichever
# process sends it. Logs show this many of its characters, as the daemon's do.
SHOWN_ID_CHARS = 8


def shown_id(session_id: str) -> str:
    """The part of a session id that logs may show."""
    return session_id[:SHOWN_ID_CHARS]


# The logger of the WARNING a client writes when its session ends (``session_end_line``). A
# program that tells its user itself what became of the daemon (the ``kvtier`` CLI) silences
# it: with no logging configured, Python writes such a line to stderr.
SESSION_LOGGER = "kvtier.client.session"


def session_end_line(session_id: str, error: grpc.RpcError | None, ours: bool) -> str | None:
    """The log line of a session's stream that ended (``error``: how), or None: said when the
    session was still the client's (``ours``), or when the daemon ended it (a call may have
    forgotten it first, see ``Client.forget_session``)."""
    if not (ours or ended_by_daemon(error)):
        return None
    return f"kvtier session {shown_id(session_id)} ended ({session_end(error)})"


def cred_socket_path(address: str) -> str | None:
    """The credential socket of a gRPC address, or None if it is not a Unix socket."""
    path = unix_socket_path(address)
    return None if path is None else path + CRED_SUFFIX


def session_ticket(path: str, timeout_s: float = 10.0) -> bytes:
    """A ticket for OpenSession, bound to this process's credentials."""
    return _request(path, b"SESSION", None, timeout_s)


class SessionTickets:
    """The ticket of one OpenSession, however many times it is sent: ``due()`` says whether
    the next send needs a new one (the first, or the held one is ``TICKET_REUSE_S`` old),
    ``fetch()`` gets it. None are needed off a Unix socket (``path`` None). A replaced
    ticket is left to expire in the daemon: at most one per ``TICKET_REUSE_S``.

    Thread-safety: none; one OpenSession's sends run one after another."""

    __slots__ = ("_asked_at", "path")

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._asked_at: float | None = None

    def due(self) -> bool:
        if self.path is None:
            return False
        return self._asked_at is None or time.monotonic() - self._asked_at >= TICKET_REUSE_S

    def fetch(self, timeout_s: float) -> bytes:
        assert self.path is not None
        # Its age counts from the request: the daemon's 10 s start later.
        asked_at = time.monotonic()
        ticket = session_ticket(self.path, max(timeout_s, 0.001))
        self._asked_at = asked_at
        return ticket


def pool_ticket(path: str, fd: int, timeout_s: float = 10.0) -> bytes:
    """Hand the memory file ``fd`` to the daemon; the ticket names it in RegisterPool."""
    return _request(path, b"POOL", fd, timeout_s)


def _request(path: str, verb: bytes, fd: int | None, timeout_s: float) -> bytes:
    line = PROTOCOL + b" " + verb + b"\n"
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            while True:
                try:
                    sock.connect(path)
                    break
                except BlockingIOError:
                    # The daemon's backlog is full for now (other clients are connecting):
                    # try again until the timeout, as a blocking connect would wait.
                    if time.monotonic() >= deadline:
                        raise TimeoutError from None
                    time.sleep(0.005)
            _check_listener(sock, path)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            if fd is None:
                sock.sendall(line)
            else:
                sock.sendmsg(
                    [line], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                )
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < _MAX_REPLY_BYTES:
                chunk = sock.recv(_MAX_REPLY_BYTES)
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            raise DeadlineExceededError(
                f"the daemon's credential socket {path} did not answer within {timeout_s}s"
            ) from None
        except PermissionError as e:
            # A daemon is listening there; this user may not connect to it.
            raise PermissionDeniedError(
                f"the daemon's credential socket {path} refused this user: {e.strerror or e} "
                "(the daemon's server.socket_mode and server.socket_group say who may connect)"
            ) from None
        except OSError as e:
            raise UnavailableError(
                f"the daemon's credential socket {path} did not answer: {e.strerror or e}"
            ) from None
    return _parse(reply, path)


def _check_listener(sock: socket.socket, path: str) -> None:
    """Refuse the credential socket ``path`` (connected as ``sock``) unless its listener runs
    as the owner of the daemon's gRPC socket beside it (see the module's docstring)."""
    _pid, uid, _gid = struct.unpack(
        "iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    )
    grpc_socket = path.removesuffix(CRED_SUFFIX)
    try:
        owner = os.stat(grpc_socket).st_uid
    except OSError as e:
        raise UntrustedSocketError(
            f"the credential socket {path} has no daemon's socket {grpc_socket} beside it "
            f"({e.strerror or e}) to show whose it is; nothing was sent to it"
        ) from None
    if uid != owner:
        raise UntrustedSocketError(
            f"the credential socket {path} is held by uid {uid}, but the daemon's socket "
            f"{grpc_socket} belongs to uid {owner}: another user's process may have taken "
            "the credential socket's place; nothing was sent to it"
        )
    # The owner tells whose the sockets are only where no one else could have put them.
    named = (grpc_socket, os.path.realpath(grpc_socket))
    folders = {os.path.dirname(name) or "." for name in named}
    for folder in sorted(folders):
        try:
            st = os.stat(folder)
        except OSError as e:
            raise UntrustedSocketError(
                f"the daemon's socket's folder {folder} cannot be checked ({e.strerror or e}); "
                "nothing was sent to it"
            ) from None
        if (problem := writers_problem(st, owner)) is not None:
            raise UntrustedSocketError(
                f"the daemon's socket {grpc_socket} is in {folder} that users other than "
                f"root and the socket's owner (uid {owner}) may write: the folder {problem} "
                "(a daemon refuses such a folder); nothing was sent to it"
            )


def _parse(reply: bytes, path: str) -> bytes:
    text = reply.decode("ascii", "replace").strip()
    status, _, rest = text.partition(" ")
    if status == "OK":
        try:
            ticket = bytes.fromhex(rest)
        except ValueError:
            ticket = b""
        if len(ticket) == 32:
            return ticket
    elif status == "ERR":
        code_name, _, message = rest.partition(" ")
        code = grpc.StatusCode.__members__.get(code_name)
        if code is not None:
            raise error_for_code(code, message)
        raise KvtierError(message or rest)
    raise UnavailableError(f"the credential socket {path} answered {text[:80]!r}")
