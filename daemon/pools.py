"""Registered engine pools: the client's KV memory, mapped into the daemon.

A pool is memory the client created, plus its layout: a memfd the client handed over on the
credential socket (the default: it has no name, so nothing is left behind if the client is
killed), a named POSIX shared-memory object, or GPU memory exported over CUDA IPC
(``daemon/cuda_pools.py``; opened only by a daemon whose GPU tier runs). Every kind lives in
one registry: a pool belongs to the session that registered it and is unmapped when that
session ends or the pool is unregistered; a copy in flight keeps the mapping alive until it
finishes (``use()``); the store takes a batch's buffer from the pool (``batch``) and never
asks which kind it is.

Invariants:
- Only memory-backed objects (memfd, tmpfs) are mapped, checked with F_GET_SEALS, so a
  page fault in the daemon never waits on a remote or user-space filesystem.
- A named object is opened without following links, must be a regular file owned by the
  session's peer uid (or by an owner ``server.shm_share`` grants that uid), and its size is
  checked with fstat on the opened file before it is mapped.
- The owner may truncate the object at any time. Copies run under the kernel's SIGBUS
  guard; a copy that faults in a pool's memory marks the pool *broken*: that request and
  every later one on the pool answer FAILED_PRECONDITION, and only unregistering (or the
  session's end) is left. A memfd sealed against shrinking (F_SEAL_SHRINK) cannot fault.
- A host pool's object must be allocated in full when it is registered (st_blocks): the
  daemon's writes into a hole would allocate pages charged to the daemon's memory cgroup,
  not the owner's. An owner that punches holes afterwards (fallocate PUNCH_HOLE) still gets
  such pages charged to the daemon, at most its tenant's mapped bytes
  (``server.max_pool_bytes_per_tenant``).
- Every check runs before anything is mapped; a refused registration leaves nothing open.
- Mapping (populating faults in every page: up to seconds for a pool of gigabytes) runs on
  a worker thread, never on the event loop, and populates without the GIL (``_populate``);
  so does unmapping (``_unmap``: tearing down the page tables of a populated pool costs as
  much). A registration under way holds its pool id and its place in the session's count
  from its checks on, so registrations in flight together cannot pass the pools-per-session
  limit together; it registers nothing when its session ends (or the registry closes)
  before the mapping does, and a mapping nobody registers is closed, as is the descriptor
  it was made from.
- Every host pool's whole size counts toward its tenant's mapped bytes (``tenant_bytes``,
  which ``server.max_pool_bytes_per_tenant`` bounds) from its checks on, as its place in the
  session's count does, until its mapping is gone: while it is mapped, registered, or
  unregistered and not yet unmapped; so does its mapping toward the tenant's count
  (``tenant_mappings``, which ``server.max_pools_per_tenant`` bounds). Registering one
  object many times counts it each time: the daemon maps it (and holds page tables for it)
  each time. CUDA IPC pools do not count: they open each GPU allocation once however many
  pools name it.
- Mapping and unmapping share ``MAP_THREADS`` threads between tenants round robin, at most
  ``MAP_THREADS_PER_TENANT`` of them for one tenant (``fairthreads``): a tenant that
  registers a flood of large pools delays another's registration by at most one mapping.
- A pool is unmapped only once no copy uses it (``use()``): unregistering takes its id away
  at once (new requests are NOT_FOUND), the unmapping starts when the last copy ends, and
  ``released()`` answers when it is done. ``stop()`` waits for every unmapping under way,
  and for every registration being mapped (which it voids) to unmap what it mapped.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import logging
import mmap
import os
import re
import secrets
import stat
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from kvtier.daemon.config import ANY_PEER
from kvtier.daemon.credentials import WRITE_SEALED, is_memory_backed, write_sealed
from kvtier.daemon.cuda_pools import CudaPool, CudaPoolOpener, open_opener
from kvtier.daemon.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    PermissionDenied,
    SessionEnded,
    SessionGone,
    Unavailable,
)
from kvtier.daemon.fairthreads import FairThreads
from kvtier.daemon.poolchecks import PoolChecks
from kvtier.daemon.ratelog import BurstGate, BurstLog, RateLimitedLog
from kvtier.daemon.sessions import PeerCred, shown_id
from kvtier.kernels.copy import MemoryFault
from kvtier.kernels.layout import LayoutError, PoolLayout
from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.advise import DONTNEED, POPULATE_READ, address, advise
from kvtier.tiers.base import PoolPages
from kvtier.tiers.sizes import format_size

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
# Threads that map and unmap pools: registrations of several engines (one per TP rank, at
# start) populate their memory in parallel, and none of them waits behind the copies' threads.
MAP_THREADS = 4
# ...of which one tenant's jobs take at most this many at once: the others keep a thread.
MAP_THREADS_PER_TENANT = MAP_THREADS - 1
# Lines about pools registered and unregistered, per tenant (a session's limit key: the uid
# without tenants): this many at once, then this many a second; the next line says how many
# were left out. A client registering and dropping pools in a loop wrote two lines each; a
# node's engines starting together stay in the burst, and another tenant's pools are logged
# whatever one does (with one budget for all, a loop kept it spent).
POOL_LOG_BURST = 256
POOL_LOG_RATE_S = 4.0
# The largest size a host pool may declare: a file's size and a mapping's length are signed
# 64-bit (off_t), so nothing larger can be a memory file's real size.
MAX_POOL_BYTES = (1 << 63) - 1


@dataclass(eq=False)
class Pool(PoolChecks):
    pool_id: int
    session_id: str
    name: str  # the object's name, or "memfd" for a handed-over descriptor
    layout: PoolLayout
    buffer: mmap.mmap
    sealed: bool = False  # cannot shrink: no copy can fault
    tenant: str = ""  # whose mapped bytes it counts toward (the session's limit key)
    broken: str = ""  # why the pool is unusable; empty while it works
    on_fault: Callable[[Pool], None] | None = None  # told once, when the pool breaks
    # Unmaps the pool off the event loop and marks it released when done (the registry's);
    # without it the pool is unmapped on the caller's thread.
    unmapper: Callable[[Pool], None] | None = None
    _users: int = 0
    _closing: bool = False
    array: np.ndarray = field(init=False)
    _base: int = field(init=False)
    _size: int = field(init=False)

    def __post_init__(self) -> None:
        self.array = np.frombuffer(self.buffer, dtype=np.uint8)
        self._base = int(self.array.ctypes.data)
        self._size = len(self.array)

    def check_usable(self) -> None:
        if self.broken:
            raise FailedPrecondition(
                f"pool {self.pool_id} is broken ({self.broken}); unregister it and register "
                "the memory again"
            )

    def batch(
        self, pages: np.ndarray, threads: int = 1, layers: tuple[int, int] | None = None
    ) -> PoolPages:
        """The buffer of a batch of ``pages`` (the chunks of ``layers``, all when None), for
        the tiers' verbs; inside ``use()``."""
        layout = self.layout
        table = layout.layer_range_table(*layers) if layers else layout.chunk_table
        return PoolPages(table, self.array, pages, threads)

    def use(self) -> _InUse:
        """Keep the mapping alive while a copy runs (``with pool.use() as memory``); a fault
        in it breaks the pool."""
        return _InUse(self)

    def _enter(self) -> np.ndarray:
        self.check_usable()
        if self._closing:
            raise NotFound(f"pool {self.pool_id} is being unregistered")
        self._users += 1
        return self.array

    def _exit(self, error: BaseException | None) -> None:
        try:
            if isinstance(error, MemoryFault):
                if not self._base <= error.address < self._base + self._size:
                    return  # not this pool's memory: the daemon's own, an internal error
                first = not self.broken
                self.broken = (
                    f"its memory faulted at byte {error.address - self._base}: the object was "
                    "truncated or could not be backed"
                )
                if first and self.on_fault is not None:
                    self.on_fault(self)
                self.check_usable()
        finally:
            self._users -= 1
            if self._closing and self._users == 0:
                self._release()

    def close(self) -> None:
        self._closing = True
        if self._users == 0:
            self._release()

    def _release(self) -> None:
        """No copy uses the mapping any more: let it go (``released()`` answers once it is
        unmapped)."""
        self.array = np.empty(0, dtype=np.uint8)
        if self.unmapper is not None:
            self.unmapper(self)
        else:
            _unmap(self.buffer, f"pool {self.pool_id}")
            self._mark_released()


class _InUse:
    """``Pool.use()``: a class, not a generator-based context manager, because every Put
    and Get of a host pool enters one, and contextlib's generator machinery cost several
    times the few lines it runs."""

    __slots__ = ("_pool",)

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def __enter__(self) -> np.ndarray:
        return self._pool._enter()

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        self._pool._exit(error)


EnginePool: TypeAlias = "Pool | CudaPool"


@dataclass(eq=False, slots=True)
class _Pending:
    """A registration whose memory is being mapped (``mapped``: its job on a worker thread):
    it holds its pool id, a place in its session's count and its size in its tenant's
    mapped bytes (``PoolRegistry._charges``); ``void`` is why it may no longer register (its
    session ended, or the registry closed)."""

    pool_id: int
    session_id: str
    mapped: asyncio.Future[tuple[mmap.mmap, bool]]
    void: KvtierError | None = None


class PoolRegistry:
    """Thread-safety: none; owned by the server's event loop. Only mapping and unmapping run
    on worker threads, and they touch no state of the registry."""

    def __init__(
        self,
        shm_dir: str,
        shm_share: frozenset[tuple[int, int]] = frozenset(),
        log_interval_s: float = 10.0,
        cuda: CudaPoolOpener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``cuda``: opens CUDA IPC pools (``open_opener``, built once at start); by default
        one that refuses them, saying that the GPU tier is not enabled. ``clock``: the log
        rates' (seconds)."""
        self._shm_dir = shm_dir
        self._shm_share = shm_share
        self._cuda = cuda if cuda is not None else open_opener(False, 0)
        self._pools: dict[int, EnginePool] = {}
        self._per_session: Counter[str] = Counter()
        self._pending: dict[int, _Pending] = {}  # by pool id: registrations being mapped
        self._unmapping: set[asyncio.Future[None]] = set()
        # What counts toward each tenant's mapped bytes, and the sum by tenant: every
        # registration being mapped, pool registered, and pool or mapping not yet unmapped.
        self._charges: dict[_Pending | Pool, tuple[str, int]] = {}
        self._tenant_bytes: Counter[str] = Counter()
        self._tenant_mappings: Counter[str] = Counter()
        self._workers: FairThreads | None = None
        self._closed = False
        self._stopped = False  # its threads are ended: what is left is unmapped inline
        self.counters: Counter[str] = Counter()
        # A client breaking its pools in a loop must not flood the log.
        self._ratelog = RateLimitedLog(log, log_interval_s, clock)
        self._lines = BurstLog(
            log,
            BurstGate(POOL_LOG_BURST, POOL_LOG_RATE_S, clock),
            " ({count} more pool lines left out before this one)",
        )

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def broken_count(self) -> int:
        return sum(1 for p in self._pools.values() if p.broken)

    def session_pools(self, session_id: str) -> int:
        """The session's pools, those being mapped included: the count its limit applies to."""
        pending = sum(1 for p in self._pending.values() if p.session_id == session_id)
        return self._per_session[session_id] + pending

    def all(self) -> list[EnginePool]:
        return list(self._pools.values())

    def per_session_counts(self) -> dict[str, int]:
        """The pool counts the per-session limit keeps, for the invariant check."""
        return dict(self._per_session)

    @property
    def mappings(self) -> int:
        """Host pool mappings the daemon holds: registrations being mapped, registered
        pools and pools not yet unmapped (what ``server.max_pools`` bounds)."""
        return len(self._charges)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of host memory mapped for ``tenant`` (a session's limit key): registrations
        being mapped, registered pools, and pools not yet unmapped. What
        ``server.max_pool_bytes_per_tenant`` bounds."""
        return self._tenant_bytes[tenant]

    def tenant_mappings(self, tenant: str) -> int:
        """Host pool mappings held for ``tenant``, counted as ``mappings`` is (what
        ``server.max_pools_per_tenant`` bounds)."""
        return self._tenant_mappings[tenant]

    def check(self) -> list[str]:
        """The mapped bytes per tenant against what they count: every registration being
        mapped and every registered host pool is counted, and the sums match the parts."""
        problems = []
        held_now: list[_Pending | Pool] = [*self._pending.values()]
        held_now += [p for p in self._pools.values() if isinstance(p, Pool)]
        for held in held_now:
            if held not in self._charges:
                problems.append(f"pool {held.pool_id} is not counted in its tenant's mapped bytes")
        sums: Counter[str] = Counter()
        for tenant, nbytes in self._charges.values():
            sums[tenant] += nbytes
        if sums != self._tenant_bytes:
            problems.append("the per-tenant mapped bytes differ from the pools they count")
        if Counter(tenant for tenant, _ in self._charges.values()) != self._tenant_mappings:
            problems.append("the per-tenant mappings differ from the pools they count")
        return problems

    async def register_shm(
        self,
        session_id: str,
        peer: PeerCred,
        name: str,
        size_bytes: int,
        layout: PoolLayout,
        *,
        tenant: str = "",
    ) -> Pool:
        """Map the named shared-memory object ``name``, which ``peer`` must own (or be
        granted by ``server.shm_share``). Every check runs, and the pool's place in the
        session's count is taken, before the first await (see the module invariants)."""
        check_shm_name(name)
        check_host_region(size_bytes, layout)
        self._check_open()
        path = os.path.join(self._shm_dir, name)
        try:
            # NONBLOCK: opening a FIFO planted under the name must not wait for a writer.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"shared-memory object {name!r} does not exist") from None
        except PermissionError:
            raise PermissionDenied(
                f"the daemon may not open shared-memory object {name!r}"
            ) from None
        except OSError as e:
            raise InvalidArgument(
                f"cannot open shared-memory object {name!r}: {e.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"shared-memory object {name!r} is not a regular file")
            if not self._may_use(peer.uid, st.st_uid):
                raise PermissionDenied(
                    f"shared-memory object {name!r} belongs to uid {st.st_uid}, not to this "
                    f"session's uid {peer.uid} (server.shm_share can grant it)"
                )
            if not is_memory_backed(fd):
                raise InvalidArgument(
                    f"shared-memory object {name!r} is not in memory (tmpfs); check server.shm_dir"
                )
            _check_size(st, size_bytes, name)
            _check_allocated(st, size_bytes, name)
        except BaseException:
            os.close(fd)
            raise
        return await self._map_and_add(session_id, tenant, name, layout, fd, size_bytes, name)

    async def register_fd(
        self, session_id: str, fd: int, size_bytes: int, layout: PoolLayout, *, tenant: str = ""
    ) -> Pool:
        """Map a memory fd the client handed over (the caller closes ``fd``; the mapping is
        made from a copy of it). Checked before the first await, as ``register_shm``."""
        check_host_region(size_bytes, layout)
        self._check_open()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not is_memory_backed(fd):
            raise InvalidArgument("the handed-over descriptor is not a memory file")
        if write_sealed(fd):  # sealed after its ticket was answered: mapping it would fail
            raise InvalidArgument(WRITE_SEALED)
        _check_size(st, size_bytes, "the memory file")
        _check_allocated(st, size_bytes, "the memory file")
        own = os.dup(fd)  # the worker's: the caller may close ``fd`` before it maps
        return await self._map_and_add(
            session_id, tenant, "memfd", layout, own, size_bytes, "the memory file"
        )

    def register_cuda_ipc(
        self, session_id: str, region: pb.CudaIpcRegion, layout: PoolLayout
    ) -> CudaPool:
        """Open GPU memory the session's engine exported over CUDA IPC (every check is the
        opener's, before anything stays open). FailedPrecondition where this daemon cannot
        serve CUDA IPC pools, with the reason."""
        self._check_open()
        pool = self._cuda.open(self._new_id(), session_id, region, layout)
        self._pools[pool.pool_id] = pool
        self._per_session[session_id] += 1
        return pool

    def get(self, session_id: str, pool_id: int) -> EnginePool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id} is not registered")
        if pool.session_id != session_id:
            raise PermissionDenied(f"pool {pool_id} belongs to another session")
        return pool

    def unregister(self, session_id: str, pool_id: int) -> EnginePool:
        """Close the pool (its id is gone and new copies are refused at once) and return it:
        ``released()`` answers once the copies still running on it are done and its memory
        is unmapped (on a worker thread)."""
        pool = self.get(session_id, pool_id)
        del self._pools[pool_id]
        self._per_session[session_id] -= 1
        if self._per_session[session_id] <= 0:
            del self._per_session[session_id]
        pool.close()
        self._info(pool, "pool %d unregistered", pool_id)
        return pool

    def _info(self, pool: EnginePool, msg: str, *args: object) -> None:
        """An INFO line about a pool, at the rates of POOL_LOG_BURST and POOL_LOG_RATE_S for
        its tenant (GPU pools, which carry none, share one budget)."""
        self._lines.info(pool.tenant if isinstance(pool, Pool) else "", msg, *args)

    def drop_session(self, session_id: str, *, by_daemon: bool = False) -> int:
        """Unregister the session's pools; registrations of it still being mapped register
        nothing when their mapping ends (it is closed) and answer SessionGone, or
        SessionEnded where the daemon ended the session (``by_daemon``: its client sends
        them again in a new session)."""
        gone = SessionEnded if by_daemon else SessionGone
        for pending in self._pending.values():
            if pending.session_id == session_id and pending.void is None:
                pending.void = gone(
                    f"session {shown_id(session_id)} ended while its pool was being mapped"
                )
        ids = [p.pool_id for p in self._pools.values() if p.session_id == session_id]
        for pool_id in ids:
            self.unregister(session_id, pool_id)
        return len(ids)

    def close(self) -> None:
        """Unregister every pool and refuse registrations from now on, those being mapped
        included. A mapping still running finishes on its thread and is closed; ``stop``
        waits for the unmappings."""
        self._closed = True
        for pending in self._pending.values():
            if pending.void is None:
                pending.void = Unavailable("the daemon is stopping")
        for pool in list(self._pools.values()):
            self.unregister(pool.session_id, pool.pool_id)

    async def stop(self) -> None:
        """``close``, then wait until every pool it let go (and every other unmapping under
        way) is unmapped, and every registration it voided has unmapped what it mapped, and
        end the worker threads. A pool a copy still uses is unmapped when the copy ends, on
        the thread that ends it."""
        self.close()
        # A voided registration leaves ``_pending`` once its mapping ends, in the step that
        # starts unmapping it.
        while self._pending or self._unmapping:
            waits: set[asyncio.Future[Any]] = {p.mapped for p in self._pending.values()}
            await asyncio.wait(waits | self._unmapping)
        self._stopped = True
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = None

    def _may_use(self, peer_uid: int, owner_uid: int) -> bool:
        return (
            owner_uid == peer_uid
            or (peer_uid, owner_uid) in self._shm_share
            or (ANY_PEER, owner_uid) in self._shm_share
        )

    def _faulted(self, pool: Pool) -> None:
        self.counters["pool_faults"] += 1
        self._ratelog.warning(
            "pool fault",
            "pool %d of session %s is broken: %s",
            pool.pool_id,
            shown_id(pool.session_id),
            pool.broken,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the daemon is stopping")

    async def _map_and_add(
        self,
        session_id: str,
        tenant: str,
        name: str,
        layout: PoolLayout,
        fd: int,
        size_bytes: int,
        what: str,
    ) -> Pool:
        """Map ``fd`` (which this call owns and closes) on a worker thread, then register it,
        unless the registration was voided meanwhile (see the module invariants). Its size
        counts toward ``tenant``'s mapped bytes from here until its mapping is gone."""
        try:
            pool_id = self._new_id()
            job = self._worker_pool().submit(tenant, _map_and_close, fd, size_bytes, what)
        except BaseException:
            os.close(fd)
            raise
        pending = _Pending(pool_id, session_id, asyncio.wrap_future(job))
        self._pending[pool_id] = pending
        self._charge(pending, tenant, size_bytes)
        try:
            try:
                # Shielded: a cancel (only the loop's own end cancels a request, see
                # ``server._rpc``) leaves the job running; the mapping is closed when it ends.
                buffer, sealed = await asyncio.shield(pending.mapped)
            except asyncio.CancelledError:
                job.add_done_callback(_close_mapping)
                raise
        except BaseException:
            self._refund(pending)  # nothing mapped, or closed by the job's end (the loop's)
            raise
        finally:
            del self._pending[pending.pool_id]
        if pending.void is not None:
            # Answered once the mapping is gone, as an unregistration is; shielded as above.
            unmapped = self._unmap_off_loop(buffer, "a voided registration", tenant)
            unmapped.add_done_callback(lambda _: self._refund(pending))
            await asyncio.shield(unmapped)
            raise pending.void
        pool = Pool(pending.pool_id, session_id, name, layout, buffer, sealed, tenant=tenant)
        self._charges[pool] = self._charges.pop(pending)
        return self._add(pool)

    def _charge(self, holder: _Pending | Pool, tenant: str, nbytes: int) -> None:
        self._charges[holder] = (tenant, nbytes)
        self._tenant_bytes[tenant] += nbytes
        self._tenant_mappings[tenant] += 1

    def _refund(self, holder: _Pending | Pool) -> None:
        """``holder``'s mapping is gone (or was never made): its bytes no longer count."""
        charge = self._charges.pop(holder, None)
        if charge is None:
            return
        tenant, nbytes = charge
        self._tenant_bytes[tenant] -= nbytes
        if self._tenant_bytes[tenant] <= 0:
            del self._tenant_bytes[tenant]
        self._tenant_mappings[tenant] -= 1
        if self._tenant_mappings[tenant] <= 0:
            del self._tenant_mappings[tenant]

    def _worker_pool(self) -> FairThreads:
        if self._workers is None:
            self._workers = FairThreads(MAP_THREADS, MAP_THREADS_PER_TENANT, "kvtier-map")
        return self._workers

    def _unmap_off_loop(self, buffer: mmap.mmap, what: str, tenant: str) -> asyncio.Future[None]:
        """Unmap ``buffer`` (``_unmap``) on a worker thread, in ``tenant``'s turn; the
        future ends when it is gone."""
        done = asyncio.wrap_future(self._worker_pool().submit(tenant, _unmap, buffer, what))
        self._unmapping.add(done)
        done.add_done_callback(self._unmapping.discard)
        return done

    def _unmap_pool(self, pool: Pool) -> None:
        """A registered pool's ``unmapper``: called (on the event loop) once no copy uses
        the pool. Without a running loop (a registry driven outside the daemon), or once the
        registry has stopped (its threads are ended: a copy outlasted the stop), the pool is
        unmapped here, at once."""
        if not self._stopped:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                unmapped = self._unmap_off_loop(pool.buffer, f"pool {pool.pool_id}", pool.tenant)
                unmapped.add_done_callback(lambda _: self._unmapped(pool))
                return
        _unmap(pool.buffer, f"pool {pool.pool_id}")
        self._unmapped(pool)

    def _unmapped(self, pool: Pool) -> None:
        self._refund(pool)
        pool._mark_released()

    def _add(self, pool: Pool) -> Pool:
        pool.on_fault = self._faulted
        pool.unmapper = self._unmap_pool
        self._pools[pool.pool_id] = pool
        self._per_session[pool.session_id] += 1
        layout = pool.layout
        self._info(
            pool,
            "pool %d registered: %s, %s%s, %d pages of %d-byte blocks, %d layers",
            pool.pool_id,
            pool.name,
            format_size(len(pool.buffer)),
            " (sealed)" if pool.sealed else "",
            layout.num_pages,
            layout.block_bytes,
            len(layout.layers),
        )
        return pool

    def _new_id(self) -> int:
        while True:
            pool_id = secrets.randbits(63) or 1
            if pool_id not in self._pools and pool_id not in self._pending:
                return pool_id


def check_shm_name(name: str) -> None:
    """Refuse a shared-memory name that is not a plain file name (a path, a hidden name)."""
    if not _SHM_NAME.fullmatch(name) or name.startswith("."):
        raise InvalidArgument(
            f"shared-memory name {name[:64]!r} must be 1-200 characters of letters, "
            "digits, '.', '_' or '-'"
        )


def check_host_region(size_bytes: int, layout: PoolLayout) -> None:
    """The checks of a host pool's request on its own content (its declared size and
    layout), which no limit and no state changes: the service runs them before the limits,
    so that a request that can never succeed is INVALID_ARGUMENT, not RESOURCE_EXHAUSTED
    (told to retry once room is made)."""
    if size_bytes <= 0:
        raise InvalidArgument("size_bytes must be positive")
    if size_bytes > MAX_POOL_BYTES:
        raise InvalidArgument(
            f"size_bytes {size_bytes} is beyond the largest memory file or mapping "
            f"({MAX_POOL_BYTES} bytes)"
        )
    try:
        layout.validate(size_bytes)
    except LayoutError as e:
        raise InvalidArgument(f"layout does not fit the pool: {e}") from None


def _check_size(st: os.stat_result, size_bytes: int, what: str) -> None:
    if st.st_size < size_bytes:
        raise InvalidArgument(
            f"{what} has {st.st_size} bytes, fewer than the {size_bytes} declared"
        )


def _check_allocated(st: os.stat_result, size_bytes: int, what: str) -> None:
    """Refuse memory that is not all allocated (a sparse object). A page is charged to the
    memory cgroup of the process whose access allocates it, so a Get that wrote into a hole
    would allocate that page charged to the daemon, up to the pool's declared size (a 1 GiB
    sparse memfd took the daemon's RSS from 91 to 347 MB in 4,096 Gets, and a daemon under
    a 400 MiB limit was OOM-killed). Allocated by its owner, every page is the owner's.
    st_blocks counts what is allocated on tmpfs, memfd and hugetlbfs alike, but in the whole
    object, so the whole object must be allocated: one larger than declared could hold its
    allocated bytes past the declared size and holes within it (SEEK_HOLE cannot tell: tmpfs
    reports pages allocated by fallocate and never written as holes)."""
    need = max(size_bytes, st.st_size)
    if st.st_blocks * 512 < need:
        raise FailedPrecondition(
            f"{what} has {st.st_blocks * 512} of its {need} bytes allocated: allocate "
            "all of it before registering it (posix_fallocate, or write every page), or the "
            "daemon would be charged for the pages it writes"
        )


def _map(fd: int, size_bytes: int, what: str) -> mmap.mmap:
    """The slow part of a registration: every page is faulted in before this returns. On a
    worker thread."""
    try:
        buffer = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
    except (OSError, OverflowError, ValueError) as e:
        raise InvalidArgument(f"cannot map {what}: {e}") from None
    _populate(buffer)
    return buffer


def _populate(buffer: mmap.mmap) -> None:
    """Fault in every page of ``buffer`` now, so that copies do not. Not with MAP_POPULATE
    or ``mmap.madvise``: Python holds the GIL through both, which stalled the event loop on
    another thread as long as populating on it did (0.5-1 s for 4 GiB); ``tiers.advise``
    lets the GIL go. Best effort, as MAP_POPULATE is: on a kernel before 5.14 (EINVAL) the copies fault
    the pages in, and memory the owner truncated meanwhile (EFAULT) faults then, under the
    copies' guard."""
    if err := advise(address(buffer), len(buffer), POPULATE_READ):
        log.debug("a pool was not populated: %s", os.strerror(err))


def _map_and_close(fd: int, size_bytes: int, what: str) -> tuple[mmap.mmap, bool]:
    """A registration's job on its worker thread: the mapping and whether the object is
    sealed against shrinking; ``fd`` is closed whatever happens (the mapping keeps the
    memory)."""
    try:
        return _map(fd, size_bytes, what), _sealed(fd)
    finally:
        os.close(fd)


def _close_mapping(job: Future[tuple[mmap.mmap, bool]]) -> None:
    """Close the mapping of a job whose registration was abandoned (on whichever thread
    ends the job)."""
    if not job.cancelled() and job.exception() is None:
        _unmap(job.result()[0], "an abandoned registration")


def _unmap(buffer: mmap.mmap, what: str) -> None:
    """Unmap ``buffer``, which no copy uses any more; on a worker thread. The munmap of a
    populated pool costs about as much as populating it (0.1-0.9 s for 4 GiB here): its page
    tables are torn down first with madvise(MADV_DONTNEED) (``tiers.advise``), which lets the
    GIL go and, on a shared mapping, drops only this process's view of the pages (the object
    keeps its data). ``mmap.close`` then has almost nothing left to do. It lets the GIL go
    too (CPython 3.11), but a munmap holds the address-space lock while it tears down, and
    the event loop's own mmap calls (large allocations) waited for all of it (Linux 6.18;
    madvise did not hold them up). Best effort, as populating: where madvise fails (locked
    or huge pages) close does it all. A view of the memory still alive keeps the mapping
    until it is dropped: copies hold theirs only while they run, but a copy that failed (a
    fault in the pool) left its pages in its traceback, which a reference cycle keeps until
    the collector runs; that garbage is collected here before the close is given up."""
    try:
        if buffer.closed:
            return
        if err := advise(address(buffer), len(buffer), DONTNEED):
            log.debug("%s was not emptied first: %s", what, os.strerror(err))
        try:
            buffer.close()
        except BufferError:
            gc.collect()
            buffer.close()
    except BufferError:
        log.warning("%s still has views at unmap; leaving it to the OS", what)
    except Exception:
        log.exception("unmapping %s failed", what)


def _sealed(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False
