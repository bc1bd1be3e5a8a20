"""Handing memory freed after a burst back to the operating system.

A flood of calls (thousands waiting in gRPC core at once, see ``MAX_PENDING_CALLS`` in
``daemon/server.py``) makes the C allocator take hundreds of MB for call state; when the
calls end, glibc keeps most of it: ``free`` returns only a free run at the top of each heap
(the main one and the arenas of gRPC's threads), and the chunks freed lie between chunks
still in use. The process then holds that memory for
good, which an operator reads as a leak. ``malloc_trim(0)`` gives back every free page
inside the heaps as well (about two thirds of a 16,000-call flood's growth here, in ~20 ms of
CPU); it is cheap enough to run after a burst, not on every call. So a background task asks
the allocator, every ``CHECK_INTERVAL_S``, how much freed memory it holds, and trims once
that passes the configured threshold and the process has grown by as much since the last
trim (see ``MemoryTrimmer.check``).

Only glibc has both calls (``mallinfo2`` since 2.33); elsewhere the trimmer says so once
at start and does nothing (the daemon keeps what it allocated, as before).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os

from kvtier.daemon.stats import Counters

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 5.0


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2, every field a size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        # CDLL releases the GIL around each call: a trim does not hold up Python threads.
        return ctypes.CDLL(name)
    except OSError:
        return None


def _rss_bytes() -> int:
    """Resident memory of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryTrimmer:
    """Trims the C heap when it holds more than ``threshold_bytes`` freed and the process has
    grown by as much since the last trim (0: never).

    ``free_bytes`` and ``trim`` block (the allocator's locks, one heap at a time) and run on
    a worker thread from ``run``. Counters: ``memory_trims`` (trims done) and
    ``memory_trimmed_bytes`` (resident memory they gave back).
    """

    def __init__(self, threshold_bytes: int, counters: Counters) -> None:
        self.threshold_bytes = threshold_bytes
        self.counters = counters
        libc = _libc()
        self._info = getattr(libc, "mallinfo2", None)
        self._trim = getattr(libc, "malloc_trim", None)
        self._base_rss: int | None = None  # the size after the last trim (or lowest since)
        if self._info is not None and self._trim is not None:
            self._info.restype = _MallInfo2
            self._info.argtypes = []
            self._trim.restype = ctypes.c_int
            self._trim.argtypes = [ctypes.c_size_t]

    @property
    def available(self) -> bool:
        return self._info is not None and self._trim is not None

    def free_bytes(self) -> int:
        """Bytes the allocator holds in free chunks of its heaps (not its mmapped blocks,
        which go back when freed)."""
        assert self._info is not None
        return int(self._info().fordblks)

    def trim(self) -> int:
        """Give every free page of the heaps back; returns the resident bytes that freed
        (0 if the process grew meanwhile)."""
        assert self._trim is not None
        before = _rss_bytes()
        self._trim(0)
        freed = max(0, before - _rss_bytes())
        self.counters.inc("memory_trims")
        self.counters.inc("memory_trimmed_bytes", freed)
        return freed

    def check(self) -> int:
        """One check: trim when the allocator holds more than the threshold freed and the
        process has grown by more than it since the last trim (or its lowest size since);
        returns what a trim gave back (0 when none ran).

        Both, because neither alone says there is something to give back: a trim hands back
        the pages of free chunks but leaves the chunks free, so the freed count stays where
        it was after one (alone, it would trim at every check after a burst); and the
        process grows for its own reasons too (the L1 arena's pre-fault, pools mapped)."""
        rss = _rss_bytes()
        if self._base_rss is None or rss < self._base_rss:
            self._base_rss = rss
        if rss - self._base_rss <= self.threshold_bytes:
            return 0
        if self.free_bytes() <= self.threshold_bytes:
            return 0
        freed = self.trim()
        self._base_rss = _rss_bytes()
        log.info("returned %.0f MiB of freed memory to the system", freed / (1 << 20))
        return freed

    async def run(self) -> None:
        """Check every ``CHECK_INTERVAL_S`` until cancelled."""
        if self.threshold_bytes <= 0:
            return
        if not self.available:
            log.info("memory trimming needs glibc's malloc_trim and mallinfo2: not done here")
            return
        while True:  # the first check, at once, sets the size growth counts from
            try:
                await asyncio.to_thread(self.check)
            except Exception:
                log.exception("memory trim failed")
                self.counters.inc("background_errors")
            await asyncio.sleep(CHECK_INTERVAL_S)
