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
- Every check runs before anything is mapped; a refused registration leaves nothing open.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from kvtier.daemon.config import ANY_PEER
from kvtier.daemon.credentials import is_memory_backed
from kvtier.daemon.cuda_pools import CudaPool, CudaPoolOpener, open_opener
from kvtier.daemon.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from kvtier.daemon.poolchecks import PoolChecks
from kvtier.daemon.ratelog import RateLimitedLog
from kvtier.daemon.sessions import PeerCred, shown_id
from kvtier.kernels.copy import MemoryFault
from kvtier.kernels.layout import LayoutError, PoolLayout
from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.base import PoolPages

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


@dataclass(eq=False)
class Pool(PoolChecks):
    pool_id: int
    session_id: str
    name: str  # the object's name, or "memfd" for a handed-over descriptor
    layout: PoolLayout
    buffer: mmap.mmap
    sealed: bool = False  # cannot shrink: no copy can fault
    broken: str = ""  # why the pool is unusable; empty while it works
    on_fault: Callable[[Pool], None] | None = None  # told once, when the pool breaks
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

    @contextlib.contextmanager
    def use(self) -> Iterator[np.ndarray]:
        """Keep the mapping alive while a copy runs; a fault in it breaks the pool."""
        self.check_usable()
        if self._closing:
            raise NotFound(f"pool {self.pool_id} is being unregistered")
        self._users += 1
        try:
            yield self.array
        except MemoryFault as e:
            if not self._base <= e.address < self._base + self._size:
                raise  # not this pool's memory: the daemon's own, an internal error
            first = not self.broken
            self.broken = (
                f"its memory faulted at byte {e.address - self._base}: the object was "
                "truncated or could not be backed"
            )
            if first and self.on_fault is not None:
                self.on_fault(self)
            self.check_usable()
        finally:
            self._users -= 1
            if self._closing and self._users == 0:
                self._unmap()

    def close(self) -> None:
        self._closing = True
        if self._users == 0:
            self._unmap()

    def _unmap(self) -> None:
        self._mark_released()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.buffer.close()
        except BufferError:
            log.warning("pool %d still has views at unmap; leaving it to the OS", self.pool_id)


EnginePool: TypeAlias = "Pool | CudaPool"


class PoolRegistry:
    """Thread-safety: none; owned by the server's event loop."""

    def __init__(
        self,
        shm_dir: str,
        shm_share: frozenset[tuple[int, int]] = frozenset(),
        log_interval_s: float = 10.0,
        cuda: CudaPoolOpener | None = None,
    ) -> None:
        """``cuda``: opens CUDA IPC pools (``open_opener``, built once at start); by default
        one that refuses them, saying that the GPU tier is not enabled."""
        self._shm_dir = shm_dir
        self._shm_share = shm_share
        self._cuda = cuda if cuda is not None else open_opener(False, 0)
        self._pools: dict[int, EnginePool] = {}
        self._per_session: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        # A client breaking its pools in a loop must not flood the log.
        self._ratelog = RateLimitedLog(log, log_interval_s)

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def broken_count(self) -> int:
        return sum(1 for p in self._pools.values() if p.broken)

    def session_pools(self, session_id: str) -> int:
        return self._per_session[session_id]

    def all(self) -> list[EnginePool]:
        return list(self._pools.values())

    def per_session_counts(self) -> dict[str, int]:
        """The pool counts the per-session limit keeps, for the invariant check."""
        return dict(self._per_session)

    def register_shm(
        self, session_id: str, peer: PeerCred, name: str, size_bytes: int, layout: PoolLayout
    ) -> Pool:
        """Map the named shared-memory object ``name``, which ``peer`` must own (or be
        granted by ``server.shm_share``)."""
        if not _SHM_NAME.match(name) or name.startswith("."):
            raise InvalidArgument(
                f"shared-memory name {name[:64]!r} must be 1-200 characters of letters, "
                "digits, '.', '_' or '-'"
            )
        _check_layout(size_bytes, layout)
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
            buffer = _map(fd, st, size_bytes, name)
            sealed = _sealed(fd)
        finally:
            os.close(fd)
        return self._add(Pool(self._new_id(), session_id, name, layout, buffer, sealed))

    def register_fd(self, session_id: str, fd: int, size_bytes: int, layout: PoolLayout) -> Pool:
        """Map a memory fd the client handed over (the caller closes ``fd``)."""
        _check_layout(size_bytes, layout)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not is_memory_backed(fd):
            raise InvalidArgument("the handed-over descriptor is not a memory file")
        buffer = _map(fd, st, size_bytes, "the memory file")
        return self._add(Pool(self._new_id(), session_id, "memfd", layout, buffer, _sealed(fd)))

    def register_cuda_ipc(
        self, session_id: str, region: pb.CudaIpcRegion, layout: PoolLayout
    ) -> CudaPool:
        """Open GPU memory the session's engine exported over CUDA IPC (every check is the
        opener's, before anything stays open). FailedPrecondition where this daemon cannot
        serve CUDA IPC pools, with the reason."""
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
        """Close the pool (new copies are refused at once) and return it: ``released()``
        answers once the copies still running on it are done."""
        pool = self.get(session_id, pool_id)
        del self._pools[pool_id]
        self._per_session[session_id] -= 1
        if self._per_session[session_id] <= 0:
            del self._per_session[session_id]
        pool.close()
        log.info("pool %d unregistered", pool_id)
        return pool

    def drop_session(self, session_id: str) -> int:
        ids = [p.pool_id for p in self._pools.values() if p.session_id == session_id]
        for pool_id in ids:
            self.unregister(session_id, pool_id)
        return len(ids)

    def close(self) -> None:
        for pool in list(self._pools.values()):
            self.unregister(pool.session_id, pool.pool_id)

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

    def _add(self, pool: Pool) -> Pool:
        pool.on_fault = self._faulted
        self._pools[pool.pool_id] = pool
        self._per_session[pool.session_id] += 1
        layout = pool.layout
        log.info(
            "pool %d registered: %s, %d MiB%s, %d pages of %d-byte blocks, %d layers",
            pool.pool_id,
            pool.name,
            len(pool.buffer) >> 20,
            " (sealed)" if pool.sealed else "",
            layout.num_pages,
            layout.block_bytes,
            len(layout.layers),
        )
        return pool

    def _new_id(self) -> int:
        while True:
            pool_id = secrets.randbits(63) or 1
            if pool_id not in self._pools:
                return pool_id


def _check_layout(size_bytes: int, layout: PoolLayout) -> None:
    if size_bytes <= 0:
        raise InvalidArgument("size_bytes must be positive")
    try:
        layout.validate(size_bytes)
    except LayoutError as e:
        raise InvalidArgument(f"layout does not fit the pool: {e}") from None


def _map(fd: int, st: os.stat_result, size_bytes: int, what: str) -> mmap.mmap:
    if st.st_size < size_bytes:
        raise InvalidArgument(
            f"{what} has {st.st_size} bytes, fewer than the {size_bytes} declared"
        )
    # Populate only memory that exists: faulting in a sparse object's holes would allocate
    # them, charged to the daemon, however large the client declared it.
    populate = _MAP_POPULATE if st.st_blocks * 512 >= size_bytes else 0
    try:
        return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | populate)
    except (OSError, OverflowError, ValueError) as e:
        raise InvalidArgument(f"cannot map {what}: {e}") from None


def _sealed(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
