"""The disk tier's data files: their layout, preallocation, the descriptors, and the system
calls that move bytes, behind an injectable backend.

The tier's slots are carved from the concatenation of ``data-NNNN.bin`` files, each a whole
number of segments. Every system call that touches a data file goes through a ``FileBackend``
(``OsFiles`` in production), so tests inject faults (EIO, ENOSPC, short transfers, O_DIRECT
refusals) by wrapping it, without patching ``os``.

Thread-safety: transfers and syncs may run on any threads; ``open``/``close`` and the
buffered fallback are serialised internally.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from kvtier.tiers.base import TierUnavailable

log = logging.getLogger("kvtier.tiers.disk")

ALIGN = 4096
DATA_GLOB = "data-[0-9][0-9][0-9][0-9].bin"
FILE_MODE = 0o600
# The file a tier holds an exclusive flock on while it has the directory open (one tier, one
# process, per directory). A check (``kvtierd --check-config``) takes it shared for a moment,
# to learn whether a tier holds it; a tier that finds only shared holders tries again
# (``probe_lock``).
LOCK_NAME = "lock"
# How long a tier opening a lock that only checks hold (``kvtierd --check-config``, each for a
# moment) keeps trying, and how often it tries: only checks run back to back for that long
# make the open fail.
PROBE_WAIT_S = 2.0
PROBE_RETRY_S = 0.01


def lock_exclusive(fd: int, path: Path) -> OSError | None:
    """Take an exclusive flock of ``fd`` (the lock file ``path``) for as long as it stays open,
    or the error that refused it. Refused at once while a tier holds it; while only checks
    hold it (``probe_lock``: shared, for a moment), tried again for up to ``PROBE_WAIT_S``."""
    give_up = time.monotonic() + PROBE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except OSError as e:
            refused = e
        if probe_lock(path) is not None or time.monotonic() > give_up:
            return refused
        time.sleep(PROBE_RETRY_S)


def probe_lock(path: Path) -> OSError | None:
    """Whether a tier holds the lock ``path`` now: the error of a shared, non-blocking flock
    of it (a tier's exclusive lock refuses it), or None (the lock is free, or held only by
    other probes; it was taken shared and let go at once). Never exclusive, so a tier opening
    the directory meanwhile is not refused because of a probe (it was: ``--check-config``
    took it exclusively for a moment). Raises OSError when ``path`` cannot be opened; it is
    never created. A link is not followed and a FIFO's open does not wait for a writer (an
    open that waited held the check, and SIGTERM could not end it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e
    finally:
        os.close(fd)  # closing lets go of the lock
    return None


def lock_holders(paths: Sequence[Path]) -> str:
    """The processes but this one that hold a POSIX lock (SQLite's kind) on any of ``paths``,
    as "pid 1234, sqlite3", from the kernel's list of locks (``/proc/locks``); "" where it
    lists none (their locks let go since, a process in another pid namespace, or no such
    list)."""
    ids = set()
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            ids.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    pids: list[int] = []
    for line in lines:
        # "1: POSIX  ADVISORY  WRITE 1234 08:02:131075 1073741824 1073741824"; a process
        # waiting for a lock has "->" before its kind.
        fields = line.split()
        if len(fields) < 6 or fields[1] != "POSIX":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            found = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if found in ids and pid > 0 and pid != os.getpid() and pid not in pids:
            pids.append(pid)
    named = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            command = "?"
        named.append(f"pid {pid}, {command}")
    return "; ".join(named)


class FileBackend(Protocol):
    """The system calls the tier makes on its data files."""

    def open(self, path: str, flags: int, mode: int = FILE_MODE) -> int: ...

    def close(self, fd: int) -> None: ...

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int: ...

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int: ...

    def fdatasync(self, fd: int) -> None: ...

    def fsync(self, fd: int) -> None: ...

    def fallocate(self, fd: int, offset: int, length: int) -> None: ...

    def ftruncate(self, fd: int, length: int) -> None: ...

    def size(self, fd: int) -> int: ...

    def same_file(self, fd: int, path: str) -> bool: ...


class OsFiles:
    """The real system calls."""

    def open(self, path: str, flags: int, mode: int = FILE_MODE) -> int:
        # Never through a link: one planted in the folder would have the tier preallocate
        # and write blocks into another file (ELOOP instead).
        return os.open(path, flags | os.O_NOFOLLOW, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def same_file(self, fd: int, path: str) -> bool:
        """Whether ``fd`` is still the file ``path`` names (not removed, not replaced)."""
        st = os.fstat(fd)
        if st.st_nlink == 0:
            return False
        try:
            named = os.stat(path)
        except FileNotFoundError:
            return False
        return (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def layout(directory: Path, capacity_bytes: int, file_bytes: int) -> list[tuple[Path, int]]:
    """The data files, and their sizes, that hold ``capacity_bytes``."""
    count = -(-capacity_bytes // file_bytes)
    return [
        (directory / f"data-{i:04d}.bin", min(file_bytes, capacity_bytes - i * file_bytes))
        for i in range(count)
    ]


def damage(files: list[tuple[Path, int]], backend: FileBackend) -> dict[int, str]:
    """Which data files cannot back the blocks an index names: file number -> the reason
    (``missing_file``, ``short_file`` or ``unreadable_file``)."""
    out: dict[int, str] = {}
    probe = bytearray(1)
    for i, (path, size) in enumerate(files):
        try:
            fd = backend.open(str(path), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            out[i] = "missing_file"
            continue
        except OSError:
            out[i] = "unreadable_file"
            continue
        try:
            if backend.size(fd) < size:
                out[i] = "short_file"
            else:
                backend.preadv(fd, [memoryview(probe)], size - 1)
        except OSError:
            out[i] = "unreadable_file"
        finally:
            with contextlib.suppress(OSError):
                backend.close(fd)
    return out


def transfer_all(
    call: Callable[[int, list[memoryview], int], int],
    fd: int,
    iovs: list[memoryview],
    offset: int,
) -> None:
    """``preadv``/``pwritev`` all of ``iovs`` at ``offset``, resuming after short transfers."""
    remaining = sum(len(v) for v in iovs)
    while remaining:
        n = call(fd, iovs, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"short transfer at offset {offset}: the file ends early")
        remaining -= n
        offset += n
        while n and iovs:
            if n >= len(iovs[0]):
                n -= len(iovs[0])
                iovs = iovs[1:]
            else:
                iovs = [iovs[0][n:], *iovs[1:]]
                n = 0


class SlotFiles:
    """The open data files of one tier."""

    def __init__(
        self, directory: Path, files: list[tuple[Path, int]], file_bytes: int, backend: FileBackend
    ) -> None:
        self.directory = directory
        self.paths = [p for p, _ in files]
        self.sizes = [s for _, s in files]
        self.file_bytes = file_bytes
        self.backend = backend
        self.fds: list[int] = []
        self._retired: list[int] = []
        self.direct = False
        self._lock = threading.Lock()

    def locate(self, offset: int) -> tuple[int, int]:
        """(file number, offset in it) of a byte offset of the tier."""
        return divmod(offset, self.file_bytes)

    def prepare(self, capacity_bytes: int) -> None:
        """Create and preallocate the data files; TierUnavailable when that fails (the tier
        checks the space first: ``tier.space_shortfall``)."""
        created: list[Path] = []
        path = self.paths[0]
        try:
            for path, size in zip(self.paths, self.sizes, strict=True):
                if not path.exists():
                    created.append(path)
                fd = self.backend.open(str(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
                try:
                    os.fchmod(fd, FILE_MODE)
                    if self.backend.size(fd) > size:
                        self.backend.ftruncate(fd, size)  # the geometry shrank
                    self.backend.fallocate(fd, 0, size)
                    self.backend.fsync(fd)
                finally:
                    self.backend.close(fd)
        except OSError as e:
            for p in created:
                with contextlib.suppress(OSError):
                    p.unlink()
            raise TierUnavailable(
                f"L2 directory {self.directory} cannot hold tiers.l2.capacity_bytes="
                f"{capacity_bytes}: preparing {path.name} failed: {e.strerror}"
            ) from None
        extra = sorted(set(self.directory.glob(DATA_GLOB)) - set(self.paths))
        for p in extra:
            log.info("L2: removing %s, beyond the configured capacity", p)
            p.unlink()
        if created or extra:
            fsync_dir(self.directory)

    def open(self, direct_io: bool) -> None:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        refusal = ""
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                for path in self.paths:
                    self.fds.append(self.backend.open(str(path), flags | os.O_DIRECT))
                probe = mmap.mmap(-1, ALIGN)
                try:
                    self.backend.preadv(self.fds[0], [memoryview(probe)], 0)
                finally:
                    probe.close()
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refusal = f"{e.strerror}"
                self._close(self.fds)
                self.fds = []
        elif direct_io:
            refusal = "O_DIRECT is not available on this platform"
        if not self.direct:
            self.fds = [self.backend.open(str(p), flags) for p in self.paths]
        if refusal:
            log.warning(
                "L2: the filesystem of %s refuses O_DIRECT (%s); using buffered I/O, which goes "
                "through the page cache",
                self.directory,
                refusal,
            )

    def transfer(self, writing: bool, file: int, iovs: list[memoryview], offset: int) -> None:
        call = self.backend.pwritev if writing else self.backend.preadv
        # Whether this transfer goes through an O_DIRECT descriptor, read before the
        # descriptor: another thread may switch to buffered I/O while it runs, and its refusal
        # is then one more of the same, not a fault.
        direct = self.direct
        try:
            transfer_all(call, self.fds[file], iovs, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            # Some filesystems accept O_DIRECT at open and refuse it at the first transfer.
            self.fall_back_to_buffered(e)
            transfer_all(call, self.fds[file], iovs, offset)

    def sync(self, file: int) -> OSError | None:
        """fdatasync ``file``; the error, or None when its writes are durable under its name
        (a file removed or replaced while open, by hand or a clean-up script, is synced to
        nowhere the next start would look: an error too)."""
        try:
            self.backend.fdatasync(self.fds[file])
            if not self.backend.same_file(self.fds[file], str(self.paths[file])):
                return OSError(
                    errno.ENOENT,
                    f"{self.paths[file].name} was removed or replaced while open: its blocks "
                    "would be lost at the next start",
                )
        except OSError as e:
            return e
        return None

    def fall_back_to_buffered(self, exc: OSError) -> None:
        with self._lock:
            if not self.direct:
                return
            flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
            fds = [self.backend.open(str(p), flags) for p in self.paths]
            # In-flight transfers may still use the old descriptors; close them at close().
            self._retired.extend(self.fds)
            self.fds = fds
            self.direct = False
        log.warning(
            "L2: the filesystem of %s refused an O_DIRECT transfer (%s); switched to buffered I/O",
            self.directory,
            exc.strerror,
        )

    def close(self) -> None:
        with self._lock:
            self._close(self.fds + self._retired)
            self.fds, self._retired = [], []

    def _close(self, fds: list[int]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                self.backend.close(fd)
