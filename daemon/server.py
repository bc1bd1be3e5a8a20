"""The gRPC front: a thin servicer over KVService, and the server's lifecycle.

The servicer only translates protobuf to domain calls and back; errors become status codes in
exactly one place (``_rpc``). The server runs on one asyncio event loop; copies run on a small
thread pool while the loop keeps answering.

Invariants:
- Every call is answered with a status, never UNKNOWN. At most ``MAX_RECEIVING_REQUESTS``
  calls wait for their request message at once, each at most ``REQUEST_RECEIVE_TIMEOUT_S``
  (``RequestReceiver``): a request stalled short of its end holds no buffer for long.
  Requests are parsed by the servicer's own deserializers, a request of
  ``LARGE_REQUEST_BYTES`` or more in its turn, round robin over the tenants
  (``daemon/parseturns.py``): one client's flood of large requests does not hold other
  clients' calls behind all of it. The handler of a request of ``STEP_TURN_BYTES`` or more
  starts in its turn too, once gRPC has handed over the calls that came meanwhile
  (``daemon/stepturns.py``): gRPC takes up calls one a pass in the order they came, and one
  tenant's large steps, one a pass, held another's small call behind every call queued
  before it. Bytes that are not a valid message become
  INVALID_ARGUMENT with at most one WARNING line per method every
  ``server.bad_request_log_interval_s`` (no traceback); domain errors map to their status;
  anything unexpected is INTERNAL with a traceback, at most one per method per interval.
- A request runs to its end even when its client cancels it or its deadline passes (the
  answer is dropped): the store's state is never left halfway between two awaits (slots
  freed while a copy still writes them, a delete that forgot blocks but not their slots).
  One still waiting where it has changed nothing (``daemon/droppable.py``: a Delete waiting
  for L2's recovery) is dropped instead, as if it had never come: it would hold its request
  for an answer no one reads for as long as the wait lasts. Shutdown waits for the requests
  left to run before it closes the store, within its bound: past
  ``server.drain_timeout_s`` plus the flush's timeout plus ``server.stop_grace_s`` (a disk
  write that never returns) the process exits with ``EXIT_STOP_ABANDONED`` as a crash would,
  after logging the blocks it abandons (``Daemon.stop``; a thread of its own ends one whose
  event loop is blocked). A RegisterPool whose client
  cancelled it while the memory was mapped, or whose deadline passed by the time it would
  answer, unregisters its pool again: its client never learns the pool's id. A pinning
  Lookup in that case releases its lease again, for the same reason.
- A RegisterPool maps the client's memory on a worker thread (``daemon/pools.py``), and an
  UnregisterPool or a session's end unmaps it on one: other clients are answered while a
  pool of gigabytes is populated or torn down.
- Every RPC but OpenSession and the health service needs an open session; Check, Drain and
  Quarantine need an admin session. While draining, the health service answers NOT_SERVING.
- At most ``server.max_health_watches`` health watches are open at once, and
  ``server.max_health_watches_per_peer`` from one TCP client host (``WatchLimits``); one more
  is RESOURCE_EXHAUSTED before it watches.
- Both sockets have ``server.socket_mode`` and ``server.socket_group`` before they listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from kvtier import paths
from kvtier.daemon import systemd
from kvtier.daemon.config import Config, ServerConfig, join_host_port, split_host_port
from kvtier.daemon.connections import ConnectionWatch
from kvtier.daemon.credentials import (
    CredentialServer,
    FdCloser,
    TicketBook,
    cred_socket_path,
)
from kvtier.daemon.cuda_pools import open_opener
from kvtier.daemon.droppable import droppable
from kvtier.daemon.eager import eager_future
from kvtier.daemon.errors import (
    DeadlineExceeded,
    Draining,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SessionGone,
    TicketRefused,
    Unauthenticated,
    Unavailable,
)
from kvtier.daemon.health import NOT_SERVING, SERVING, HealthService
from kvtier.daemon.memtrim import MemoryTrimmer
from kvtier.daemon.observe import RpcObserver
from kvtier.daemon.parseturns import (
    LARGE_REQUEST_BYTES,
    WAITING_MESSAGES,
    ParseTurns,
    TurnRefused,
    session_id_of,
)
from kvtier.daemon.pools import EnginePool, PoolRegistry
from kvtier.daemon.ratelog import GRPC_CORE_LOGGER, LostAnswerFilter, RateLimitedLog
from kvtier.daemon.service import KVService
from kvtier.daemon.sessions import SessionRegistry
from kvtier.daemon.stats import Counters
from kvtier.daemon.stepturns import STEP_TURN_BYTES, StepTurns
from kvtier.daemon.store import BlockStore
from kvtier.daemon.tenants import TenantDirectory
from kvtier.daemon.unixsock import (
    BIND_SUFFIX,
    SocketAccess,
    SocketIdentity,
    SocketLock,
    apply_access,
    clear_socket_name,
    move_bound,
    prepare_socket_path,
    private_umask,
    remove_socket,
)
from kvtier.kernels.copy import ensure_fault_handler
from kvtier.kernels.layout import MAX_LAYERS, LayerLayout, PoolLayout
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.wire import (
    ANSWERED_KEY,
    DRAINING_KEY,
    DTYPE_NAMES,
    SESSION_GONE_KEY,
    TICKET_REFUSED_KEY,
    tier_enum,
)
from kvtier.tiers.sizes import counted

log = logging.getLogger(__name__)

SERVICE_NAME = "kvtier.v1.KVTier"
HEALTH_SERVICE_NAME = "grpc.health.v1.Health"
# Requests a stream keeps for its whole life are held to sizes far below the message limit:
# an open session, or a health watch (which needs no session), holding a 64 MiB request each
# would let one client pin gigabytes. A session's name is kept to 200 characters and a token
# is at most 4096 bytes; the health service knows two service names, both short.
MAX_OPEN_SESSION_BYTES = 64 << 10
MAX_HEALTH_SERVICE_CHARS = 1024
# Calls whose request has not fully arrived. gRPC buffers a request until its last byte, and a
# client may announce server.max_message_bytes and stall one byte short, on any number of
# calls and connections: unbounded, ten connections of a hundred such calls held 4 GB. Past
# this many the call that has waited longest ends (a request of a live client arrives within
# milliseconds, so the oldest waiters are the stalled ones); each waits at most the timeout.
MAX_RECEIVING_REQUESTS = 256
# kvtierd's exit status when its stop ran past its bound (``Daemon.stop``): not 0, so that the
# service manager and the operator see a stop that left blocks behind.
EXIT_STOP_ABANDONED = 3
# How many keys of the blocks an abandoned stop loses its log line names (it counts them all).
ABANDONED_KEYS_SHOWN = 32
# How long past its bound a stop whose event loop does not answer (blocked in a call that
# waits for a hung thread: the close of the transfer threads joins them) is given before a
# thread of its own ends the process (``Daemon.stop``).
ABANDON_BLOCKED_AFTER_S = 5.0
REQUEST_RECEIVE_TIMEOUT_S = 10.0
# Calls that have arrived but that the event loop has not taken up yet, every connection's
# together. gRPC's defaults (past 1,000 it drops new calls at random, past 3,000 all of them)
# end the calls of an ordinary burst (3,000 Lookups from one client lost a fifth) with a bare
# CANCELLED that says nothing of why. Past this bound each new call is dropped the same way,
# so it sits above the bursts of live clients; but every call waiting costs memory the
# process keeps (16,000 header-only calls: +170 MB at this bound, +270 MB at 16,384), so not
# far above.
MAX_PENDING_CALLS = 8192
# Calls open at once on one connection (HTTP/2 MAX_CONCURRENT_STREAMS). Without a bound, one
# connection that opens calls and resets each at once (a "rapid reset" flood: no session
# needed, 200,000 in 8 s) filled the pending calls above with calls its client had already
# given up, and every other client's calls waited behind them for seconds or were dropped.
# Bounded, gRPC refuses that connection's excess streams itself, before any work (RST_STREAM:
# REFUSED_STREAM, UNAVAILABLE to the caller, which kvtier's client sends again; or
# ENHANCE_YOUR_CALM to a client that ignores the bound), and the others are served (a Lookup
# beside such a flood: p50 2.4 s with some dropped -> 0.07-0.14 s, none dropped). An engine
# keeps a few calls open per connection, far under the bound.
MAX_STREAMS_PER_CONNECTION = 256
# A request's metadata (headers), set as both of gRPC's limits. Its defaults are a soft 8 KiB,
# past which it refuses requests at random (the nearer the hard limit, the more often), and a
# hard 16 KiB: one call with 10 KB of metadata was served three times in four. One bound
# refuses every request past it (RESOURCE_EXHAUSTED) and serves every one under it.
MAX_METADATA_BYTES = 16 << 10
# File descriptors the daemon keeps for its own use beside server.max_connections (its files,
# the credential socket's connections, memfds handed over with their tickets): fewer under
# RLIMIT_NOFILE is warned of at start.
FD_RESERVE = 1024
R = TypeVar("R")

# The one place where domain errors become gRPC status codes.
STATUS: dict[type[KvtierError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def stop_bound_s(config: Config) -> float:
    """How long a stop may run before the daemon abandons it (``Daemon.stop``): the drain,
    the flush at stop (with L2 and ``flush_on_stop``) and the grace for the stop's own steps.
    The process may outlive it by ``ABANDON_BLOCKED_AFTER_S`` (its event loop blocked) or,
    a stop ended, by ``main.EXIT_AFTER_STOP_S``: what a service manager must wait for."""
    server, l2 = config.server, config.tiers.l2
    flush_s = l2.flush_timeout_s if l2.enabled and l2.flush_on_stop else 0.0
    return server.drain_timeout_s + flush_s + server.stop_grace_s


def status_of(error: KvtierError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


@dataclass(frozen=True, slots=True)
class Malformed:
    """What a deserializer hands the servicer for bytes that are not a valid message."""

    message_type: str
    size: int


async def abort_with(context: grpc.aio.ServicerContext, error: KvtierError) -> NoReturn:
    """End the call with ``error``'s status; an UNAVAILABLE says the daemon sent it."""
    code = status_of(error)
    trailing: tuple[tuple[str, str], ...] = ()
    if code == grpc.StatusCode.UNAVAILABLE:
        trailing = ((ANSWERED_KEY, "1"),)
        if isinstance(error, Draining):
            trailing += ((DRAINING_KEY, "1"),)
    elif isinstance(error, SessionGone):
        trailing = ((SESSION_GONE_KEY, "1"),)
    elif isinstance(error, TicketRefused):
        trailing = ((TICKET_REFUSED_KEY, "1"),)
    await context.abort(code, str(error), trailing_metadata=trailing)
    raise AssertionError("unreachable: abort raises")


def _lenient(message_cls: Any) -> Callable[[bytes], Any]:
    """A deserializer that never raises: a payload that does not parse becomes Malformed."""
    name = message_cls.DESCRIPTOR.name

    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except Exception:  # DecodeError, or anything the parser raises on hostile bytes
            return Malformed(name, len(data))

    return parse


def _rpc(
    fn: Callable[[Any, Any, grpc.aio.ServicerContext], Coroutine[Any, Any, R]],
) -> Callable[..., Awaitable[R]]:
    """Answer malformed requests and errors with their status (see the module invariants)."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: KVTierServicer, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            if isinstance(request, Malformed):
                raise self.malformed(method, request)
            if self.closing.is_set():
                # Sessions end as the daemon stops: without this a request that arrives now
                # names a session already gone and is told NOT_FOUND, as if it never existed.
                raise Unavailable("the daemon is stopping; it takes no new requests")
            # A client that cancels (or whose deadline passes) gets no answer, but the request
            # runs to its end: the store's steps between awaits are not undone halfway. One
            # that waits where it has changed nothing yet (``droppable.unchanged_wait``) is
            # dropped there instead. It starts at once and needs a task of its own only if it
            # waits for something.
            handler = fn(self, request, context)
            work = eager_future(handler)
            try:
                if work.done():
                    # It never waited (most small requests): nothing to shield, nor to await.
                    return work.result()
                try:
                    return await asyncio.shield(work)
                except asyncio.CancelledError:
                    if not work.done():
                        if droppable(handler):
                            self.drop(work)
                        else:
                            self.detach(method, work)
                    raise
            finally:
                # The future holds the handler's exception, whose traceback holds this frame:
                # a cycle keeping the request alive until a full collection.
                del work, handler
        except KvtierError as e:
            if isinstance(e, NotFound) and self.closing.is_set():
                # A request that ran into its session's end as the daemon stops (its pool or
                # lease gone with it) is told why, as one that arrives now is, not that it
                # named something that never was.
                e = Unavailable(f"the daemon is stopping ({e})")
            await abort_with(context, e)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            await context.abort(grpc.StatusCode.INTERNAL, self.internal_error(method))
        raise AssertionError("unreachable")

    return wrapper


# The answer to a single-key Put that is not durable, by its result: built once, since
# building a message with a repeated field took longer than the rest of the handler. gRPC
# only serializes what a handler returns, so the messages are shared and never changed.
_ONE_PUT_RESPONSE = {
    code: pb.PutResponse(results=[code], stored=int(code == pb.PUT_STORED))
    for code in pb.PutResult.values()
}


def layout_from_pb(msg: pb.PoolLayout) -> PoolLayout:
    if msg.dtype not in DTYPE_NAMES:
        raise InvalidArgument("layout.dtype is unspecified or unknown")
    # Counted before anything is built: millions of layers fit in one message, and turning
    # them into objects on the event loop would hold up every other client for seconds.
    if len(msg.layers) > MAX_LAYERS:
        raise InvalidArgument(
            f"layout does not fit the pool: layout has {len(msg.layers)} layers; at most "
            f"{MAX_LAYERS}"
        )
    layers = tuple(
        LayerLayout(x.offset, x.kv_count, x.kv_stride, x.page_stride, x.chunk_bytes)
        for x in msg.layers
    )
    return PoolLayout(layers, msg.num_pages, msg.block_tokens, DTYPE_NAMES[msg.dtype])


class KVTierServicer:
    """Thread-safety: the server's event loop only."""

    def __init__(
        self,
        service: KVService,
        ping_interval_s: int,
        log_interval_s: float = 10.0,
        health_servicer: HealthService | None = None,
    ) -> None:
        self.service = service
        self.ping_interval_s = ping_interval_s
        self.ratelog = RateLimitedLog(log, log_interval_s)
        self.health = health_servicer
        # Set at shutdown: session streams end, so draining waits only for real requests.
        self.closing = asyncio.Event()
        # The open sessions' streams by session id (``end_session`` ends one).
        self._streams: dict[str, _SessionStream] = {}
        # Requests whose client went away before they ended (see the module invariants).
        self.detached: set[asyncio.Future[Any]] = set()

    def drop(self, work: asyncio.Future[Any]) -> None:
        """Cancel a request whose client cancelled it while it waited where it had changed
        nothing yet (``droppable.unchanged_wait``): it unwinds at once, undoing nothing."""
        work.cancel()
        self.service.counters["requests_dropped"] += 1

    def detach(self, method: str, work: asyncio.Future[Any]) -> None:
        """Let a request whose client cancelled it finish on its own."""
        self.detached.add(work)
        self.service.counters["requests_detached"] += 1

        def done(task: asyncio.Future[Any]) -> None:
            self.detached.discard(task)
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None and not isinstance(exc, KvtierError):
                self.service.counters["requests_internal_error"] += 1
                self.ratelog.error(
                    f"internal {method}", "%s failed after its client left", method, exc_info=exc
                )

        work.add_done_callback(done)

    def close_streams(self) -> None:
        """At shutdown: no new session, and every session stream ends (its session with it)."""
        self.closing.set()
        for stream in self._streams.values():
            stream.ended.set()

    def end_session(self, session_id: str, why: str) -> None:
        """End an open session from the daemon's side (a reload changed the tenants so that
        its binding no longer holds): its leases and pools go now, requests naming it are
        NOT_FOUND from now on, and its stream ends with PERMISSION_DENIED and ``why`` (the
        client opens another session, bound as the tenants are now, at its next call)."""
        self.service.close_session(session_id, by_daemon=True)
        stream = self._streams.get(session_id)
        if stream is not None:
            stream.why = why
            stream.ended.set()

    def _given_up_ended(self, session_id: str) -> None:
        """End the stream of a session its client gave up, which the daemon has ended
        (``KVService.end_given_up``), without an error: the client asked for it, and
        nothing reads that stream."""
        stream = self._streams.get(session_id)
        if stream is not None:
            stream.ended.set()

    def client_left(self) -> bool:
        """Whether the client of the request running now has cancelled it, or its deadline
        passed, while it awaited: grpc cancels the handler, ``_rpc`` detaches the request's
        task (the current one, once it has awaited) and its answer will be dropped."""
        return asyncio.current_task() in self.detached

    def unanswered(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the answer of the request running now will reach no one: its client left
        (``client_left``) or its deadline passed while the event loop was busy. A request
        that took something its answer names (a pool, a lease) gives it back then, in the
        same step: no other request runs in between."""
        return self.client_left() or context.time_remaining() == 0

    async def settle(self, timeout_s: float) -> None:
        """Wait for the requests whose clients left to finish."""
        if self.detached:
            await asyncio.wait(list(self.detached), timeout=timeout_s)

    async def end_detached(self) -> None:
        """Cancel the requests whose clients left that still run, and wait until they have
        unwound: left to run, they went on past the close of the tiers (a durable put whose
        L2 writes the flush at stop no longer waits for freed its slots once the transfer
        threads had stopped: an error logged after 'kvtierd stopped')."""
        running = list(self.detached)
        for work in running:
            work.cancel()
        if running:
            await asyncio.wait(running)

    def malformed(self, method: str, request: Malformed) -> InvalidArgument:
        self.service.counters["requests_malformed"] += 1
        self.ratelog.warning(
            f"malformed {method}",
            "%s: refused a request of %d bytes that is not a valid %s",
            method,
            request.size,
            request.message_type,
        )
        return InvalidArgument(f"the request is not a valid {request.message_type} message")

    def internal_error(self, method: str) -> str:
        self.service.counters["requests_internal_error"] += 1
        self.ratelog.exception(f"internal {method}", "%s failed", method)
        return f"{method} failed inside the daemon; see its log"

    async def OpenSession(
        self, request: pb.OpenSessionRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent]:
        try:
            if isinstance(request, Malformed):
                raise self.malformed("OpenSession", request)
            if (size := request.ByteSize()) > MAX_OPEN_SESSION_BYTES:
                raise InvalidArgument(
                    f"an OpenSession request of {size} bytes; at most {MAX_OPEN_SESSION_BYTES}"
                )
            if self.closing.is_set():
                raise Unavailable("the daemon is stopping")
            session = self.service.open_session(
                request.client_name,
                request.credential_ticket,
                unix_socket=context.peer().startswith("unix"),
                token=request.token,
                given_up=request.given_up_sessions,
                given_up_tickets=request.given_up_tickets,
                ended=self._given_up_ended,
            )
        except KvtierError as e:
            if isinstance(e, (Unauthenticated, PermissionDenied, Unavailable)):
                # Who was turned away, for the operator; at a bounded rate.
                self.ratelog.warning(
                    f"session refused {type(e).__name__}", "session refused: %s", e
                )
            await abort_with(context, e)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            await context.abort(grpc.StatusCode.INTERNAL, self.internal_error("OpenSession"))
        stream = self._streams[session.session_id] = _SessionStream()
        try:
            yield pb.SessionEvent(
                session_id=session.session_id,
                ping_interval_s=self.ping_interval_s,
                tenant=session.tenant,
                admin=session.admin,
            )
            ping = pb.SessionEvent(
                session_id=session.session_id, ping_interval_s=self.ping_interval_s
            )
            while not stream.ended.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stream.ended.wait(), self.ping_interval_s)
                if not stream.ended.is_set():
                    yield ping
            if stream.why:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, stream.why)
        finally:
            self._streams.pop(session.session_id, None)
            self.service.close_session(session.session_id)

    @_rpc
    async def RegisterPool(
        self, request: pb.RegisterPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterPoolResponse:
        self.service.session(request.session_id)  # before anything else is looked at
        region = request.WhichOneof("region")
        pool: EnginePool
        if region == "shm":
            layout = layout_from_pb(request.layout)
            pool = await self.service.register_shm_pool(
                request.session_id, request.shm.name, request.shm.size_bytes, layout
            )
        elif region == "fd":
            try:
                layout = layout_from_pb(request.layout)
            except InvalidArgument:
                # Refused before the service redeems the ticket: spent here, its fd closed
                # (see ``KVService.register_fd_pool``).
                self.service.tickets.discard(request.fd.ticket)
                raise
            pool = await self.service.register_fd_pool(
                request.session_id, request.fd.ticket, request.fd.size_bytes, layout
            )
        elif region == "cuda_ipc":
            layout = layout_from_pb(request.layout)
            pool = self.service.register_cuda_ipc_pool(request.session_id, request.cuda_ipc, layout)
        else:
            raise InvalidArgument("RegisterPool needs a region: fd, shm or cuda_ipc")
        if self.unanswered(context):
            # The client cancelled, or its deadline passed (while the memory was mapped, or
            # while the event loop was busy): it never learns the pool's id, so only the
            # session's end would unregister the pool. Both are checked in the step that
            # registered it: no other request ran in between.
            self.service.drop_unanswered_pool(request.session_id, pool)
            raise DeadlineExceeded(
                f"the call was cancelled or its deadline passed before pool {pool.pool_id} "
                "could be answered; it is unregistered again"
            )
        return pb.RegisterPoolResponse(
            pool_id=pool.pool_id, block_bytes=pool.block_bytes, sealed=pool.sealed
        )

    @_rpc
    async def UnregisterPool(
        self, request: pb.UnregisterPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterPoolResponse:
        await self.service.unregister_pool(request.session_id, request.pool_id)
        return pb.UnregisterPoolResponse()

    @_rpc
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        out = await self.service.lookup(
            request.session_id, request.keys, request.pin, request.lease_ms, request.namespace
        )
        if out.lease_id and self.unanswered(context):
            # As for RegisterPool: a client that left (while a key-addressed tier was probed)
            # never learns the lease, so only its expiry would release the pins. Checked in
            # the step that took it: nothing else ran in between.
            self.service.release(request.session_id, out.lease_id)
            raise DeadlineExceeded(
                "the call was cancelled or its deadline passed before its lease could be "
                "answered; it is released again"
            )
        return pb.LookupResponse(
            prefix_len=out.prefix_len, tiers=out.tiers.tolist(), lease_id=out.lease_id
        )

    @_rpc
    async def Put(
        self, request: pb.PutRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        results, persisted = await self.service.put(
            request.session_id,
            request.pool_id,
            request.keys,
            request.pages,
            request.parent_key,
            request.durable,
            request.namespace,
        )
        codes = results.tolist()
        if persisted is None:
            if len(codes) == 1:
                return _ONE_PUT_RESPONSE[codes[0]]
            # Not durable: no persisted field (an empty list given costs as much again as
            # the rest of the message).
            return pb.PutResponse(results=codes, stored=codes.count(pb.PUT_STORED))
        return pb.PutResponse(
            results=codes, stored=codes.count(pb.PUT_STORED), persisted=persisted.tolist()
        )

    @_rpc
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetResponse:
        loaded = await self.service.get(
            request.session_id,
            request.pool_id,
            request.keys,
            request.pages,
            request.lease_id,
            request.layer_begin,
            request.layer_end,
            request.namespace,
        )
        # As lists: numpy's reductions cost more than the scan for the few keys of most Gets.
        flags = loaded.tolist()
        prefix = flags.index(False) if False in flags else len(flags)
        return pb.GetResponse(loaded=flags, prefix_len=prefix)

    @_rpc
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        self.service.release(request.session_id, request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    async def Prefetch(
        self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefetchResponse:
        out = await self.service.prefetch(
            request.session_id,
            request.keys,
            request.deadline_ms,
            request.priority,
            request.namespace,
        )
        return pb.PrefetchResponse(
            resident=out.resident, scheduled=out.scheduled, missing=out.missing
        )

    @_rpc
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        out = await self.service.delete(
            request.session_id, request.keys, request.namespace, request.tenant
        )
        return pb.DeleteResponse(deleted=out.deleted, missing=out.missing, busy=out.busy)

    @_rpc
    async def Evict(
        self, request: pb.EvictRequest, context: grpc.aio.ServicerContext
    ) -> pb.EvictResponse:
        out = await self.service.evict(
            request.session_id, request.keys, request.tier, request.namespace, request.tenant
        )
        return pb.EvictResponse(evicted=out.evicted, missing=out.missing, busy=out.busy)

    @_rpc
    async def Check(
        self, request: pb.CheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckResponse:
        out = await self.service.check(request.session_id, request.settle_ms, request.list_limit)
        return pb.CheckResponse(
            problems=out.problems,
            strict=out.strict,
            blocks=out.blocks,
            sessions=out.sessions,
            leases=out.leases,
            pools=out.pools,
            details=[
                pb.CheckDetail(
                    problem=d.problem,
                    keys=d.keys,
                    slots=d.slots,
                    keys_total=d.keys_total,
                    slots_total=d.slots_total,
                )
                for d in out.details
            ],
        )

    @_rpc
    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        out = self.service.drain(request.session_id, request.resume)
        if self.health is not None and not self.closing.is_set():
            status = NOT_SERVING if out.draining else SERVING
            for name in ("", SERVICE_NAME):
                self.health.set(name, status)
        return pb.DrainResponse(draining=out.draining, sessions=out.sessions)

    @_rpc
    async def Quarantine(
        self, request: pb.QuarantineRequest, context: grpc.aio.ServicerContext
    ) -> pb.QuarantineResponse:
        held, released, deferred = await self.service.quarantine(
            request.session_id, request.release, request.slots
        )
        # A disk that failed many reads holds tens of thousands of slots: the list stops where
        # the reply would pass the message size limit (a varint is at most 10 bytes, its
        # field's tag and length at most 6), and held_count counts every one.
        room = (
            self.service.config.server.max_message_bytes - 64 - 10 * (len(released) + len(deferred))
        )
        listed = []
        for q in held:
            entry = pb.QuarantinedSlot(
                slot=q.slot,
                slot_bytes=q.slot_bytes,
                file=q.file,
                offset=q.offset,
                reason=q.reason,
                at=q.at,
                tried=q.tried,
            )
            room -= entry.ByteSize() + 6
            if room < 0:
                break
            listed.append(entry)
        return pb.QuarantineResponse(
            held=listed,
            released=released,
            held_count=len(held),
            held_bytes=sum(q.slot_bytes for q in held),
            untried_count=sum(not q.tried for q in held),
            deferred=deferred,
        )

    @_rpc
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        snap = self.service.stats(request.session_id)
        return pb.StatsResponse(
            tiers=[
                pb.TierStats(
                    tier=tier_enum(int(u.kind)),
                    capacity_bytes=u.capacity_bytes,
                    used_bytes=u.used_bytes,
                    blocks=u.blocks,
                    state=str(u.health),
                )
                for u in snap.tiers
            ],
            counters=snap.counters,
            gauges=snap.gauges,
            uptime_s=snap.uptime_s,
            version=snap.version,
            addresses=snap.addresses,
            metrics_url=snap.metrics_url,
            tenants=[
                pb.TenantStats(
                    tenant=t.tenant,
                    sessions=t.sessions,
                    tiers=[
                        pb.TenantTierStats(
                            tier=tier_enum(int(u.kind)),
                            used_bytes=u.used_bytes,
                            quota_bytes=u.quota_bytes,
                            blocks=u.blocks,
                        )
                        for u in t.tiers
                    ],
                )
                for t in snap.tenants
            ],
        )


class Daemon:
    """One running kvtierd: store, service, gRPC server, credential socket and background
    tasks."""

    def __init__(self, config: Config, socket_lock: SocketLock | None = None) -> None:
        """``socket_lock``: the lock of ``server.socket``, taken by the caller before anything
        else (``serve``); let go of once the daemon no longer listens."""
        self.config = config
        self.socket_lock = socket_lock
        cfg = config.server
        # Token files first: a config that cannot run fails before L1 is allocated.
        self.tenants = TenantDirectory.from_config(config)
        self.store = BlockStore(config)
        self.pools = PoolRegistry(
            cfg.shm_dir,
            cfg.shm_share_pairs(),
            cfg.bad_request_log_interval_s,
            cuda=open_opener(config.tiers.l0.enabled, config.tiers.l0.device),
        )
        self.sessions = SessionRegistry(cfg.max_sessions_per_tenant, self.store.counters)
        self.fd_closer = FdCloser()
        self.tickets = TicketBook(self.fd_closer)
        self.service = KVService(
            config, self.store, self.pools, self.sessions, self.tickets, self.tenants
        )
        self.service.apply_quotas()
        self.health = HealthService()
        self.servicer = KVTierServicer(
            self.service, cfg.session_ping_s, cfg.bad_request_log_interval_s, self.health
        )
        self.credentials: CredentialServer | None = None
        # Counts the gRPC connections once the server listens (see server.max_connections).
        self.connections: ConnectionWatch | None = None
        # The gRPC socket this daemon bound (removed at stop only while still this one).
        self._socket_identity: SocketIdentity | None = None
        self.server: grpc.aio.Server | None = None
        self.addresses: list[str] = []
        self._stopping = asyncio.Event()
        # What the stop is doing, for the line of one that runs past its bound.
        self._stop_step = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._lost_answers = LostAnswerFilter(cfg.bad_request_log_interval_s)
        self.receiver = RequestReceiver(
            MAX_RECEIVING_REQUESTS,
            REQUEST_RECEIVE_TIMEOUT_S,
            self.service.counters,
            self.sessions.limit_key_of,
            WAITING_MESSAGES * cfg.max_message_bytes,
            self.store.counters,
        )

    async def start(self) -> None:
        cfg = self.config.server
        if ensure_fault_handler():
            log.warning("another SIGBUS handler had replaced the copy guard's; it is back in front")
        logging.getLogger(GRPC_CORE_LOGGER).addFilter(self._lost_answers)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = cfg.max_connections + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < want:
            # The soft limit is the process's own to raise, up to the hard one; 1,024, a
            # common default, is below the default bound on connections alone.
            raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
            if raised > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                log.info("raised the soft RLIMIT_NOFILE from %d to %d", soft, raised)
                soft = raised
        if soft != resource.RLIM_INFINITY and soft < want:
            log.warning(
                "server.max_connections=%d leaves fewer than %d of the %d file descriptors "
                "RLIMIT_NOFILE allows for the daemon's own use: clients that keep that many "
                "connections open can keep it from accepting anyone; lower the key or raise "
                "the limit (LimitNOFILE= in the systemd unit)",
                cfg.max_connections,
                FD_RESERVE,
                soft,
            )
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # The same bound twice: no random drops below it (see MAX_PENDING_CALLS).
                ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                ("grpc.max_metadata_size", MAX_METADATA_BYTES),
                ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
                ("grpc.max_connection_idle_ms", round(cfg.idle_connection_s * 1000)),
                # gRPC binds TCP ports with SO_REUSEPORT by default: a second daemon given the
                # same server.tcp_address listened beside the first and the kernel split the
                # connections between them. Off, the second one's bind fails.
                ("grpc.so_reuseport", 0),
                # Connections in all (see server.max_connections): gRPC closes one more as it
                # accepts it, so the daemon keeps descriptors for its credential socket, the
                # memfds clients hand over and its files.
                ("grpc.max_allowed_incoming_connections", cfg.max_connections),
            ],
        )
        # Latency per method and status, and request ids in log lines (daemon/observe.py).
        observer = RpcObserver(self.store.latency)
        receiver = self.receiver
        kvtier_handlers = observer.wrap(SERVICE_NAME, _kvtier_handlers(self.servicer))
        _add_handlers(self.server, SERVICE_NAME, receiver.wrap(kvtier_handlers))
        health_handlers = _health_handlers(
            self.health,
            self.servicer,
            WatchLimits(cfg.max_health_watches, cfg.max_health_watches_per_peer),
        )
        health_observed = observer.wrap(HEALTH_SERVICE_NAME, health_handlers)
        _add_handlers(self.server, HEALTH_SERVICE_NAME, receiver.wrap(health_observed))
        access = SocketAccess.from_config(cfg)
        unix_path, tcp_port = "", 0
        if cfg.socket:
            path = os.path.abspath(cfg.socket)
            cred_path = cred_socket_path(path)
            prepare_socket_path(path, access)
            clear_socket_name(path + BIND_SUFFIX)  # what gRPC's bind would take or fail on
            prepare_socket_path(cred_path, access)
            # Bound private under a name of its own, then given the path (move_bound: gRPC's
            # stop unlinks the name it bound), its mode and group, and only then listening
            # (start()).
            with private_umask():
                self.server.add_insecure_port(paths.unix_address(path + BIND_SUFFIX))
            # Known before its access is set: a start that cannot set it removes it (unbind).
            self._socket_identity = move_bound(path + BIND_SUFFIX, path)
            apply_access(path, access)
            self.credentials = CredentialServer(
                cred_path,
                self.tickets,
                self.fd_closer,
                lambda e: status_of(e).name,
                cfg.bad_request_log_interval_s,
                self.service.counters,
            )
            self.credentials.start(access)
            self.addresses.append(paths.unix_address(path))
            unix_path = path + BIND_SUFFIX  # the name its connections carry (move_bound)
        if cfg.tcp_address:
            try:
                port = self.server.add_insecure_port(cfg.tcp_address)
            except RuntimeError:  # gRPC's way to say the bind failed
                port = 0
            if port == 0:
                raise OSError(
                    f"cannot listen on {cfg.tcp_address} (server.tcp_address): the port is in "
                    "use or the address is not one of this host's"
                )
            host, wanted = split_host_port(cfg.tcp_address)
            # Port 0 takes a free port: announce the one gRPC took, which clients need.
            self.addresses.append(cfg.tcp_address if wanted else join_host_port(host, port))
            tcp_port = port
        self.service.addresses = list(self.addresses)
        await self.store.open()
        await self.server.start()
        self.store.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, SERVING)
        self._tasks.append(asyncio.create_task(self._expire_leases(), name="lease-reaper"))
        self.connections = ConnectionWatch(unix_path, tcp_port, cfg.max_connections)
        self.service.connections = self.connections
        self._tasks.append(asyncio.create_task(self.connections.run(), name="connection-watch"))
        trimmer = MemoryTrimmer(cfg.memory_trim_bytes, self.store.counters)
        self._tasks.append(asyncio.create_task(trimmer.run(), name="memory-trimmer"))
        if (watchdog_s := systemd.watchdog_interval_s()) is not None:
            self._tasks.append(asyncio.create_task(self._watchdog(watchdog_s), name="watchdog"))
        log.info("kvtierd listening on %s", ", ".join(self.addresses))
        log.info("%s", self.tenants.describe())
        systemd.notify("READY=1\nSTATUS=serving")

    async def unbind(self) -> None:
        """Undo the binding of a start that failed after it (L3 refusing the password, a
        TCP port taken since the host checks): stop listening and remove both sockets, which
        would otherwise stay with nobody listening, for engines and the next start to find."""
        if self.server is not None:
            await self.server.stop(None)
        if self.credentials is not None:
            self.credentials.close()
        if self._socket_identity is not None:
            path = os.path.abspath(self.config.server.socket)
            remove_socket(path, self._socket_identity, still_listening=True)

    def stop_on_signals(self) -> None:
        """From now on SIGTERM and SIGINT stop the daemon (``request_stop``)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        """Stop as SIGTERM does: ``run_until_stopped`` stops the daemon, then returns."""
        self._stopping.set()

    async def run_until_stopped(self) -> None:
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        """Stop as SIGTERM asks (``_stop_in_order``), within ``server.drain_timeout_s`` plus
        the flush's ``tiers.l2.flush_timeout_s`` plus ``server.stop_grace_s``. A write the
        disk never returns holds the flush's or a request's thread for good, and the stop
        with it: past the bound the process logs what it leaves (``_abandon``) and ends as a
        crash would, which loses nothing acknowledged durable (L2's index commits a block
        only once its bytes are synced)."""
        bound_s = stop_bound_s(self.config)
        self._stop_step = "draining requests"
        blocked = threading.Timer(
            bound_s + ABANDON_BLOCKED_AFTER_S, self._abandon_blocked, args=(bound_s,)
        )
        blocked.daemon = True
        blocked.start()
        stopping = asyncio.create_task(self._stop_in_order(), name="stop")
        try:
            # Shielded: a stop past its bound is not unwound, the process ends under it.
            await asyncio.wait_for(asyncio.shield(stopping), bound_s)
        except asyncio.TimeoutError:  # asyncio's: on Python 3.10 not the builtin
            self._abandon(bound_s)
        finally:
            blocked.cancel()

    def _abandon_blocked(self, bound_s: float) -> None:
        """``_abandon`` for a stop whose event loop is blocked, run by a thread of its own:
        the loop's state (which blocks are where) is not this thread's to read, so the line
        says what the stop was doing and not which blocks it loses."""
        log.error(
            "the stop did not end within %gs and its event loop does not answer (blocked "
            "while %s): exiting with status %d; the blocks held only in memory are lost "
            "(none was acknowledged durable)",
            bound_s,
            self._stop_step,
            EXIT_STOP_ABANDONED,
        )
        self._exit_abandoned()

    def _exit_abandoned(self) -> NoReturn:
        if self._socket_identity is not None:
            remove_socket(os.path.abspath(self.config.server.socket), self._socket_identity)
        logging.shutdown()  # flushes the handlers: os._exit skips it
        os._exit(EXIT_STOP_ABANDONED)

    def _abandon(self, bound_s: float) -> NoReturn:
        """End the process now, its stop past ``bound_s``: log the blocks that no persistent
        tier holds (none acknowledged durable: a durable put still writing them was answered
        an error, or is cut off now) and exit with ``EXIT_STOP_ABANDONED``. ``os._exit``:
        the threads of a hung write cannot be joined, and the interpreter's exit joins them."""
        lost = self.store.not_persisted()
        shown = " ".join(
            self.store.table.key_bytes(int(b)).hex() for b in lost[:ABANDONED_KEYS_SHOWN]
        )
        more = (
            f" and {len(lost) - ABANDONED_KEYS_SHOWN} more"
            if len(lost) > ABANDONED_KEYS_SHOWN
            else ""
        )
        log.error(
            "the stop did not end within %gs (server.drain_timeout_s, the flush's "
            "tiers.l2.flush_timeout_s and server.stop_grace_s), while %s: exiting with "
            "status %d; abandoning %d blocks not on a persistent tier, lost (none was "
            "acknowledged durable)%s%s%s",
            bound_s,
            self._stop_step,
            EXIT_STOP_ABANDONED,
            len(lost),
            ": " if len(lost) else "",
            shown,
            more,
        )
        self._exit_abandoned()

    async def _stop_in_order(self) -> None:
        drain_s = self.config.server.drain_timeout_s
        log.info("kvtierd stopping: draining requests for up to %gs", drain_s)
        drained_by = time.monotonic() + drain_s
        systemd.notify("STOPPING=1")
        self.health.enter_graceful_shutdown()
        self.servicer.close_streams()
        if self.credentials is not None:
            self.credentials.close()
        if self.server is not None:
            await self.server.stop(drain_s)
        if self.socket_lock is not None:
            # It never listens again: a successor may start while this one flushes L2 (its
            # sockets are removed below only while they are still this one's).
            self.socket_lock.release()
        # One budget for both waits: the requests whose clients left get what gRPC's grace
        # left of it, so that drain plus flush bounds the stop, as README and the unit's
        # TimeoutStopSec count on (each its own drain_timeout_s had doubled the drain).
        await self.servicer.settle(max(0.0, drained_by - time.monotonic()))
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        l2 = self.config.tiers.l2
        self._stop_step = "flushing to L2"
        await self.store.stop(flush=l2.flush_on_stop, flush_timeout_s=l2.flush_timeout_s)
        self._stop_step = "waiting for requests and transfers still running"
        await self.pools.stop()  # which waits for the registrations under way
        # While the tiers are open; then what their unwinding started (slots freed).
        await self.servicer.end_detached()
        await self.store.space.drain()
        self._stop_step = "closing the tiers"
        self.tickets.close()
        self.store.close()
        if self._socket_identity is not None:
            remove_socket(os.path.abspath(self.config.server.socket), self._socket_identity)
        logging.getLogger(GRPC_CORE_LOGGER).removeFilter(self._lost_answers)
        log.info("kvtierd stopped")

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                await self.service.reap_leases()
                self.tickets.expire()
            except Exception:
                log.exception("lease expiry failed")
                self.store.counters.inc("background_errors")

    async def _watchdog(self, interval_s: float) -> None:
        while True:
            systemd.notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)


# ------------------------------------------------------------------ handlers


class RequestReceiver:
    """Reads each call's one request message itself, so that it can bound the calls waiting
    for theirs (see ``MAX_RECEIVING_REQUESTS``), end those that end their request without
    one (gRPC's unary handling answers those nothing at all), and parse large ones in turns
    (``ParseTurns``).

    ``wrap`` turns a unary-request handler into the request-streaming one of the same method:
    on the wire the two are the same, the client's stubs do not change.

    Thread-safety: the event loop only.
    """

    def __init__(
        self,
        max_waiting: int,
        timeout_s: float,
        counters: Counter[str],
        sender_of: Callable[[str], str] = lambda session_id: "",
        max_turn_bytes: int = WAITING_MESSAGES * ServerConfig.max_message_bytes,
        errors: Counters | None = None,
    ) -> None:
        """``errors``: where a failed hand-on of a large request's turn is counted (the
        store's counters, ``StepTurns``)."""
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.counters = counters
        # Large requests are parsed in turns, round robin over the senders (``sender_of``
        # their session), read from the bytes before the parse; those waiting for theirs
        # hold at most ``max_turn_bytes``.
        self.turns = ParseTurns(
            lambda data: sender_of(session_id_of(data)), counters, max_turn_bytes
        )
        # Their handlers' first steps go in turns too, once the calls queued in gRPC are in,
        # by the parsed request's session: wherever its client wrote the field.
        self._sender_of = sender_of
        self.steps = StepTurns(counters, errors=errors)
        # Calls waiting for their request, oldest first (a dict keeps insertion order).
        self.waiting: dict[_Waiter, None] = {}
        # One timer for every waiter (a timer per call cost more than the rest of the wait):
        # armed while some call waits, it ends those past the timeout, oldest first.
        self._sweep: asyncio.TimerHandle | None = None

    def wrap(self, handlers: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, h in handlers.items():
            # gRPC hands over the request's bytes; ``receive`` parses them (``ParseTurns``).
            if h.unary_unary is not None:
                out[name] = grpc.stream_unary_rpc_method_handler(
                    self._unary(h.unary_unary, h.request_deserializer),
                    response_serializer=h.response_serializer,
                )
            elif h.unary_stream is not None:
                out[name] = grpc.stream_stream_rpc_method_handler(
                    self._stream(h.unary_stream, h.request_deserializer),
                    response_serializer=h.response_serializer,
                )
            else:
                raise ValueError(f"{name}: only unary requests are received here")
        return out

    def _unary(
        self, behavior: Callable[..., Coroutine[Any, Any, Any]], parse: Callable[[bytes], Any]
    ) -> Callable[..., Awaitable[Any]]:
        async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                request, sender = await self._receive(context, parse)
                if sender is None:
                    return await behavior(request, context)
                await self.steps.begin(sender)
                try:
                    # Its first step in its turn; the rest, after a wait, in its own.
                    work: asyncio.Future[Any] = eager_future(behavior(request, context))
                finally:
                    self.steps.end()
                del request
                return await work
            except grpc.aio.AbortError as e:
                _unchain(e)
                raise

        return unary

    def _stream(
        self, behavior: Callable[..., AsyncGenerator[Any, None]], parse: Callable[[bytes], Any]
    ) -> Callable[..., Any]:
        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # aclosing: the handler's own cleanup (a session's end) runs when this stream
            # is closed, not whenever the garbage collector finalizes it.
            try:
                async with contextlib.aclosing(
                    behavior(await self.receive(context, parse), context)
                ) as out:
                    async for response in out:
                        yield response
            except grpc.aio.AbortError as e:
                _unchain(e)
                raise

        return stream

    async def receive(
        self, context: grpc.aio.ServicerContext, parse: Callable[[bytes], Any]
    ) -> Any:
        """The call's request, parsed by ``parse`` (a large one in its turn), or the call
        ends with a status."""
        return (await self._receive(context, parse))[0]

    async def _receive(
        self, context: grpc.aio.ServicerContext, parse: Callable[[bytes], Any]
    ) -> tuple[Any, str | None]:
        """``receive``'s request, and its sender if its handler's first step takes a turn
        (``STEP_TURN_BYTES`` or more; None if not)."""
        self.steps.arrived()
        if len(self.waiting) >= self.max_waiting:
            self._end(next(iter(self.waiting)), grpc.StatusCode.RESOURCE_EXHAUSTED)
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        waiter = _Waiter(task, loop.time())
        self.waiting[waiter] = None
        if self._sweep is None:
            self._sweep = loop.call_later(self.timeout_s, self._expire)
        try:
            request = await context.read()
        except asyncio.CancelledError:
            if waiter.ended is None:
                raise  # the client went away
            if (uncancel := getattr(task, "uncancel", None)) is not None:
                uncancel()  # Python 3.11+: this task goes on, to answer the status
            await context.abort(waiter.ended, self._why(waiter.ended))
        finally:
            self.waiting.pop(waiter, None)
        if request is grpc.aio.EOF:
            self.counters["requests_malformed"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
        if len(request) < STEP_TURN_BYTES:
            self.steps.took_small()
            return parse(request), None
        if len(request) < LARGE_REQUEST_BYTES:
            # Parsed at once, but its handler costs the loop enough to take turns.
            parsed = parse(request)
        else:
            # Handed over whole: ParseTurns frees the bytes of a request it refuses at once.
            held = [request]
            del request
            try:
                parsed = await self.turns.parse(held, parse)
            except TurnRefused as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                raise AssertionError("unreachable") from None  # abort raises
        # A malformed request names no session: it goes with those naming none.
        return parsed, self._sender_of(getattr(parsed, "session_id", ""))

    def _expire(self) -> None:
        """End the calls that have waited ``timeout_s``; re-armed for the oldest left."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() - self.timeout_s
        while self.waiting:
            oldest = next(iter(self.waiting))
            if oldest.since > deadline:
                self._sweep = loop.call_at(oldest.since + self.timeout_s, self._expire)
                return
            self._end(oldest, grpc.StatusCode.DEADLINE_EXCEEDED)

    def _end(self, waiter: _Waiter, code: grpc.StatusCode) -> None:
        if waiter in self.waiting:
            del self.waiting[waiter]
            waiter.ended = code
            waiter.task.cancel()
            self.counters["requests_unreceived"] += 1

    def _why(self, code: grpc.StatusCode) -> str:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return (
                counted(self.max_waiting, "call was", "calls were")
                + " waiting for the rest of their request; this "
                "one had waited longest"
            )
        return f"the request did not arrive in full within {self.timeout_s:g}s"


def _unchain(abort: grpc.aio.AbortError) -> None:
    """Drop what an abort's exception holds of the handler's frames. gRPC keeps the call's
    AbortError on the call's state, which the handler's frames reference (its context): a
    cycle holding the request, up to ``server.max_message_bytes``, and everything the
    handler held, until the collector finds it. With the daemon's collector thresholds
    (``main.GC_FIRST_THRESHOLD``) a client sending large requests that fail (a Put naming a
    closed session) made it hold gigabytes: 100 calls of 3.5 MB held 1.8 GB. gRPC needs the
    exception, not its traceback (nothing logs it) nor the error it was raised for."""
    abort.__traceback__ = None
    abort.__context__ = None
    abort.__cause__ = None


@dataclass(slots=True, eq=False)
class _SessionStream:
    """An open session's stream: set ``ended`` to end it, with ``why`` (empty at shutdown)."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""


@dataclass(slots=True, eq=False)
class _Waiter:
    """A call waiting for its request, and the status it was ended with, if it was."""

    task: asyncio.Task[Any]
    since: float  # loop time it began to wait
    ended: grpc.StatusCode | None = None


def _add_handlers(server: grpc.aio.Server, service: str, handlers: dict[str, Any]) -> None:
    # Generic handlers only, not also registered ones: grpc.aio's server loop keeps a request
    # future armed per registered method (one for the generic ones) and waits on all of them
    # with asyncio.wait on every call, which walks each of them twice; with the 15 methods
    # registered, that cost every small RPC about 10 us of the event loop's time.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def _kvtier_handlers(servicer: KVTierServicer) -> dict[str, Any]:
    """The KVTier service's methods, each parsing its request with a lenient deserializer."""
    handlers: dict[str, Any] = {}
    for method in pb.DESCRIPTOR.services_by_name["KVTier"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        factory = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_lenient(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    return handlers


def watch_peer(peer: str) -> str | None:
    """Whom a watch counts against beyond the total: the host of a TCP peer
    (``ipv4:10.0.0.5`` of ``ipv4:10.0.0.5:41234``), or None for a Unix socket peer, whose
    every connection gRPC names ``unix:`` alone."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, colon, _ = rest.rpartition(":")
    return f"{kind}:{host}" if colon else peer


class WatchLimits:
    """Health watches open at once, every client's together (``server.max_health_watches``)
    and per TCP client host (``server.max_health_watches_per_peer``). A watch needs no
    session (over TCP no token either) and holds a few kilobytes for as long as it stays
    open: unbounded, 20,000 of them grew a daemon by 130 MB; bounded in total only, one
    client took every watch. Unix socket peers cannot be told apart (gRPC's server names
    none), so there the total is the bound.

    Thread-safety: the event loop only."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self.open = 0
        self._by_peer: Counter[str] = Counter()

    def refusal(self, peer: str | None) -> str | None:
        """Why one more watch from ``peer`` is refused, or None if it may open."""
        if self.open >= self.total:
            return (
                f"{self.open} health watches are open; at most {self.total} "
                "(server.max_health_watches)"
            )
        if peer is not None and self._by_peer[peer] >= self.per_peer:
            return (
                f"{self._by_peer[peer]} health watches are open from {peer}; at most "
                f"{self.per_peer} per client host (server.max_health_watches_per_peer)"
            )
        return None

    def opened(self, peer: str | None) -> None:
        self.open += 1
        if peer is not None:
            self._by_peer[peer] += 1

    def closed(self, peer: str | None) -> None:
        self.open -= 1
        if peer is not None:
            self._by_peer[peer] -= 1
            if not self._by_peer[peer]:
                del self._by_peer[peer]


def _health_handlers(
    health_servicer: HealthService, servicer: KVTierServicer, limits: WatchLimits
) -> dict[str, Any]:
    """The standard health service, with malformed requests answered like ours and watches
    bounded by ``limits``."""

    async def refuse(method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, str(servicer.malformed(method, request))
            )
        if len(request.service) > MAX_HEALTH_SERVICE_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a service name of {len(request.service)} characters; at most "
                f"{MAX_HEALTH_SERVICE_CHARS}",
            )

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse("Check", request, context)
        return await health_servicer.Check(request, context)

    async def watch(request: Any, context: grpc.aio.ServicerContext) -> None:
        await refuse("Watch", request, context)
        peer = watch_peer(context.peer())
        if (refusal := limits.refusal(peer)) is not None:
            servicer.service.counters["health_watches_refused"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        limits.opened(peer)
        try:
            await health_servicer.Watch(request, context)
        finally:
            limits.closed(peer)

    serialize = health_pb2.HealthCheckResponse.SerializeToString
    parse = _lenient(health_pb2.HealthCheckRequest)
    return {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=parse, response_serializer=serialize
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=parse, response_serializer=serialize
        ),
    }


async def serve(config: Config, *, on_ready: Callable[[Daemon], None] | None = None) -> None:
    started = time.monotonic()
    cfg = config.server
    # First of all: a second daemon at the socket path of a live one stops here, before it
    # has allocated, opened or bound anything (the first one's socket, L2 folder, TCP and
    # metrics ports stay untouched). Held until the daemon stops listening (``Daemon.stop``).
    lock = None
    if cfg.socket:
        lock = SocketLock.take(os.path.abspath(cfg.socket), SocketAccess.from_config(cfg))
    try:
        daemon = Daemon(config, lock)
        try:
            await daemon.start()
        except BaseException:
            await daemon.unbind()
            raise
        log.info("started in %.2fs", time.monotonic() - started)
        # Before ``on_ready``: a stop signal that arrived while starting, held until now
        # (``daemon/entry.py``), is honoured there, and every later one is the daemon's own.
        daemon.stop_on_signals()
        if on_ready is not None:
            try:
                on_ready(daemon)
            except BaseException:
                # It serves already (the metrics port, taken since the host checks): stopped
                # as at SIGTERM, or its sockets stayed for engines and the next start to find.
                await daemon.stop()
                raise
        await daemon.run_until_stopped()
    finally:
        if lock is not None:
            lock.release()
