"""The daemon's API in domain terms: requests are checked here, then carried out by the store.

The gRPC servicer only translates protobuf to these calls and errors to status codes; this
module owns the rules (batch limits, key sizes, who may use which pool or lease). Every check
runs before any state changes, so a refused request leaves the daemon as it was.

Every call but ``open_session`` names an open session. A session carries its peer's
credentials when it was opened with a credential ticket (always, on the Unix socket); only
such a session may register memory, and only memory its peer owns. The limits (keys per
request, pools per session, sessions per tenant) answer with an error naming their key.

Thread-safety: none; called from the server's event loop only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier import __version__
from kvtier.daemon.config import Config
from kvtier.daemon.credentials import TicketBook, TicketKind
from kvtier.daemon.cuda_pools import CudaPool
from kvtier.daemon.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvtier.daemon.pools import EnginePool, Pool, PoolRegistry
from kvtier.daemon.sessions import PeerCred, Session, SessionRegistry
from kvtier.daemon.store import BlockStore, DeleteResult, PrefetchResult, TierUsage
from kvtier.daemon.table import keys_to_words
from kvtier.kernels.layout import PoolLayout
from kvtier.proto import kvtier_pb2 as pb

log = logging.getLogger(__name__)

# Until tenants are authenticated every session shares one namespace; keys still differ per
# model, dtype, layout and tenant because the client's key seed binds them.
DEFAULT_NAMESPACE = 0


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    prefix_len: int
    tiers: np.ndarray
    lease_id: int


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    tiers: list[TierUsage]
    counters: dict[str, int]
    gauges: dict[str, float]
    uptime_s: float
    version: str


class KVService:
    def __init__(
        self,
        config: Config,
        store: BlockStore,
        pools: PoolRegistry,
        sessions: SessionRegistry,
        tickets: TicketBook,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.pools = pools
        self.sessions = sessions
        self.tickets = tickets
        # Requests refused before reaching the rules (malformed), and similar events.
        self.counters: Counter[str] = Counter()
        self._clock = clock
        self._started = clock()

    # --------------------------------------------------------------- sessions

    def open_session(self, client_name: str, ticket: bytes, *, unix_socket: bool) -> Session:
        """Open a session bound to the credentials of ``ticket``. On the Unix socket a ticket
        is required; elsewhere (TCP) a session without one has no peer credentials."""
        peer: PeerCred | None = None
        if ticket:
            peer = self.tickets.redeem(ticket, TicketKind.SESSION).peer
        elif unix_socket:
            raise Unauthenticated(
                "a session on the Unix socket needs a credential ticket: ask the credential "
                "socket (the gRPC socket's path plus '.cred') and pass it in OpenSession"
            )
        session = self.sessions.open(client_name[:200], self._clock(), peer)
        log.info(
            "session %s opened by %r (%s, pid %s)",
            session.session_id,
            session.client_name,
            session.tenant,
            peer.pid if peer else "-",
        )
        return session

    def session(self, session_id: str) -> Session:
        """The open session ``session_id`` (NotFound otherwise)."""
        return self.sessions.get(session_id)

    def close_session(self, session_id: str) -> None:
        leases = self.sessions.close(session_id)
        for lease in leases:
            self.store.unpin(lease.refs)
        pools = self.pools.drop_session(session_id)
        log.info(
            "session %s closed: %d pools unregistered, %d leases released",
            session_id,
            pools,
            len(leases),
        )

    # ------------------------------------------------------------------ pools

    def register_shm_pool(
        self, session_id: str, name: str, size_bytes: int, layout: PoolLayout
    ) -> Pool:
        session = self.sessions.get(session_id)
        peer = self._check_may_register(session, layout)
        return self.pools.register_shm(session_id, peer, name, size_bytes, layout)

    def register_fd_pool(
        self, session_id: str, ticket: bytes, size_bytes: int, layout: PoolLayout
    ) -> Pool:
        session = self.sessions.get(session_id)
        peer = self._check_may_register(session, layout)
        handed = self.tickets.redeem(ticket, TicketKind.POOL)
        try:
            if handed.peer.uid != peer.uid:
                raise PermissionDenied(
                    f"the memory was handed over by uid {handed.peer.uid}, not by this "
                    f"session's uid {peer.uid}"
                )
            return self.pools.register_fd(session_id, handed.fd, size_bytes, layout)
        finally:
            os.close(handed.fd)  # the mapping keeps the memory; a memfd closes at once

    def _check_may_register(self, session: Session, layout: PoolLayout) -> PeerCred:
        if session.peer is None:
            raise PermissionDenied(
                "this session has no peer credentials (it was opened without a credential "
                "ticket, e.g. over TCP); only sessions on the Unix socket may register memory"
            )
        limit = self.config.server.max_pools_per_session
        if self.pools.session_pools(session.session_id) >= limit:
            raise ResourceExhausted(
                f"this session already has {limit} pools registered, the most one session may "
                "have (server.max_pools_per_session)"
            )
        max_block = self.store.max_block_bytes()
        if layout.layers and layout.block_bytes > max_block:
            raise InvalidArgument(
                f"blocks of this layout have {layout.block_bytes} bytes, more than the "
                f"{max_block} a tier slot holds (raise {self.store.max_block_key()})"
            )
        return session.peer

    def register_cuda_ipc_pool(
        self, session_id: str, region: pb.CudaIpcRegion, layout: PoolLayout
    ) -> CudaPool:
        """GPU memory over CUDA IPC: the rules of every pool (credentials, pools per
        session, block size against every tier's slots, L0's included), then the GPU tier
        must run: only it reaches GPU memory."""
        session = self.sessions.get(session_id)
        self._check_may_register(session, layout)
        if self.store.stack.device is None:
            raise FailedPrecondition(
                "CUDA IPC pools need the GPU tier (L0), which this daemon does not run: set "
                "tiers.l0.enabled=true on a host with CUDA"
            )
        return self.pools.register_cuda_ipc(session_id, region, layout)

    def unregister_pool(self, session_id: str, pool_id: int) -> None:
        self.sessions.get(session_id)
        self.pools.unregister(session_id, pool_id)

    # ------------------------------------------------------------------ blocks

    async def lookup(
        self, session_id: str, keys: Sequence[bytes], pin: bool, lease_ms: int
    ) -> LookupOutcome:
        self.sessions.get(session_id)
        words = self._words(keys)
        lease_s = self._lease_s(lease_ms) if pin else 0.0
        prefix, tiers, ids = await self.store.lookup(DEFAULT_NAMESPACE, words)
        lease_id = 0
        if pin:
            found = np.unique(ids[ids >= 0])
            if len(found):
                # The session may have ended while the lookup awaited; pinning for it then
                # would leave pins no lease releases.
                self.sessions.get(session_id)
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
    ) -> tuple[np.ndarray, np.ndarray | None]:
        pool = self._pool(session_id, pool_id)
        words = self._words(keys)
        page_arr = self._pages(pool, pages, len(keys), unique=False)
        parent = None
        if parent_key:
            parent = self._words([parent_key], what="parent_key")[0]
        return await self.store.put(
            pool, DEFAULT_NAMESPACE, words, page_arr, parent, durable=durable
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
    ) -> np.ndarray:
        pool = self._pool(session_id, pool_id)
        words = self._words(keys)
        page_arr = self._pages(pool, pages, len(keys), unique=True)
        layers = self._layers(pool, layer_begin, layer_end)
        # A Get under a live lease is the same access as its pinning Lookup: counted once.
        # Any session may name a lease: every session is the default tenant for now, and an
        # engine pins in its scheduler process and loads in its worker processes.
        leased = bool(lease_id) and self.sessions.lease_owner(lease_id) is not None
        # Gets of one block's other layer ranges are the same access as the one of layer 0.
        touch = not leased and (layers is None or layers[0] == 0)
        return await self.store.get(
            pool, DEFAULT_NAMESPACE, words, page_arr, touch=touch, layers=layers
        )

    def release(self, session_id: str, lease_id: int) -> None:
        self.sessions.get(session_id)
        lease = self.sessions.pop_lease(session_id, lease_id)
        self.store.unpin(lease.refs)

    async def prefetch(
        self, session_id: str, keys: Sequence[bytes], deadline_ms: int, priority: int
    ) -> PrefetchResult:
        self.sessions.get(session_id)
        return await self.store.prefetch(
            DEFAULT_NAMESPACE, self._words(keys), deadline_ms, priority
        )

    async def delete(self, session_id: str, keys: Sequence[bytes]) -> DeleteResult:
        self.sessions.get(session_id)
        return await self.store.delete(DEFAULT_NAMESPACE, self._words(keys))

    def expire_leases(self) -> int:
        expired = self.sessions.pop_expired(self._clock())
        for lease in expired:
            self.store.unpin(lease.refs)
        self.store.counters.inc("leases_expired", len(expired))
        return len(expired)

    def stats(self, session_id: str) -> StatsSnapshot:
        self.sessions.get(session_id)
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
                "blocks": index.blocks,
                "index_bytes": index.nbytes,
                **self.store.gauges(),
            },
            uptime_s=self._clock() - self._started,
            version=__version__,
        )

    # ----------------------------------------------------------------- checks

    def _words(self, keys: Sequence[bytes], what: str = "keys") -> np.ndarray:
        if len(keys) == 0:
            raise InvalidArgument(f"{what} is empty")
        limit = self.config.server.max_batch_blocks
        if len(keys) > limit:
            raise InvalidArgument(
                f"{len(keys)} keys in one request; at most {limit} (server.max_batch_blocks)"
            )
        try:
            return keys_to_words(list(keys))
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
        arr = np.asarray(pages, dtype=np.int64)
        pool.check_pages(arr)
        if unique and len(np.unique(arr)) != len(arr):
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

    def _lease_s(self, lease_ms: int) -> float:
        if lease_ms == 0:
            lease_ms = self.config.server.lease_default_ms
        if lease_ms > self.config.server.lease_max_ms:
            raise InvalidArgument(
                f"lease_ms {lease_ms} exceeds the maximum {self.config.server.lease_max_ms} (server.lease_max_ms)"
            )
        return lease_ms / 1000.0
