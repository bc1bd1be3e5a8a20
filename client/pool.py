"""Shared-memory pools: host memory the engine and the daemon both map.

The client creates the region (so it owns its lifetime and permissions), fills it with KV
pages, and registers it once; afterwards requests name pages by index and the daemon copies
bytes in and out of the region directly.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from typing import TYPE_CHECKING

import numpy as np

from kvtier.kernels.layout import PoolLayout

if TYPE_CHECKING:
    import torch

DEFAULT_SHM_DIR = "/dev/shm"


class SharedMemoryPool:
    """A POSIX shared-memory region of ``size_bytes``, created fresh and pre-faulted.

    The name is removed when the pool is closed, or at the latest when the object is garbage
    collected or the process exits; the memory itself lives until every mapping is gone.
    Thread-safety: the memory may be used from any thread; close() once.
    """

    def __init__(
        self,
        size_bytes: int,
        *,
        name: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        mode: int = 0o600,
    ) -> None:
        if size_bytes <= 0:
            raise ValueError("size_bytes must be positive")
        self.name = name or f"kvtier-{os.getpid()}-{secrets.token_hex(6)}"
        self.size_bytes = size_bytes
        self.path = os.path.join(shm_dir, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
        try:
            os.ftruncate(fd, size_bytes)
            # Allocate every page now: a tmpfs that is too small fails here, not mid-copy.
            os.posix_fallocate(fd, 0, size_bytes)
            self.buffer = mmap.mmap(
                fd, size_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)

    @classmethod
    def for_layout(cls, layout: PoolLayout, **kwargs: object) -> SharedMemoryPool:
        """A pool just large enough for ``layout``."""
        return cls(layout.extent_bytes, **kwargs)  # type: ignore[arg-type]

    def array(self) -> np.ndarray:
        """The whole region as a uint8 numpy array (shares memory)."""
        return np.frombuffer(self.buffer, dtype=np.uint8)

    def tensor(
        self,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """A torch tensor view of the region from ``offset`` (shares memory)."""
        import torch

        dtype = dtype or torch.uint8
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = (self.size_bytes - offset) // itemsize
        if shape is not None:
            count = int(np.prod(shape))
        t = torch.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset)
        return t.view(shape) if shape is not None else t

    def unlink(self) -> None:
        """Remove the name now; mappings (the daemon's included) stay valid."""
        self._finalizer()

    def close(self) -> None:
        self.unlink()
        # Views (tensors, arrays) may still exist; then the mapping goes when they do.
        with contextlib.suppress(BufferError):
            self.buffer.close()

    def __enter__(self) -> SharedMemoryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
