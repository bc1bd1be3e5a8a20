"""The daemon's API in domain terms: requests are checked here, then carried out by the store.

The gRPC servicer only translates protobuf to these calls and errors to status codes; this
module owns the rules (batch limits, key sizes, who may use which pool or lease). Every check
runs before any state changes, so a refused request leaves the daemon as it was.

Every call but ``open_session`` names an open session. A session carries its peer's
credentials when it was opened with a credential ticket (always, on the Unix socket); only
such a session may register memory, and only memory its peer owns. The limits (keys per
request, pools per session, pools and bytes of pools mapped per tenant, pools mapped in all,
sessions per tenant, namespaces per tenant, leases per session and the memory a tenant's
leases hold) answer with an error naming their key.

Tenants: a session is bound to one tenant when it opens (``daemon/tenants.py``), and every
block request's namespace is derived here from that tenant and the name the request declares,
never taken from the client: a tenant can not find, read, overwrite, delete, evict or
prefetch another's blocks, whatever keys it sends. A put binds its namespace to the tenant in
the store (once per session and namespace), so the tenant's quotas apply and blocks recovered
from disk keep their owner. Any session of a lease's tenant may load under it, only the
session that took it may release it, no other tenant may name it. Admin sessions may check
the invariants, drain, list and release L2's quarantined slots, and delete or evict in any
tenant's namespace. While draining, only admin sessions open.

Thread-safety: none; called from the server's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from kvtier import __version__
from kvtier.daemon.config import TENANT_NAME, Config
from kvtier.daemon.connections import ConnectionWatch
from kvtier.daemon.credentials import TicketBook, TicketKind, ticket_digest
from kvtier.daemon.cuda_pools import CudaPool, parse_region, plan_region
from kvtier.daemon.errors import (
    Draining,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SessionEnded,
    Unauthenticated,
)
from kvtier.daemon.loops import InTurns
from kvtier.daemon.pools import (
    EnginePool,
    Pool,
    PoolRegistry,
    check_host_region,
    check_shm_name,
)
from kvtier.daemon.ratelog import BurstGate, BurstLog
from kvtier.daemon.sessions import (
    LEASE_BYTES,
    Lease,
    PeerCred,
    Session,
    SessionRegistry,
    lease_bytes,
    shown_id,
)
from kvtier.daemon.store import BlockStore, DeleteResult, EvictResult, PrefetchResult, TierUsage
from kvtier.daemon.table import keys_to_words, repeats
from kvtier.daemon.tenants import Space, TenantDirectory
from kvtier.kernels.layout import PoolLayout
from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.base import QuarantinedSlot, SlotTier, TierKind
from kvtier.tiers.sizes import counted

log = logging.getLogger(__name__)

# The longest a Check waits for transfers in flight to finish.
MAX_SETTLE_MS = 60_000  # the clients cut a longer wait to it (client/types.py)
_NO_REFS = np.zeros(0, dtype=np.int64)
# A Check lists at most this many blocks and slots of each broken invariant (32 KiB of keys
# each): a table broken throughout would otherwise answer with all of its keys. The clients
# refuse more (client/types.py).
MAX_CHECK_LIST = 1000
# What a listed key and a listed slot add to a CheckResponse, at most (a 32-byte key with its
# tag and length; a uint64 varint): all of its details together are kept under half of
# server.max_message_bytes, the rest for its problems' lines. One invariant broken in each of
# many namespaces lists up to MAX_CHECK_LIST keys each, and an answer past the limit is not
# sent at all (RESOURCE_EXHAUSTED) when the operator needs it most.
CHECK_KEY_BYTES = 34
CHECK_SLOT_BYTES = 10
# The expiry entries past their deadline one step of the event loop pops (a slice of the reaper's,
# or of a pinning Lookup's at a lease limit): of live leases, which it releases, or of released
# ones, which stay in the heap until their deadline; some 5-10 ms. A tenant may hold some 130,000
# leases (server.max_lease_bytes_per_tenant); released in one step when they expired together, at
# 5-11 us each here (mostly the expiry heap's pops; their pins go back in one store call), they held
# every other client's calls for 0.6-1.4 s.
EXPIRY_SLICE_LEASES = 1024
# The pinned refs that leases ending together give back in one step of the event loop at most
# (``KVService._unpin_all``); the rest are owed, and go back as many a turn. A session's close
# gave back all of its leases' at once, and a tenant's leases may pin some 7.3 million refs
# (server.max_lease_bytes_per_tenant): 16,384 leases of 448 blocks took 570 ms of the loop's
# CPU time (1.2 s on a loaded host), every other client's calls waiting; a slice of this many
# takes 1.6-2.8 ms.
UNPIN_SLICE_REFS = 1 << 16
# Lines about sessions opened and closed, per uid (tenant, with tenants configured): this many
# at once, then this many a second; the next line says how many were left out. Any local
# user who may connect opens and closes sessions at will, about 1,000 a second, and each
# was two lines (~500 bytes) in the log; a node's engines starting together stay in the burst.
SESSION_LOG_BURST = 64
SESSION_LOG_RATE_S = 2.0


# Gauges a non-admin session of a daemon with tenants sees (KVService._tenant_stats): the
# daemon's set-up and start, nothing that counts anyone's blocks, pools or calls.
_DAEMON_GAUGES = frozenset(
    {"recovering", "l1_page_locked", "l1_prefaulting", "l2_o_direct", "l2_files", "l0_l2_gds"}
)


class LookupOutcome(NamedTuple):  # one per Lookup: a tuple costs a fraction of a dataclass
    prefix_len: int
    tiers: np.ndarray
    lease_id: int


@dataclass(frozen=True, slots=True)
class TenantTierUsage:
    kind: TierKind
    used_bytes: int
    quota_bytes: int  # 0: none
    blocks: int


@dataclass(frozen=True, slots=True)
class TenantUsage:
    tenant: str  # a tenant, or "shared:NAME"
    sessions: int
    tiers: list[TenantTierUsage]


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    tiers: list[TierUsage]
    counters: dict[str, int]
    gauges: dict[str, float]
    uptime_s: float
    version: str
    tenants: list[TenantUsage]
    # Where the daemon listens (``KVService.addresses``), and its metrics endpoint's URL
    # ('' for none, or withheld: ``KVService.metrics_url``).
    addresses: list[str]
    metrics_url: str


@dataclass(frozen=True, slots=True)
class CheckDetail:
    """The blocks (their keys) and slots one broken invariant names, the first of each."""

    problem: int  # index in CheckReport.problems
    keys: list[bytes]
    slots: list[int]
    keys_total: int
    slots_total: int


@dataclass(frozen=True, slots=True)
class CheckReport:
    problems: list[str]
    strict: bool  # nothing was in flight: slot accounting checked exactly
    blocks: int
    sessions: int
    leases: int
    pools: int
    details: list[CheckDetail]


@dataclass(frozen=True, slots=True)
class DrainState:
    draining: bool
    sessions: int  # open sessions besides the caller's


def _check_gpu_tier_serves(tier: SlotTier) -> None:
    """FailedPrecondition naming L0's state unless it serves: after a CUDA fault it serves
    no GPU pool until the daemon restarts."""
    health = tier.health()
    if not health.serves_reads:
        raise FailedPrecondition(
            f"the GPU tier (L0), which CUDA IPC pools need, is {health}; it serves no GPU "
            "pool until the daemon restarts"
        )


def _who(session: Session) -> str:
    """The session's tenant as a limit's message names it (with the uid it is counted by,
    without tenants configured)."""
    key = session.limit_key
    return (
        f"tenant {session.tenant}" if key == session.tenant else f"tenant {session.tenant} ({key})"
    )


class KVService:
    def __init__(
        self,
        config: Config,
        store: BlockStore,
        pools: PoolRegistry,
        sessions: SessionRegistry,
        tickets: TicketBook,
        tenants: TenantDirectory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.pools = pools
        self.sessions = sessions
        self.tickets = tickets
        self.tenants = tenants if tenants is not None else TenantDirectory(admin_uids={0})
        # Requests refused before reaching the rules (malformed), and similar events.
        self.counters: Counter[str] = Counter()
        self._clock = clock
        self._started = clock()
        self.draining = False
        self._session_lines = BurstLog(
            log,
            BurstGate(SESSION_LOG_BURST, SESSION_LOG_RATE_S, clock),
            " ({count} more session lines of {key} left out before this one)",
        )
        # The daemon's count of its gRPC connections, once it listens.
        self.connections: ConnectionWatch | None = None
        # Where it listens, as bound (the port taken for a port 0), once it does
        # (``Daemon.start``), and the URL of its metrics endpoint once that serves ('' none):
        # told in Stats, so that an operator need not read the log for a port it took.
        self.addresses: list[str] = []
        self.metrics_url = ""
        # Pins of ended leases not given back yet (``_unpin_all``), oldest first: while
        # some are, a turn of the loop is scheduled to give back the next slice.
        self._owed_unpins: deque[np.ndarray] = deque()
        self._unpins = InTurns(
            self._unpin_a_slice, "giving back pins owed by ended leases", store.counters
        )

    def apply_quotas(self) -> None:
        """Put the configured quotas into the store, in place of those it had (each tenant's
        owner index is made here, so tenants appear in stats before they store anything)."""
        for label in self.tenants.labels():
            self.store.owner_of(label)
        self.store.space.quotas.clear()
        for label, kind, nbytes in self.tenants.quotas():
            if kind in self.store.stack:
                self.store.space.quotas[(self.store.owner_of(label), kind)] = nbytes

    # --------------------------------------------------------------- sessions

    def open_session(
        self,
        client_name: str,
        ticket: bytes,
        *,
        unix_socket: bool,
        token: bytes = b"",
        given_up: Sequence[str] = (),
        given_up_tickets: Sequence[bytes] = (),
        ended: Callable[[str], None] | None = None,
    ) -> Session:
        """Open a session bound to the credentials of ``ticket`` and to a tenant (by those
        credentials, or by ``token``). On the Unix socket a ticket is required; elsewhere
        (TCP) a session has no peer credentials and needs a token.

        ``given_up``: sessions the client gave up without ending their streams, and
        ``given_up_tickets``: the tickets of OpenSessions it gave up before it read their
        first event, whose sessions it never knew; ended first so that they hold no slot of
        the tenant's session limit (also where a drain refuses the new one), ``ended`` told of
        each (it ends their streams): see ``end_given_up``."""
        peer: PeerCred | None = None
        if ticket:
            peer = self.tickets.redeem(ticket, TicketKind.SESSION).peer
        elif unix_socket:
            raise Unauthenticated(
                "a session on the Unix socket needs a credential ticket: ask the credential "
                "socket (the gRPC socket's path plus '.cred') and pass it in OpenSession"
            )
        try:
            binding = self.tenants.bind(peer, token)
        except (Unauthenticated, PermissionDenied):
            self.store.counters.inc("sessions_refused", reason="tenant")
            raise
        # Before the drain's refusal: ``drain --wait`` waits for the sessions to end, and a
        # given-up one ends only where its client names it.
        self.end_given_up(given_up, given_up_tickets, peer, binding.tenant, ended)
        if self.draining and not binding.admin:
            self.store.counters.inc("sessions_refused", reason="draining")
            raise Draining(
                "the daemon is draining (kvtier drain): it takes no new sessions until an "
                "admin resumes it; treat this as a miss, or use another daemon"
            )
        session = self.sessions.open(
            client_name[:200],
            self._clock(),
            peer,
            binding.tenant,
            admin=binding.admin,
            limit_key=binding.limit_key,
            token_digest=binding.token_digest,
            ticket_digest=ticket_digest(ticket) if ticket else b"",
        )
        self._session_lines.info(
            binding.limit_key,
            "session %s opened by %r (tenant %s%s, uid %s, pid %s)",
            shown_id(session.session_id),
            session.client_name,
            session.tenant,
            ", admin" if session.admin else "",
            peer.uid if peer else "-",
            peer.pid if peer else "-",
        )
        return session

    def end_given_up(
        self,
        session_ids: Sequence[str],
        tickets: Sequence[bytes],
        peer: PeerCred | None,
        tenant: str,
        ended: Callable[[str], None] | None = None,
    ) -> None:
        """End each of ``session_ids``, and each session one of ``tickets`` opened, that the
        process ``peer`` names opened (its pid and uid, as its credential tickets said) bound
        to ``tenant``, and tell ``ended`` of it: sessions its client gave up whose streams it
        could not end (a blocking client's channel that an interrupt left locked), which
        would otherwise live, with their leases and pools, until that process exits; by its
        ticket where the interrupt came before the client read the session's id (a named
        ticket of that process not yet spent is spent unused: the OpenSession that sent it,
        which may still be on its way, then opens nothing). Any other id or ticket (another
        process's or tenant's session, one ended already, none at all) is ignored: a session
        id lets a request act as that session, but a session never ends another client's.
        Nothing is ended for a peer without credentials (TCP). A daemon in a pid namespace of
        its own reads pid 0 for every peer outside it: there the uid and tenant are checked,
        and the id or ticket itself is the client's.

        Ended as a reload ends one (``by_daemon``): the client sends the calls it had in it
        again, in a new session, so a registration being mapped gives its ticket back."""
        if peer is None:
            return
        for ticket in tickets:  # one whose OpenSession has yet to run opens nothing
            self.tickets.withdraw(ticket, peer)
        named = [*map(self.sessions.find, session_ids)]
        named += (self.sessions.opened_by(ticket_digest(ticket)) for ticket in tickets)
        for old in named:
            if (
                old is not None
                and self.sessions.find(old.session_id) is old  # not named twice
                and old.peer is not None
                and (old.peer.pid, old.peer.uid) == (peer.pid, peer.uid)
                and old.tenant == tenant
            ):
                self.close_session(old.session_id, by_daemon=True)
                if ended is not None:
                    ended(old.session_id)

    def session(self, session_id: str) -> Session:
        """The open session ``session_id`` (NotFound otherwise)."""
        return self.sessions.get(session_id)

    def close_session(self, session_id: str, *, by_daemon: bool = False) -> None:
        """End a session, releasing its leases and pools; nothing for one not open (the
        daemon may have ended it before its stream ends, see ``KVTierServicer.end_session``).
        ``by_daemon``: the daemon ends it, not its client's stream (a reload, or a session its
        client gave up: ``end_given_up``), and its client sends the calls it had in it again
        in a new session (see ``PoolRegistry.drop_session``)."""
        try:
            key = self.sessions.get(session_id).limit_key
        except NotFound:
            return
        leases = self.sessions.close(session_id)
        self._unpin_all(leases)
        pools = self.pools.drop_session(session_id, by_daemon=by_daemon)
        self._session_lines.info(
            key,
            "session %s closed: %s unregistered, %s released",
            shown_id(session_id),
            counted(pools, "pool"),
            counted(len(leases), "lease"),
        )

    # ------------------------------------------------------------------ pools

    async def register_shm_pool(
        self, session_id: str, name: str, size_bytes: int, layout: PoolLayout
    ) -> Pool:
        """Every rule is checked, and the pool counted in the session's, before the mapping
        is awaited (it runs on a worker thread): registrations in flight together do not
        pass the pools-per-session limit together. A session that ends before the mapping
        does gets no pool (NotFound)."""
        session = self.sessions.get(session_id)
        check_shm_name(name)
        check_host_region(size_bytes, layout)
        peer = self._check_may_register(session, layout, size_bytes)
        return await self.pools.register_shm(
            session_id, peer, name, size_bytes, layout, tenant=session.limit_key
        )

    async def register_fd_pool(
        self, session_id: str, ticket: bytes, size_bytes: int, layout: PoolLayout
    ) -> Pool:
        """As ``register_shm_pool``, for a memory fd handed over with ``ticket``. Where the
        daemon ends the session while the memory is mapped (SessionEnded: a reload, or its
        client gave it up), the ticket is given back with its fd: the client sends this
        request again, with the same ticket, in a new session (as it does where the session
        is gone before: NotFound, the ticket untouched). Any other refusal spends it and
        closes its fd: one refused before it was redeemed (a limit, a layout that does not
        fit) stayed in the book until it expired, one of its uid's unused tickets, though
        no client sends that request again."""
        session = self.sessions.get(session_id)
        handed = self.tickets.redeem(ticket, TicketKind.POOL)
        try:
            check_host_region(size_bytes, layout)
            peer = self._check_may_register(session, layout, size_bytes)
            if handed.peer.uid != peer.uid:
                raise PermissionDenied(
                    f"the memory was handed over by uid {handed.peer.uid}, not by this "
                    f"session's uid {peer.uid}"
                )
            pool = await self.pools.register_fd(
                session_id, handed.fd, size_bytes, layout, tenant=session.limit_key
            )
        except SessionEnded:
            self.tickets.give_back(ticket, handed)  # the book owns the fd again
            raise
        except BaseException:
            os.close(handed.fd)
            raise
        os.close(handed.fd)  # the mapping keeps the memory; a memfd closes at once
        return pool

    def _check_may_register(
        self, session: Session, layout: PoolLayout, size_bytes: int = 0
    ) -> PeerCred:
        """The rules of every registration; ``size_bytes``: the host memory it maps (none
        for CUDA IPC), counted against the tenant's mapped bytes. A host pool's request has
        passed ``check_host_region`` first."""
        if session.peer is None:
            raise PermissionDenied(
                "this session has no peer credentials (it was opened without a credential "
                "ticket, e.g. over TCP); only sessions on the Unix socket may register memory"
            )
        # What the request cannot change comes before the limits (RESOURCE_EXHAUSTED says
        # to retry once there is room).
        max_block = self.store.max_block_bytes()
        if layout.layers and layout.block_bytes > max_block:
            raise InvalidArgument(
                f"blocks of this layout have {layout.block_bytes} bytes, more than the "
                f"{max_block} a tier slot holds (raise {self.store.max_block_key()})"
            )
        limit = self.config.server.max_pools_per_session
        if self.pools.session_pools(session.session_id) >= limit:
            raise ResourceExhausted(
                f"this session already has {counted(limit, 'pool')} registered, the most one "
                "session may have (server.max_pools_per_session)"
            )
        key = session.limit_key
        who = _who(session)
        # The tenant's own share first: without it one tenant could take every mapping the
        # daemon holds (server.max_pools) and refuse every other tenant's registration.
        most = self.config.server.max_pools_per_tenant
        if size_bytes and (held := self.pools.tenant_mappings(key)) >= most:
            raise ResourceExhausted(
                f"{who} already has {counted(held, 'pool')} mapped (registered, or being mapped "
                "or unmapped), the most one tenant may have (server.max_pools_per_tenant)"
            )
        most = self.config.server.max_pools
        if size_bytes and self.pools.mappings >= most:
            raise ResourceExhausted(
                f"the daemon already holds {self.pools.mappings} pool mappings of all its "
                f"clients, the most it holds (server.max_pools); retry once pools are "
                "unregistered"
            )
        cap = self.config.server.max_pool_bytes_per_tenant
        mapped = self.pools.tenant_bytes(key)
        if size_bytes > cap - mapped:
            raise ResourceExhausted(
                f"{who} has {mapped} bytes of pools mapped (registered, or being mapped or "
                f"unmapped); {size_bytes} more would pass the {cap} one tenant may have "
                "(server.max_pool_bytes_per_tenant); each registration counts in full, even "
                "of memory already registered"
            )
        return session.peer

    def register_cuda_ipc_pool(
        self, session_id: str, region: pb.CudaIpcRegion, layout: PoolLayout
    ) -> CudaPool:
        """GPU memory over CUDA IPC: the region and layout well formed (INVALID_ARGUMENT on
        any host, as a host pool's own content is), the rules of every pool (credentials,
        pools per session, block size against every tier's slots, L0's included), then the
        GPU tier must run and serve: only it reaches GPU memory, and after a CUDA fault it
        serves nothing until the daemon restarts (nothing is opened through that context).
        It is asked again once the handles are opened: a copy on a worker thread may fault
        meanwhile, and that is then the answer, the pool closed again."""
        session = self.sessions.get(session_id)
        plan_region(parse_region(region), layout)
        self._check_may_register(session, layout)
        device = self.store.stack.device
        if device is None:
            raise FailedPrecondition(
                "CUDA IPC pools need the GPU tier (L0), which this daemon does not run: set "
                "tiers.l0.enabled=true on a host with CUDA"
            )
        _check_gpu_tier_serves(device.tier)
        try:
            pool = self.pools.register_cuda_ipc(session_id, region, layout)
        except FailedPrecondition:
            # An open that failed in a context a fault had just broken: the fault says why.
            _check_gpu_tier_serves(device.tier)
            raise
        try:
            _check_gpu_tier_serves(device.tier)
        except FailedPrecondition:
            self.pools.unregister(session_id, pool.pool_id)
            raise
        return pool

    def drop_unanswered_pool(self, session_id: str, pool: EnginePool) -> None:
        """Unregister ``pool``, just registered by a request whose answer cannot reach its
        client. Called before anything awaited since the registration, so no copy uses it."""
        self.pools.unregister(session_id, pool.pool_id)
        log.debug(
            "pool %d unregistered: its RegisterPool's client left or its deadline passed",
            pool.pool_id,
        )

    async def unregister_pool(self, session_id: str, pool_id: int) -> None:
        """Answers once no copy uses the pool's memory any more: the engine may then reuse
        the pages of a request that timed out without a late copy landing in them."""
        self.sessions.get(session_id)
        await self.pools.unregister(session_id, pool_id).released()

    # ------------------------------------------------------------------ blocks

    async def lookup(
        self,
        session_id: str,
        keys: Sequence[bytes],
        pin: bool,
        lease_ms: int,
        namespace: str = "",
    ) -> LookupOutcome:
        session = self.sessions.get(session_id)
        space = self._space(session, namespace)
        words = self._words(keys)
        lease_s = 0.0
        if pin:
            lease_s = self._lease_s(lease_ms)
            await self._lease_room(session_id, len(words))  # the most it may pin
        # Blocks found only in a key-addressed tier join the table as the namespace's
        # tenant's, so their copies count to its usage and quotas.
        owner = self.store.owner_of(space.owner)
        prefix, tiers, ids = await self.store.lookup(space.ns, words, owner=owner)
        lease_id = 0
        if pin:
            found = np.unique(ids[ids >= 0])
            if len(found):
                # The session may have ended while the lookup awaited; pinning for it then
                # would leave pins no lease releases. Pinning lookups awaiting together
                # passed the limits together: they are checked again, in this step.
                self._check_lease_room(self.sessions.get(session_id), len(found))
                refs = self.store.pin(found)
                lease = self.sessions.add_lease(session_id, refs, self._clock() + lease_s)
                lease_id = lease.lease_id
                # The Get that follows should find them in L1.
                self.store.promote_in_background(found)
        return LookupOutcome(prefix, tiers, lease_id)

    async def put(
        self,
        session_id: str,
        pool_id: int,
        keys: Sequence[bytes],
        pages: Sequence[int],
        parent_key: bytes,
        durable: bool = False,
        namespace: str = "",
    ) -> tuple[np.ndarray, np.ndarray | None]:
        session = self.sessions.get(session_id)
        pool = self._pool(session_id, pool_id)
        space = self._space(session, namespace)
        words = self._words(keys)
        page_arr = self._pages(pool, pages, len(keys), unique=False)
        parent = None
        if parent_key:
            parent = self._words([parent_key], what="parent_key")[0]
        if durable:
            self.store.check_durable()  # before the namespace is bound: refused means no change
        owner = await self._bind(session, space)
        return await self.store.put(
            pool, space.ns, words, page_arr, parent, durable=durable, owner=owner
        )

    async def get(
        self,
        session_id: str,
        pool_id: int,
        keys: Sequence[bytes],
        pages: Sequence[int],
        lease_id: int,
        layer_begin: int = 0,
        layer_end: int = 0,
        namespace: str = "",
    ) -> np.ndarray:
        session = self.sessions.get(session_id)
        pool = self._pool(session_id, pool_id)
        space = self._space(session, namespace)
        words = self._words(keys)
        if len(keys) > 1 and repeats(words).any():
            # Like a page, a key is loaded once per Get: a tier's read batch names each slot
            # once (L0 and L2 refuse one that repeats a slot).
            raise InvalidArgument("a key appears twice; a Get loads each block once")
        page_arr = self._pages(pool, pages, len(keys), unique=True)
        layers = self._layers(pool, layer_begin, layer_end)
        # A Get under a live lease of this tenant is the same access as its pinning Lookup:
        # counted once (an engine pins in its scheduler process and loads in its workers).
        # Another tenant's lease is refused.
        leased = bool(lease_id) and self._lease_for(session_id, lease_id) is not None
        # Gets of one block's other layer ranges are the same access as the one of layer 0.
        touch = not leased and (layers is None or layers[0] == 0)
        return await self.store.get(pool, space.ns, words, page_arr, touch=touch, layers=layers)

    def release(self, session_id: str, lease_id: int) -> None:
        self._lease_for(session_id, lease_id)  # past its deadline: gone, NotFound below
        lease = self.sessions.pop_lease(session_id, lease_id)
        self.store.unpin(lease.refs)

    def _lease_for(self, session_id: str, lease_id: int) -> Lease | None:
        """``SessionRegistry.lease_for``, a lease past its deadline released first, as the
        reaper releases it: a lease is gone at its deadline, not when the reaper (every
        0.25 s, in slices: daemon/server.py) comes to it, so that what a call naming it gets
        does not depend on the reaper's timing. Only the lease named: releasing every lease
        past its deadline here held the loop for all of them (a tenant's 130,000 at once).
        Released before it is looked up, whoever took it: another tenant's lease past its
        deadline is gone (None, NotFound for a Release), not PERMISSION_DENIED."""
        if (due := self.sessions.due_lease(lease_id, self._clock())) is not None:
            self.sessions.end_lease(due)
            self.store.unpin(due.refs)
            self.store.counters.inc("leases_expired")
        return self.sessions.lease_for(session_id, lease_id)

    async def prefetch(
        self,
        session_id: str,
        keys: Sequence[bytes],
        deadline_ms: int,
        priority: int,
        namespace: str = "",
    ) -> PrefetchResult:
        space = self._space(self.sessions.get(session_id), namespace)
        return await self.store.prefetch(space.ns, self._words(keys), deadline_ms, priority)

    async def delete(
        self, session_id: str, keys: Sequence[bytes], namespace: str = "", tenant: str = ""
    ) -> DeleteResult:
        space = self._space(self.sessions.get(session_id), namespace, tenant, admin_call=True)
        return await self.store.delete(space.ns, self._words(keys))

    async def evict(
        self,
        session_id: str,
        keys: Sequence[bytes],
        tier: int,
        namespace: str = "",
        tenant: str = "",
    ) -> EvictResult:
        space = self._space(self.sessions.get(session_id), namespace, tenant, admin_call=True)
        words = self._words(keys)
        try:
            kind = TierKind(tier)
        except ValueError:
            raise InvalidArgument(
                f"tier {tier} is not a tier; name the one to evict from (L0, L1 or L2)"
            ) from None
        return await self.store.evict(space.ns, words, kind)

    def expire_leases(self, now: float | None = None) -> int:
        """Release the leases past their deadline (at ``now``, the clock's time unless
        given), earliest first, looking at most ``EXPIRY_SLICE_LEASES`` expiry entries
        (``SessionRegistry.pop_expired``; the reaper, and a pinning Lookup at a limit, call
        again after a turn of the event loop); returns how many it released."""
        expired = self.sessions.pop_expired(
            self._clock() if now is None else now, EXPIRY_SLICE_LEASES
        )
        if not expired:
            return 0
        self._unpin_all(expired)
        self.store.counters.inc("leases_expired", len(expired))
        return len(expired)

    async def reap_leases(self) -> int:
        """The reaper's pass: every lease past its deadline when it began released,
        ``EXPIRY_SLICE_LEASES`` expiry entries at a time with a turn of the event loop between
        slices, as a Check examines its rows; returns how many. Those that come due during the
        pass wait for the next: a pass that took them too never ended while entries came due
        as fast as it popped them, and the reaper's other work waited."""
        now = self._clock()
        total = self.expire_leases(now=now)
        while self.sessions.expiry_due(now):
            await asyncio.sleep(0)
            total += self.expire_leases(now=now)
        return total

    def _unpin_all(self, leases: list[Lease]) -> None:
        """Unpin the blocks of the ended ``leases`` in one store call: one call each (tens of
        microseconds) held the event loop for 1.2 s when a tenant's 40,000 leases expired at
        one deadline, and for 0.7 s when its client holding as many was killed (every other
        client's calls waited), and a tenant may hold some 130,000
        (server.max_lease_bytes_per_tenant). Up to ``UNPIN_SLICE_REFS`` refs go back in
        this step; more are owed and go back that many a turn of the loop (as the policies'
        owed moves, ``SpaceManager.owed_work``), the pins held meanwhile (Check counts them).
        Leases whose refs fit a slice go back at once even while others' are owed: queued
        behind a closed session's backlog, another tenant's expired lease kept its blocks
        pinned for as long (a pin is a count: the order they go back in changes nothing)."""
        refs = [x.refs for x in leases]
        if sum(map(len, refs)) <= UNPIN_SLICE_REFS:
            if len(refs) == 1:
                self.store.unpin(refs[0])
            elif refs:
                self.store.unpin(np.concatenate(refs), distinct=False)
            return
        self._owed_unpins.extend(refs)  # not joined here: that copies every ref in this step
        self._unpins.begin()

    def _unpin_a_slice(self) -> bool:
        """Give back the next ``UNPIN_SLICE_REFS`` owed pins; whether more are owed (a slice
        is then due at the next turn, ``InTurns``). The slice is taken off the queue only
        once made: an exception before leaves the queue as it was, and ``InTurns`` logs,
        counts and tries the slice again ``loops.TURN_RETRY_S`` later. The store's unpin,
        which takes what pins it can when it raises (it found one it could not take, an
        invariant broken), is done with the slice: its failure is logged and counted here,
        as the lease reaper's are, and the rest go back on at the next turn (raised to
        ``InTurns``, each slice that held such a pin held the rest for a second: with a
        block every lease pins, 7.3 million refs owed, 112 slices, went back in 112 s)."""
        owed = self._owed_unpins
        room, part = UNPIN_SLICE_REFS, []
        rest: np.ndarray | None = None  # of the queue's array the slice ends inside
        for refs in owed:
            if not room:
                break
            if len(refs) > room:
                part.append(refs[:room])
                rest = refs[room:]
                break
            part.append(refs)
            room -= len(refs)
        refs = np.concatenate([_NO_REFS, *part])
        # Made: taken off the queue only now (pops and an item set, which allocate nothing).
        for _ in range(len(part) - (rest is not None)):
            owed.popleft()
        if rest is not None:
            owed[0] = rest
        try:
            self.store.unpin(refs, distinct=False)
        except Exception:
            log.exception("giving back %s owed by ended leases failed", counted(len(refs), "pin"))
            self.store.counters.inc("background_errors")
        return bool(owed)

    def owed_unpins(self) -> np.ndarray:
        """The refs of the pins that ended leases still hold (given back in turns of the
        loop, ``_unpin_all``): a block once per such pin."""
        return np.concatenate([_NO_REFS, *self._owed_unpins])

    def stats(self, session_id: str) -> StatsSnapshot:
        session = self.sessions.get(session_id)
        visible = self.tenants.visible_to(session.tenant, session.admin)
        tenants = self.tenant_usage(visible)
        if visible is not None and self.tenants.configured:
            return self._tenant_stats(tenants)
        index = self.store.table.stats()
        return StatsSnapshot(
            tiers=self.store.usage(),
            counters={**self.store.all_counters(), **self.pools.counters, **self.counters},
            gauges={
                "sessions": self.sessions.session_count,
                "pools": len(self.pools),
                "pools_broken": self.pools.broken_count,
                "leases": self.sessions.lease_count,
                "credential_tickets": len(self.tickets),
                **({"connections": self.connections.count} if self.connections else {}),
                "blocks": index.blocks,
                "index_bytes": index.nbytes,
                **self.store.gauges(),
            },
            uptime_s=self._clock() - self._started,
            version=__version__,
            tenants=tenants,
            addresses=list(self.addresses),
            metrics_url=self.metrics_url,
        )

    def _tenant_stats(self, tenants: list[TenantUsage]) -> StatsSnapshot:
        """Stats for a non-admin session of a daemon with tenants: the daemon-wide figures
        would tell it the others' usage (a tier's total minus its own), their traffic as it
        happens (hits, puts, sessions) and their names (counters labelled by tenant), so it
        gets each tier's capacity and health with the usage of what it may see, the counters
        labelled with what it may see (its quota evictions), the gauges that describe the
        daemon rather than anyone's work, and where the daemon listens, but not its metrics
        endpoint (which names every tenant and shows its traffic)."""
        labels = {t.tenant for t in tenants}
        counters = {
            c.key: c.value
            for c in self.store.counters.samples()
            if any(k == "tenant" and v in labels for k, v in c.labels)
        }
        own: Counter[tuple[TierKind, str]] = Counter()
        for t in tenants:
            for u in t.tiers:
                own[u.kind, "bytes"] += u.used_bytes
                own[u.kind, "blocks"] += u.blocks
        tiers = [
            replace(
                u,
                used_bytes=own[u.kind, "bytes"],
                blocks=own[u.kind, "blocks"],
                counters={},
                gauges={},
            )
            for u in self.store.usage()
        ]
        gauges = {k: v for k, v in self.store.gauges().items() if k in _DAEMON_GAUGES}
        return StatsSnapshot(
            tiers=tiers,
            counters=counters,
            gauges=gauges,
            uptime_s=self._clock() - self._started,
            version=__version__,
            tenants=tenants,
            addresses=list(self.addresses),
            metrics_url="",
        )

    def tenant_usage(self, visible: list[str] | None = None) -> list[TenantUsage]:
        """Bytes, blocks and quota per tenant (and shared namespace) per slot tier, and open
        sessions per tenant; only the labels in ``visible`` unless it is None.

        The labels are the configured ones, those with sessions, and owners no longer
        configured (a tenant a reload removed) while they still hold blocks: once their last
        block is gone they drop out, so tenants churned through reloads do not leave a
        series each behind."""
        store, table = self.store, self.store.table
        sessions = Counter(s.tenant for s in self.sessions.sessions())
        levels = [lv for lv in store.stack if not lv.keyed]
        blocks = {}
        for level in levels:
            holders = table.holders(level.col)
            blocks[level.kind] = np.bincount(table.owner[holders], minlength=table.usage.shape[1])
        n = table.usage.shape[1]
        holding = np.zeros(n, dtype=bool)
        for level in levels:
            holding |= (blocks[level.kind][:n] != 0) | (table.usage[level.col] != 0)
        owning = [x for x, o in store.owners.items() if o < n and holding[o]]
        labels = list(dict.fromkeys([*self.tenants.labels(), *owning, *sessions]))
        if visible is not None:
            labels = [x for x in labels if x in visible]
        out = []
        for label in labels:
            owner = store.owners.get(label)
            tiers = []
            for level in levels:
                held = owner is not None and owner < table.usage.shape[1]
                tiers.append(
                    TenantTierUsage(
                        level.kind,
                        int(table.usage[level.col, owner]) if held else 0,
                        store.space.quotas.get((owner, level.kind), 0) if owner is not None else 0,
                        int(blocks[level.kind][owner]) if held else 0,
                    )
                )
            out.append(TenantUsage(label, sessions.get(label, 0), tiers))
        return out

    # ------------------------------------------------------------------ admin

    def _admin(self, session_id: str, what: str) -> Session:
        session = self.sessions.get(session_id)
        if not session.admin:
            raise PermissionDenied(
                f"{what} is an admin call: it needs a session of an admin tenant, root, the "
                "daemon's user or a uid in server.admin_uids"
            )
        return session

    async def check(self, session_id: str, settle_ms: int = 0, list_limit: int = 0) -> CheckReport:
        """The store's invariants plus what only the service knows: every lease's and pool's
        session is open, the sessions' lease sets match the leases, the per-tenant and
        per-session counts the limits keep add up, and pin counts match the leases (theirs,
        and those ended leases still owe, ``_unpin_all``). With ``list_limit``, the first
        blocks and slots (up to it, at most ``MAX_CHECK_LIST``) of each broken invariant of
        the store that names them, fewer where the answer would pass half of
        ``server.max_message_bytes``."""
        self._admin(session_id, "Check")
        # The blocks one by one, in slices between other calls; the rest below, where what
        # is compared with what (leases and pins, counts and sums) is read in one step and
        # added up in the next ones (``BlockStore.check_problems_in_turns``).
        suspects = await self.store.check_suspects()
        # The wait for the transfers in flight comes after the slices, not before, at each
        # tier's step (``settle``): the calls let in between the steps start transfers
        # again, and those steps examine what holds only when none is in flight (strict).
        deadline = self._clock() + min(settle_ms, MAX_SETTLE_MS) / 1000.0

        async def settle() -> None:
            while not self.store.quiescent() and self._clock() < deadline:
                await asyncio.sleep(0.005)

        problems: list[str] = []
        sessions = {s.session_id: s for s in self.sessions.sessions()}
        leases = self.sessions.leases()
        lease_ids = {x.lease_id for x in leases}
        table = self.store.table
        # Every lease's blocks at once: a Python step per pinned block took 79 ms of the loop
        # for 16 leases of 4,096 blocks.
        pinned = table.resolve_many(np.concatenate([_NO_REFS, *(x.refs for x in leases)]))
        freed = np.bincount(
            np.repeat(np.arange(len(leases)), [len(x.refs) for x in leases])[pinned < 0],
            minlength=len(leases),
        )
        for lease, n_freed in zip(leases, freed.tolist(), strict=True):
            owner = sessions.get(lease.session_id)
            if owner is None:
                problems.append(f"lease {lease.lease_id} outlives its session")
            elif lease.lease_id not in owner.leases:
                problems.append(f"lease {lease.lease_id} is missing from its session's leases")
            elif lease.tenant != owner.tenant:
                problems.append(f"lease {lease.lease_id} is of another tenant than its session")
            problems += [f"lease {lease.lease_id} pins a block that was freed"] * n_freed
        # Ended leases' pins not given back yet (``_unpin_all``) are pins the table holds.
        owed = table.resolve_many(self.owed_unpins())
        if n_freed := int((owed < 0).sum()):
            problems.append(f"{counted(n_freed, 'pin')} owed by ended leases on freed blocks")
        pins = np.concatenate([pinned[pinned >= 0], owed[owed >= 0]])
        for session in sessions.values():
            if stray := session.leases - lease_ids:
                problems.append(
                    f"session {shown_id(session.session_id)} lists "
                    + counted(len(stray), "lease that does not exist", "leases that do not exist")
                )
        counts = Counter(s.limit_key for s in sessions.values())
        if dict(counts) != self.sessions.per_tenant_counts():
            problems.append("the per-tenant session counts differ from the open sessions")
        held: Counter[str] = Counter()
        for lease in leases:
            if (owner := sessions.get(lease.session_id)) is not None:
                held[owner.limit_key] += lease_bytes(len(lease.refs))
        if dict(held) != self.sessions.per_tenant_lease_bytes():
            problems.append("the per-tenant lease bytes differ from the live leases")
        pools = self.pools.all()
        for pool in pools:
            if pool.session_id not in sessions:
                problems.append(f"pool {pool.pool_id} outlives its session")
        if dict(Counter(p.session_id for p in pools)) != self.pools.per_session_counts():
            problems.append("the per-session pool counts differ from the registered pools")
        problems += self.pools.check()
        details: list[CheckDetail] = []
        limit = min(list_limit, MAX_CHECK_LIST)
        room = self.config.server.max_message_bytes // 2
        # A tier's strict invariants are examined where nothing is in flight at its step,
        # which waits for that first (up to the one deadline).
        found, strict = await self.store.check_problems_in_turns(pins, suspects, settle)
        for problem in found:
            if limit and (len(problem.blocks) or len(problem.slots)):
                # Within the room left: fewer listed, the totals still count them all.
                n_keys = min(limit, len(problem.blocks), room // CHECK_KEY_BYTES)
                room -= n_keys * CHECK_KEY_BYTES
                n_slots = min(limit, len(problem.slots), room // CHECK_SLOT_BYTES)
                room -= n_slots * CHECK_SLOT_BYTES
                # The blocks still there: one freed since the step that found it is gone,
                # its row perhaps another block's.
                rows = table.resolve_many(problem.blocks[:n_keys])
                details.append(
                    CheckDetail(
                        len(problems),
                        [table.key_bytes(b) for b in rows[rows >= 0].tolist()],
                        problem.slots[:n_slots].tolist(),
                        len(problem.blocks),
                        len(problem.slots),
                    )
                )
            problems.append(problem.text)
        return CheckReport(
            problems, strict, len(table), len(sessions), len(leases), len(pools), details
        )

    def drain(self, session_id: str, resume: bool) -> DrainState:
        """Stop (or resume) taking new sessions but admins'; open ones carry on."""
        session = self._admin(session_id, "Drain")
        if self.draining == resume:  # a change
            log.warning(
                "%s by session %s: %s new sessions; %d open",
                "resumed" if resume else "draining",
                shown_id(session.session_id),
                "taking" if resume else "refusing",
                self.sessions.session_count,
            )
        self.draining = not resume
        return DrainState(self.draining, self.sessions.session_count - 1)

    async def quarantine(
        self, session_id: str, release: bool, slots: Sequence[int]
    ) -> tuple[list[QuarantinedSlot], list[int], list[int]]:
        """L2's quarantined slots, after giving ``slots`` back to use with ``release``, the
        slots released and those left for a later release (``BlockStore.quarantine``);
        admins only. A release naming none tries at most
        ``server.max_batch_blocks`` slots, as one naming them may, so that the reply can list
        every slot released (the config's check makes room for that many keys)."""
        session = self._admin(session_id, "Quarantine")
        if slots and not release:
            raise InvalidArgument("slots name what a release gives back: set release too")
        limit = self.config.server.max_batch_blocks
        if len(slots) > limit:
            raise InvalidArgument(
                f"{len(slots)} slots in one request; at most {limit} (server.max_batch_blocks)"
            )
        held, released, deferred = await self.store.quarantine(release, slots, limit)
        if release:
            log.warning(
                "quarantine release by session %s: %d slot(s) back in use, %d held (%d left "
                "for a later release)",
                shown_id(session.session_id),
                len(released),
                len(held),
                len(deferred),
            )
        return held, released, deferred

    # ----------------------------------------------------------------- checks

    def _space(
        self, session: Session, namespace: str, tenant: str = "", *, admin_call: bool = False
    ) -> Space:
        """The namespace a request addresses: ``namespace`` inside the session's tenant, or
        inside ``tenant`` for an admin. Only the admin calls (``admin_call``: delete, evict)
        reach a shared namespace that does not list the session's tenant: an admin reads no
        one's blocks, nor puts its own where other tenants would load them."""
        acting = session.tenant
        if tenant and tenant != session.tenant:
            if not session.admin:
                raise PermissionDenied(
                    "only an admin session may act in another tenant's namespace (tenant "
                    "is an admin field)"
                )
            if not TENANT_NAME.fullmatch(tenant):
                raise InvalidArgument("tenant is not a tenant's name")
            acting = tenant
        return self.tenants.space(acting, namespace, admin=session.admin and admin_call)

    async def _bind(self, session: Session, space: Space) -> int:
        """The owner index of ``space`` for a put, binding the namespace to its owner in the
        store (durably, where a tier records it) the first time this session stores there; the
        store refuses a namespace past the tenant's limit."""
        key = (space.name, space.owner)
        hit = session.bound.get(key)
        # Still bound: the store unbinds a namespace left empty when its owner needs room.
        if hit is not None and self.store.ns_owner.get(hit[0]) == hit[1]:
            return hit[1]
        owner_idx = await self.store.namespace(space.ns, space.owner)
        bound = session.bound
        floor = 2 * self.config.server.max_namespaces_per_tenant
        if len(bound) >= max(session.bound_trim_at, floor):
            # Namespaces the store has unbound since (emptied, then passed over at the limit)
            # go: a session that moves through namespaces one after another would otherwise
            # keep every one it ever bound. What is still bound is at most the limit per owner,
            # but a session may bind for many owners (an admin, shared namespaces): the next
            # trim waits for twice what this one kept, or each bind would rebuild them all.
            owners = self.store.ns_owner
            session.bound = bound = {k: v for k, v in bound.items() if owners.get(v[0]) == v[1]}
            session.bound_trim_at = max(floor, 2 * len(bound))
        bound[key] = (space.ns, owner_idx)
        return owner_idx

    def _words(self, keys: Sequence[bytes], what: str = "keys") -> np.ndarray:
        if len(keys) == 0:
            raise InvalidArgument(f"{what} is empty")
        limit = self.config.server.max_batch_blocks
        if len(keys) > limit:
            raise InvalidArgument(
                f"{len(keys)} keys in one request; at most {limit} (server.max_batch_blocks)"
            )
        try:
            # A request's repeated field is read as a list once, where keys_to_words goes over
            # it twice; its one key is read as it is (the copy costs more than the rest).
            return keys_to_words(keys if len(keys) == 1 else list(keys))
        except ValueError as e:
            raise InvalidArgument(f"{what}: {e}") from None

    def _pool(self, session_id: str, pool_id: int) -> EnginePool:
        self.sessions.get(session_id)
        pool = self.pools.get(session_id, pool_id)
        pool.check_usable()
        return pool

    @staticmethod
    def _pages(pool: EnginePool, pages: Sequence[int], nkeys: int, *, unique: bool) -> np.ndarray:
        if len(pages) != nkeys:
            raise InvalidArgument(f"{len(pages)} pages for {nkeys} keys; give one page per key")
        # fromiter: np.asarray walks a protobuf repeated field as a generic sequence, several
        # times the cost for the few pages of a small request; one page is read as an int.
        if nkeys == 1:
            arr = np.empty(1, dtype=np.int64)  # np.array([page]) first works out a dtype
            arr[0] = pages[0]
        else:
            arr = np.fromiter(pages, dtype=np.int64, count=len(pages))
        pool.check_pages(arr)
        if unique and len(arr) > 1:
            # Sorted and compared with the next, not counted by np.unique: numpy 2's unique
            # of integers goes through a hash set, 0.4-0.7 ms for 4,096 pages (a fifth of a
            # large Get's first step, which other tenants' calls wait behind), the sort 0.02.
            order = np.sort(arr)
            if (order[1:] == order[:-1]).any():
                raise InvalidArgument("a page appears twice; each loaded block needs its own page")
        return arr

    @staticmethod
    def _layers(pool: EnginePool, begin: int, end: int) -> tuple[int, int] | None:
        """The layer range of a Get, or None for whole blocks."""
        nlayers = len(pool.layout.layers)
        if end == 0:
            if begin:
                raise InvalidArgument("layer_begin needs a layer_end (0 means every layer)")
            return None
        if not begin < end <= nlayers:
            raise InvalidArgument(
                f"layer range [{begin}, {end}) is empty or beyond the pool's {nlayers} layers"
            )
        return None if (begin, end) == (0, nlayers) else (begin, end)

    async def _lease_room(self, session_id: str, blocks: int) -> None:
        """Make room for a new lease of up to ``blocks`` pinned blocks of open session
        ``session_id`` (every lease holds its pinned block refs, up to 32 KiB, until it ends,
        for up to ``lease_max_ms``, and a tenant may open ``max_sessions_per_tenant``
        sessions), before the store is asked which blocks it pins; ResourceExhausted where
        not even a lease of none fits. Only live leases count: the leases past their deadline
        that the reaper has not reached yet are released a slice (``expire_leases``) a turn of
        the event loop, until the lease fits or none is left; earliest first, whoever's, so
        one slice alone refused a caller whose own came after others'. Not after the store's
        answer: a Delete or an eviction in such a turn frees the rows found, which the Lookup
        then pinned."""
        session = self.sessions.get(session_id)
        while self._lease_refusal(session, blocks) and self.sessions.expiry_due(self._clock()):
            self.expire_leases()
            await asyncio.sleep(0)
            session = self.sessions.get(session_id)  # it may have ended meanwhile
        self._check_lease_room(session, 0)

    def _check_lease_room(self, session: Session, blocks: int) -> None:
        """Refuse (ResourceExhausted) a new lease of ``blocks`` pinned blocks that would pass
        ``session``'s limits or its tenant's, once a slice of the leases past their deadline
        is released (those that came due while the store answered): in the step that pins,
        so that Lookups awaiting together do not pass the limits together."""
        if self._lease_refusal(session, blocks) and self.sessions.expiry_due(self._clock()):
            self.expire_leases()
        if why := self._lease_refusal(session, blocks):
            raise ResourceExhausted(why)

    def _lease_refusal(self, session: Session, blocks: int) -> str:
        """Why a new lease of ``blocks`` pinned blocks would pass ``session``'s limits, or ""."""
        limit = self.config.server.max_leases_per_session
        if len(session.leases) >= limit:
            return (
                f"this session already holds {counted(limit, 'lease')}, the most one session may "
                "hold (server.max_leases_per_session); release some or let them expire"
            )
        cap = self.config.server.max_lease_bytes_per_tenant
        need = lease_bytes(blocks)
        if (held := self.sessions.tenant_lease_bytes(session.limit_key)) + need > cap:
            return (
                f"the leases of {_who(session)} hold {held} bytes of the daemon's memory "
                f"({LEASE_BYTES} a lease, 8 a pinned block); {need} more would pass the {cap} "
                "one tenant's leases may hold (server.max_lease_bytes_per_tenant); release "
                "some or let them expire"
            )
        return ""

    def _lease_s(self, lease_ms: int) -> float:
        if lease_ms == 0:
            lease_ms = self.config.server.lease_default_ms
        if lease_ms > self.config.server.lease_max_ms:
            raise InvalidArgument(
                f"lease_ms {lease_ms} exceeds the maximum {self.config.server.lease_max_ms} (server.lease_max_ms)"
            )
        return lease_ms / 1000.0
