"""L1: the host-memory arena.

One anonymous mapping of the whole capacity is made at start and pre-faulted (transparent huge
pages requested), so blocks rarely pay for a first-touch page fault and no block is ever
allocated on its own. Pre-faulting gigabytes takes seconds, so by default it runs on a
background thread while the daemon already serves: a slot used before its pages were reached
simply faults them in itself. Slots come from a
SlabAllocator; every slot starts on a page boundary (so the disk tier can read and write it
with O_DIRECT). With CUDA present the arena is also page-locked (cudaHostRegister) so device
copies run at full speed.
"""

from __future__ import annotations

import gc
import logging
import mmap
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np

from kvtier.tiers.advise import CHUNK, POPULATE_WRITE, advise
from kvtier.tiers.base import (
    HEALTHY,
    BlockRef,
    HostBuffers,
    ReadBatch,
    RecoveredBlocks,
    TierHealth,
    TierKind,
    TierStats,
    TierUnavailable,
    WriteBatch,
    WriteOutcomes,
)
from kvtier.tiers.buffers import load_into, store_from
from kvtier.tiers.sizes import format_size
from kvtier.tiers.slab import SlabAllocator

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable


class HostArena:
    """The L1 slot tier.

    Thread-safety: ``write`` and ``read`` may run on any threads for distinct slots; the
    allocator and ``remove`` (which only frees slots) are the owner's to serialise.
    """

    kind = TierKind.HOST
    persistent = False
    checksummed = False

    def __init__(
        self,
        capacity_bytes: int,
        segment_bytes: int,
        *,
        pin_cuda: bool = False,
        prefault: str = "sync",
    ) -> None:
        """``prefault``: ``sync`` (before returning), ``background`` (a thread does it, from
        ``start_prefault()`` on, while the arena is already in use) or ``none``."""
        if prefault not in ("sync", "background", "none"):
            raise ValueError(f"prefault must be sync, background or none, not {prefault!r}")
        self.allocator = SlabAllocator(capacity_bytes, segment_bytes)
        size = self.allocator.capacity_bytes
        self.buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.buffer.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self.buffer, dtype=np.uint8)
        self._counters: Counter[str] = Counter()
        self._cuda_registered = False
        self._stop = threading.Event()
        self.prefaulted = threading.Event()
        self._prefaulter: threading.Thread | None = None
        log.info(
            "L1 host arena: %s in %d segments of %s (transparent huge pages: %s)",
            format_size(size),
            self.allocator.num_segments,
            format_size(self.allocator.segment_bytes),
            _thp_mode(),
        )
        if pin_cuda:
            # cudaHostRegister faults every page in itself.
            self._register_cuda()
            self.prefaulted.set()
        elif prefault == "sync":
            self._prefault()
        elif prefault == "background":
            self._prefaulter = threading.Thread(
                target=self._prefault, name="l1-prefault", daemon=True
            )
        else:
            self.prefaulted.set()

    def start_prefault(self) -> None:
        """Start the background pre-fault (``prefault="background"``); idempotent. Called
        once the daemon serves: faulting pages in holds the process's memory-map lock a chunk
        at a time, which would slow everything else that maps memory while it starts."""
        if (
            self._prefaulter is not None
            and not self._prefaulter.is_alive()
            and not self.prefaulted.is_set()
        ):
            self._prefaulter.start()

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = self.allocator.offset(slot)
        return memoryview(self.buffer)[start : start + nbytes]

    def buffers(self, slots: Sequence[int], nbytes: int) -> HostBuffers:
        """The slots as host buffers of their full slot size (page-aligned, so a disk tier
        moves them without staging)."""
        size = self.allocator.slot_bytes_for(nbytes)
        offsets = self.allocator.offsets(np.asarray(slots, dtype=np.int64))
        starts = offsets.tolist()
        whole = memoryview(self.buffer)
        return HostBuffers(
            [whole[o : o + size] for o in starts], (offsets + self._address()).tolist()
        )

    def write(self, batch: WriteBatch) -> WriteOutcomes:
        given = batch.slots
        if len(given) == 1:
            # A single-key put's slot: np.asarray of a list first works out its dtype, and
            # ``offsets`` reads the slot as it was given, not back from the array.
            slots = np.empty(1, dtype=np.int64)
            slots[0] = given[0]
            starts = self.allocator.offsets(given)
        else:
            slots = np.asarray(given, dtype=np.int64)
            starts = self.allocator.offsets(slots)
        n = len(slots)
        store_from(batch.src, range(n), self.array, starts, batch.nbytes)
        self._counters["blocks_written"] += n
        self._counters["bytes_written"] += n * batch.nbytes
        return WriteOutcomes.all_stored(slots)

    def read(self, batch: ReadBatch) -> list[bool]:
        starts = self.allocator.offsets(batch.slots)
        load_into(batch.dest, range(len(batch.slots)), self.array, starts, batch.nbytes)
        self._counters["blocks_read"] += len(batch.slots)
        self._counters["bytes_read"] += len(batch.slots) * batch.nbytes
        return [True] * len(batch.slots)

    def remove(self, slots: Sequence[int]) -> bool:
        self.allocator.free_many(slots)
        return True

    def removing(self, slots: Sequence[int], refs: Sequence[BlockRef] | None = None) -> None:
        pass  # no rows: nothing survives a restart

    def rows_left(self, refs: Sequence[BlockRef]) -> bool:
        return False

    def drop_rows_left(self, refs: Sequence[BlockRef]) -> bool:
        return True

    def recover_chunks(self, rows: int = 65536) -> Iterator[RecoveredBlocks]:
        return iter(())

    def health(self) -> TierHealth:
        return HEALTHY

    def stats(self) -> TierStats:
        return TierStats(
            self.kind,
            HEALTHY,
            self.allocator.capacity_bytes,
            self.allocator.used_bytes,
            dict(self._counters),
            {
                "page_locked": float(self._cuda_registered),
                # 1 until every page of the arena is faulted in (a background pre-fault runs
                # while the daemon serves; copies into pages not yet faulted in cost more).
                "prefaulting": float(not self.prefaulted.is_set()),
            },
        )

    def close(self) -> None:
        self._stop.set()
        if self._prefaulter is not None:
            if self._prefaulter.is_alive():
                self._prefaulter.join()
            self._prefaulter = None
        if self._cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._address())
            self._cuda_registered = False
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.buffer.close()
        except BufferError:
            # Views of the arena held only by garbage not yet collected (reference cycles,
            # e.g. the frames of a finished transfer: kvtierd collects rarely, see
            # kvtier.daemon.main) are freed by a collection; every stop after an L2 flush
            # warned without it.
            gc.collect()
            try:
                self.buffer.close()
            except BufferError:
                # A view is still exported (a copy in flight at shutdown); the OS reclaims it.
                log.warning("L1 arena still in use at close; leaving it to the OS")

    def _address(self) -> int:
        return int(self.array.ctypes.data)

    def _register_cuda(self) -> None:
        """Page-lock the arena for CUDA. Raises TierUnavailable (the daemon's one-line "cannot
        start") where it cannot: without torch or a CUDA device, or when CUDA refuses."""
        try:
            import torch
        except ImportError:
            raise TierUnavailable(
                "tiers.l1.pin_memory=true needs torch, which this Python lacks: "
                "pip install 'kvtier[torch]'"
            ) from None
        if not torch.cuda.is_available():
            raise TierUnavailable(
                "tiers.l1.pin_memory=true needs a CUDA device, and this host has none "
                "(torch.cuda.is_available() is False); set it to auto or false"
            )
        # Portable: pinned for every CUDA context of the process, so the GPU tier's copies
        # run as DMA whichever device it uses, not only the one current here.
        err = torch.cuda.cudart().cudaHostRegister(
            self._address(), len(self.buffer), _CUDA_HOST_REGISTER_PORTABLE
        )
        if int(err) != 0:
            raise TierUnavailable(
                f"cudaHostRegister of the L1 arena failed with CUDA error {int(err)} "
                "(tiers.l1.pin_memory)"
            )
        self._cuda_registered = True

    def _prefault(self) -> None:
        """Fault every page in, a chunk at a time (each madvise call runs without the GIL),
        stopping early when the arena closes."""
        started = time.monotonic()
        base, size = self._address(), len(self.buffer)
        for start in range(0, size, CHUNK):
            if self._stop.is_set():
                return
            length = min(CHUNK, size - start)
            if advise(base + start, length, POPULATE_WRITE) != 0:
                # Older kernels: touch one byte per page instead.
                self.array[start : start + length : mmap.PAGESIZE] = 0
        self.prefaulted.set()
        log.info("L1 arena pre-faulted in %.2fs", time.monotonic() - started)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()
