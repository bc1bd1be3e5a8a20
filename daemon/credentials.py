"""The credential socket: who a client is, and the memory it hands over.

gRPC's Python server does not expose the credentials of a Unix-socket peer, so the daemon
also listens on a small plain Unix socket beside the gRPC one (its path plus ``.cred``, same
mode and group). For each connection it reads SO_PEERCRED, the kernel's record of the
connecting process's (pid, uid, gid), and answers one *ticket*: 32 random bytes that are good
once, for ``TICKET_TTL_S`` seconds, and bound to those credentials. The client passes the
ticket in ``OpenSession`` (the session then carries the credentials) or, for memory it sends
along with the request as a file descriptor (SCM_RIGHTS), in ``RegisterPool``.

Protocol (one request per connection, ASCII lines)::

    client: "KVTIER-CRED/1 SESSION\\n"                     daemon: "OK <64 hex digits>\\n"
    client: "KVTIER-CRED/1 POOL\\n" + one fd (SCM_RIGHTS)  daemon: "OK <64 hex digits>\\n"
    on any refusal                                        daemon: "ERR <STATUS> <text>\\n"

Invariants:
- A ticket is redeemed at most once, only for its kind, and only before it expires. The
  table is keyed by the ticket's SHA-256, so no lookup compares a guess with a secret. The
  one exception: a pool ticket whose registration the daemon undid because it ended the
  session meanwhile (``SessionEnded``: a reload, or a session its client gave up) is given
  back, good until it expires as before, since the client sends the same request with it
  again in a new session.
- A pool ticket owns its fd until it is redeemed (the caller then owns it), discarded (a
  registration refused before redeeming it: the fd is closed) or expires (the fd is
  closed); given back, it owns it again. Only memory-backed fds are kept: memfds and
  tmpfs files, the files on which F_GET_SEALS succeeds. They cannot stall a page fault on a
  remote or user-space filesystem. They must be open for reading and writing, and not sealed
  against writing (the daemon writes loaded blocks into them).
- Nothing here blocks the event loop: sockets are non-blocking, a connection has
  ``IO_TIMEOUT_S`` to send its request, at most ``MAX_CONNECTIONS`` are open at once (one
  more ends the oldest connection of the uid that holds the most, so a uid that connects and
  says nothing over and over takes room from itself, never from the others), and a
  received fd that is not memory-backed (its close() may wait on a filesystem, FUSE's flush
  for one) is closed on the FdCloser's thread. While that thread is behind, no new
  connection is accepted, so a stuck close costs the credential socket, never the daemon.
- One uid holds at most ``MAX_TICKETS_PER_UID`` unredeemed tickets; one request holds
  at most ``MAX_FDS_PER_REQUEST`` received fds, over all its messages (one more refuses its request at once).

Thread-safety: the event loop only, except FdCloser, whose methods any thread may call.
"""

from __future__ import annotations

import array
import asyncio
import enum
import fcntl
import hashlib
import logging
import os
import queue
import secrets
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.daemon.errors import (
    InvalidArgument,
    KvtierError,
    ResourceExhausted,
    TicketRefused,
)
from kvtier.daemon.ratelog import RateLimitedLog
from kvtier.daemon.sessions import PeerCred
from kvtier.daemon.unixsock import SocketAccess, SocketIdentity, bind_unix, remove_socket

log = logging.getLogger(__name__)

PROTOCOL = b"KVTIER-CRED/1"
CRED_SUFFIX = ".cred"
# Long enough for a loaded client to get from the ticket to its RPC; short enough that a
# leaked ticket is soon worthless. Clients replace a session ticket they have held for half
# of it (the client's TICKET_REUSE_S) before sending a refused OpenSession again.
TICKET_TTL_S = 10.0
MAX_TICKETS_PER_UID = 256
MAX_CONNECTIONS = 64
# Connections accepted per wake-up of the event loop: clients connecting in a loop must not
# keep the loop accepting while every other callback waits.
ACCEPTS_PER_WAKEUP = 16
IO_TIMEOUT_S = 2.0
MAX_REQUEST_BYTES = 128
MAX_FDS_PER_REQUEST = 4
# Received fds waiting for the closer thread beyond which accepting pauses.
MAX_PENDING_CLOSES = 64


def cred_socket_path(socket_path: str) -> str:
    return socket_path + CRED_SUFFIX


# Seals under which a file can no longer be written through a new shared mapping: the daemon
# writes loaded blocks into a pool. F_SEAL_FUTURE_WRITE (Linux 5.1) is not in Python's fcntl.
WRITE_SEALS = fcntl.F_SEAL_WRITE | 0x10
WRITE_SEALED = (
    "the memory file is sealed against writing (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE); the "
    "daemon writes loaded blocks into a pool, so seal it against shrinking and growing only"
)


def write_sealed(fd: int) -> bool:
    """Whether memory file ``fd`` is sealed against writing (``WRITE_SEALS``), which makes
    the daemon's mapping of it fail; False for a file that takes no seals."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & WRITE_SEALS)
    except OSError:
        return False


def is_memory_backed(fd: int) -> bool:
    """Whether ``fd`` is a memfd or a tmpfs file. F_GET_SEALS succeeds exactly on those and
    never calls into a filesystem, so it is safe on any fd a client sends."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return True


class FdCloser:
    """Closes received fds. A memory-backed fd closes at once; any other goes to a thread of
    its own, since close() may wait on its filesystem (or on a lingering socket)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self, fd: int) -> None:
        if is_memory_backed(fd):
            os.close(fd)
            return
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvtier-fd-closer", daemon=True
                )
                self._thread.start()
        self._queue.put(fd)

    def _run(self) -> None:
        while True:
            fd = self._queue.get()
            try:
                os.close(fd)
            except OSError as e:
                log.debug("closing a received fd failed: %s", e)
            with self._lock:
                self._pending -= 1


class TicketKind(enum.Enum):
    SESSION = "SESSION"
    POOL = "POOL"


@dataclass(eq=False, slots=True)
class Ticket:
    kind: TicketKind
    peer: PeerCred
    expires_at: float
    fd: int = -1  # a pool ticket's memory; the redeemer owns it


class TicketBook:
    """Unredeemed tickets. Thread-safety: none; the event loop's."""

    def __init__(
        self,
        closer: FdCloser,
        *,
        ttl_s: float = TICKET_TTL_S,
        max_per_uid: int = MAX_TICKETS_PER_UID,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._closer = closer
        self._ttl_s = ttl_s
        self._max_per_uid = max_per_uid
        self._clock = clock
        self._tickets: dict[bytes, Ticket] = {}
        self._per_uid: Counter[int] = Counter()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tickets)

    def issue(self, kind: TicketKind, peer: PeerCred, fd: int = -1) -> bytes:
        """A new ticket; on refusal the caller still owns ``fd``."""
        self.expire()
        if self._per_uid[peer.uid] >= self._max_per_uid:
            raise ResourceExhausted(
                f"uid {peer.uid} holds {self._max_per_uid} unused tickets; redeem or let "
                "them expire first"
            )
        secret = secrets.token_bytes(32)
        self._tickets[ticket_digest(secret)] = Ticket(kind, peer, self._clock() + self._ttl_s, fd)
        self._per_uid[peer.uid] += 1
        return secret

    def redeem(self, secret: bytes, kind: TicketKind) -> Ticket:
        """Spend a ticket; raises TicketRefused if it is unknown, spent, expired or of another
        kind (the ticket is spent in every case)."""
        self.expire()
        ticket = self._tickets.pop(ticket_digest(secret), None) if len(secret) == 32 else None
        if ticket is None:
            raise TicketRefused(
                "the credential ticket is unknown, already used or expired; ask the "
                "credential socket for a new one"
            )
        self._forget(ticket)
        if ticket.kind is not kind:
            self._drop_fd(ticket)
            raise TicketRefused(
                f"a {ticket.kind.value.lower()} ticket cannot be used for a {kind.value.lower()}"
            )
        return ticket

    def withdraw(self, secret: bytes, peer: PeerCred) -> None:
        """Spend ``secret`` unused if it is an unspent session ticket of ``peer``'s process
        (pid and uid): its client gave up the OpenSession that sent it, which may yet run;
        spent, it opens no session that client no longer knows of. Nothing otherwise."""
        digest = ticket_digest(secret)
        ticket = self._tickets.get(digest)
        if (
            ticket is not None
            and ticket.kind is TicketKind.SESSION
            and (ticket.peer.pid, ticket.peer.uid) == (peer.pid, peer.uid)
        ):
            del self._tickets[digest]
            self._forget(ticket)

    def discard(self, secret: bytes) -> None:
        """Spend ``secret`` unused, its fd closed, if the book holds it: the request that
        carried it was refused before redeeming it, and is not sent again with it. Nothing
        otherwise."""
        ticket = self._tickets.pop(ticket_digest(secret), None) if len(secret) == 32 else None
        if ticket is not None:
            self._forget(ticket)
            self._drop_fd(ticket)

    def give_back(self, secret: bytes, ticket: Ticket) -> None:
        """Make ``ticket``, redeemed with ``secret``, good again until it expires as it would
        have (see the module invariants), with its fd: the book owns the fd again, and the
        caller must not close it. One that has expired meanwhile, or given back to a closed
        book, is dropped (its fd closed) at once. Counted to its uid again, even beyond
        ``max_per_uid``: it was counted when it was issued."""
        if self._closed or ticket.expires_at <= self._clock():
            self._drop_fd(ticket)
            return
        self._tickets[ticket_digest(secret)] = ticket
        self._per_uid[ticket.peer.uid] += 1

    def expire(self) -> int:
        now = self._clock()
        stale = [d for d, t in self._tickets.items() if t.expires_at <= now]
        for d in stale:
            ticket = self._tickets.pop(d)
            self._forget(ticket)
            self._drop_fd(ticket)
        return len(stale)

    def close(self) -> None:
        self._closed = True
        for ticket in self._tickets.values():
            self._drop_fd(ticket)
        self._tickets.clear()
        self._per_uid.clear()

    def _forget(self, ticket: Ticket) -> None:
        self._per_uid[ticket.peer.uid] -= 1
        if self._per_uid[ticket.peer.uid] <= 0:
            del self._per_uid[ticket.peer.uid]

    def _drop_fd(self, ticket: Ticket) -> None:
        if ticket.fd >= 0:
            self._closer.close(ticket.fd)
            ticket.fd = -1


def ticket_digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: PeerCred
    timer: asyncio.TimerHandle | None = None
    buffer: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)


class CredentialServer:
    """The credential socket on the event loop. Thread-safety: the event loop only."""

    def __init__(
        self,
        path: str,
        tickets: TicketBook,
        closer: FdCloser,
        status_name: Callable[[KvtierError], str],
        log_interval_s: float = 10.0,
        counters: Counter[str] | None = None,
    ) -> None:
        self.path = path
        self.tickets = tickets
        self.closer = closer
        # The server's mapping of errors to status names (ERR lines use gRPC's names).
        self._status_name = status_name
        self._ratelog = RateLimitedLog(log, log_interval_s)
        # The server's counters (``kvtier stats`` and the metrics show them), or its own.
        self.counters: Counter[str] = Counter() if counters is None else counters
        self._sock: socket.socket | None = None
        self._identity: SocketIdentity = (0, 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connections: dict[_Connection, None] = {}  # in the order they came
        self._per_uid: Counter[int] = Counter()
        self._accepting = False

    def start(self, access: SocketAccess) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock, self._identity = bind_unix(self.path, access)
        self._resume_accepting()

    def close(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._pause_accepting()
            self._sock.close()
            self._sock = None
            remove_socket(self.path, self._identity)
        for conn in list(self._connections):
            self._drop(conn)

    # ------------------------------------------------------------------ accept

    def _resume_accepting(self) -> None:
        if not self._accepting and self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._on_accept)
            self._accepting = True

    def _pause_accepting(self) -> None:
        if self._accepting and self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._accepting = False

    def _on_accept(self) -> None:
        assert self._sock is not None and self._loop is not None
        for _ in range(ACCEPTS_PER_WAKEUP):
            if self._sock is None:
                return
            if self.closer.pending >= MAX_PENDING_CLOSES:
                # The backlog holds the rest until the closer thread catches up.
                self._pause_accepting()
                self._loop.call_later(IO_TIMEOUT_S, self._resume_accepting)
                return
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: try again a little later
                log.warning("credential socket: accept failed: %s", e)
                self._pause_accepting()
                self._loop.call_later(IO_TIMEOUT_S, self._resume_accepting)
                return
            try:
                sock.setblocking(False)
                pid, uid, gid = struct.unpack(
                    "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                )
            except OSError:
                sock.close()
                continue
            if len(self._connections) >= MAX_CONNECTIONS:
                self._make_room()
            conn = _Connection(sock, PeerCred(pid, uid, gid))
            conn.timer = self._loop.call_later(IO_TIMEOUT_S, self._drop, conn)
            self._connections[conn] = None
            self._per_uid[uid] += 1
            self._loop.add_reader(sock.fileno(), self._on_readable, conn)

    def _make_room(self) -> None:
        """End the oldest connection of the uid that holds the most, answering it."""
        busiest = self._per_uid.most_common(1)[0][0]
        oldest = next(c for c in self._connections if c.peer.uid == busiest)
        self._reply(
            oldest,
            ResourceExhausted(
                f"the credential socket holds {MAX_CONNECTIONS} connections, the most of them "
                f"uid {busiest}'s: its oldest was ended; send a request as soon as connected"
            ),
        )

    # ------------------------------------------------------------------ serve

    def _on_readable(self, conn: _Connection) -> None:
        try:
            self._read(conn)
        except Exception:
            # A client must not be able to make the event loop log tracebacks at will.
            self.counters["credential_internal_errors"] += 1
            self._ratelog.exception("credential socket", "credential socket: request failed")
            self._drop(conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data, ancillary, flags, _ = conn.sock.recvmsg(
                MAX_REQUEST_BYTES,
                socket.CMSG_SPACE(MAX_FDS_PER_REQUEST * 4),
                socket.MSG_CMSG_CLOEXEC,
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                conn.fds.extend(fds)
        # Counted over the whole request: one fd with each byte of a line not yet ended
        # would otherwise hold hundreds per connection until the I/O timeout.
        if flags & socket.MSG_CTRUNC or len(conn.fds) > MAX_FDS_PER_REQUEST:
            self._reply(conn, InvalidArgument(f"at most {MAX_FDS_PER_REQUEST} fds per request"))
            return
        if not data:
            self._drop(conn)  # closed before a whole request
            return
        conn.buffer += data
        end = conn.buffer.find(b"\n")
        if end < 0:
            if len(conn.buffer) >= MAX_REQUEST_BYTES:
                self._reply(conn, InvalidArgument("the request line is too long"))
            return
        try:
            self._reply(conn, self._serve(conn, bytes(conn.buffer[:end])))
        except KvtierError as e:
            self._reply(conn, e)

    def _serve(self, conn: _Connection, line: bytes) -> bytes:
        proto, _, verb = line.partition(b" ")
        if proto != PROTOCOL:
            raise InvalidArgument(f"expected {PROTOCOL.decode()} SESSION or POOL")
        if verb == TicketKind.SESSION.value.encode():
            if conn.fds:
                raise InvalidArgument("a session request carries no file descriptor")
            self.counters["credential_session_tickets"] += 1
            return self.tickets.issue(TicketKind.SESSION, conn.peer)
        if verb == TicketKind.POOL.value.encode():
            if len(conn.fds) != 1:
                raise InvalidArgument(
                    f"a pool request carries exactly one file descriptor, not {len(conn.fds)}"
                )
            fd = conn.fds[0]
            _check_pool_fd(fd)
            secret = self.tickets.issue(TicketKind.POOL, conn.peer, fd)
            conn.fds.clear()  # the ticket owns it now
            self.counters["credential_pool_tickets"] += 1
            return secret
        raise InvalidArgument(f"unknown request {verb[:32]!r}; expected SESSION or POOL")

    def _reply(self, conn: _Connection, answer: bytes | KvtierError) -> None:
        if isinstance(answer, KvtierError):
            self.counters["credential_refused"] += 1
            text = str(answer).replace("\n", " ")
            line = f"ERR {self._status_name(answer)} {text}\n".encode()
        else:
            line = b"OK " + answer.hex().encode() + b"\n"
        try:
            conn.sock.send(line)  # a few dozen bytes into an empty socket buffer
        except OSError as e:
            log.debug("credential socket: reply to pid %d lost: %s", conn.peer.pid, e)
        self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        if conn not in self._connections:
            return
        del self._connections[conn]
        self._per_uid[conn.peer.uid] -= 1
        if self._per_uid[conn.peer.uid] <= 0:
            del self._per_uid[conn.peer.uid]
        if conn.timer is not None:
            conn.timer.cancel()
        if self._loop is not None:
            self._loop.remove_reader(conn.sock.fileno())
        conn.sock.close()
        for fd in conn.fds:
            self.closer.close(fd)
        conn.fds.clear()
        if self.closer.pending < MAX_PENDING_CLOSES:
            self._resume_accepting()


def _check_pool_fd(fd: int) -> None:
    if not is_memory_backed(fd):
        raise InvalidArgument(
            "the file descriptor is not memory (a memfd or a tmpfs file); other files are refused"
        )
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument("the file descriptor is not a regular memory file")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidArgument("the file descriptor must be open for reading and writing")
    if write_sealed(fd):
        raise InvalidArgument(WRITE_SEALED)
