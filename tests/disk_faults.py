"""A disk-tier file backend with faults a test switches on (no patching of ``os``), and a full
disk (``fill_disk``)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from kvtier.tiers.disk import OsFiles


class FaultyFiles(OsFiles):
    """The disk tier's real system calls, with faults a test switches on by call name
    (``open``, ``preadv``, ``pwritev``, ``fdatasync``, ...): ``faults[name]`` is called with
    the call's arguments before the real call and may raise."""

    def __init__(self) -> None:
        self.faults: dict[str, Callable[..., None]] = {}

    def fail(self, name: str, errno_: int, times: int | None = None) -> None:
        """Make ``name`` raise ``errno_`` (the next ``times`` calls, or every call)."""
        left = [times]

        def fault(*_: object) -> None:
            if left[0] is not None:
                if left[0] <= 0:
                    return
                left[0] -= 1
            raise OSError(errno_, os.strerror(errno_))

        self.faults[name] = fault

    def clear(self) -> None:
        self.faults.clear()

    def _check(self, name: str, *args: object) -> None:
        fault = self.faults.get(name)
        if fault is not None:
            fault(*args)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._check("open", path, flags)
        return super().open(path, flags, mode)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        self._check("preadv", fd, offset)
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        self._check("pwritev", fd, offset)
        return super().pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        self._check("fdatasync", fd)
        super().fdatasync(fd)


def fill_disk(path: Path) -> None:
    """Write a file until the filesystem refuses another byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 4096, 512, 1):
            data = b"\xee" * chunk
            while True:
                try:
                    os.write(fd, data)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
