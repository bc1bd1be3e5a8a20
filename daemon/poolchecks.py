"""The checks every registered pool answers the same way, whatever its memory."""

from __future__ import annotations

import asyncio

import numpy as np

from kvtier.daemon.errors import InvalidArgument
from kvtier.kernels.layout import PoolLayout


class PoolChecks:
    """What every registered pool (shared memory here, CUDA IPC in ``cuda_pools``) answers
    the same way: its block size and whether page indices fall inside it."""

    pool_id: int
    layout: PoolLayout
    _released: asyncio.Event | None = None

    def _mark_released(self) -> None:
        """The memory is let go: no copy uses it any more (called on the event loop)."""
        if self._released is None:
            self._released = asyncio.Event()
        self._released.set()

    async def released(self) -> None:
        """Return once the pool is closed, the last copy using it has finished and the
        daemon has let its memory go (a shared-memory pool's is unmapped on a worker
        thread), so its owner may reuse or free the memory. Called on the event loop, after
        ``close``."""
        if self._released is None:
            self._released = asyncio.Event()
        await self._released.wait()

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def check_pages(self, pages: np.ndarray) -> None:
        if not len(pages):
            return
        if len(pages) <= 8:  # a small request's pages: Python's min and max cost less
            few = pages.tolist()
            lo, hi = min(few), max(few)
        else:
            lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= self.layout.num_pages:
            bad = int(pages[(pages < 0) | (pages >= self.layout.num_pages)][0])
            raise InvalidArgument(
                f"page index {bad} is out of range for pool {self.pool_id} "
                f"with {self.layout.num_pages} pages"
            )
