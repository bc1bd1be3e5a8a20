"""``madvise(2)`` over a mapping without Python's GIL, for the daemon's large mappings (the
L1 arena, engine pools).

CPython 3.11 holds the GIL through ``mmap.madvise`` and ``MAP_POPULATE``, so faulting in or
tearing down gigabytes that way stalls the event loop on another thread; a ctypes call lets
the GIL go. Each call also holds the process's address-space lock, so ranges go in steps of
``CHUNK``: other threads (the event loop's large allocations) may map memory in between.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

POPULATE_READ = 22  # Linux >= 5.14; not exported by the mmap module
POPULATE_WRITE = 23  # likewise
DONTNEED = mmap.MADV_DONTNEED
CHUNK = 8 << 20

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.madvise.restype = ctypes.c_int


def address(buffer: mmap.mmap) -> int:
    """Where ``buffer`` starts, without leaving an export of it alive (an export would make
    its ``close`` fail)."""
    view = np.frombuffer(buffer, dtype=np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


def advise(base: int, size: int, advice: int) -> int:
    """``madvise(advice)`` over ``[base, base + size)`` in steps of ``CHUNK``: 0, or the
    errno of the first step that failed (the steps after it are not tried)."""
    for start in range(0, size, CHUNK):
        if _LIBC.madvise(base + start, min(CHUNK, size - start), advice) != 0:
            return ctypes.get_errno()
    return 0
