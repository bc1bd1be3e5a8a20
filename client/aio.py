"""The asyncio client: the surface of ``kvtier.client.Client`` with coroutines.

Thread-safety: use from one event loop. A client belongs to the event loop of its first call
(grpc.aio binds a channel to its loop, so the channel is made then): it may be made outside
any loop, before ``asyncio.run``; a call from another loop is FailedPreconditionError (its
``close()`` aside).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc

from kvtier.client import credentials
from kvtier.client import health as hc
from kvtier.client import types as t
from kvtier.client.cuda import CudaIpcExport
from kvtier.client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
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
    AsyncTransferJob,
    JobStatus,
    JobTable,
    LoadSegment,
    SaveSegment,
    TransferPlan,
)
from kvtier.client.keys import Namespace
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.slots import (
    DEFAULT_MAX_CALLS_OPEN,
    AsyncCallSlots,
    checked_max_calls_open,
    slot_wait_error,
)
from kvtier.client.sync import (
    _SESSION_METHODS,
    ANSWER_GRACE_S,
    CHANNEL_OPTIONS,
    NAMESPACE_METHODS,
    SessionToken,
    client_namespace,
    client_settings,
    in_own_process,
    late_lookup_text,
    no_fd_transport,
    refuse_in_child,
    session_watch_ended,
)
from kvtier.kernels.layout import PoolLayout
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

session_log = logging.getLogger(credentials.SESSION_LOGGER)
# What passes through a call and is no interrupt: the call's own error (an Exception), a
# cancel (of the caller's task, or by close()), the close of a dropped task's coroutine. Any
# other BaseException (a KeyboardInterrupt, a SystemExit, whatever else a signal's handler
# raised in the loop) is one: it may land anywhere in the call, gRPC's code and the client's
# release of the call's slot included (see ``_until_run``, ``_settle_pinned``).
NOT_INTERRUPTS = (Exception, asyncio.CancelledError, GeneratorExit)
# Tasks of clients collected unclosed, or of none: the session watchers (``_watch_session``)
# and the closes of collected clients' channels (``_close_dropped``), held until they end
# (the loop keeps only a weak reference to a task).
_orphans: set[asyncio.Task[Any]] = set()


def _hold_orphan(task: asyncio.Task[Any]) -> None:
    _orphans.add(task)
    task.add_done_callback(_orphans.discard)


async def _watch_session(client: weakref.ref[AsyncClient], call: Any, session_id: str) -> None:
    """A session's watcher task: waits for the end of its stream, then has the client, if it
    still exists, forget the session and log why it ended. It holds only a weak reference to
    the client, as the blocking client's watcher thread does: with a strong one (its bound
    method), a client dropped unclosed while its loop ran lived on until the loop ended, its
    session open in the daemon and its connection with it."""
    # read(), not async iteration: grpc forbids mixing the two on one call.
    error = None
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.RpcError as e:
        error = e
    session_watch_ended(client, session_id, error)


def _close_dropped(held: dict[str, Any], pid: int) -> None:
    """Close an AsyncClient collected without ``close()`` (its finalizer; it may run on any
    thread): its session's call and its channel are closed on its loop, while that loop is
    open. A loop closed already, or a client that never made its channel, leaves nothing to
    close; nor does a forked child, where the channel is the parent's."""
    loop = held.get("loop")
    if loop is None or not in_own_process(pid) or loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(_close_on_loop, held["channel"], held.get("call"))


def _close_on_loop(channel: Any, session_call: Any) -> None:
    if session_call is not None:
        session_call.cancel()  # the daemon then ends the session, freeing its leases and pools
    _hold_orphan(asyncio.ensure_future(channel.close()))


class AsyncClient:
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
        """See ``Client``."""
        self.address = t.checked_address(t.resolve_address(address))
        self.timeout_s, self.max_batch_blocks, client_name = client_settings(
            timeout_s, max_batch_blocks, client_name
        )
        self.max_calls_open = checked_max_calls_open(max_calls_open)
        self._slots = AsyncCallSlots(self.max_calls_open)  # the channel's (see Client)
        self.namespace = client_namespace(namespace)
        self._token = SessionToken(token, token_file)
        self.tenant = ""  # the session's tenant, once it is open
        self.admin = False
        self.client_name = client_name or f"pid {os.getpid()} (asyncio)"
        # The channel, made on the loop of the first call (see _on_loop): grpc.aio binds a
        # channel to the loop it is made on, so one made here, outside the loop that used it
        # (a client made before asyncio.run), failed every call with a RuntimeError.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: Any = None
        self._stub: Any = None
        self._health: Any = None
        self._lock = asyncio.Lock()
        self._register_lock = asyncio.Lock()  # one registration at a time (see _pool_id)
        self._closed = False
        self._session_id = ""
        self._session_call: Any = None
        self._session_task: asyncio.Task[None] | None = None
        self._pools: dict[int, PoolBinding] = {}
        self._jobs = JobTable()
        # Tasks nobody awaits (unregister_pool_nowait's, Releases sent without waiting,
        # pinning Lookups whose caller left, the watchers of sessions given up), held here
        # until they end (the loop keeps only a weak reference to a task).
        self._unanswered: set[asyncio.Task[Any]] = set()
        # UnregisterPools that went unanswered: see Client._unregister_unconfirmed.
        self._unconfirmed: dict[int, str] = {}
        self._pid = os.getpid()
        # A client dropped unclosed is closed when collected: its session's watcher holds no
        # reference to it (see _watch_session), and its finalizer holds none either, only its
        # loop, its channel and the open session's call (kept in _held).
        self._held: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, _close_dropped, self._held, self._pid)
        self._finalizer.atexit = False  # the process's exit ends its sessions anyway

    # --------------------------------------------------------------- lifecycle

    def _on_loop(self) -> None:
        """Check that the caller runs on this client's event loop, making the channel there on
        the first call. A call from another loop is refused before it touches gRPC (whose
        calls there failed with a RuntimeError about another loop, or hung), and so is one in
        a child the client's process forked (``refuse_in_child``)."""
        refuse_in_child(self._pid, "AsyncClient")
        loop = asyncio.get_running_loop()
        if self._closed and loop is not self._loop:
            raise closed_error()  # on its own loop, the call's own path says so
        if self._loop is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = pb_grpc.KVTierStub(self._channel)
            self._health = self._channel.unary_unary(
                hc.CHECK_METHOD,
                request_serializer=None,  # health() encodes its request before sending it
                response_deserializer=hc.decode_response,
            )
            self._loop = loop
            self._held["loop"], self._held["channel"] = loop, self._channel
        elif loop is not self._loop:
            which = "which has closed" if self._loop.is_closed() else "not the caller's"
            raise FailedPreconditionError(
                f"this AsyncClient belongs to the event loop of its first call, {which}: "
                "make one client per event loop"
            )

    async def close(self) -> None:
        """Close the client; from another event loop than its own too: while its own runs
        (in another thread) the client is closed there, and once its own has stopped or
        closed it is marked closed and its channel is left to the garbage collector. In a
        forked child it only marks the child's copy closed (see ``Client.close``)."""
        if not in_own_process(self._pid):
            self._closed = True
            return
        own = self._loop
        if own is not None and own is not asyncio.get_running_loop():
            if own.is_running():
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.close(), own))
                return
            self._closed = True
            self._finalizer.detach()  # nothing is left to close, on a loop that has ended
            self._session_id, self._session_call, self._session_task = "", None, None
            self._unanswered.clear()
            return
        self._closed = True
        self._finalizer.detach()  # closed here: collected, it is not closed again
        call, task = self._session_call, self._session_task
        self._session_id, self._session_call, self._session_task = "", None, None
        if call is not None:
            call.cancel()
        for unanswered in list(self._unanswered):
            unanswered.cancel()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._channel is not None:
            await self._channel.close()

    def closed_error_for(self, error: BaseException) -> UnavailableError | None:
        """What a call that ended in ``error`` raises instead when this client's ``close()``
        ended it: ``closed_error()``, as the blocking client says (``Client.error_of``), for
        grpc.aio's ``UsageError`` (a call made on the closed channel) and for
        ``asyncio.CancelledError`` (grpc.aio cancels the calls still on it) unless the
        caller's own task is being cancelled; else None, and ``error`` goes on. Before Python
        3.11 a task does not tell whether it is being cancelled: None there for a cancel, as a
        cancel of the caller's task must never be swallowed."""
        if not self._closed:
            return None
        if isinstance(error, asyncio.CancelledError):
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if cancelling is None or cancelling():
                return None
        return closed_error()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def session(self) -> str:
        """The open session, opened on first use."""
        return await self._session(open_one=True)

    async def _session(self, *, open_one: bool) -> str:
        """The open session; without one, a new one, or (not ``open_one``)
        ``lease_session_ended()``."""
        self._on_loop()
        async with self._lock:
            if self._closed:
                raise closed_error()
            if self._session_call is not None and self._session_call.done():
                self._session_id, self._session_call = "", None
            if not self._session_id:
                if not open_one:
                    raise lease_session_ended()
                await self._open_session()
            return self._session_id

    async def _open_session(self) -> None:
        tickets = credentials.SessionTickets(credentials.cred_socket_path(self.address))
        request = t.build_request(
            pb.OpenSessionRequest, client_name=self.client_name, token=self._token.current()
        )
        if tickets.due():
            request.credential_ticket = await _off_loop(tickets.fetch, self.timeout_s)
        # Sent again as the blocking client's, with a new ticket past the held one's age.
        resends = Resends(self.timeout_s)
        while (opened := await self._send_open_session(request, resends)) is None:
            if tickets.due():
                request.credential_ticket = await _off_loop(tickets.fetch, resends.left_s())
        first, call = opened
        if first is grpc.aio.EOF:
            raise UnavailableError("the daemon closed the session at once")
        self._session_id, self._session_call = first.session_id, call
        self._held["call"] = call
        self.tenant, self.admin = first.tenant, first.admin
        self._session_task = asyncio.create_task(
            _watch_session(weakref.ref(self), call, first.session_id)
        )
        _hold_orphan(self._session_task)  # held past the client's collection, until it ends

    async def _send_open_session(self, request: Any, resends: Resends) -> tuple[Any, Any] | None:
        """(first event, call) of one OpenSession, or None after a pause when the daemon's
        gRPC refused it unrun and the client's timeout leaves time to send it again."""
        try:
            # close() may have run while the ticket was fetched off the loop: grpc.aio's
            # answer on the closed channel is its UsageError, the closed client's error here.
            call = self._stub.OpenSession(request)
        except grpc.aio.UsageError as e:
            if (closed := self.closed_error_for(e)) is None:
                raise
            raise closed from None
        try:
            # The first event must come within the client's timeout (see the sync client).
            return await asyncio.wait_for(call.read(), resends.left_s()), call
        except asyncio.TimeoutError:
            call.cancel()
            raise DeadlineExceededError(
                f"the daemon did not open a session within {self.timeout_s}s"
            ) from None
        except grpc.RpcError as e:
            if not refused_stream(e) or (pause := resends.pause_s()) is None:
                raise from_rpc_error(e) from None
        except asyncio.CancelledError as e:
            if (closed := self.closed_error_for(e)) is None:
                raise
            raise closed from None
        await asyncio.sleep(pause)
        return None

    def forget_session(self, session_id: str) -> bool:
        """As the sync client's."""
        if self._session_id != session_id:
            return False
        self._session_id, self._session_call = "", None
        return True

    # ------------------------------------------------------------------ calls

    async def _invoke(
        self,
        method: str,
        request: Any,
        binding: PoolBinding | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        # A Release is sent in the open session only (see ``lease_session_ended``).
        releasing = method == "Release"
        again = SendAgain(method in _SESSION_METHODS and not releasing, binding is not None)
        while True:
            if releasing:
                request.session_id = await self._session(open_one=False)
            elif method in _SESSION_METHODS:
                request.session_id = await self.session()
            if binding is not None:
                request.pool_id = await self._pool_id(binding, request.session_id)
            try:
                return await self.call(method, request, timeout_s or self.timeout_s)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            except (grpc.aio.UsageError, asyncio.CancelledError) as e:  # see closed_error_for
                if (closed := self.closed_error_for(e)) is None:
                    raise
                raise closed from None
            if not (why := again.after(err)):
                raise err
            if why == "session":
                self.forget_session(request.session_id)
            if binding is not None:
                self.forget_pool_id(binding, request.pool_id)

    async def call(
        self, method: str, request: Any, timeout_s: float, *, timed_wait: bool = True
    ) -> Any:
        """One call, in one of the client's call slots (``max_calls_open``: see
        ``Client.call``), sent again while the daemon's gRPC refuses it unrun
        (``refused_stream``: this connection has many calls open) and its time allows;
        raises grpc.RpcError, or DeadlineExceededError when its time ran out before a slot
        came free. ``timed_wait`` False: its time starts once it has a slot (the transfer
        jobs' parts, sent through it too: each RPC has the job's timeout)."""
        self._on_loop()
        return await self._until_run(getattr(self._stub, method), request, timeout_s, timed_wait)

    async def _until_run(
        self, rpc: Any, request: Any, timeout_s: float, timed_wait: bool = True
    ) -> Any:
        """``rpc(request)`` in a call slot, sent again as ``call`` says (also the health
        check's)."""
        self._on_loop()
        resends = Resends(timeout_s)
        slots = self._slots
        try:
            while not slots.take():
                got = await slots.wait(resends.left_s() if timed_wait else None)
                if got:
                    break
                if got is not None:
                    raise slot_wait_error(self.max_calls_open, timeout_s)
                slots = self._slots  # given up while the call waited: it queues on the new
            try:  # from the slot's taking on: an interrupt may land at any call
                if not timed_wait:
                    resends = Resends(timeout_s)
                # A pinning Lookup's caller waits its time only (``_pinning_lookup``).
                pinning = type(request) is pb.LookupRequest and request.pin
                grace_s = ANSWER_GRACE_S if pinning else 0.0
                while True:
                    try:
                        return await rpc(request, timeout=resends.left_s() + grace_s)
                    except grpc.RpcError as e:
                        if not refused_stream(e) or (pause := resends.pause_s()) is None:
                            raise
                    await asyncio.sleep(pause)
            finally:
                slots.release()
        except NOT_INTERRUPTS:
            raise  # a cancel, or the close of a task's coroutine dropped, is never inside release
        except BaseException:
            # What a signal's handler raised (a KeyboardInterrupt under a loop run without
            # ``asyncio.run``'s handler, as a notebook's): landing in the release, it left
            # the slot taken for good. The slots are given up, as the blocking client gives
            # up its channel and the slots with it (``Client._until_run``).
            self._give_up_slots(slots)
            raise

    def _give_up_slots(self, slots: AsyncCallSlots) -> None:
        """Count the calls on new slots from now on (the new ones first: another interrupt
        before the old are given up leaves their tasks to their time) and give up ``slots``,
        unless an earlier interrupt did: the calls queued there queue on the new ones."""
        if self._slots is slots:
            self._slots = AsyncCallSlots(self.max_calls_open)
            slots.give_up()

    async def _drive(self, flow: Flow, binding: PoolBinding | None) -> int:
        advance: Callable[[Any], tuple[str, Any]]  # the flow's send, or its throw
        try:
            method, request = next(flow)
            while True:
                if method in NAMESPACE_METHODS:
                    request.namespace = self.namespace
                try:
                    response = await self._flow_call(method, request, binding)
                except Exception as e:
                    advance, value = flow.throw, e
                except BaseException:  # a cancel of the caller's task: no more awaits
                    self._abandon(flow)
                    raise
                else:
                    advance, value = flow.send, response
                try:
                    method, request = advance(value)
                except Exception:
                    raise
                except BaseException:  # a signal handler's, as the flow took ``value`` in
                    abandon_advanced(flow, request, value, self._send_release)
                    raise
        except StopIteration as done:
            return int(done.value)

    async def _flow_call(self, method: str, request: Any, binding: PoolBinding | None) -> Any:
        """A flow's call; a pinning Lookup as ``_pinning_lookup`` says."""
        call = self._invoke(method, request, binding if method in ("Put", "Get") else None)
        if method != "Lookup" or not request.pin:
            return await call
        return await self._pinning_lookup(call, request, self.timeout_s)

    async def _pinning_lookup(
        self, call: Coroutine[Any, Any, Any], request: pb.LookupRequest, timeout_s: float
    ) -> Any:
        """A pinning Lookup (a load's, or ``lookup(pin=True)``: ``call``, sending ``request``)
        that runs on to its answer when the caller's task is cancelled (or interrupted) or its
        time (``timeout_s``) runs out, and whose lease is then released: the daemon pins as
        it answers, and the lease id is only in the answer, so a cancel that came after the
        daemon had answered left the blocks pinned until the lease expired
        (``server.lease_default_ms``, or the call's ``lease_ms``). Its gRPC deadline comes
        ``ANSWER_GRACE_S`` after its time (``_until_run``): with one deadline at both ends,
        gRPC dropped an answer the daemon sent in time that reached the client late, its
        lease pinned likewise. One whose call an interrupt ended, its answer unread, gives
        its session up (see ``_settle_pinned``)."""
        try:
            # The session is opened first, within the client's time: ``timeout_s`` is the
            # Lookup's own, as any call's (README), and the blocking client's.
            await self.session()
        except BaseException:
            call.close()  # not begun
            raise
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:  # asyncio's: on Python 3.10 not the builtin
            self._settle_when_answered(request, task)
            raise DeadlineExceededError(late_lookup_text(timeout_s)) from None
        except BaseException:  # the call's own error, or the caller's cancel, or an interrupt
            if task.done():
                self._settle_pinned(request, task)
            else:
                self._settle_when_answered(request, task)
            raise

    def _settle_when_answered(self, request: pb.LookupRequest, lookup: asyncio.Task[Any]) -> None:
        """Settle pinning Lookup ``lookup`` (``_settle_pinned``) once it is answered."""
        self._hold(lookup)  # close() cancels it: the session frees its pins
        lookup.add_done_callback(functools.partial(self._settle_pinned, request))

    def _settle_pinned(self, request: pb.LookupRequest, lookup: asyncio.Task[Any]) -> None:
        """Free what a pinning Lookup whose answer its caller will not read pinned: its lease,
        released, if it was answered (the caller cancelled, or its time ran out); its session,
        given up (``_give_up_session``), if an interrupt (not ``NOT_INTERRUPTS``) ended its
        call. That one may have landed inside gRPC's call as it took the answer in, or as the
        call's slot was freed, once the daemon had pinned: the lease id was lost with the
        answer, and the blocks stayed pinned until the lease expired, in the session the
        client kept."""
        if lookup.cancelled():
            return
        if (error := lookup.exception()) is None:
            release_unclaimed(lookup.result(), self._send_release)
        elif not isinstance(error, NOT_INTERRUPTS):
            self._give_up_session(request.session_id)

    def _give_up_session(self, session_id: str) -> None:
        """Give ``session_id`` up, if it is still the client's, as the blocking client gives
        up its channel's (``Client.interrupted``): the daemon ends the session once its
        stream's cancel reaches it, freeing its leases, pins and pools, and the next call
        opens another and registers the pools again there. The channel is kept (gRPC's aio
        channel is not left hung by an interrupt, and its call slots are given up by
        ``_until_run``). The calls that already name that session (queued for a slot, say)
        are answered that it is gone (``session_gone``) and sent again in the new one by
        ``_invoke`` (one the daemon runs before it ends the session is answered there), but
        a Release, whose lease went with the session (NotFoundError), and a transfer job's
        part (its job fails). Not a coroutine: nothing awaits on an interrupt's way out."""
        if not session_id or session_id != self._session_id:
            return  # ended already, and its leases with it
        call, watcher = self._session_call, self._session_task
        self._session_id, self._session_call, self._session_task = "", None, None
        call.cancel()
        if watcher is not None:  # held until it sees the cancel
            self._hold(watcher)

    def _hold(self, task: asyncio.Task[Any]) -> None:
        """Hold ``task``, which nobody awaits, in ``_unanswered`` until it ends (the loop keeps
        only a weak reference to a task); ``close()`` cancels it."""
        self._unanswered.add(task)
        task.add_done_callback(self._unanswered.discard)

    def _abandon(self, flow: Flow) -> None:
        """See ``Client._abandon``: a load whose task was cancelled (``asyncio.wait_for``)
        during its Get, or during its Release, left its lease pinning the blocks until it
        expired. Its Releases, the interrupted one included, go out as tasks of the loop that
        nobody awaits (``close()`` cancels them)."""
        abandon(flow, self._send_release)

    def _send_release(self, request: pb.ReleaseRequest) -> None:
        """Send a Release in the open session, if any, as a task nobody awaits."""
        if self._session_id and not self._closed:
            request.session_id = self._session_id
            self._hold(asyncio.get_running_loop().create_task(self._release_nowait(request)))

    async def _release_nowait(self, request: pb.ReleaseRequest) -> None:
        try:
            with contextlib.suppress(grpc.RpcError, grpc.aio.UsageError, DeadlineExceededError):
                await self.call("Release", request, self.timeout_s)
        except NOT_INTERRUPTS:
            raise
        except BaseException:
            # An interrupt (see ``_settle_pinned``), the Release perhaps not sent: the lease,
            # whose id only the client has, stayed pinned until it expired. Sent again (one
            # already released is NOT_FOUND, ignored) rather than ending its session: the
            # caller's own leases there, pools and jobs stay. A session ended took it along.
            if request.session_id == self._session_id:
                self._send_release(request)
            raise

    async def _register(self, binding: PoolBinding) -> None:
        await self._unregister_unconfirmed()
        request = await self._registration_request(binding)
        try:
            resp = await self._send_registration(request)
        except UnauthenticatedError as e:
            # A ticket refused, not a session (``PoolBinding.registers_again``): a session
            # refused first raises from ``_registration_request`` before any ticket is
            # fetched, one refused as the request was sent again in a new session (a token
            # revoked meanwhile) from ``_invoke``.
            if not binding.registers_again(e):
                raise
            request = await self._registration_request(binding)
            resp = await self._send_registration(request)
        binding.pool_id, binding.block_bytes = resp.pool_id, resp.block_bytes
        binding.sealed = resp.sealed
        binding.session_id = request.session_id
        self._pools[resp.pool_id] = binding

    async def _registration_request(self, binding: PoolBinding) -> Any:
        """The request of one registration of ``binding`` (see
        ``Client._send_registration``): the session opened before the ticket is fetched, so
        that one refused (a wrong token) costs no ticket."""
        await self.session()
        ticket = b""
        if binding.hands_over_fd:
            path = credentials.cred_socket_path(self.address)
            if path is None:
                raise no_fd_transport(self.address)
            ticket = await _off_loop(_pool_ticket, binding, path, self.timeout_s)
        return binding.register_request(ticket)

    async def _send_registration(self, request: Any) -> Any:
        """The answer to ``request``, a RegisterPool, sent in the open session (again in a new
        one where the daemon ended it: ``_invoke``)."""
        try:
            return await self._invoke("RegisterPool", request)
        except NOT_INTERRUPTS:
            raise
        except BaseException:
            # An interrupt (see ``_settle_pinned``) once the daemon may have registered the
            # pool: its id lost, the pool stayed the session's, and each registration again
            # added one, until ``server.max_pools_per_session`` refused them. The session's
            # end frees it.
            self._give_up_session(request.session_id)
            raise

    @property
    def stub(self) -> pb_grpc.KVTierStub:
        """The raw gRPC stub (requests need ``session_id`` filled in by the caller); on the
        client's event loop (its first use makes the channel there)."""
        self._on_loop()
        return self._stub  # type: ignore[no-any-return]

    async def pool_id_of(self, binding: PoolBinding) -> int:
        """See ``Client.pool_id_of``."""
        return await self._pool_id(binding, await self.session())

    async def _pool_id(self, binding: PoolBinding, session_id: str) -> int:
        """See ``Client._pool_id``: a coroutine that finds another registering the pool
        takes that id."""
        if not binding.pool_id or binding.session_id != session_id:
            async with self._register_lock:
                if not binding.pool_id or binding.session_id != session_id:
                    await self._register(binding)
        return binding.pool_id

    def forget_pool_id(self, binding: PoolBinding, pool_id: int) -> None:
        """See ``Client.forget_pool_id``."""
        if binding.pool_id == pool_id:
            binding.pool_id = 0

    # ----------------------------------------------------------------- pools

    async def register_pool(
        self, shm: SharedMemoryPool, layout: PoolLayout, namespace: Namespace | None = None
    ) -> AsyncRegisteredPool:
        binding = new_binding(shm, SharedMemoryPool, layout, namespace)
        await self._register(binding)
        return AsyncRegisteredPool(self, binding)

    async def register_cuda_pool(
        self, export: CudaIpcExport, layout: PoolLayout, namespace: Namespace | None = None
    ) -> AsyncRegisteredPool:
        """Register GPU memory exported over CUDA IPC (``kvtier.client.cuda``); the daemon
        needs its GPU tier (``tiers.l0``) on the same device, else FailedPreconditionError."""
        binding = new_binding(export, CudaIpcExport, layout, namespace)
        await self._register(binding)
        return AsyncRegisteredPool(self, binding)

    async def unregister_pool(self, pool_id: int) -> None:
        await self._invoke(
            "UnregisterPool", t.build_request(pb.UnregisterPoolRequest, pool_id=pool_id)
        )
        self._pools.pop(pool_id, None)

    def unregister_pool_nowait(self, binding: PoolBinding) -> None:
        """See ``Client.unregister_pool_nowait``. Not a coroutine (as ``Queue.put_nowait``):
        a synchronous close path may call it, from this client's event loop; the
        UnregisterPool goes out as a task of that loop, sent again while the daemon's gRPC
        refuses it unrun, and ``close()`` cancels it (the session's end frees the pool)."""
        loop = asyncio.get_running_loop()  # off the loop: RuntimeError, the pool kept
        if not in_own_process(self._pid):  # a forked child's copy: the pool is the parent's
            t.checked_type(binding, PoolBinding, "binding")
            return
        if self._loop is not None:
            self._on_loop()  # another loop: FailedPreconditionError, the pool kept
        request = unregistration(binding, self._pools, self._session_id)
        if request is None:
            return
        self._hold(loop.create_task(self._unregister_nowait(request)))

    async def _unregister_nowait(self, request: pb.UnregisterPoolRequest) -> None:
        # Nobody waits for the answer; one left unanswered is sent again before the next
        # registration (see Client._unregister_unconfirmed).
        with contextlib.suppress(grpc.aio.UsageError):
            try:
                await self.call("UnregisterPool", request, self.timeout_s)
            except grpc.RpcError as e:
                if unclean(from_rpc_error(e)):
                    self._unconfirmed[request.pool_id] = request.session_id
            except DeadlineExceededError:  # no call slot in time: not sent
                self._unconfirmed[request.pool_id] = request.session_id

    async def _unregister_unconfirmed(self) -> None:
        """See ``Client._unregister_unconfirmed``."""
        if not self._unconfirmed:
            return
        session_id = await self.session()
        todo = [pool for pool, sid in self._unconfirmed.items() if sid == session_id]
        self._unconfirmed = {pool: session_id for pool in todo}
        for pool_id in todo:
            request = t.build_request(
                pb.UnregisterPoolRequest, session_id=session_id, pool_id=pool_id
            )
            try:
                await self.call("UnregisterPool", request, self.timeout_s)
            except grpc.RpcError as e:
                if unclean(from_rpc_error(e)):
                    break  # still unanswered: kept, with those after it
            except DeadlineExceededError:  # no call slot in time: not sent, kept
                break
            self._unconfirmed.pop(pool_id, None)

    # ---------------------------------------------------------------- blocks

    def _ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else namespace

    async def lookup(
        self,
        keys: Sequence[bytes],
        *,
        pin: bool = False,
        lease_ms: int = 0,
        timeout_s: float | None = None,
        namespace: str | None = None,
    ) -> t.LookupResult:
        """``timeout_s`` bounds this call instead of the client's timeout."""
        req = t.build_request(
            pb.LookupRequest, keys=keys, pin=pin, lease_ms=lease_ms, namespace=self._ns(namespace)
        )
        timeout_s = t.checked_seconds(timeout_s, "Lookup: timeout_s")
        call = self._invoke("Lookup", req, timeout_s=timeout_s)
        timeout_s = timeout_s or self.timeout_s
        answer = await (self._pinning_lookup(call, req, timeout_s) if req.pin else call)
        try:
            return t.lookup_result(answer)
        except BaseException:  # a signal handler's KeyboardInterrupt
            release_unclaimed(answer, self._send_release)
            raise

    async def put(
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
        """See ``Client.put``: ``timeout_s`` bounds this call instead of the client's timeout."""
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
        return t.put_result(await self._invoke("Put", req, timeout_s=timeout_s))

    async def get(
        self,
        pool_id: int,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        lease_id: int = 0,
        namespace: str | None = None,
        timeout_s: float | None = None,
    ) -> t.GetResult:
        """See ``Client.get``: ``timeout_s`` bounds this call instead of the client's timeout."""
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
        return t.get_result(await self._invoke("Get", req, timeout_s=timeout_s))

    async def release(self, lease_id: int) -> None:
        await self._invoke("Release", t.build_request(pb.ReleaseRequest, lease_id=lease_id))

    async def prefetch(
        self,
        keys: Sequence[bytes],
        *,
        deadline_ms: int = 0,
        priority: int = 0,
        namespace: str | None = None,
    ) -> t.PrefetchResult:
        """``Client.prefetch``: ``priority`` (int32, default 0) orders it among the prefetches
        waiting in the daemon, higher first, always behind demand reads and ahead of
        background writes."""
        req = t.build_request(
            pb.PrefetchRequest,
            keys=keys,
            deadline_ms=deadline_ms,
            priority=priority,
            namespace=self._ns(namespace),
        )
        return t.prefetch_result(await self._invoke("Prefetch", req))

    async def delete(
        self, keys: Sequence[bytes], *, namespace: str | None = None, tenant: str = ""
    ) -> t.DeleteResult:
        req = t.build_request(
            pb.DeleteRequest, keys=keys, namespace=self._ns(namespace), tenant=tenant
        )
        return t.delete_result(await self._invoke("Delete", req))

    async def evict(
        self,
        keys: Sequence[bytes],
        tier: t.Tier | int | str,
        *,
        namespace: str | None = None,
        tenant: str = "",
        timeout_s: float | None = None,
    ) -> t.EvictResult:
        """See ``Client.evict``."""
        timeout_s = t.checked_seconds(timeout_s, "Evict: timeout_s")
        req = t.build_request(
            pb.EvictRequest,
            keys=keys,
            tier=t.tier_value(tier),
            namespace=self._ns(namespace),
            tenant=tenant,
        )
        return t.evict_result(await self._invoke("Evict", req, timeout_s=timeout_s))

    async def stats(self) -> t.Stats:
        return t.stats_result(await self._invoke("Stats", t.build_request(pb.StatsRequest)))

    async def check(self, *, settle_s: float = 1.0, list_limit: int = 0) -> t.CheckResult:
        """See ``Client.check``."""
        request = t.check_request(settle_s, list_limit)
        timeout_s = t.check_timeout_s(request, self.timeout_s)
        return t.check_result(await self._invoke("Check", request, timeout_s=timeout_s))

    async def drain(self, *, resume: bool = False) -> t.DrainResult:
        """See ``Client.drain``."""
        return t.drain_result(
            await self._invoke("Drain", t.build_request(pb.DrainRequest, resume=resume))
        )

    async def quarantine(
        self, *, release: bool = False, slots: Sequence[int] = (), timeout_s: float | None = None
    ) -> t.QuarantineResult:
        """See ``Client.quarantine``."""
        timeout_s = t.checked_seconds(timeout_s, "Quarantine: timeout_s")
        req = t.build_request(pb.QuarantineRequest, release=release, slots=slots)
        return t.quarantine_result(await self._invoke("Quarantine", req, timeout_s=timeout_s))

    async def health(self, service: str = "") -> bool:
        request = hc.encode_request(service)
        try:
            self._on_loop()
            status = await self._until_run(self._health, request, self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except (grpc.aio.UsageError, asyncio.CancelledError) as e:  # see closed_error_for
            if (closed := self.closed_error_for(e)) is None:
                raise
            raise closed from None
        return bool(status == hc.SERVING)

    # ------------------------------------------------------------ high level

    async def store(
        self, pool: AsyncRegisteredPool, token_ids: Sequence[int], pages: Sequence[int]
    ) -> int:
        blocks = await self.store_keys(pool, _pool(pool).keys(token_ids), pages)
        return blocks * pool.layout.block_tokens

    async def load(
        self,
        pool: AsyncRegisteredPool,
        token_ids: Sequence[int],
        pages: Sequence[int],
        *,
        lease_ms: int = 0,
    ) -> int:
        keys = _pool(pool).keys(token_ids)
        blocks = await self.load_keys(pool, keys, pages, lease_ms=lease_ms)
        return blocks * pool.layout.block_tokens

    async def store_keys(
        self,
        pool: AsyncRegisteredPool,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        parent_key: bytes = b"",
    ) -> int:
        """See ``Client.store_keys``."""
        binding = _pool(pool).binding
        return await self._drive(
            store_flow(binding, keys, pages, self.max_batch_blocks, parent_key), binding
        )

    async def load_keys(
        self,
        pool: AsyncRegisteredPool,
        keys: Sequence[bytes],
        pages: Sequence[int],
        *,
        lease_ms: int = 0,
    ) -> int:
        """See ``Client.load_keys``."""
        binding = _pool(pool).binding
        return await self._drive(
            load_flow(binding, keys, pages, self.max_batch_blocks, lease_ms), binding
        )

    # ------------------------------------------------------- transfer jobs

    async def submit_load(
        self,
        pool: AsyncRegisteredPool,
        segments: Sequence[LoadSegment],
        *,
        layer_groups: int | Sequence[tuple[int, int]] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncTransferJob:
        """See ``Client.submit_load``."""
        plan = TransferPlan.for_load(
            segments, len(_pool(pool).layout.layers), self.max_batch_blocks, layer_groups
        )
        return await self._start_job(pool, plan, timeout_s)

    async def submit_save(
        self,
        pool: AsyncRegisteredPool,
        segments: Sequence[SaveSegment],
        *,
        durable: bool = False,
        timeout_s: float | None = None,
    ) -> AsyncTransferJob:
        """See ``Client.submit_save``."""
        _pool(pool)
        plan = TransferPlan.for_save(segments, self.max_batch_blocks, durable)
        return await self._start_job(pool, plan, timeout_s)

    async def _start_job(
        self, pool: AsyncRegisteredPool, plan: TransferPlan, timeout_s: float | None
    ) -> AsyncTransferJob:
        timeout_s = t.checked_seconds(timeout_s, "timeout_s")
        for part in plan.parts:  # the client's namespace, as for its other calls
            if part.layer_range == 0:  # a load's other layer ranges send the same pages
                check_pages(pool.binding, part.request)
            part.request.namespace = self.namespace
        await self.session()
        await self.pool_id_of(pool.binding)
        job = AsyncTransferJob(
            self,
            pool.binding,
            plan,
            timeout_s or self.timeout_s,
            on_finish=lambda j: self._jobs.finished(j.job_id),
        )
        self._jobs.add(job)
        return await job.start()

    def job(self, job_id: int) -> AsyncTransferJob:
        """See ``Client.job``."""
        return self._jobs.get(job_id)  # type: ignore[no-any-return]

    def poll(self, job_id: int) -> JobStatus:
        """See ``Client.poll``."""
        return self.job(job_id).poll()

    async def wait(self, job_id: int, timeout_s: float | None = None) -> JobStatus:
        """See ``Client.wait``."""
        status = await self.job(job_id).wait(timeout_s)
        if status.finished:
            self._jobs.forget(job_id)
        return status

    async def cancel(self, job_id: int) -> JobStatus:
        """See ``Client.cancel``."""
        job = self.job(job_id)
        await job.cancel()
        self._jobs.forget(job_id)
        return job.poll()


async def _off_loop(fn: Any, *args: Any) -> Any:
    """Run a short blocking exchange (the credential socket) without stalling the loop."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


def _pool_ticket(binding: PoolBinding, path: str, timeout_s: float) -> bytes:
    """Hand the pool's memory to the daemon (``credentials.pool_ticket``), on a worker
    thread that owns the duplicate descriptor it sends: a cancelled ``await`` does not stop
    the thread, and had the coroutine closed the duplicate, the thread sent a closed
    descriptor, or another file that took its number."""
    with binding.handed_fd() as fd:
        return credentials.pool_ticket(path, fd, timeout_s)


def _pool(pool: AsyncRegisteredPool) -> AsyncRegisteredPool:
    return t.checked_type(pool, AsyncRegisteredPool, "pool")


class AsyncRegisteredPool(PoolView):
    """A pool registered through an AsyncClient."""

    def __init__(self, client: AsyncClient, binding: PoolBinding) -> None:
        self.client = client
        self.binding = binding

    async def store(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        return await self.client.store(self, token_ids, pages)

    async def load(
        self, token_ids: Sequence[int], pages: Sequence[int], *, lease_ms: int = 0
    ) -> int:
        return await self.client.load(self, token_ids, pages, lease_ms=lease_ms)

    async def store_keys(
        self, keys: Sequence[bytes], pages: Sequence[int], *, parent_key: bytes = b""
    ) -> int:
        return await self.client.store_keys(self, keys, pages, parent_key=parent_key)

    async def load_keys(
        self, keys: Sequence[bytes], pages: Sequence[int], *, lease_ms: int = 0
    ) -> int:
        return await self.client.load_keys(self, keys, pages, lease_ms=lease_ms)

    async def unregister(self) -> None:
        await self.client.unregister_pool(self.pool_id)
