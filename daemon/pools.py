"""Registered engine pools: the client's KV memory, mapped into the daemon.

A pool is a POSIX shared-memory object that the client created, plus its layout. The daemon
checks the name, the object's real size and the layout before it maps a byte, and checks every
page index of every request against the layout. A pool belongs to the session that registered
it and is unmapped when that session ends or the pool is unregistered; a copy in flight keeps
the mapping alive until it finishes (``use()``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvtier.daemon.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from kvtier.kernels.layout import LayoutError, PoolLayout

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


@dataclass(eq=False)
class Pool:
    pool_id: int
    session_id: str
    name: str
    layout: PoolLayout
    buffer: mmap.mmap
    _users: int = 0
    _closing: bool = False
    array: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.array = np.frombuffer(self.buffer, dtype=np.uint8)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def check_pages(self, pages: np.ndarray) -> None:
        if len(pages) and int(pages.max()) >= self.layout.num_pages:
            bad = int(pages[pages >= self.layout.num_pages][0])
            raise InvalidArgument(
                f"page index {bad} is out of range for pool {self.pool_id} "
                f"with {self.layout.num_pages} pages"
            )

    @contextlib.contextmanager
    def use(self) -> Iterator[np.ndarray]:
        """Keep the mapping alive while a copy runs."""
        if self._closing:
            raise NotFound(f"pool {self.pool_id} is being unregistered")
        self._users += 1
        try:
            yield self.array
        finally:
            self._users -= 1
            if self._closing and self._users == 0:
                self._unmap()

    def close(self) -> None:
        self._closing = True
        if self._users == 0:
            self._unmap()

    def _unmap(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.buffer.close()
        except BufferError:
            log.warning("pool %d still has views at unmap; leaving it to the OS", self.pool_id)


class PoolRegistry:
    """Thread-safety: none; owned by the server's event loop."""

    def __init__(self, shm_dir: str) -> None:
        self._shm_dir = shm_dir
        self._pools: dict[int, Pool] = {}

    def __len__(self) -> int:
        return len(self._pools)

    def register_shm(self, session_id: str, name: str, size_bytes: int, layout: PoolLayout) -> Pool:
        if not _SHM_NAME.match(name) or name.startswith("."):
            raise InvalidArgument(
                f"shared-memory name {name!r} must be 1-200 characters of letters, digits, '.', '_' or '-'"
            )
        if size_bytes <= 0:
            raise InvalidArgument("shm.size_bytes must be positive")
        try:
            layout.validate(size_bytes)
        except LayoutError as e:
            raise InvalidArgument(f"layout does not fit the pool: {e}") from None
        path = os.path.join(self._shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
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
            if st.st_size < size_bytes:
                raise InvalidArgument(
                    f"shared-memory object {name!r} has {st.st_size} bytes, "
                    f"fewer than the {size_bytes} declared"
                )
            buffer = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        finally:
            os.close(fd)
        pool_id = self._new_id()
        pool = Pool(pool_id, session_id, name, layout, buffer)
        self._pools[pool_id] = pool
        log.info(
            "pool %d registered: shm %s, %d MiB, %d pages of %d-byte blocks, %d layers",
            pool_id,
            name,
            size_bytes >> 20,
            layout.num_pages,
            layout.block_bytes,
            len(layout.layers),
        )
        return pool

    def register_cuda_ipc(self, session_id: str) -> Pool:
        raise FailedPrecondition(
            "CUDA IPC pools need the L0 GPU tier, which this daemon does not run "
            "(no CUDA device, or the GPU tier is not enabled)"
        )

    def get(self, session_id: str, pool_id: int) -> Pool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id} is not registered")
        if pool.session_id != session_id:
            raise PermissionDenied(f"pool {pool_id} belongs to another session")
        return pool

    def unregister(self, session_id: str, pool_id: int) -> None:
        pool = self.get(session_id, pool_id)
        del self._pools[pool_id]
        pool.close()
        log.info("pool %d unregistered", pool_id)

    def drop_session(self, session_id: str) -> int:
        ids = [p.pool_id for p in self._pools.values() if p.session_id == session_id]
        for pool_id in ids:
            self.unregister(session_id, pool_id)
        return len(ids)

    def close(self) -> None:
        for pool in list(self._pools.values()):
            self.unregister(pool.session_id, pool.pool_id)

    def _new_id(self) -> int:
        while True:
            pool_id = secrets.randbits(63) or 1
            if pool_id not in self._pools:
                return pool_id


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
