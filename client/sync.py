"""The blocking client. ``AsyncClient`` in ``kvtier.client.aio`` has the same surface.

A client holds one gRPC channel and, once a call needs one, one session: a server stream that
the daemon watches to know this process is alive. Pools and leases belong to the session, so
they vanish if the process dies. If the daemon restarts, the next call opens a new session and
re-registers the pools it used before, once. So does a client whose gRPC call a
KeyboardInterrupt ended, on a new channel (see ``Client.interrupted``).

On a Unix socket the client first asks the daemon's credential socket for a ticket that binds
the session to this process's uid (see ``kvtier.client.credentials``); a memfd pool's
descriptor goes over the same socket when it is registered. The daemon binds the session to a
tenant by that uid (or by a tenant ``token``, required over TCP); every block call addresses a
namespace inside that tenant, ``namespace`` ("" by default), so tenants never see each other's
blocks whatever keys they use.

Thread-safety: a Client may be shared by threads. It belongs to the process that made it: in
a child that process forked, its calls are FailedPreconditionError (see ``in_own_process``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvtier.client import credentials
from kvtier.client import health as hc
from kvtier.client import types as t
from kvtier.client.cuda import CudaIpcExport
from kvtier.client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvtierError,
    NotFoundError,
    PermissionDeniedError,
    Resends,
    UnauthenticatedError,
    UnavailableError,
    closed_error,
    from_rpc_error,
    refused_stream,
    unclean,
)
from kvtier.client.flows import (
    Flow,
    PoolBinding,
    PoolView,
    SendAgain,
    abandon,
    abandon_advanced,
    check_pages,
    lease_session_ended,
    load_flow,
    new_binding,
    release_unclaimed,
    store_flow,
    unregistration,
)
from kvtier.client.jobs import (
    JobStatus,
    JobTable,
    LoadSegment,
    SaveSegment,
    TransferJob,
    TransferPlan,
)
from kvtier.client.keys import Namespace
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.slots import (
    DEFAULT_MAX_CALLS_OPEN,
    CallSlots,
    checked_max_calls_open,
    slot_wait_error,
)
from kvtier.client.types import resolve_address
from kvtier.kernels.layout import PoolLayout
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

session_log = logging.getLogger(credentials.SESSION_LOGGER)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # A connection of the channel's own. gRPC shares one between a process's channels of the
    # same target and options, and the daemon keeps 256 calls open per connection: a client's
    # max_calls_open then bounded nothing (the 257th client of a process opened no session,
    # and no call of any of them was taken), nor did a given-up channel's calls stay off its
    # replacement's connection.
    ("grpc.use_local_subchannel_pool", 1),
]

# The given-up OpenSessions' tickets an OpenSession names at most (the latest): interrupts
# that end every OpenSession in a row must not grow it past what the daemon takes in one
# (server.MAX_OPEN_SESSION_BYTES, 64 KiB; a ticket takes 34 bytes of it).
MAX_GIVEN_UP_TICKETS = 256

# Requests that name a session (all but OpenSession); the driver fills it in.
_SESSION_METHODS = frozenset(
    {
        "RegisterPool",
        "UnregisterPool",
        "Lookup",
        "Put",
        "Get",
        "Release",
        "Prefetch",
        "Delete",
        "Evict",
        "Stats",
        "Check",
        "Drain",
        "Quarantine",
    }
)
# Calls that a second run answers as the first (or whose first run the given-up session's
# end undoes: its pinning Lookup's lease), so that one the given-up channel's close ended,
# which the daemon may have run, is sent again (see ``cut_off_error``). A RegisterPool is
# made again by ``_register``: a memfd's ticket is spent by the first run.
_RESENT_AFTER_CUT_OFF = frozenset({"Lookup", "Get", "Stats", "Check"})
# How much later than its caller's time a pinning Lookup's gRPC deadline is (both clients):
# the caller's wait ends at its time, and the call runs on for this long, so that an answer
# that comes late (on its way, or waiting for a busy client's thread) is taken in and its
# lease released, not dropped by gRPC with the blocks pinned until the lease expired. Also
# how long past the last deadline of a job's parts on a channel given up those still
# unanswered wait before they fail (``TransferJob.channel_given_up``): gRPC delivers neither
# answer nor deadline there while an interrupt left the channel's lock held.
ANSWER_GRACE_S = 2.0
# Requests that carry a namespace; the driver fills in the client's for the flows' requests.
NAMESPACE_METHODS = frozenset({"Lookup", "Put", "Get", "Prefetch", "Delete", "Evict"})


class _RunsOn(Exception):
    """A call whose caller's time ran out, left to run on to its end, which frees its call
    slot (a pinning Lookup: ``Client._pinning_lookup``); DeadlineExceededError to the
    caller."""


def late_lookup_text(timeout_s: float) -> str:
    """What the caller of a pinning Lookup whose time ran out is told (both clients)."""
    return (
        f"Lookup: no answer within {timeout_s:.3g}s; the call runs on {ANSWER_GRACE_S:g}s "
        "more, and the lease of an answer that comes is released"
    )


def resolve_token(token: bytes | str | None, token_file: str | os.PathLike[str] | None) -> bytes:
    """A tenant token given as such, or read from a file (surrounding whitespace dropped).
    A file that cannot be read, or holds no token, is a typed error naming it at
    construction: PermissionDeniedError when this user may not read it, InvalidArgumentError
    otherwise (a bare OSError escaped, and an empty file opened a session with no token);
    a path holding a NUL and a str token that is no UTF-8 too (Python's own errors)."""
    if token is not None and token_file is not None:
        raise InvalidArgumentError("give token or token_file, not both")
    if token_file is not None:
        # Not an int: open() takes one as a descriptor and would read whatever it is.
        t.checked_type(token_file, (str, os.PathLike), "token_file")
        # open() refused it with a ValueError of its own; a path-like's path may be bytes.
        if b"\0" in os.fsencode(token_file):
            raise InvalidArgumentError(f"token_file {token_file!r}: holds a NUL character")
        try:
            with open(token_file, "rb") as f:
                token = f.read(4096).strip()
        except PermissionError as e:
            raise PermissionDeniedError(
                f"token_file {token_file}: cannot be read: {e.strerror}"
            ) from None
        except OSError as e:
            raise InvalidArgumentError(
                f"token_file {token_file}: cannot be read: {e.strerror or e}"
            ) from None
        if not token:
            raise InvalidArgumentError(f"token_file {token_file}: holds no token")
        return token
    if token is None:
        return b""
    # Checked now: an int failed only at the first session, inside the credential exchange.
    t.checked_type(token, (bytes, str), "token")
    if isinstance(token, bytes):
        return token
    try:
        return token.encode()
    except UnicodeEncodeError as e:  # a lone surrogate: a byte that was not UTF-8
        raise InvalidArgumentError(f"token: not encodable as UTF-8 ({e.reason})") from None


class SessionToken:
    """A client's tenant token, presented at each session it opens: given as such, or read
    from ``token_file`` at construction (see ``resolve_token``) and again at each session
    the client opens, so that a token rotated in the file (and in the daemon, at a SIGHUP)
    serves the next session without a new client. A file that cannot be read then keeps the
    token read before."""

    def __init__(
        self, token: bytes | str | None, token_file: str | os.PathLike[str] | None
    ) -> None:
        self.value = resolve_token(token, token_file)
        self.file = token_file

    def current(self) -> bytes:
        if self.file is not None:
            with contextlib.suppress(InvalidArgumentError, PermissionDeniedError):
                self.value = resolve_token(None, self.file)
        return self.value


def client_settings(
    timeout_s: float, max_batch_blocks: int, client_name: str
) -> tuple[float, int, str]:
    """A client's own settings, checked at construction (both clients): a str timeout failed
    each call inside gRPC with a TypeError, a zero batch size failed each store with
    Python's ValueError of range()."""
    timeout = t.checked_seconds(timeout_s, "timeout_s", optional=False)
    if not timeout:
        raise InvalidArgumentError(f"timeout_s: must be more than 0 (got {timeout_s!r})")
    batch = t.checked_int(max_batch_blocks, "max_batch_blocks", minimum=1)
    return timeout, batch, t.checked_type(client_name, str, "client_name")


def client_namespace(namespace: str) -> str:
    """A client's namespace, checked now: the drivers give it to the flows' and the jobs'
    requests as they send them."""
    if not isinstance(namespace, str):
        raise InvalidArgumentError(f"namespace: expected str, not {type(namespace).__name__}")
    return namespace


def _watch_session(client: weakref.ref[Client], call: Any, session_id: str) -> None:
    """A session's watcher thread: waits for the end of its stream, then has the client, if
    it still exists, forget the session and log why it ended. It holds only a weak reference
    to the client: with a strong one (its bound method), a client dropped unclosed lived on,
    its session open in the daemon (one of ``server.max_sessions_per_tenant``, which count
    per uid without tenants: 256 such clients turned every process of that user away)."""
    error = None
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        error = e
    session_watch_ended(client, session_id, error)


def session_watch_ended(client: weakref.ref[Any], session_id: str, error: Any) -> None:
    """The end of a session's watch (either client's): the client, if it still exists,
    forgets the session, and why it ended is logged (``credentials.session_end_line``); a
    client collected meanwhile was closed by its finalizer."""
    owner = client()
    if owner is None:
        return
    ours = owner.forget_session(session_id)
    del owner
    if (line := credentials.session_end_line(session_id, error, ours)) is not None:
        session_log.warning("%s", line)


def _end_channel(channel: grpc.Channel, session_call: Any) -> None:
    """End a channel and its session's stream (the daemon then ends that session, freeing
    its leases, pins and pools)."""
    if session_call is not None:
        session_call.cancel()
    channel.close()


def _cancel_calls(*calls: Any) -> None:
    for call in calls:
        call.cancel()


def end_entered_contexts(error: BaseException) -> None:
    """End each generator context (``contextlib.contextmanager``) whose ``__enter__`` ``error``
    left after the generator had run to its ``yield``: the ``with`` never began, so nothing
    else ends it on this thread, and where a cycle keeps the traceback (the interrupt's, as a
    saved error holds it) a collection on another thread ends it there. gRPC's latency hook
    holds its process-wide RLock (grpc/_observability.py get_plugin) across that ``yield``:
    released by another thread it stayed held (RuntimeError: cannot release un-acquired
    lock), and every channel's thread, which takes it as each call ends, waited for ever:
    no call of the process ended again, on a new channel or client too."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is contextlib._GeneratorContextManager.__enter__.__code__:
            manager = frame.f_locals.get("self")
            if isinstance(manager, contextlib._GeneratorContextManager):
                manager.gen.close()  # ends it where it waits, at its yield; none if it ended
        tb = tb.tb_next


class _ChannelCloser:
    """Closes the channels of clients collected without ``close()``, on a thread of its own
    (one a process, started by its first client): a collection may happen on the channel's
    own gRPC thread (the last reference went with a callback, as unregister_pool_nowait's),
    where ``channel.close()`` waited for that very thread forever, and the session's watcher
    with it. A finalizer only puts the channel in a SimpleQueue, whose ``put`` is safe
    wherever a collection runs (starting a thread there is not: a collection inside
    ``threading``'s own lock would wait for itself).

    It also ends the channels a client gave up after an interruption (``discard``), each on
    a thread of its own: there gRPC's channel lock may be held for good, so that ending it
    waits for ever; that thread then parks. ``discard`` is a ``put`` too, as it runs where
    another KeyboardInterrupt may land.

    What an interruption may have left locked is kept (``_kept``) until that thread has
    ended it: the given-up channel, its session's call, and the interrupted calls
    (``keep``, which cancels them). gRPC's finalizers take those locks (a channel's closes
    it, a call's cancels it); run by a collection, on any thread but the one that holds the
    lock, they waited for ever, and so did that collection: every later ``gc.collect()`` in
    the process returned at once, and cyclic garbage grew until it exited. Ending them takes
    the same locks, so what ends has none held and is let go; only what parks is kept for
    good, as its thread is, and not every interruption's objects."""

    def __init__(self) -> None:
        # What each ending thread ends, and how, by a key of its own (see the class). Not
        # reset at fork: dropped in the child, where those threads do not run, the copies
        # would be collected there.
        self._kept: dict[int, tuple[Callable[..., None], tuple[Any, ...]]] = {}
        self._keys = itertools.count()
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # the thread does not cross fork()

    def _reset(self) -> None:
        # A channel to close (``close_later``), or the key of what to end on a thread of its
        # own (``discard``, ``keep``).
        self._channels: queue.SimpleQueue[grpc.Channel | int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        with self._lock:
            if not self._started:
                threading.Thread(target=self._run, name="kvtier-closer", daemon=True).start()
                self._started = True

    def close_later(self, channel: grpc.Channel) -> None:
        self._channels.put(channel)

    def discard(self, channel: grpc.Channel, session_call: Any) -> None:
        self._end_later(_end_channel, channel, session_call)

    def keep(self, *calls: Any) -> None:
        """Cancel gRPC calls an interruption ended, keeping them until that ends (see the
        class)."""
        self._end_later(_cancel_calls, *calls)

    def _end_later(self, end: Callable[..., None], *objects: Any) -> None:
        # No lock: this runs in finalizers, and where another KeyboardInterrupt may land.
        key = next(self._keys)
        self._kept[key] = (end, objects)
        self._channels.put(key)

    def _run(self) -> None:
        while True:
            item = self._channels.get()
            if isinstance(item, int):
                threading.Thread(
                    target=self._end, args=(item,), name="kvtier-discarded", daemon=True
                ).start()
            else:
                try:
                    item.close()
                except Exception:
                    session_log.exception("closing the channel of a client collected unclosed")
            del item

    def _end(self, key: int) -> None:
        end, objects = self._kept[key]
        end(*objects)  # parks for good where an interruption left one of their locks held
        del self._kept[key]  # none is: their finalizers may run on any thread


_closer = _ChannelCloser()


def _close_dropped(held: dict[str, Any], pid: int) -> None:
    """Close a client collected without ``close()``: its session's call at once, and its
    channel on ``_closer``'s thread (in the process that made it only: a forked child's
    copy is the parent's); a channel an interruption left suspect, both on a thread of
    their own (see ``Client.interrupted``)."""
    if os.getpid() != pid:
        return
    call = held.get("call")
    if held["suspect"]:
        _closer.discard(held["channel"], call)
        return
    if call is not None:
        call.cancel()
    _closer.close_later(held["channel"])


def given_up_error(session_id: str) -> NotFoundError:
    """The error of a call on a channel that the client gave up meanwhile, as another thread's
    interruption made it (``Client.interrupted``): closing that channel ended the call (gRPC's
    CANCELLED) or kept it from being sent (its ValueError), and the daemon ends its session.
    A ``session_gone`` NotFoundError, so that ``_invoke`` sends the call again in a new
    session on the new channel, as after the daemon ended a session; a Release is not (its
    lease went with that session), nor a transfer job's part (``Client.given_up``), nor a
    call the close ended once sent whose second run would answer otherwise
    (``cut_off_error``)."""
    error = NotFoundError(
        f"session {session_id}: this client gave it up, and its channel, while the call was "
        "on it (a KeyboardInterrupt ended another of the client's calls)"
    )
    error.session_gone = True
    return error


def cut_off_error(given_up: NotFoundError) -> UnavailableError:
    """The error of a call that the close of a channel the client gave up ended once sent
    (``given_up``, its ``given_up_error``) when a second run would not answer as the first:
    the daemon may have run it (a Delete sent again answered its keys missing, a Put its
    blocks present), so it is not sent again and fails with this, which ``unclean`` reads as
    a call that may have run (``cut_off``: ``Client._register`` registers again)."""
    error = UnavailableError(f"{given_up}; the daemon may have run it, so it is not sent again")
    error.cut_off = True
    return error


def in_own_process(pid: int) -> bool:
    """Whether this is still the process ``pid`` that made a client (not a child it forked)."""
    return os.getpid() == pid


def refuse_in_child(pid: int, kind: str) -> None:
    """Refuse a client's call in a child forked from the process ``pid`` that made it, before
    the call touches gRPC: there the child's copy of the parent's channel hung past every
    timeout (gRPC's fork support off), or failed once and then acted in the parent's session
    (its leases, its pools) with gRPC's fork handlers skipped, as they are while any thread
    waits in gRPC (the session's watcher always does)."""
    if not in_own_process(pid):
        raise FailedPreconditionError(
            f"this {kind} was made in process {pid}, not in this one ({os.getpid()}), which "
            "it forked: a client does not cross fork(); start workers with spawn, or fork "
            "them before making a client"
        )


def no_fd_transport(address: str) -> FailedPreconditionError:
    return FailedPreconditionError(
        f"a memfd pool is handed to the daemon over its Unix socket; {address} is not one "
        "(use SharedMemoryPool(..., backing='shm') with a daemon on this host)"
    )


class ChannelStub(pb_grpc.KVTierStub):
    """A channel's stub, with the channel's health check and call slots. The slots are the
    channel's: the calls a given-up channel may hold for good (see ``Client.interrupted``)
    take none of its replacement's. One attribute of the client, read once by a call, so that
    the call takes the slots of the channel it is sent on: read as two, the stub then the
    slots, another thread's interrupt between the two reads sent a call on the given-up
    channel holding one of the new channel's slots, for good where it waited there."""

    def __init__(self, channel: grpc.Channel, max_calls_open: int) -> None:
        super().__init__(channel)
        self.call_slots = CallSlots(max_calls_open)
        self.health_check = channel.unary_unary(
            hc.CHECK_METHOD,
            request_serializer=None,  # health() encodes its request before sending it
            response_deserializer=hc.decode_response,
        )


class Client:
    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float = 30.0,
        client_name: str = "",
        max_batch_blocks: int = 1024,
        namespace: str = "",
        token: bytes | str | None = None,
        token_file: str | None = None,
        max_calls_open: int = DEFAULT_MAX_CALLS_OPEN,
    ) -> None:
        """``namespace``: the namespace (inside this client's tenant) of every call that does
        not name its own; "shared:NAME[/SUB]" for a namespace the daemon's config shares.
        ``token`` (or ``token_file``, read again at each session the client opens): a
        tenant's secret, to be that tenant (over TCP the only way to open a session).
        ``max_calls_open`` (1 to 255): the calls this client keeps open on its channel at
        once; the rest wait in the client, in the order they came (``kvtier.client.slots``),
        their wait counted in their timeout (a transfer job's parts: not)."""
        self.address = t.checked_address(t.resolve_address(address))
        self.timeout_s, self.max_batch_blocks, client_name = client_settings(
            timeout_s, max_batch_blocks, client_name
        )
        self.max_calls_open = checked_max_calls_open(max_calls_open)
        self.namespace = client_namespace(namespace)
        self._token = SessionToken(token, token_file)
        self._tenant = ""
        self._admin = False
        self.client_name = client_name or f"pid {os.getpid()}"
        # A client dropped unclosed is closed when collected: its session's watcher holds no
        # reference to it (see _watch_session), and its finalizer holds none either, only
        # the channel, whether it is suspect, and the open session's call (kept in _held).
        self._held: dict[str, Any] = {}
        self._connect()
        # The session's id and call; never held across a call: gRPC's callback thread,
        # which delivers every answer of the channel, takes it (live_ids, forget_session).
        self._lock = threading.Lock()
        # One session opened at a time (see session_id); held across the OpenSession call.
        self._open_lock = threading.Lock()
        # One registration at a time (see _pool_id); held across the RegisterPool call, so
        # never taken with _lock held, nor on gRPC's callback threads.
        self._register_lock = threading.Lock()
        # A binding's pool id as a registration sets it and a late NotFound drops it
        # (forget_pool_id, which jobs call on gRPC's callback thread); never held across a
        # call: that thread delivers every answer of the channel, the session's included.
        self._ids_lock = threading.Lock()
        self._closed = False
        self._session_id = ""
        self._session_call: Any = None
        # Sessions given up with their channel (``_replace_if_suspect``), and the tickets of
        # OpenSessions given up before their first event (``_open_session``), named in the
        # next OpenSession so that the daemon ends them (under _lock).
        self._given_up: list[str] = []
        self._given_up_tickets: list[bytes] = []
        self._pools: dict[int, PoolBinding] = {}
        # Pools whose UnregisterPool went unanswered (a timeout, a daemon stopped meanwhile),
        # by id, with their session: sent again before the next registration (under
        # _ids_lock, as gRPC's callback thread adds to it).
        self._unconfirmed: dict[int, str] = {}
        self._jobs = JobTable()
        self._pid = os.getpid()
        _closer.start()
        self._finalizer = weakref.finalize(self, _close_dropped, self._held, self._pid)
        self._finalizer.atexit = False  # the process's exit ends its sessions anyway

    def _connect(self) -> None:
        """A new channel (it connects at its first call) and its stub (``ChannelStub``)."""
        self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = ChannelStub(self._channel, self.max_calls_open)
        self._held["channel"], self._held["suspect"] = self._channel, False

    # --------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the client. In a forked child it only marks the child's copy closed: the
        session, its pools and the channel are the parent's. Sessions it gave up that no
        OpenSession has named yet are named on a thread of its own (``_name_given_up``). A
        KeyboardInterrupt that lands as it ends the session and the channel leaves them to end
        on a thread of their own (see ``interrupted``)."""
        if not in_own_process(self._pid):
            self._closed = True  # not under _lock: another thread may have held it at fork
            return
        with self._lock:
            self._closed = True
            call, self._session_call, self._session_id = self._session_call, None, ""
            channel, suspect = self._channel, self._held["suspect"]
            given_up, self._given_up = self._given_up, []
            tickets, self._given_up_tickets = self._given_up_tickets, []
        self._finalizer.detach()  # closed here: collected, it is not closed again
        if given_up or tickets:  # RuntimeError: no new thread at the interpreter's exit
            with contextlib.suppress(RuntimeError):
                threading.Thread(
                    target=self._name_given_up,
                    args=(given_up, tickets),
                    name="kvtier-given-up",
                    daemon=True,
                ).start()
        if suspect:  # ending it may wait for ever (see ``interrupted``)
            _closer.discard(channel, call)
            return
        try:
            if call is not None:
                call.cancel()
            channel.close()
        except Exception:
            raise
        except BaseException:
            # gRPC's locks are not safe against it (see ``interrupted``): ended on a thread of
            # its own, which parks where this left one held. Before, a session whose cancel
            # it cut short stayed open in the daemon, and the channel too, until the exit.
            _closer.discard(channel, call)
            raise

    def _name_given_up(self, given_up: list[str], tickets: list[bytes]) -> None:
        """Have the daemon end ``given_up``, sessions this closed client gave up that no
        OpenSession named (see ``_replace_if_suspect``), and those its given-up ``tickets``
        opened (see ``_open_session``), in a session opened for that on a channel of its own
        and ended at once: a client closed before its next session left them open until the
        process exited, their leases until they expired, their pools and slots of
        ``server.max_sessions_per_tenant``. On a thread of its own: close()
        waited for that session, the client's whole timeout on a hung daemon (the one a
        Ctrl-C gave up the channel of, which a ``with`` block then closes). A failure leaves
        them as they were: the process's exit ends them."""
        channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        try:
            _, call = self._open_session(pb_grpc.KVTierStub(channel), given_up, tickets)
            call.cancel()
        except KvtierError:
            pass
        finally:
            channel.close()

    def interrupted(
        self, error: BaseException, *calls: Any, holding: CallSlots | None = None
    ) -> None:
        """Note that something other than a call's error (a KeyboardInterrupt, or whatever
        else a signal handler raised) ended a gRPC call of this client's on this thread.
        gRPC's sync channel is not safe against that: landing inside its call start (or a
        blocking call's end) it left the channel's lock held, or its count of calls wrong,
        and every later call on the channel waited for ever, past its deadline. So the
        client gives the channel up now (see ``_replace_if_suspect``) and sends nothing more
        on it (not the Releases of an interrupted load: the session's end frees them). The
        calls other threads had on it end once its close ends them (``given_up_error``): one
        not sent yet, or a Lookup, Get, Stats or Check (``_RESENT_AFTER_CUT_OFF``), is sent
        again on the new one, and a RegisterPool made again (``_register``); a Release fails
        with that NotFoundError, its lease gone with the session, and so do a transfer job's
        parts; any other call already sent (a Put, a Delete, an Evict, a Prefetch, an
        UnregisterPool, a Drain, a Quarantine), which the daemon may have run, fails with
        ``cut_off_error``. Where the interruption left the channel's lock held, nothing ends
        them: gRPC delivers no answer on that channel, not even its deadline, and those calls
        wait for ever inside gRPC, for that lock, with no timeout; but a pinning Lookup, made
        as a future, whose wait the client bounds itself (its time), and a transfer job's
        part (``ANSWER_GRACE_S`` past its deadline: ``TransferJob.channel_given_up``). The
        mark comes first: another interruption that lands before the channel is replaced
        leaves that to the client's next call. Once an ``error``: the guards of the calls that
        it passes through on its way out each note it, and a second replacement would only
        give up the new channel. ``calls``: the gRPC calls ``error`` ended, which the client
        would drop; cancelled on a thread of their own instead, and kept until that ends (see
        ``_ChannelCloser``). The generator contexts that ``error`` entered but left before
        their ``with`` began are ended here, on the thread that entered them
        (``end_entered_contexts``), after the mark. ``holding``: the slots (``call_slots``)
        one of which the interrupted call held, freed here once the channel is given up with
        them, which then changes nothing: freed first, the slot went to the caller queued
        next, sent on that channel, to wait for good on the lock the interruption left held
        (a transfer job's part, ``TransferJob._granted``, granted on this thread)."""
        if calls:
            _closer.keep(*calls)
        if not getattr(error, "_kvtier_noted", False):
            error._kvtier_noted = True  # type: ignore[attr-defined]
            self._held["suspect"] = True
            end_entered_contexts(error)
            self._replace_if_suspect()
        if holding is not None:
            holding.release()

    def _replace_if_suspect(self) -> None:
        """Give up a channel an interruption left suspect for a new one: the session is
        forgotten, the next call opens another and registers the pools again there (as after
        a daemon restart). The old channel and its session's stream are ended on a thread of
        their own (``_closer.discard``): the daemon then ends that session, freeing its
        leases, pins and pools. Where the interruption left gRPC's lock held, nothing can end
        them, so the next OpenSession names that session (``given_up_sessions``), or
        ``close()`` does, and the daemon ends it then. The old channel's call slots are given
        up (``CallSlots.give_up``), once the new stub is the client's: the callers queued
        there find their channel given up; and the transfer jobs' parts in flight there end
        by their deadline, whatever the channel's lock (``TransferJob.channel_given_up``)."""
        if not self._held["suspect"]:
            return
        with self._lock:
            if not self._held["suspect"] or self._closed:
                return
            stub = self._stub
            if self._session_id:
                self._given_up.append(self._session_id)
            call, self._session_id, self._session_call = self._session_call, "", None
            self._held.pop("call", None)
            # Handed over before the new channel clears the mark: an interruption between
            # the two has the old one handed over again, never dropped (see _ChannelCloser).
            _closer.discard(self._channel, call)
            self._connect()
        # Outside the lock: a job part's end takes it.
        stub.call_slots.give_up()
        with self._jobs.lock:
            jobs = list(self._jobs.jobs.values())
        for job in jobs:
            job.channel_given_up(stub, _closer.keep, ANSWER_GRACE_S)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _session_id_unguarded(self) -> str:
        """The open session, opened on first use. A session is opened under a lock of its
        own, not ``_lock``: opening it under ``_lock`` while a job's answer needed that lock
        on gRPC's callback thread, which was to deliver the session's first answer, hung
        both threads for good (a cancel of the call is delivered by that thread too)."""
        refuse_in_child(self._pid, "Client")
        self._replace_if_suspect()
        with self._lock:
            if session_id := self._live_session():
                return session_id
        with self._open_lock:
            with self._lock:
                if session_id := self._live_session():
                    return session_id  # another thread opened it meanwhile
            while True:
                stub = self._stub
                with self._lock:
                    given_up, tickets = list(self._given_up), list(self._given_up_tickets)
                try:
                    first, call = self._open_session(stub, given_up, tickets)
                    break
                except (KvtierError, ValueError):  # ValueError: the channel closed meanwhile
                    if self._closed:
                        raise closed_error() from None
                    # Another thread's interruption gave the channel up, whose close ended
                    # the call (CANCELLED, read as the wait's timer): opened on the new one.
                    if not self.given_up(stub, ""):
                        raise
            with self._lock:
                if self._closed:
                    call.cancel()
                    raise closed_error()
                del self._given_up[: len(given_up)]  # the daemon has ended them
                del self._given_up_tickets[: len(tickets)]
                self._session_id, self._session_call = first.session_id, call
                self._held["call"] = call
                self._tenant, self._admin = first.tenant, first.admin
            threading.Thread(
                target=_watch_session,
                args=(weakref.ref(self), call, first.session_id),
                name="kvtier-session",
                daemon=True,
            ).start()
            return str(first.session_id)

    @property
    def session_id(self) -> str:
        """The open session, opened on first use (see ``_session_id_unguarded``)."""
        try:
            return self._session_id_unguarded()
        except Exception:
            raise
        except BaseException as e:  # gRPC's locks are not safe against it: see ``interrupted``
            self.interrupted(e)
            raise

    def _open_session_id(self) -> str:
        """The open session's id, opening none: ``lease_session_ended()`` when there is
        none."""
        refuse_in_child(self._pid, "Client")
        self._replace_if_suspect()
        with self._lock:
            if session_id := self._live_session():
                return session_id
        raise lease_session_ended()

    def _live_session(self) -> str:
        """The open session's id, or "" when there is none (its stream ended); under
        ``_lock``."""
        if self._closed:
            raise closed_error()
        if self._session_call is not None and not self._session_call.is_active():
            self._session_id, self._session_call = "", None
        return self._session_id

    @property
    def tenant(self) -> str:
        """The tenant the daemon bound this client's session to (opens it if needed)."""
        _ = self.session_id
        return self._tenant

    @property
    def admin(self) -> bool:
        """Whether this client's session may use the admin calls (check, drain, ...)."""
        _ = self.session_id
        return self._admin

    def _open_session(
        self, stub: Any, given_up: list[str], given_up_tickets: list[bytes]
    ) -> tuple[Any, Any]:
        """(first event, call) of a new session's stream on ``stub``, naming ``given_up`` and
        ``given_up_tickets``."""
        tickets = credentials.SessionTickets(credentials.cred_socket_path(self.address))
        request = t.build_request(
            pb.OpenSessionRequest,
            client_name=self.client_name,
            token=self._token.current(),
            given_up_sessions=given_up,
            given_up_tickets=given_up_tickets,
        )
        if tickets.due():
            request.credential_ticket = tickets.fetch(self.timeout_s)
        # Sent again, as every call, while the daemon's gRPC refuses it unrun: the daemon
        # never saw it, so its ticket is unspent, but it expires (a new one past its age).
        resends = Resends(self.timeout_s)
        try:
            while (opened := self._send_open_session(stub, request, resends)) is None:
                if tickets.due():
                    request.credential_ticket = tickets.fetch(resends.left_s())
        except Exception:
            raise
        except BaseException:
            # The daemon may have opened the session with it: the next OpenSession names it.
            # (``session_id``'s guard gives the channel up.)
            if request.credential_ticket:
                with self._lock:
                    self._given_up_tickets.append(request.credential_ticket)
                    del self._given_up_tickets[:-MAX_GIVEN_UP_TICKETS]
            raise
        return opened

    def _send_open_session(
        self, stub: Any, request: Any, resends: Resends
    ) -> tuple[Any, Any] | None:
        """(first event, call) of one OpenSession, or None after a pause when the daemon's
        gRPC refused it unrun and the client's timeout leaves time to send it again."""
        call = stub.OpenSession(request)
        # The stream has no deadline (it lives as long as the session), but its first event
        # must come within the client's timeout: a daemon that is hung must not hang us.
        timer = threading.Timer(resends.left_s(), call.cancel)
        timer.daemon = True
        timer.start()
        try:
            return next(call), call
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                raise DeadlineExceededError(
                    f"the daemon did not open a session within {self.timeout_s}s"
                ) from None
            if not refused_stream(e) or (pause := resends.pause_s()) is None:
                raise from_rpc_error(e) from None
        except StopIteration:
            raise UnavailableError("the daemon closed the session at once") from None
        except Exception:
            raise
        except BaseException as e:
            self.interrupted(e, call)
            raise
        finally:
            timer.cancel()
        time.sleep(pause)
        return None

    def forget_session(self, session_id: str) -> bool:
        """Forget ``session_id`` (its stream ended, or the daemon answered it is not open:
        ``session_gone``, which a call may see before the watcher sees the end) if it is still
        this client's, so that the next call opens another; whether it was."""
        with self._lock:
            if self._session_id != session_id:
                return False
            self._session_id, self._session_call = "", None
            return True

    # ------------------------------------------------------------------ calls

    def _invoke(
        self,
        method: str,
        request: Any,
        binding: PoolBinding | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        # Not only the call itself: the session's (``is_active``, opening it, registering a
        # pool) goes through gRPC's locks too.
        try:
            return self._invoke_unguarded(method, request, binding, timeout_s)
        except Exception:
            raise
        except BaseException as e:
            self.interrupted(e)
            raise

    def _invoke_unguarded(
        self,
        method: str,
        request: Any,
        binding: PoolBinding | None,
        timeout_s: float | None,
    ) -> Any:
        # A Release is sent in the open session only (see ``lease_session_ended``).
        releasing = method == "Release"
        again = SendAgain(method in _SESSION_METHODS and not releasing, binding is not None)
        while True:
            if releasing:
                request.session_id = self._open_session_id()
            elif method in _SESSION_METHODS:
                request.session_id = self.session_id
            if binding is not None:
                request.pool_id = self._pool_id(binding, request.session_id)
            self._replace_if_suspect()  # so that ``stub`` is the one ``call`` uses
            stub = self._stub
            try:
                return self.call(method, request, timeout_s or self.timeout_s)
            except grpc.RpcError as e:
                err = self.error_of(e)
                # The given-up channel's close ends a call with CANCELLED; any other status
                # is the call's own answer (a DEADLINE_EXCEEDED one may yet have run). The
                # daemon may have run the call the close ended: sent again only where a
                # second run answers as the first (``_RESENT_AFTER_CUT_OFF``). A Release's
                # lease went with the given-up session: NotFound, not sent again (a load's
                # cleanup reads it as a lease already gone).
                if e.code() == grpc.StatusCode.CANCELLED and (
                    given_up := self.given_up(stub, request.session_id)
                ):
                    as_unsent = method in _RESENT_AFTER_CUT_OFF or releasing
                    err = given_up if as_unsent else cut_off_error(given_up)
            except ValueError:  # grpc's answer to a call on a closed (or given-up) channel
                if self._closed:
                    raise closed_error() from None
                if not (given_up := self.given_up(stub, request.session_id)):
                    raise
                err = given_up
            if not (why := again.after(err)):
                raise err
            if why == "session":
                self.forget_session(request.session_id)
            if binding is not None:
                self.forget_pool_id(binding, request.pool_id)

    def call(self, method: str, request: Any, timeout_s: float) -> Any:
        """One call, sent again while the daemon's gRPC refuses it unrun (``refused_stream``:
        this connection has many calls open) and its time allows; raises grpc.RpcError, or
        DeadlineExceededError when its time ran out before one of the channel's call slots
        (``max_calls_open``) came free. Refused in a forked child before the channel is
        replaced: a child forked while an interruption's mark waited for the replacement built
        a channel of its own first."""
        refuse_in_child(self._pid, "Client")
        self._replace_if_suspect()
        stub = self._stub
        rpc = getattr(stub, method)
        if method == "Lookup" and request.pin:
            rpc = functools.partial(self._pinning_lookup, rpc, stub.call_slots)
        return self._until_run(rpc, request, timeout_s, stub.call_slots)

    def _pinning_lookup(self, rpc: Any, slots: CallSlots, request: Any, timeout: float) -> Any:
        """A pinning Lookup, made as a future so that the call a KeyboardInterrupt ends in
        the wait for its answer is the client's to keep (``interrupted``): the daemon pins
        as it answers, and the lease id is only in the answer, so the interrupted call's
        lease is freed by its session's end, which giving the channel up brings (as
        close() does), not by a Release. Its wait ends at ``timeout``, but its gRPC deadline
        comes ``ANSWER_GRACE_S`` later: an answer that comes after the caller's time has its
        lease released, and the call keeps its slot of ``slots`` until then (``_late``).
        The daemon releases the lease of a Lookup whose deadline passed before it ran, but
        with one deadline at both ends gRPC dropped an answer sent in time that reached the
        client late, its blocks pinned until the lease expired. A channel whose gRPC lock an
        interruption left held delivers neither."""
        fut = rpc.future(request, timeout=timeout + ANSWER_GRACE_S)
        try:
            return fut.result(timeout=timeout)
        except grpc.RpcError:
            raise
        except grpc.FutureTimeoutError:
            # Also keeps the call from being cancelled when ``fut`` is collected.
            fut.add_done_callback(functools.partial(self._late, slots))
            raise _RunsOn(late_lookup_text(timeout)) from None
        except BaseException as e:
            self.interrupted(e, fut)
            raise

    def _late(self, slots: CallSlots, lookup: Any) -> None:
        """The end of a pinning Lookup whose caller's time ran out (``_pinning_lookup``): its
        answer's lease released (without waiting), its slot freed. On gRPC's thread (or the
        caller's, where it ended as its caller's wait did)."""
        try:
            if not lookup.cancelled() and lookup.exception() is None:
                release_unclaimed(lookup.result(), self._release_nowait)
        finally:
            slots.release()

    def _until_run(self, rpc: Any, request: Any, timeout_s: float, slots: CallSlots) -> Any:
        """``rpc(request)`` in one of its channel's call ``slots``, waited for within the call's
        time (else DeadlineExceededError, nothing sent; the slots given up with their channel
        meanwhile, a ValueError, as gRPC's for a closed channel: nothing sent), sent again as
        ``call`` says (also the health check's). The guard takes in the slot's taking and
        freeing: an interrupt that lands between the slot's taking and its freeing gives the
        channel up, and the slot with it, as one inside gRPC does (else the slot stayed taken
        on the live channel, through ``health()``, ``fence_pool()`` and
        ``_unregister_unconfirmed``). One that ends the call frees its slot once the channel
        is given up (``interrupted``)."""
        resends = Resends(timeout_s)
        try:
            if not (got := slots.acquire(resends.left_s())):
                if got is None:  # given up with their channel: as gRPC refuses a call there
                    raise ValueError("the call's channel was given up, and sends nothing more")
                raise slot_wait_error(slots.limit, timeout_s)
            try:
                while True:
                    try:
                        response = rpc(request, timeout=resends.left_s())
                        break
                    except grpc.RpcError as e:
                        if not refused_stream(e) or (pause := resends.pause_s()) is None:
                            raise
                    time.sleep(pause)
            except _RunsOn as e:  # its slot is freed as the call ends
                raise DeadlineExceededError(str(e)) from None
            except Exception:
                slots.release()
                raise
            except BaseException as e:
                self.interrupted(e, holding=slots)
                raise
            slots.release()
            return response
        except Exception:
            raise
        except BaseException as e:  # see ``interrupted``
            self.interrupted(e)
            raise

    def _drive(self, flow: Flow, binding: PoolBinding | None) -> int:
        advance: Callable[[Any], tuple[str, Any]]  # the flow's send, or its throw
        try:
            method, request = next(flow)
            while True:
                if method in NAMESPACE_METHODS:
                    request.namespace = self.namespace
                try:
                    response = self._invoke(
                        method, request, binding if method in ("Put", "Get") else None
                    )
                except Exception as e:
                    advance, value = flow.throw, e
                except BaseException:  # KeyboardInterrupt, SystemExit: no more calls
                    self._abandon(flow)
                    raise
                else:
                    advance, value = flow.send, response
                try:
                    method, request = advance(value)
                except Exception:
                    raise
                except BaseException:  # as the flow took ``value`` in, or just after
                    abandon_advanced(flow, request, value, self._release_nowait)
                    raise
        except StopIteration as done:
            return int(done.value)

    def _abandon(self, flow: Flow) -> None:
        """Let a flow that something other than a call's error (a KeyboardInterrupt) ends at
        its pending call release what it holds: the Releases its cleanup asks for are sent
        without waiting for an answer, and so is that call when it was a Release itself (the
        lease stayed pinned until it expired: the flow's cleanup had already asked for it;
        one the daemon had run answers NotFound, which nobody reads), in the open session
        (``_release_nowait``): where the interrupt ended a call, ``_invoke``'s guard gave that
        session up, whose end frees the lease, and nothing is sent. The flow was left
        suspended, so its lease pinned the blocks until it expired, and its cleanup ran when
        the flow was collected, as "generator ignored GeneratorExit"."""
        abandon(flow, self._release_nowait)

    def _release_nowait(self, request: pb.ReleaseRequest) -> None:
        """Send a Release in the open session, if any, without waiting for its answer."""
        request.session_id = self._session_id
        if request.session_id and not self._held["suspect"]:
            with contextlib.suppress(ValueError):  # the client was closed meanwhile
                fut = None
                try:
                    fut = self._stub.Release.future(request, timeout=self.timeout_s)
                    # The callback keeps the call from being cancelled when ``fut`` is
                    # collected (gRPC cancels a call whose future goes unreferenced), until
                    # it ends. Added under the call's lock, which the answer's delivery takes.
                    fut.add_done_callback(lambda fut: None)
                except Exception:
                    raise
                except BaseException as e:  # another interrupt, in an abandoned load or lookup
                    self.interrupted(e, *([fut] if fut is not None else []))
                    raise

    def _register(self, binding: PoolBinding) -> None:
        self._unregister_unconfirmed()
        try:
            request, resp = self._send_registration(binding)
        except UnavailableError as e:
            if not e.cut_off:
                raise
            # The given-up channel's close ended it (``cut_off_error``): made again, in the
            # new session, with a new ticket (sent again, a memfd's ticket that the first run
            # spent was UNAUTHENTICATED). A pool the first run made goes with the old session.
            request, resp = self._send_registration(binding)
        except UnauthenticatedError as e:
            # Its ticket refused, not its session (``PoolBinding.registers_again``): expired
            # while the call waited for a call slot, or spent by a first run sent again in
            # a new session. Made again, with a new one.
            if not binding.registers_again(e):
                raise
            request, resp = self._send_registration(binding)
        with self._ids_lock:
            binding.pool_id, binding.block_bytes = resp.pool_id, resp.block_bytes
            binding.sealed = resp.sealed
            binding.session_id = request.session_id
        self._pools[resp.pool_id] = binding

    def _send_registration(self, binding: PoolBinding) -> tuple[Any, Any]:
        """(request, answer) of one registration of ``binding``, in the open session: by a
        new ticket of its descriptor where it hands one over, else by name or handles. The
        session is opened first: where it is refused (a wrong or revoked token), a ticket
        fetched before stayed with the daemon until it expired, one of the uid's unused
        tickets."""
        _ = self.session_id
        ticket = b""
        if binding.hands_over_fd:
            path = credentials.cred_socket_path(self.address)
            if path is None:
                raise no_fd_transport(self.address)
            with binding.handed_fd() as fd:
                ticket = credentials.pool_ticket(path, fd, self.timeout_s)
        request = binding.register_request(ticket)
        return request, self._invoke("RegisterPool", request)

    def _unconfirmed_unregistration(self, request: pb.UnregisterPoolRequest) -> None:
        """Keep an UnregisterPool that went unanswered, to send again (see below)."""
        with self._ids_lock:
            self._unconfirmed[request.pool_id] = request.session_id

    def _unregister_unconfirmed(self) -> None:
        """Send again, in the open session, the UnregisterPools of it that went unanswered,
        before registering a pool: a call whose deadline passed while the daemon was stopped
        is never run, so each such pool stayed registered (its memory mapped) until the
        session's end while the next call registered the memory again, one more pool of
        ``server.max_pools_per_session`` each time, until every registration failed with
        ResourceExhaustedError. One still unanswered is kept for the next registration, and
        so are those after it (a daemon that does not answer costs one timeout here, not one
        each); those of an earlier session ended with it."""
        if not self._unconfirmed:
            return
        session_id = self.session_id
        with self._ids_lock:
            todo = [pool for pool, sid in self._unconfirmed.items() if sid == session_id]
            self._unconfirmed = {pool: session_id for pool in todo}
        for pool_id in todo:
            request = t.build_request(
                pb.UnregisterPoolRequest, session_id=session_id, pool_id=pool_id
            )
            try:
                self.call("UnregisterPool", request, self.timeout_s)
            except grpc.RpcError as e:
                if unclean(from_rpc_error(e)):
                    break  # still unanswered: kept, with those after it
            except DeadlineExceededError:  # no call slot in time: not sent, kept
                break
            except ValueError:  # its channel given up meanwhile: the session ends with it
                break
            with self._ids_lock:
                self._unconfirmed.pop(pool_id, None)

    @property
    def stub(self) -> ChannelStub:
        """The raw gRPC stub (requests need ``session_id`` filled in by the caller); its calls
        take no call slot (``max_calls_open``). Its ``call_slots`` are its channel's (a
        transfer job's parts take them)."""
        return self._stub

    @property
    def call_slots(self) -> CallSlots:
        """The call slots of the channel ``stub`` sends on."""
        return self._stub.call_slots

    def error_of(self, err: grpc.RpcError) -> KvtierError:
        """The typed exception for a failed call. ``close()`` closes the channel, and gRPC
        ends the calls still on it with CANCELLED, which ``from_rpc_error`` reads as the
        daemon's server ending them: a call this client's own ``close()`` ended is
        ``closed_error()``, not a daemon going away."""
        if self._closed:
            return closed_error()
        return from_rpc_error(err)

    def given_up(self, stub: Any, session_id: str) -> NotFoundError | None:
        """``given_up_error(session_id)`` when ``stub`` is of a channel this client gave up
        after an interruption (``interrupted``), not one ``close()`` closed; else None.
        ``_invoke`` sends its call again on it (and a session being opened is opened again
        on the new channel: ``_session_id_unguarded``); a transfer job's part fails with it
        instead: its request names that session's pool id, and a load's that session's
        lease."""
        if stub is self._stub or self._closed:
            return None
        return given_up_error(session_id)

    def live_ids(self, binding: PoolBinding) -> tuple[str, int] | None:
        """(session id, pool id) when the session is open and the pool registered in it;
        never calls the daemon."""
        try:
            with self._lock:
                call = self._session_call
                session_id = self._session_id if call is not None and call.is_active() else ""
        except Exception:
            raise
        except BaseException as e:  # gRPC's locks are not safe against it: see ``interrupted``
            self.interrupted(e)
            raise
        if not session_id or not binding.pool_id or binding.session_id != session_id:
            return None
        return session_id, binding.pool_id

    def pool_id_of(self, binding: PoolBinding) -> int:
        """The pool's id in the current session, registering it again if the daemon lost it."""
        return self._pool_id(binding, self.session_id)

    def _pool_id(self, binding: PoolBinding, session_id: str) -> int:
        """The pool's id in session ``session_id``, registering it there first if it has none.
        Checked again under the registration lock: a thread that finds another registering
        the pool takes that id instead of registering the pool a second time (the daemon
        would keep the extra registration, and its memory mapped, until the session ends)."""
        if not binding.pool_id or binding.session_id != session_id:
            with self._register_lock:
                if not binding.pool_id or binding.session_id != session_id:
                    self._register(binding)
        return binding.pool_id

    def forget_pool_id(self, binding: PoolBinding, pool_id: int) -> None:
        """The daemon answered NotFound for a call with ``pool_id``: register the pool again
        on its next use, unless another thread already has (a late answer must not drop the
        id it registered). Never waits for a registration under way: a job calls it on
        gRPC's callback thread, which a registration may itself wait for (a new session's
        first answer)."""
        with self._ids_lock:
            if binding.pool_id == pool_id:
                binding.pool_id = 0

    # ----------------------------------------------------------------- pools

    def register_pool(
        self, shm: SharedMemoryPool, layout: PoolLayout, namespace: Namespace | None = None
    ) -> RegisteredPool:
        """Register a shared-memory pool laid out as ``layout``. With a namespace, the returned
        pool can store and load by token ids."""
        binding = new_binding(shm, SharedMemoryPool, layout, namespace)
        self._register(binding)
        return RegisteredPool(self, binding)

    def register_cuda_pool(
        self, export: CudaIpcExport, layout: PoolLayout, namespace: Namespace | None = None
    ) -> RegisteredPool:
        """Register GPU memory exported over CUDA IPC (``kvtier.client.cuda``); the daemon
        needs its GPU tier (``tiers.l0``) on the same device, else FailedPreconditionError."""
        binding = new_binding(export, CudaIpcExport, layout, namespace)
        self._register(binding)
        return RegisteredPool(self, binding)

    def unregister_pool(self, pool_id: int) -> None:
        self._invoke("UnregisterPool", t.build_request(pb.UnregisterPoolRequest, pool_id=pool_id))
        self._pools.pop(pool_id, None)

    def unregister_pool_nowait(self, binding: PoolBinding) -> None:
        """Unregister a pool without waiting for the answer (a pool of a session that has
        ended needs nothing: the daemon dropped it with the session). The next call through
        ``binding`` registers the memory again. Raises nothing but InvalidArgumentError for
        what is no binding; a failure of the call itself goes unreported (one left unanswered
        is sent again before this client's next registration). In a forked child it does
        nothing: the pool is the parent's."""
        if not in_own_process(self._pid):
            t.checked_type(binding, PoolBinding, "binding")
            return
        request = unregistration(binding, self._pools, self._session_id)
        if request is not None and not self._held["suspect"]:
            self._unregister_nowait(request, Resends(self.timeout_s))

    def _unregister_nowait(self, request: Any, resends: Resends) -> None:
        """Send an UnregisterPool whose answer nobody waits for, and send it again while the
        daemon's gRPC refuses it unrun (else the daemon keeps the pool, and its memory
        mapped, until the session ends). The answer comes on gRPC's callback thread, which
        must not sleep: a timer sends it again."""

        def answered(fut: Any) -> None:
            if fut.cancelled() or self._closed:
                return
            error = fut.exception()
            if not isinstance(error, grpc.RpcError):
                return
            if refused_stream(error) and (pause := resends.pause_s()) is not None:
                timer = threading.Timer(pause, self._unregister_nowait, args=(request, resends))
                timer.daemon = True
                timer.start()
            elif unclean(from_rpc_error(error)):
                self._unconfirmed_unregistration(request)  # sent again before a registration

        fut = None
        try:
            fut = self._stub.UnregisterPool.future(request, timeout=resends.left_s())
            # Under the call's lock, which the answer's delivery takes: guarded as the call.
            fut.add_done_callback(answered)
        except ValueError:  # the client was closed meanwhile: the session ends with it
            return
        except Exception:
            raise
        except BaseException as e:  # gRPC's locks are not safe against it: see ``interrupted``
            self.interrupted(e, *([fut] if fut is not None else []))
            raise

    def fence_pool(self, binding: PoolBinding, timeout_s: float | None = None) -> bool:
        """Unregister the pool and wait for the daemon's answer, which comes once no copy
        uses its memory any more: after a transfer that ended without an answer (a timeout),
        True means the engine may reuse the pages; no late copy can land in them. False when
        that could not be confirmed (no answer in time, the session is gone): a copy the
        daemon started may still finish. The next call through ``binding`` registers the
        memory again; an UnregisterPool left unanswered is sent again first (see
        ``_unregister_unconfirmed``), so the daemon does not keep both."""
        t.checked_type(binding, PoolBinding, "binding")
        timeout_s = t.checked_seconds(timeout_s, "timeout_s")
        refuse_in_child(self._pid, "Client")
        request = unregistration(binding, self._pools, self._session_id)
        if request is None:
            return False
        try:
            self.call("UnregisterPool", request, timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            if unclean(from_rpc_error(e)):
                self._unconfirmed_unregistration(request)  # sent again before a registration
            return False
        except DeadlineExceededError:  # no call slot in time: not sent
            self._unconfirmed_unregistration(request)  # sent again before a registration
            return False
        except ValueError:  # grpc's answer to a call on a channel closed (or given up) meanwhile
            if not self._closed and request.session_id == self._session_id:
                raise
            return False  # the session went with the client or the channel: nothing to confirm
        return True

    # ---------------------------------------------------------------- blocks

    def _ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else namespace

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        pin: bool = False,
        lease_ms: int = 0,
        timeout_s: float | None = None,
        namespace: str | None = None,
    ) -> t.LookupResult:
        """``timeout_s`` bounds this call instead of the client's timeout (opening a session
        first, if one is needed, still takes up to the client's)."""
        req = t.build_request(
            pb.LookupRequest, keys=keys, pin=pin, lease_ms=lease_ms, namespace=self._ns(namespace)
        )
        timeout_s = t.checked_seconds(timeout_s, "Lookup: timeout_s")
        answer = self._invoke("Lookup", req, timeout_s=timeout_s)
        try:
            return t.lookup_result(answer)
        except BaseException:
            release_unclaimed(answer, self._release_nowait)
            raise

    def put(
        self,
        pool_id: int,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        parent_key: bytes = b"",
        durable: bool = False,
        namespace: str | None = None,
        timeout_s: float | None = None,
    ) -> t.PutResult:
        """Copy pages into the store. ``timeout_s`` bounds this call instead of the client's
        timeout (a durable put waits for the disk tier's writes: give it the time they take;
        opening a session or registering the pool first still takes up to the client's);
        ``None`` or 0 means the client's timeout."""
        timeout_s = t.checked_seconds(timeout_s, "Put: timeout_s")
        req = t.build_paged_request(
            pb.PutRequest,
            pool_id=pool_id,
            keys=keys,
            pages=pages,
            parent_key=parent_key,
            durable=durable,
            namespace=self._ns(namespace),
        )
        check_pages(self._pools.get(req.pool_id), req)
        return t.put_result(self._invoke("Put", req, timeout_s=timeout_s))

    def get(
        self,
        pool_id: int,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        lease_id: int = 0,
        namespace: str | None = None,
        timeout_s: float | None = None,
    ) -> t.GetResult:
        """Copy stored blocks into pages. ``timeout_s`` bounds this call instead of the
        client's timeout (as for ``put``)."""
        timeout_s = t.checked_seconds(timeout_s, "Get: timeout_s")
        req = t.build_paged_request(
            pb.GetRequest,
            pool_id=pool_id,
            keys=keys,
            pages=pages,
            lease_id=lease_id,
            namespace=self._ns(namespace),
        )
        check_pages(self._pools.get(req.pool_id), req)
        return t.get_result(self._invoke("Get", req, timeout_s=timeout_s))

    def release(self, lease_id: int) -> None:
        self._invoke("Release", t.build_request(pb.ReleaseRequest, lease_id=lease_id))

    def prefetch(
        self,
        keys: Sequence[bytes],
        *,
        deadline_ms: int = 0,
        priority: int = 0,
        namespace: str | None = None,
    ) -> t.PrefetchResult:
        """Start moving the keys' blocks that only lower tiers hold up to the top tier,
        without waiting for them. ``deadline_ms``: the engine reads them within it (0: no
        deadline); they are kept until then (at most the daemon's ``policy.hint_max_s``).
        ``priority`` (int32, default 0) orders this prefetch among those still waiting in the
        daemon: higher first, equal priorities in arrival order; whatever its priority, a
        prefetch waits behind demand reads (a ``get``) and goes ahead of background writes."""
        req = t.build_request(
            pb.PrefetchRequest,
            keys=keys,
            deadline_ms=deadline_ms,
            priority=priority,
            namespace=self._ns(namespace),
        )
        return t.prefetch_result(self._invoke("Prefetch", req))

    def delete(
        self, keys: Sequence[bytes], *, namespace: str | None = None, tenant: str = ""
    ) -> t.DeleteResult:
        """Remove blocks; ``tenant`` (admins only): in that tenant's namespace."""
        req = t.build_request(
            pb.DeleteRequest, keys=keys, namespace=self._ns(namespace), tenant=tenant
        )
        return t.delete_result(self._invoke("Delete", req))

    def evict(
        self,
        keys: Sequence[bytes],
        tier: t.Tier | int | str,
        *,
        namespace: str | None = None,
        tenant: str = "",
        timeout_s: float | None = None,
    ) -> t.EvictResult:
        """Take blocks out of ``tier`` (``"L1"``, ``Tier.L1_HOST``): a block only there moves
        down to the next tier that takes it, else leaves the store. ``tenant`` (admins
        only): in that tenant's namespace. ``timeout_s`` bounds this call instead of the
        client's timeout (a move down writes the blocks into the next tier; ``None`` or 0:
        the client's)."""
        timeout_s = t.checked_seconds(timeout_s, "Evict: timeout_s")
        req = t.build_request(
            pb.EvictRequest,
            keys=keys,
            tier=t.tier_value(tier),
            namespace=self._ns(namespace),
            tenant=tenant,
        )
        return t.evict_result(self._invoke("Evict", req, timeout_s=timeout_s))

    def stats(self) -> t.Stats:
        return t.stats_result(self._invoke("Stats", t.build_request(pb.StatsRequest)))

    def check(self, *, settle_s: float = 1.0, list_limit: int = 0) -> t.CheckResult:
        """The daemon's invariant check (admins only), after waiting up to ``settle_s`` for
        transfers in flight: the call may take that much longer than the client's timeout.
        ``list_limit``: list up to that many of the blocks (keys) and slots each broken
        invariant names (``CheckResult.details``; the daemon lists at most 1000, fewer
        once they would pass half of its ``server.max_message_bytes``)."""
        request = t.check_request(settle_s, list_limit)
        timeout_s = t.check_timeout_s(request, self.timeout_s)
        return t.check_result(self._invoke("Check", request, timeout_s=timeout_s))

    def drain(self, *, resume: bool = False) -> t.DrainResult:
        """Make the daemon refuse new sessions but admins' (or take them again, ``resume``);
        admins only."""
        return t.drain_result(
            self._invoke("Drain", t.build_request(pb.DrainRequest, resume=resume))
        )

    def quarantine(
        self, *, release: bool = False, slots: Sequence[int] = (), timeout_s: float | None = None
    ) -> t.QuarantineResult:
        """The slots L2 holds out of use after reads of them failed (admins only: as many as one
        reply holds, in slot order, and how many in all); with ``release``, after giving ``slots``
        (when empty, up to ``server.max_batch_blocks`` held, going on past the last slot an
        earlier such release tried: call again for the rest) back to use, each once its extent
        takes a write and gives it back (one that fails stays held, its reason saying why;
        ``untried_count`` counts the slots held that no release has tried since their
        quarantine, or since the daemon started; ``deferred`` lists those the release left
        held, no check of theirs failing, for a later one: a read of the slot in flight, or
        the daemon's free of it not done). FailedPreconditionError without L2, and for a
        release while L2 is degraded (but by a failed read, which a release whose every check
        passes clears) or still reading its index. ``timeout_s`` bounds this call instead of
        the client's timeout (a release writes, syncs and reads every extent; ``None`` or 0:
        the client's)."""
        timeout_s = t.checked_seconds(timeout_s, "Quarantine: timeout_s")
        req = t.build_request(pb.QuarantineRequest, release=release, slots=slots)
        return t.quarantine_result(self._invoke("Quarantine", req, timeout_s=timeout_s))

    def health(self, service: str = "") -> bool:
        """Whether the daemon reports SERVING."""
        request = hc.encode_request(service)
        refuse_in_child(self._pid, "Client")  # before the replacement: see ``call``
        self._replace_if_suspect()
        stub = self._stub
        try:
            status = self._until_run(stub.health_check, request, self.timeout_s, stub.call_slots)
        except grpc.RpcError as e:
            raise self.error_of(e) from None
        except ValueError:  # grpc's answer to a call on a closed channel
            if self._closed:
                raise closed_error() from None
            if not self.given_up(stub, ""):
                raise
            return self.health(service)  # given up meanwhile: asked on the new channel
        return bool(status == hc.SERVING)

    # ------------------------------------------------------------ high level

    def store(self, pool: RegisteredPool, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Store the full blocks of ``token_ids`` from ``pages`` (page i holds block i).
        Returns the number of leading tokens the daemon now holds."""
        keys = _pool(pool).keys(token_ids)
        return self.store_keys(pool, keys, pages) * pool.layout.block_tokens

    def load(
        self,
        pool: RegisteredPool,
        token_ids: Sequence[int],
        pages: Sequence[int],
        *,
        lease_ms: int = 0,
    ) -> int:
        """Load the longest stored prefix of ``token_ids`` into ``pages``; returns tokens loaded."""
        blocks = self.load_keys(pool, _pool(pool).keys(token_ids), pages, lease_ms=lease_ms)
        return blocks * pool.layout.block_tokens

    def store_keys(
        self,
        pool: RegisteredPool,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        parent_key: bytes = b"",
    ) -> int:
        """Store a key chain from ``pages`` (page i holds the block of ``keys[i]``).

        For engines that store a long sequence piece by piece through a smaller pool:
        ``parent_key`` is the key before ``keys[0]`` when the chain continues an earlier store.
        Returns the number of leading blocks of ``keys`` the daemon now holds."""
        binding = _pool(pool).binding
        return self._drive(
            store_flow(binding, keys, pages, self.max_batch_blocks, parent_key), binding
        )

    def load_keys(
        self,
        pool: RegisteredPool,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        lease_ms: int = 0,
    ) -> int:
        """Load the longest stored prefix of a key chain into ``pages`` (page i receives the
        block of ``keys[i]``); returns blocks loaded."""
        binding = _pool(pool).binding
        return self._drive(
            load_flow(binding, keys, pages, self.max_batch_blocks, lease_ms), binding
        )

    # ------------------------------------------------------- transfer jobs

    def submit_load(
        self,
        pool: RegisteredPool,
        segments: Sequence[LoadSegment],
        *,
        layer_groups: int | Sequence[tuple[int, int]] | None = None,
        timeout_s: float | None = None,
    ) -> TransferJob:
        """Start loading blocks into ``pool`` in the background; returns the job at once.

        ``layer_groups`` splits each block's layers into that many contiguous ranges (or the
        ranges given), each its own Get, so ``job.wait_layers(n)`` returns as soon as layers
        ``[0, n)`` are in. Each RPC has ``timeout_s`` (the client's timeout by default).
        Raises KvtierError only if the session or the pool cannot be set up; failures of
        the transfer itself end up in the job's status."""
        plan = TransferPlan.for_load(
            segments, len(_pool(pool).layout.layers), self.max_batch_blocks, layer_groups
        )
        return self._start_job(pool, plan, timeout_s)

    def submit_save(
        self,
        pool: RegisteredPool,
        segments: Sequence[SaveSegment],
        *,
        durable: bool = False,
        timeout_s: float | None = None,
    ) -> TransferJob:
        """Start storing key chains from ``pool`` in the background; returns the job at once.
        Chains are stored concurrently, each batch after batch; with ``durable`` each Put
        answers once its blocks are on the daemon's disk tier."""
        _pool(pool)
        plan = TransferPlan.for_save(segments, self.max_batch_blocks, durable)
        return self._start_job(pool, plan, timeout_s)

    def _start_job(
        self, pool: RegisteredPool, plan: TransferPlan, timeout_s: float | None
    ) -> TransferJob:
        timeout_s = t.checked_seconds(timeout_s, "timeout_s")
        for part in plan.parts:  # the client's namespace, as for its other calls
            if part.layer_range == 0:  # a load's other layer ranges send the same pages
                check_pages(pool.binding, part.request)
            part.request.namespace = self.namespace
        # Set up the session and the pool now, so that their errors reach the caller.
        self.session_id  # noqa: B018 - opens the session
        self.pool_id_of(pool.binding)
        job = TransferJob(
            self,
            pool.binding,
            plan,
            timeout_s or self.timeout_s,
            on_finish=lambda j: self._jobs.finished(j.job_id),
        )
        self._jobs.add(job)
        return job.start()

    def job(self, job_id: int) -> TransferJob:
        """A submitted job by id (NotFoundError once its result was taken)."""
        return self._jobs.get(job_id)  # type: ignore[no-any-return]

    def poll(self, job_id: int) -> JobStatus:
        """A job's status now, without waiting."""
        return self.job(job_id).poll()

    def wait(self, job_id: int, timeout_s: float | None = None) -> JobStatus:
        """Wait for a job; once it has finished, its id is forgotten."""
        status = self.job(job_id).wait(timeout_s)
        if status.finished:
            self._jobs.forget(job_id)
        return status

    def cancel(self, job_id: int) -> JobStatus:
        """Cancel a job and forget its id; returns its final status."""
        job = self.job(job_id)
        job.cancel()
        self._jobs.forget(job_id)
        return job.poll()


def _pool(pool: RegisteredPool) -> RegisteredPool:
    return t.checked_type(pool, RegisteredPool, "pool")


class RegisteredPool(PoolView):
    """A pool registered through a Client: addresses its pages and stores/loads by tokens."""

    def __init__(self, client: Client, binding: PoolBinding) -> None:
        self.client = client
        self.binding = binding

    def store(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        return self.client.store(self, token_ids, pages)

    def load(self, token_ids: Sequence[int], pages: Sequence[int], *, lease_ms: int = 0) -> int:
        return self.client.load(self, token_ids, pages, lease_ms=lease_ms)

    def store_keys(
        self, keys: Sequence[bytes], pages: Sequence[int], *, parent_key: bytes = b""
    ) -> int:
        return self.client.store_keys(self, keys, pages, parent_key=parent_key)

    def load_keys(self, keys: Sequence[bytes], pages: Sequence[int], *, lease_ms: int = 0) -> int:
        return self.client.load_keys(self, keys, pages, lease_ms=lease_ms)

    def unregister(self) -> None:
        self.client.unregister_pool(self.pool_id)


def wait_until_serving(
    address: str | None = None,
    timeout_s: float = 60.0,
    *,
    check: Callable[[], None] | None = None,
) -> None:
    """Wait until the daemon at ``address`` answers its health check with SERVING.

    ``check`` is called between attempts and may raise to give up early (e.g. when the
    daemon's process exited). Raises TimeoutError when the time runs out, and
    InvalidArgumentError for a ``timeout_s`` that is not a finite number of seconds >= 0
    (a negative or NaN one gave up without asking, an infinite one waited for ever).
    """
    limit_s = t.checked_seconds(timeout_s, "wait_until_serving: timeout_s", optional=False)
    deadline = time.monotonic() + (limit_s or 0.0)  # never None: optional=False
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            with Client(address, timeout_s=2.0) as client:
                if client.health():
                    return
        except InvalidArgumentError:
            raise  # an address no daemon can have: waiting will not mend it
        except KvtierError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"kvtierd at {resolve_address(address)} not serving after {timeout_s}s")
