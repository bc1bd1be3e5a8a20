"""Memory a burst made the C allocator take goes back to the system once it is freed
(``daemon/memtrim.py``): glibc alone keeps every free chunk below the top of its heaps."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time

import pytest

from kvtier.client import AsyncClient
from kvtier.daemon.memtrim import MemoryTrimmer, _rss_bytes
from kvtier.daemon.stats import Counters

CHUNK = 2048  # well below glibc's mmap threshold: these come from the heap
COUNT = 60_000  # ~120 MiB


def _fragmented_heap() -> list[int]:
    """Allocate and touch ``COUNT`` heap chunks, free all but every 16th (and the last, so
    the heap's top stays in use): about 110 MiB freed that ``free`` itself cannot return.
    Returns the chunks kept (free them after)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    ptrs = [libc.malloc(CHUNK) for _ in range(COUNT)]
    for p in ptrs:
        ctypes.memset(p, 1, CHUNK)
    kept = []
    for i, p in enumerate(ptrs):
        if i % 16 == 0 or i == COUNT - 1:
            kept.append(p)
        else:
            libc.free(p)
    return kept


def _free(ptrs: list[int]) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.free.argtypes = [ctypes.c_void_p]
    for p in ptrs:
        libc.free(p)


def test_freed_heap_memory_past_the_threshold_goes_back_to_the_system():
    counters = Counters()
    trimmer = MemoryTrimmer(32 << 20, counters)
    assert trimmer.available  # glibc: what the daemon's images and this machine run
    trimmer.trim()  # start from a trimmed heap
    assert trimmer.check() == 0  # what is freed from here on counts
    kept = _fragmented_heap()
    try:
        freed_chunks = (COUNT - len(kept)) * CHUNK
        assert trimmer.free_bytes() >= freed_chunks
        rss = _rss_bytes()
        returned = trimmer.check()
        assert returned >= freed_chunks // 2
        assert rss - _rss_bytes() >= freed_chunks // 2
        assert counters.get("memory_trims") == 2  # the one above, and this one
        assert counters.get("memory_trimmed_bytes") >= returned
        # The chunks are still free (their pages gone): no trim again until more is freed.
        assert trimmer.check() == 0
        assert counters.get("memory_trims") == 2
    finally:
        _free(kept)


def test_below_the_threshold_nothing_is_trimmed():
    counters = Counters()
    trimmer = MemoryTrimmer(1 << 40, counters)
    trimmer.check()
    kept = _fragmented_heap()
    try:
        assert trimmer.check() == 0
        assert counters.get("memory_trims") == 0
    finally:
        _free(kept)


def test_a_threshold_of_zero_never_trims():
    counters = Counters()
    trimmer = MemoryTrimmer(0, counters)
    asyncio.run(asyncio.wait_for(trimmer.run(), 1.0))  # returns at once, no loop
    assert counters.get("memory_trims") == 0


@pytest.mark.slow  # a burst of calls against a real daemon, ~3-6 s: `make test-slow`
def test_the_daemon_trims_after_a_burst_of_calls(daemon_factory):
    """A burst of 3,000 calls leaves freed memory in the daemon's heaps; within a few checks
    the daemon has given it back (the threshold set low so that any burst passes it)."""
    d = daemon_factory("server.memory_trim_bytes=1MiB")

    async def burst() -> None:
        async with AsyncClient(d.address, timeout_s=120) as client:
            await asyncio.gather(*(client.lookup([b"k" * 32]) for _ in range(3000)))

    asyncio.run(burst())
    deadline = time.monotonic() + 30
    with d.client(timeout_s=10) as client:
        while time.monotonic() < deadline:
            counters = client.stats().counters
            if counters.get("memory_trims", 0) >= 1:
                break
            time.sleep(0.5)
        assert counters.get("memory_trims", 0) >= 1
    assert "memory trim failed" not in d.log()
