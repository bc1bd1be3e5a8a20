"""The daemon's API in domain terms: requests are checked here, then carried out by the store.

The gRPC servicer only translates protobuf to these calls and errors to status codes; this
module owns the rules (batch limits, key sizes, who may use which pool or lease). Every check
runs before any state changes, so a refused request leaves the daemon as it was.

Thread-safety: none; called from the server's event loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier import __version__
from kvtier.daemon.config import Config
from kvtier.daemon.errors import InvalidArgument
from kvtier.daemon.index import keys_to_words
from kvtier.daemon.pools import Pool, PoolRegistry
from kvtier.daemon.sessions import Session, SessionRegistry
from kvtier.daemon.store import BlockStore, DeleteResult, PrefetchResult, TierUsage
from kvtier.kernels.layout import PoolLayout

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.pools = pools
        self.sessions = sessions
        self._clock = clock
        self._started = clock()

    # --------------------------------------------------------------- sessions

    def open_session(self, client_name: str) -> Session:
        session = self.sessions.open(client_name[:200], self._clock())
        log.info("session %s opened by %r", session.session_id, session.client_name)
        return session

    def close_session(self, session_id: str) -> None:
        leases = self.sessions.close(session_id)
        for lease in leases:
            self.store.unpin(lease.bids)
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
        self.sessions.get(session_id)
        max_block = self.store.max_block_bytes()
        if layout.layers and layout.block_bytes > max_block:
            raise InvalidArgument(
                f"blocks of this layout have {layout.block_bytes} bytes, more than the "
                f"{max_block} a tier slot holds (raise tiers.l1.segment_bytes)"
            )
        return self.pools.register_shm(session_id, name, size_bytes, layout)

    def register_cuda_ipc_pool(self, session_id: str) -> Pool:
        self.sessions.get(session_id)
        return self.pools.register_cuda_ipc(session_id)

    def unregister_pool(self, session_id: str, pool_id: int) -> None:
        self.sessions.get(session_id)
        self.pools.unregister(session_id, pool_id)

    # ------------------------------------------------------------------ blocks

    def lookup(
        self, session_id: str, keys: Sequence[bytes], pin: bool, lease_ms: int
    ) -> LookupOutcome:
        words = self._words(keys)
        if pin:
            self.sessions.get(session_id)
            lease_s = self._lease_s(lease_ms)
        elif session_id:
            self.sessions.get(session_id)
        prefix, tiers, ids = self.store.lookup(DEFAULT_NAMESPACE, words)
        lease_id = 0
        if pin:
            found = np.unique(ids[ids >= 0])
            if len(found):
                self.store.pin(found)
                lease = self.sessions.add_lease(session_id, found, self._clock() + lease_s)
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
        self.store.unpin(lease.bids)

    def prefetch(
        self, session_id: str, keys: Sequence[bytes], deadline_ms: int, priority: int
    ) -> PrefetchResult:
        if session_id:
            self.sessions.get(session_id)
        return self.store.prefetch(DEFAULT_NAMESPACE, self._words(keys), deadline_ms, priority)

    async def delete(self, session_id: str, keys: Sequence[bytes]) -> DeleteResult:
        if session_id:
            self.sessions.get(session_id)
        return await self.store.delete(DEFAULT_NAMESPACE, self._words(keys))

    def expire_leases(self) -> int:
        expired = self.sessions.pop_expired(self._clock())
        for lease in expired:
            self.store.unpin(lease.bids)
        if expired:
            self.store.counters["leases_expired"] += len(expired)
        return len(expired)

    def stats(self) -> StatsSnapshot:
        index = self.store.index.stats()
        return StatsSnapshot(
            tiers=self.store.usage(),
            counters=self.store.all_counters(),
            gauges={
                "sessions": self.sessions.session_count,
                "pools": len(self.pools),
                "leases": self.sessions.lease_count,
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

    def _pool(self, session_id: str, pool_id: int) -> Pool:
        self.sessions.get(session_id)
        return self.pools.get(session_id, pool_id)

    @staticmethod
    def _pages(pool: Pool, pages: Sequence[int], nkeys: int, *, unique: bool) -> np.ndarray:
        if len(pages) != nkeys:
            raise InvalidArgument(f"{len(pages)} pages for {nkeys} keys; give one page per key")
        arr = np.asarray(pages, dtype=np.int64)
        pool.check_pages(arr)
        if unique and len(np.unique(arr)) != len(arr):
            raise InvalidArgument("a page appears twice; each loaded block needs its own page")
        return arr

    @staticmethod
    def _layers(pool: Pool, begin: int, end: int) -> tuple[int, int] | None:
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
