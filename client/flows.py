"""Multi-call operations written once for both clients.

A flow is a generator that yields ``(method, request)`` and receives the response (or has the
call's typed exception thrown into it); the sync client drives it with plain calls, the
asyncio client with awaits. Flows never see session or pool ids: the driver fills those in
when it sends a request, so a driver may re-open a session and re-register a pool behind a
flow's back. A flow builds every request it may send before it yields the first, so a bad
argument in any batch raises InvalidArgumentError before the daemon has seen the call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.cuda import CudaIpcExport
from kvtier.client.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from kvtier.client.keys import Namespace, block_keys, sequence_len
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.types import PutStatus, build_request, checked_type, shown
from kvtier.kernels.layout import PoolLayout
from kvtier.proto import kvtier_pb2 as pb

Call = tuple[str, Any]
Flow = Generator[Call, Any, int]


@dataclass(eq=False)
class PoolBinding:
    """What a client needs to (re-)register a pool and address its pages."""

    # Host shared memory, or GPU memory exported over CUDA IPC (the name predates the latter).
    shm: SharedMemoryPool | CudaIpcExport
    layout: PoolLayout
    namespace: Namespace | None
    pool_id: int = 0
    block_bytes: int = 0
    sealed: bool = False  # the daemon found the memory sealed against shrinking
    # The session the pool was registered in: its secret (any request naming it acts as the
    # session), kept out of the repr, which engines log and error reporters record.
    session_id: str = field(default="", repr=False)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        if self.namespace is None:
            raise InvalidArgumentError(
                "this pool was registered without a namespace; pass keys explicitly"
            )
        sequence_len(token_ids, "token_ids")
        try:
            return block_keys(self.namespace, token_ids)
        except InvalidArgumentError:
            raise  # naming token_ids itself
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"token_ids: {e}") from None

    @property
    def memfd(self) -> int:
        """The memory's descriptor, which registering hands to the daemon; -1 when the pool is
        registered by name (a named object) or by CUDA IPC handles."""
        return self.shm.fd if isinstance(self.shm, SharedMemoryPool) else -1

    @property
    def hands_over_fd(self) -> bool:
        return self.memfd >= 0

    def registers_again(self, err: UnauthenticatedError) -> bool:
        """Whether a registration refused with ``err`` is made again, with a new ticket (the
        clients' ``_register``): only where the daemon refused a ticket (``ticket_refused``):
        the memory's, which expired while the call waited for a call slot (a ticket
        lives ``TICKET_TTL_S``, 10 s; a call may wait its whole timeout), or which the
        first run spent before it was sent again in a new session (``SendAgain``): the
        daemon gives it back where it ended the session itself (a reload), not where the
        client did (a given-up session). A session refused (a wrong or revoked token) would
        only be refused again, one more OpenSession and credential ticket spent."""
        return self.hands_over_fd and err.ticket_refused

    def handed_fd(self) -> contextlib.AbstractContextManager[int]:
        """The descriptor to hand to the daemon, a duplicate of the memory's, open for the
        ``with`` block (``SharedMemoryPool.descriptor``): a pool closed meanwhile raises
        ``InvalidArgumentError``. Only where ``hands_over_fd``."""
        assert isinstance(self.shm, SharedMemoryPool)
        return self.shm.descriptor()

    def register_request(self, ticket: bytes = b"") -> pb.RegisterPoolRequest:
        """The registration: by the ticket of a handed-over descriptor, or by name. A pool
        closed since it was bound (registered again after a daemon restart) raises
        ``InvalidArgumentError``: a closed memory file has no descriptor to hand over, and was
        sent by a name it never had (the daemon answered NotFoundError)."""
        from kvtier.client.types import layout_to_pb

        if isinstance(self.shm, SharedMemoryPool) and self.shm.closed:
            raise self.shm.closed_error()

        layout = layout_to_pb(self.layout)
        if isinstance(self.shm, CudaIpcExport):
            return build_request(pb.RegisterPoolRequest, cuda_ipc=self.shm.region(), layout=layout)
        if self.hands_over_fd:
            if not ticket:
                raise ValueError("a memfd pool is registered with the ticket of its descriptor")
            region = build_request(pb.FdRegion, ticket=ticket, size_bytes=self.shm.size_bytes)
            return build_request(pb.RegisterPoolRequest, fd=region, layout=layout)
        shm = build_request(pb.ShmRegion, name=self.shm.name, size_bytes=self.shm.size_bytes)
        return build_request(pb.RegisterPoolRequest, shm=shm, layout=layout)


def new_binding(
    memory: SharedMemoryPool | CudaIpcExport,
    kind: type[SharedMemoryPool] | type[CudaIpcExport],
    layout: PoolLayout,
    namespace: Namespace | None,
) -> PoolBinding:
    """The binding of a pool to register, its arguments checked (both clients): a wrong
    object failed deep inside with an AttributeError, a namespace that is no ``Namespace``
    was taken and failed at the first store by tokens, a closed pool was registered by its
    gone name (the daemon answered NotFound), and a namespace of another block size than
    the layout's was taken: its keys then named blocks of other tokens than the pages hold
    (with fewer tokens, a key named a page whose later tokens it never hashed, so another
    prompt sharing only the key's tokens loaded KV computed over different ones)."""
    what = "shm" if kind is SharedMemoryPool else "export"
    checked_type(memory, kind, what)
    if isinstance(memory, SharedMemoryPool) and memory.closed:
        raise memory.closed_error()
    checked_type(layout, PoolLayout, "layout")
    if namespace is not None:
        checked_type(namespace, Namespace, "namespace")
        if namespace.block_tokens != layout.block_tokens:
            raise InvalidArgumentError(
                f"namespace: block_tokens {shown(namespace.block_tokens)} is not the layout's "
                f"{shown(layout.block_tokens)}: a page holds one block of the layout's tokens"
            )
    return PoolBinding(memory, layout, namespace)


def unregistration(
    binding: PoolBinding, pools: dict[int, PoolBinding], session_id: str
) -> pb.UnregisterPoolRequest | None:
    """Forget ``binding``'s pool in the client (its next use registers the memory again) and
    build the UnregisterPool that frees it in the daemon; None when there is nothing to
    free: no pool, or one of a session other than ``session_id``, the open one (the daemon
    dropped it with its session). Both clients' ``unregister_pool_nowait`` and
    ``fence_pool`` start so."""
    checked_type(binding, PoolBinding, "binding")
    pool_id, pool_session = binding.pool_id, binding.session_id
    binding.pool_id = 0
    pools.pop(pool_id, None)
    if not pool_id or pool_session != session_id:
        return None
    return build_request(pb.UnregisterPoolRequest, session_id=pool_session, pool_id=pool_id)


def check_pages(binding: PoolBinding | None, request: pb.PutRequest | pb.GetRequest) -> None:
    """Refuse a page past the pool's last before the request is sent (the daemon refuses it
    too, but the client knows the pool's layout); nothing to check without the binding (a
    ``put`` or ``get`` by the id of a pool another client registered)."""
    if binding is None or not len(request.pages):
        return
    last, num_pages = max(request.pages), binding.layout.num_pages
    if last >= num_pages:
        call = request.DESCRIPTOR.name.removesuffix("Request")
        raise InvalidArgumentError(
            f"{call}: pages: page {last} is past the pool's last ({num_pages} pages)"
        )


class PoolView:
    """What both clients' registered pools show: ids, geometry and keys by tokens."""

    binding: PoolBinding

    @property
    def pool_id(self) -> int:
        return self.binding.pool_id

    @property
    def block_bytes(self) -> int:
        return self.binding.block_bytes

    @property
    def layout(self) -> PoolLayout:
        return self.binding.layout

    @property
    def sealed(self) -> bool:
        """Whether the daemon found the memory sealed against shrinking (a memfd)."""
        return self.binding.sealed

    @property
    def namespace(self) -> Namespace | None:
        return self.binding.namespace

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.binding.keys(token_ids)


def store_flow(
    binding: PoolBinding,
    keys: Sequence[bytes],
    pages: Sequence[int],
    max_batch: int,
    parent_key: bytes = b"",
) -> Flow:
    """Put a key chain from ``pages``; returns how many leading blocks the daemon now holds.

    ``parent_key`` is the key of the block before ``keys[0]`` when the chain continues one
    stored earlier (empty when ``keys[0]`` is the first block).
    """
    nkeys, npages = sequence_len(keys, "store: keys"), sequence_len(pages, "store: pages")
    if npages < nkeys:
        raise InvalidArgumentError(f"store: {npages} pages for {nkeys} keys")
    puts: list[pb.PutRequest] = []
    parent = parent_key
    for start in range(0, nkeys, max_batch):
        stop = min(nkeys, start + max_batch)
        puts.append(
            build_request(
                pb.PutRequest, keys=keys[start:stop], pages=pages[start:stop], parent_key=parent
            )
        )
        check_pages(binding, puts[-1])
        parent = puts[-1].keys[-1]
    held = 0
    for put in puts:
        resp = yield "Put", put
        for status in resp.results:
            if status == PutStatus.REJECTED_FULL:
                return held
            held += 1
    return held


def load_flow(
    binding: PoolBinding, keys: Sequence[bytes], pages: Sequence[int], max_batch: int, lease_ms: int
) -> Flow:
    """Load the longest stored prefix of a key chain into ``pages``; returns blocks loaded.
    At most ``len(pages)`` blocks: fewer pages than keys loads the stored prefix that fits
    (an engine loads into the pages it has free; a store, by contrast, needs every page).

    Each batch is pinned by a Lookup so that no block is evicted between finding and loading
    it, and the lease is released whatever happens to the Get. A batch's Get is built with
    its pages up front (so that a bad page is refused before the first Lookup) and given the
    keys found once its Lookup has answered. A pin the daemon refuses for a limit (the
    session's or tenant's leases, or what the tenant's pins and hints may protect:
    RESOURCE_EXHAUSTED) is no reason to load nothing: the batch is looked up unpinned and
    loaded as far as its blocks are still there.
    """
    n = min(sequence_len(keys, "load: keys"), sequence_len(pages, "load: pages"))
    batches: list[tuple[pb.LookupRequest, pb.GetRequest]] = []
    for start in range(0, n, max_batch):
        stop = min(n, start + max_batch)
        batches.append(
            (
                build_request(pb.LookupRequest, keys=keys[start:stop], pin=True, lease_ms=lease_ms),
                build_request(pb.GetRequest, pages=pages[start:stop]),
            )
        )
        check_pages(binding, batches[-1][1])
    loaded = 0
    for lookup, get in batches:
        try:
            found = yield "Lookup", lookup
        except ResourceExhaustedError:
            unpinned = build_request(pb.LookupRequest, keys=lookup.keys)
            found = yield "Lookup", unpinned
        if found.prefix_len == 0:
            # Blocks found past a missing first one are pinned too: let them go.
            if found.lease_id:
                yield from release_flow(found.lease_id)
            break
        try:
            get.keys.extend(lookup.keys[: found.prefix_len])
            del get.pages[found.prefix_len :]
            get.lease_id = found.lease_id
            got = yield "Get", get
        finally:
            if found.lease_id:
                yield from release_flow(found.lease_id)
        loaded += got.prefix_len
        if got.prefix_len < len(lookup.keys):
            break
    return loaded


def release_flow(lease_id: int) -> Generator[Call, Any, None]:
    """Release ``lease_id`` (one that already expired, NotFound, left nothing pinned). Given
    up here (``abandon``), the flow asks for this Release once more: an interrupt of its
    call, or one that came as the flow handed it over, which its driver then never had,
    left the lease pinning its blocks until it expired."""
    request = build_request(pb.ReleaseRequest, lease_id=lease_id)
    try:
        yield "Release", request
    except NotFoundError:
        pass
    except FlowAbandoned:
        yield "Release", request
        raise


class FlowAbandoned(BaseException):
    """Thrown into a flow at its pending call by a driver that gives it up (``abandon``); a
    BaseException, so that no handler of a call's error takes it. Unlike an interrupt that
    lands as a flow is resumed, it tells the flow that its pending call may be unsent."""


def abandon(flow: Flow, release: Callable[[Any], None]) -> None:
    """End a flow that its driver gives up at its pending call (no call's error ended it: a
    KeyboardInterrupt, a cancelled task, in the call or as the flow handed it over), sending
    each Release its cleanup asks for through ``release`` (which must not wait for an
    answer), the pending call again when it was a Release (``release_flow``; one the daemon
    had run answers NotFound, which nobody reads). Left suspended, the flow's lease pinned
    its blocks until it expired."""
    try:
        method, request = flow.throw(FlowAbandoned())
        while method == "Release":
            release(request)
            method, request = flow.send(None)
    except BaseException:  # the flow ends (FlowAbandoned): the caller raises its own error
        pass
    flow.close()


def abandon_advanced(flow: Flow, sent: Any, value: Any, release: Callable[[Any], None]) -> None:
    """Let a flow release what it holds where an interrupt (a signal handler's
    KeyboardInterrupt) came as it took in ``value``, the answer or error of its call
    ``sent``, or as its next call came back (both clients' ``_drive``): no call was
    interrupted, so the session stayed open, and the flow's lease pinned its blocks until it
    expired. A flow left suspended at its next call, which the driver never had, is abandoned
    there (``abandon``); one that the interrupt ended sent no Release for the lease of the
    pinning Lookup's answer it was given, or of the Get it loaded under (its cleanup's
    Release, ended as it was being made), which is released here."""
    if inspect.getgeneratorstate(flow) == inspect.GEN_SUSPENDED:
        abandon(flow, release)
    elif isinstance(value, pb.LookupResponse):
        release_unclaimed(value, release)
    elif isinstance(sent, pb.GetRequest) and sent.lease_id:
        release(build_request(pb.ReleaseRequest, lease_id=sent.lease_id))


def release_unclaimed(answer: pb.LookupResponse, release: Callable[[Any], None]) -> None:
    """Release, through ``release``, the lease of a pinning Lookup's ``answer`` that its
    caller will not read: an interrupt (no call's error) kept it from its caller once the
    call had ended (both clients' ``lookup`` and ``_drive``), or it came after its caller's
    time ran out or its task was cancelled (``Client._late``, ``AsyncClient._settle_pinned``).
    The lease id was only in it, so its blocks stayed pinned until the lease expired."""
    if answer.lease_id:
        release(build_request(pb.ReleaseRequest, lease_id=answer.lease_id))


def lease_session_ended() -> NotFoundError:
    """The answer to a Release with no session open (both clients' ``_invoke``): a lease lives
    in the session that took it, and the daemon dropped it with that session (a restart, a
    reload of the tenants), so the Release is not sent again in a new one. Opening a session
    for it cost a credential ticket, an OpenSession and the Release, each bounded by the
    client's timeout, to be answered NotFound."""
    return NotFoundError("lease: its session has ended, and the daemon dropped the lease with it")


# A reload that swaps tenants ends every session; a call sent again in a new session can see
# that session ended too when reloads come faster than the call (one every 0.1 s under load).
SESSION_RESENDS = 3


class SendAgain:
    """Whether a call that failed is sent again (the clients' ``_invoke``). Only a
    NotFoundError is: in a new session, up to ``SESSION_RESENDS`` times, when the daemon ended
    the call's session (a reload of its tenants, a restart), which ran nothing of the call;
    with its pool registered again, once, when the daemon lost the pool (it restarted)."""

    def __init__(self, names_session: bool, names_pool: bool) -> None:
        self._sessions = SESSION_RESENDS if names_session else 0
        self._pools = 1 if names_pool else 0

    def after(self, err: BaseException) -> str:
        """What the call is sent again for: "session" (open another first), "pool" (register
        its pool again first), or "" when it is not."""
        if not isinstance(err, NotFoundError):
            return ""
        if err.session_gone:
            if not self._sessions:
                return ""
            self._sessions -= 1
            return "session"
        if self._pools:
            self._pools -= 1
            return "pool"
        return ""
