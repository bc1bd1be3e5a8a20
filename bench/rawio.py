"""Raw file I/O: the reference the daemon's disk path is measured against.

A ``RawFile`` is one preallocated file written and read with the plainest parallel positional
I/O: each item is one ``pwrite``/``pread`` system call at its offset, the items shared out
evenly over ``threads`` threads, and a write batch ends with one ``fdatasync``. Buffers come
from ``aligned_buffer`` (anonymous memory, page aligned) so that ``O_DIRECT`` accepts them.

Thread-safety: one caller at a time; the threads are internal.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

Item = tuple[int, memoryview]  # (file offset, buffer)
_PAGE = 4096


def aligned_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of page-aligned memory, touched so no first fault lands in a timed I/O."""
    raw = np.full(nbytes + _PAGE, 0x5A, dtype=np.uint8)
    skip = -raw.ctypes.data % _PAGE
    return raw[skip : skip + nbytes].data


class RawFile:
    def __init__(self, path: Path, nbytes: int, threads: int, *, direct: bool = True) -> None:
        """Create ``path`` with ``nbytes`` preallocated (``posix_fallocate``: fresh unwritten
        extents, so the first write to them is a first fill). ``direct`` asks for
        ``O_DIRECT``; where the filesystem refuses it the file is opened buffered and
        ``self.direct`` says so."""
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self.direct = False
        fd = -1
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        self.fd = fd
        self.path = path
        self.nbytes = nbytes
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-io")

    def _spread(self, items: Sequence[Item], writing: bool) -> None:
        share = -(-len(items) // self.threads)

        def work(lo: int) -> None:
            for offset, buf in items[lo : lo + share]:
                done = 0
                while done < len(buf):
                    if writing:
                        n = os.pwrite(self.fd, buf[done:], offset + done)
                    else:
                        n = os.preadv(self.fd, [buf[done:]], offset + done)
                    if n <= 0:
                        raise OSError(errno.EIO, f"short {'write' if writing else 'read'}")
                    done += n

        list(self._pool.map(work, range(0, len(items), share)))

    def write(self, items: Sequence[Item]) -> None:
        """Write every item, then ``fdatasync`` once: durable when this returns."""
        self._spread(items, writing=True)
        os.fdatasync(self.fd)

    def read(self, items: Sequence[Item]) -> None:
        self._spread(items, writing=False)

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self.fd)

    def __enter__(self) -> RawFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def block_items(first_offset: int, block_bytes: int, buf: memoryview, count: int) -> list[Item]:
    """``count`` consecutive blocks of ``buf`` placed from ``first_offset``: one I/O each."""
    return [
        (first_offset + j * block_bytes, buf[j * block_bytes : (j + 1) * block_bytes])
        for j in range(count)
    ]


def split_items(offset: int, buf: memoryview, parts: int, align: int = 4096) -> list[Item]:
    """``buf`` written from ``offset`` as ``parts`` contiguous, aligned pieces: one I/O per
    thread, the fewest system calls that still use every thread."""
    n = len(buf)
    step = -(-n // parts)
    step = -(-step // align) * align
    return [(offset + lo, buf[lo : min(lo + step, n)]) for lo in range(0, n, step)]
