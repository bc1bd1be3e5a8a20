"""L1: the host-memory arena.

One anonymous mapping of the whole capacity is made and pre-faulted at start, so no block ever
pays for a first-touch page fault and no block is ever allocated on its own. Slots come from a
SlabAllocator; every slot starts on a page boundary (so the disk tier can read and write it
with O_DIRECT). With CUDA present the arena is also page-locked (cudaHostRegister) so device
copies run at full speed.
"""

from __future__ import annotations

import logging
import mmap
import time

import numpy as np

from kvtier.tiers.base import TierKind
from kvtier.tiers.slab import SlabAllocator

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by the mmap module
_CUDA_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable


class HostArena:
    """Thread-safety: the mapping may be read and written from any thread; the allocator is
    the owner's to serialise."""

    kind = TierKind.HOST

    def __init__(self, capacity_bytes: int, segment_bytes: int, *, pin_cuda: bool = False) -> None:
        self.allocator = SlabAllocator(capacity_bytes, segment_bytes)
        size = self.allocator.capacity_bytes
        started = time.monotonic()
        self.buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.buffer.madvise(mmap.MADV_HUGEPAGE)
        _prefault(self.buffer)
        self.array = np.frombuffer(self.buffer, dtype=np.uint8)
        self._cuda_registered = False
        if pin_cuda:
            self._register_cuda()
        log.info(
            "L1 host arena: %d MiB in %d segments of %d MiB, pre-faulted in %.2fs%s",
            size >> 20,
            self.allocator.num_segments,
            segment_bytes >> 20,
            time.monotonic() - started,
            ", page-locked for CUDA" if self._cuda_registered else "",
        )

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = self.allocator.offset(slot)
        return memoryview(self.buffer)[start : start + nbytes]

    def write(self, slot: int, data: memoryview, nbytes: int) -> None:
        self.view(slot, nbytes)[:] = memoryview(data)[:nbytes]

    def read(self, slot: int, out: memoryview, nbytes: int) -> None:
        memoryview(out)[:nbytes] = self.view(slot, nbytes)

    def state(self) -> str:
        return "ok"

    def close(self) -> None:
        if self._cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._address())
            self._cuda_registered = False
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.buffer.close()
        except BufferError:
            # A view is still exported (a copy in flight at shutdown); the OS reclaims it.
            log.warning("L1 arena still in use at close; leaving it to the OS")

    def _address(self) -> int:
        return int(self.array.ctypes.data)

    def _register_cuda(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("l1.pin_memory is set but CUDA is not available")
        # Portable: pinned for every CUDA context of the process, so the GPU tier's copies
        # run as DMA whichever device it uses, not only the one current here.
        err = torch.cuda.cudart().cudaHostRegister(
            self._address(), len(self.buffer), _CUDA_HOST_REGISTER_PORTABLE
        )
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of the L1 arena failed with CUDA error {int(err)}"
            )
        self._cuda_registered = True


def _prefault(buffer: mmap.mmap) -> None:
    try:
        buffer.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        # Older kernels: touch one byte per page instead.
        np.frombuffer(buffer, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
