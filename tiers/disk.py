"""L2: the disk tier. Block slots in preallocated files, a crash-safe SQLite index, checksums.

Layout of the tier's directory::

    lock                  flock()ed while a DiskTier has the directory open
    data-0000.bin ...     preallocated data files; each holds a whole number of segments
    index.sqlite3         (+ -wal, -shm) the index: (ns, key) -> slot, nbytes, checksum, written_at

Slots come from a SlabAllocator over the concatenated data files: a slot is one contiguous,
4 KiB-aligned extent of one file, so a block moves with one aligned ``O_DIRECT`` transfer, and
adjacent slots of a batch move with one vectored ``preadv``/``pwritev``.

Invariants:
- A block's index row is committed only after its bytes are durable (``fdatasync`` of the data
  file returned). A crash at any moment therefore loses at most blocks still in flight and
  never makes a row point at a half-written slot. ``commit`` enforces the order: it accepts a
  slot only if this tier made a write to it durable and nothing has been committed or removed
  there since.
- A slot is given back to the allocator only after the deletion of its row is durable, and a
  slot rewritten in place loses its row (durably) before the new bytes go down, so no crash
  can leave a row over bytes it does not describe.
- Every read is verified against the checksum (xxh3-64 of the block's ``nbytes`` bytes) that
  was computed from the source buffer when the block was written. A block that fails (checksum
  mismatch or I/O error) is a miss: its row is deleted, its slot is quarantined (held, never
  handed out again, also across restarts), and the event is counted and logged with the key.
- I/O faults never raise out of ``write``/``read``/``commit``/``remove``: they are results,
  counters and the tier's state. ENOSPC and EIO put the tier in a degraded state in which it
  refuses writes and keeps serving reads. Exceptions are kept for programming errors (a slot
  that is not allocated, a buffer that is too short, a commit without a durable write).
- At open, an index that SQLite cannot read or that fails ``quick_check``, or data files that
  are missing or shorter than the index needs, are logged at ERROR and the index is moved
  aside (renamed with a timestamp suffix); the tier then starts empty rather than serving data
  it cannot vouch for. Another segment or file size also starts empty (WARNING); another
  capacity keeps the blocks that still fit.

The data path is POSIX ``preadv``/``pwritev`` on host memory (L1 slots). kvikio is not used:
its gain is GPUDirect Storage for device buffers, which belongs to an L0<->L2 path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeAlias

import numpy as np
import xxhash

from kvtier.tiers.base import TierKind, TierUnavailable
from kvtier.tiers.slab import SlabAllocator, SlabStats

log = logging.getLogger(__name__)

BytesLike: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap | np.ndarray"
"""Anything that ``memoryview()`` accepts as one C-contiguous run of bytes."""

CHECKSUM_NAME = "xxh3_64"
FORMAT_VERSION = 1
INDEX_NAME = "index.sqlite3"
LOCK_NAME = "lock"
LAYOUT_CHANGED = "was made for another layout"
DEFAULT_FILE_BYTES = 4 << 30
MAX_FILES = 256

_ALIGN = 4096
# Coalesced runs stop growing here, and a batch is spread over all I/O threads. Writes hash
# in the calling thread alongside the I/O, so they take long runs; reads are verified run by
# run as they land, so shorter runs keep verification overlapped with the reads still going.
_MAX_WRITE_RUN_BYTES = 32 << 20
_MAX_READ_RUN_BYTES = 8 << 20
# Each block takes at most two iovecs (data, padding); stay under IOV_MAX (1024 on Linux).
_MAX_RUN_BLOCKS = 500
# Runs are at least this long when the slots allow: tiny transfers gain nothing from threads.
_MIN_RUN_BYTES = 256 << 10
_LOGGED_FAILURES = 16
# A batch smaller than this runs in the calling thread: a hand-off to the pool costs more.
_INLINE_BYTES = 1 << 20
_ZEROS = bytes(_ALIGN)
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
# SQLite primary result codes (the sqlite3 module exports them from Python 3.11 on).
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_NOTADB = 26

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blocks (
    ns INTEGER NOT NULL,
    key BLOB NOT NULL,
    slot INTEGER NOT NULL UNIQUE,
    nbytes INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    written_at REAL NOT NULL,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS quarantine (
    slot INTEGER PRIMARY KEY,
    nbytes INTEGER NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
"""


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum the tier stores and verifies: xxh3-64 of the bytes, as an unsigned int."""
    return int(xxhash.xxh3_64_intdigest(data))


# ---------------------------------------------------------------------------------- items


class WriteItem(NamedTuple):
    """Write ``data[:nbytes]`` into ``slot``. ``data`` must stay unchanged until ``write``
    returns. A page-aligned buffer of at least the slot's size (``allocator.slot_bytes_for``),
    such as an L1 slot view, goes straight to the disk; anything else is staged."""

    slot: int
    data: BytesLike
    nbytes: int


class PersistItem(NamedTuple):
    """Write ``data[:nbytes]`` into ``slot`` and commit it as block ``(ns, key)``."""

    ns: int
    key: bytes
    slot: int
    data: BytesLike
    nbytes: int


class CommitEntry(NamedTuple):
    """Make the durable write to ``slot`` visible as block ``(ns, key)``."""

    ns: int
    key: bytes
    slot: int


class ReadItem(NamedTuple):
    """Read ``nbytes`` of ``slot`` into ``out`` and verify them against ``checksum``.
    ``key`` is only used to name the block in logs. ``out`` may be written beyond ``nbytes``
    up to the slot's size when it is that long (the zero-copy path)."""

    slot: int
    out: BytesLike
    nbytes: int
    checksum: int
    key: bytes


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """``ok``: the block's bytes are durable (``write``) or committed (``persist``).
    ``checksum`` is valid only when ``ok``."""

    slot: int
    ok: bool
    checksum: int


@dataclass(frozen=True, slots=True)
class RecoveredBlock:
    ns: int
    key: bytes
    slot: int
    nbytes: int
    checksum: int
    written_at: float


# ------------------------------------------------------------------------------ internals


class _SharedSlab(SlabAllocator):
    """The tier's allocator, safe to share between the store's thread, which allocates, and
    the worker thread in which ``DiskTier.remove`` gives slots back.

    ``free`` is refused: an L2 slot must lose its index row (durably) before it is reused,
    which only ``DiskTier.remove`` does.
    """

    def __init__(self, capacity_bytes: int, segment_bytes: int) -> None:
        super().__init__(capacity_bytes, segment_bytes, _ALIGN)
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int | None:
        with self._lock:
            return super().allocate(nbytes)

    def can_allocate(self, nbytes: int) -> bool:
        with self._lock:
            return super().can_allocate(nbytes)

    def claim(self, slot: int, nbytes: int) -> None:
        with self._lock:
            super().claim(slot, nbytes)

    def stats(self) -> SlabStats:
        with self._lock:
            return super().stats()

    def is_allocated(self, slot: int) -> bool:
        with self._lock:
            return super().is_allocated(slot)

    def free(self, slot: int) -> None:
        raise TypeError(
            f"L2 slot {slot}: free disk slots with DiskTier.remove(), which deletes their "
            "index rows before the slots can be reused"
        )

    def release(self, slot: int) -> None:
        with self._lock:
            super().free(slot)


@dataclass(slots=True)
class _Block:
    pos: int  # index in the caller's batch
    slot: int
    file: int
    offset: int  # in its file
    nbytes: int
    padded: int
    buf: memoryview  # the caller's buffer, as bytes
    direct: bool  # buf itself can be handed to the kernel (aligned, long enough)
    expected: int = 0  # reads: the checksum to verify against
    key: bytes = b""
    staged: bool = False  # moved through the bounce buffer
    checksum: int = 0
    ok: bool = False
    error: str = ""


@dataclass(slots=True)
class _Run:
    """Blocks that lie back to back in one file: one vectored system call."""

    file: int
    offset: int
    blocks: list[_Block] = field(default_factory=list)
    nbytes: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class _Fault(NamedTuple):
    kind: str  # "enospc", "eio", "corrupt" or "io"
    detail: str


def _classify(exc: BaseException) -> _Fault:
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return _Fault("enospc", f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc}")
        if exc.errno == errno.EIO:
            return _Fault("eio", f"EIO: {exc}")
        return _Fault("io", f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc}")
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        name = getattr(exc, "sqlite_errorname", type(exc).__name__)
        if code == _SQLITE_FULL:
            return _Fault("enospc", f"index: {name}: {exc}")
        if code == _SQLITE_IOERR:
            return _Fault("eio", f"index: {name}: {exc}")
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return _Fault("corrupt", f"index: {name}: {exc}")
        return _Fault("io", f"index: {name}: {exc}")
    return _Fault("io", f"{type(exc).__name__}: {exc}")


def _as_bytes(data: BytesLike) -> memoryview:
    mv = memoryview(data)  # type: ignore[arg-type]
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def _to_i64(value: int) -> int:
    return value - _U64 if value > _I64_MAX else value


def _from_i64(value: int) -> int:
    return value + _U64 if value < 0 else value


def _transfer_all(
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


# ---------------------------------------------------------------------------------- tier


class DiskTier:
    """The L2 tier: block slots in files on a local disk, and their durable index.

    Thread-safety: ``write``, ``commit``, ``persist``, ``read``, ``remove``, ``stats`` and
    ``state`` may be called concurrently from any threads, and ``allocator`` may be used from
    any thread, provided two calls in flight never name the same slot (the store's in-flight
    marks guarantee this). Index updates are serialised internally; data transfers run in
    parallel on ``io_threads`` worker threads. The constructor, ``recover`` and ``close`` must
    not overlap any other call. Every data method blocks: call it from a worker thread, never
    from an event loop.

    Ordering: when ``write`` returns ok for a slot, its bytes are durable; when ``commit``
    (or ``persist``) returns True, the rows are durable and survive SIGKILL and power loss;
    when ``remove`` returns True, the rows are durably gone and only then are the slots free.
    """

    kind = TierKind.DISK

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        segment_bytes: int,
        *,
        io_threads: int = 4,
        file_bytes: int | None = None,
        direct_io: bool = True,
        enospc_retry_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Open (or create) the tier in ``directory`` and recover its index.

        ``file_bytes``: size of each data file (rounded up to whole segments; default
        ``DEFAULT_FILE_BYTES``, and never more than ``MAX_FILES`` files). ``direct_io=False``
        forces buffered I/O. ``enospc_retry_s``: while degraded by a full disk, one write batch
        per this many seconds is let through to find out whether space came back; EIO and
        other faults degrade the tier until it is reopened. ``clock`` gives ``written_at``.

        Raises TierUnavailable when the directory cannot hold the capacity or is in use by
        another DiskTier, ValueError for a bad geometry.
        """
        if io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, not {io_threads}")
        started = time.monotonic()
        self.directory = Path(directory)
        self.allocator = _SharedSlab(capacity_bytes, segment_bytes)
        self.io_threads = io_threads
        self._clock = clock
        self._enospc_retry_s = enospc_retry_s
        self._file_bytes = self._choose_file_bytes(file_bytes)
        layout = self._layout(self.allocator.capacity_bytes)
        n_files = len(layout)
        self._paths = [path for path, _ in layout]
        self._file_sizes = [size for _, size in layout]

        self._state_lock = threading.Lock()  # degraded state, counters, quarantine, durable
        self._db_lock = threading.Lock()  # the SQLite connection
        self._counters: Counter[str] = Counter()
        self._degraded: _Fault | None = None
        self._next_probe = 0.0
        self._quarantined: dict[int, int] = {}  # slot -> nbytes
        # Slots whose last write is durable and not committed yet: slot -> (nbytes, checksum).
        self._durable: dict[int, tuple[int, int]] = {}
        self._recovered: list[RecoveredBlock] = []
        self._fds: list[int] = []
        self._retired_fds: list[int] = []
        self._direct = direct_io
        self._local = threading.local()
        self._closed = False
        self._lock_fd = -1
        self._db: sqlite3.Connection | None = None
        self._executor: ThreadPoolExecutor | None = None

        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._lock_directory()
            self._db = self._open_index()
            self._prepare_files()
            self._open_files(direct_io)
            self._recover_index()
        except BaseException:
            self._release_resources()
            raise
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="l2-io")
        log.info(
            "L2 disk tier in %s: %d MiB in %d file(s), %d segments of %d MiB, %s I/O, "
            "%d threads; recovered %d blocks (%d MiB) in %.2fs",
            self.directory,
            self.allocator.capacity_bytes >> 20,
            n_files,
            self.allocator.num_segments,
            segment_bytes >> 20,
            "O_DIRECT" if self._direct else "buffered",
            io_threads,
            len(self._recovered),
            self.allocator.used_bytes >> 20,
            time.monotonic() - started,
        )

    # ------------------------------------------------------------------ public API

    def recover(self) -> list[RecoveredBlock]:
        """The blocks found in the index at open, whose slots are already claimed in
        ``allocator``. Every other slot is free (slots without a row are reclaimed). The list
        is handed over once; later calls return an empty list."""
        blocks, self._recovered = self._recovered, []
        return blocks

    def write(self, items: Sequence[WriteItem]) -> list[WriteOutcome]:
        """Write blocks into their (allocated) slots and make them durable.

        Returns one outcome per item, in order; ``ok`` means the bytes are on disk (data file
        ``fdatasync``ed) and ``checksum`` is what ``read`` will verify. The blocks are not in
        the index until ``commit``. A failed item's slot stays allocated: give it back with
        ``remove``. While the tier is degraded every item fails without any I/O.
        """
        self._check_open()
        blocks = [
            self._block(i, item.slot, item.data, item.nbytes, True) for i, item in enumerate(items)
        ]
        self._check_distinct(blocks)
        if not blocks:
            return []
        if not self._admit_writes():
            self._count(writes_refused_degraded=len(blocks))
            return [WriteOutcome(b.slot, False, 0) for b in blocks]
        live = [b for b in blocks if not self._is_quarantined(b.slot)]
        self._count(writes_refused_quarantined=len(blocks) - len(live))
        if not self._drop_rows_before_overwrite([b.slot for b in live]):
            return [WriteOutcome(b.slot, False, 0) for b in blocks]
        # The checksums are taken from the caller's buffers in this thread while the I/O
        # threads write those same (unchanging) buffers, so hashing costs no wall time.
        self._execute(
            self._plan(live, _MAX_WRITE_RUN_BYTES),
            self._write_run,
            lambda: self._checksum_sources(live),
        )
        self._sync([b for b in live if b.ok])
        ok = [b for b in live if b.ok]
        with self._state_lock:
            for b in ok:
                self._durable[b.slot] = (b.nbytes, b.checksum)
        self._count(
            blocks_written=len(ok),
            bytes_written=sum(b.nbytes for b in ok),
            write_failures=len(blocks) - len(ok),
        )
        return [WriteOutcome(b.slot, b.ok, b.checksum if b.ok else 0) for b in blocks]

    def _drop_rows_before_overwrite(self, slots: list[int]) -> bool:
        """Durably delete the rows of committed blocks in ``slots`` (a slot rewritten without
        ``remove``): a crash while the new bytes go down must not leave the old row over them.
        False when the index could not be updated."""
        if not slots:
            return True
        try:
            stale: list[int] = []
            with self._db_lock:
                assert self._db is not None
                for start in range(0, len(slots), 500):
                    chunk = slots[start : start + 500]
                    marks = ",".join("?" * len(chunk))
                    query = f"SELECT slot FROM blocks WHERE slot IN ({marks})"
                    stale += [row[0] for row in self._db.execute(query, chunk)]
            if stale:
                with self._transaction() as db:
                    db.executemany("DELETE FROM blocks WHERE slot = ?", [(s,) for s in stale])
                self._count(overwritten_blocks=len(stale))
        except sqlite3.Error as e:
            self._fault(_classify(e), "index delete")
            self._count(write_failures=len(slots))
            return False
        return True

    def commit(self, entries: Sequence[CommitEntry]) -> bool:
        """Insert index rows for durably written slots, in one transaction.

        True means the rows are durable. False (index I/O fault, tier degraded by EIO) means
        none was inserted; the slots stay allocated and their bytes stay durable, so the call
        may be repeated, or the slots given back with ``remove``.

        Raises ValueError when an entry's slot has no durable write awaiting commit: that
        would make a row whose bytes nobody vouched for.
        """
        self._check_open()
        if not entries:
            return True
        now = self._clock()
        rows = []
        with self._state_lock:
            for ns, key, slot in entries:
                written = self._durable.get(slot)
                if written is None:
                    raise ValueError(
                        f"L2 slot {slot} has no durable write awaiting commit "
                        f"(key {bytes(key).hex()})"
                    )
                rows.append((ns, bytes(key), slot, written[0], _to_i64(written[1]), now))
            if self._degraded is not None and self._degraded.kind != "enospc":
                self._counters["commits_refused_degraded"] += 1
                return False
        try:
            with self._transaction() as db:
                db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?, ?)", rows)
        except sqlite3.Error as e:
            self._fault(_classify(e), "index commit")
            return False
        with self._state_lock:
            for row in rows:
                self._durable.pop(row[2], None)
            self._counters["commits"] += 1
            self._counters["committed_blocks"] += len(rows)
            if self._degraded is not None and self._degraded.kind == "enospc":
                self._degraded = None
                log.warning("L2 tier admits writes again: an index commit succeeded")
        return True

    def persist(self, items: Sequence[PersistItem]) -> list[WriteOutcome]:
        """``write`` then ``commit`` of the blocks written: ``ok`` means the block is durable
        and in the index (it will be served after a crash or restart). Failed items keep their
        slots allocated; give them back with ``remove``."""
        outcomes = self.write([WriteItem(it.slot, it.data, it.nbytes) for it in items])
        done = [
            CommitEntry(it.ns, it.key, it.slot)
            for it, out in zip(items, outcomes, strict=True)
            if out.ok
        ]
        if not done or self.commit(done):
            return outcomes
        return [WriteOutcome(o.slot, False, 0) for o in outcomes]

    def read(self, items: Sequence[ReadItem]) -> list[bool]:
        """Read blocks into ``out`` buffers and verify each against its checksum.

        Returns one bool per item. True: ``out[:nbytes]`` holds exactly the bytes written.
        False (checksum mismatch, I/O error, quarantined slot): a miss. The content of ``out``
        is then unspecified and must not be used or copied anywhere (the tier zero-fills what
        it wrote there, best effort); the block's row is deleted and its slot quarantined, so
        the caller drops its L2 copy (``remove`` of the slot is allowed and changes nothing).
        Reads are served while the tier is degraded.
        """
        self._check_open()
        blocks = [
            self._block(i, it.slot, it.out, it.nbytes, False, it.checksum, it.key)
            for i, it in enumerate(items)
        ]
        self._check_distinct(blocks)
        live = []
        for b in blocks:
            if self._is_quarantined(b.slot):
                b.error = "slot is quarantined"
            else:
                live.append(b)
        self._count(reads_refused_quarantined=len(blocks) - len(live))
        self._execute_reads(self._plan(live, _MAX_READ_RUN_BYTES))
        ok = [b for b in live if b.ok]
        failed = [b for b in live if not b.ok]
        self._count(
            blocks_read=len(ok), bytes_read=sum(b.nbytes for b in ok), read_failures=len(failed)
        )
        if failed:
            self._quarantine(failed)
        return [b.ok for b in blocks]

    def remove(self, slots: Iterable[int]) -> bool:
        """Delete the index rows of these slots (one transaction) and free the slots.

        Works for committed blocks and for slots whose write or commit failed. Quarantined
        slots lose their row but stay held. Returns False when the index could not be
        updated: then nothing was freed and the rows may still exist.
        """
        self._check_open()
        slots = [int(s) for s in slots]
        if not slots:
            return True
        try:
            with self._transaction() as db:
                db.executemany("DELETE FROM blocks WHERE slot = ?", [(s,) for s in slots])
        except sqlite3.Error as e:
            self._fault(_classify(e), "index delete")
            self._count(remove_failures=len(slots))
            return False
        freed = 0
        with self._state_lock:
            for slot in slots:
                self._durable.pop(slot, None)
                if slot in self._quarantined:
                    continue
                self.allocator.release(slot)
                freed += 1
            self._counters["removed_slots"] += freed
        return True

    def release_quarantined(self) -> int:
        """Return every quarantined slot to service (an operator's decision, e.g. after the
        disk was checked). Returns how many were released."""
        self._check_open()
        with self._state_lock:
            slots = list(self._quarantined)
        if not slots:
            return 0
        try:
            with self._transaction() as db:
                db.executemany("DELETE FROM quarantine WHERE slot = ?", [(s,) for s in slots])
        except sqlite3.Error as e:
            self._fault(_classify(e), "index update")
            return 0
        with self._state_lock:
            for slot in slots:
                del self._quarantined[slot]
                self.allocator.release(slot)
        log.warning("L2 tier: %d quarantined slots returned to service", len(slots))
        return len(slots)

    def slot_location(self, slot: int) -> tuple[Path, int]:
        """The data file holding an allocated slot, and the slot's byte offset in it."""
        file, offset = divmod(self.allocator.offset(slot), self._file_bytes)
        return self._paths[file], offset

    def state(self) -> str:
        fault = self._degraded
        return "ok" if fault is None else f"degraded: {fault.kind}: {fault.detail}"

    @property
    def direct_io(self) -> bool:
        return self._direct

    def stats(self) -> dict[str, int | float | str]:
        """A snapshot of counters and gauges. Counters only grow."""
        slab = self.allocator.stats()
        with self._state_lock:
            counters = dict(self._counters)
            quarantined = len(self._quarantined)
            quarantined_bytes = sum(
                self.allocator.slot_bytes_for(n) for n in self._quarantined.values()
            )
            pending = len(self._durable)
            degraded = self._degraded
        out: dict[str, int | float | str] = {
            name: 0
            for name in (
                "blocks_written",
                "bytes_written",
                "write_failures",
                "writes_refused_degraded",
                "writes_refused_quarantined",
                "blocks_read",
                "bytes_read",
                "read_failures",
                "reads_refused_quarantined",
                "checksum_failures",
                "io_errors",
                "enospc",
                "index_errors",
                "commits",
                "committed_blocks",
                "commits_refused_degraded",
                "removed_slots",
                "remove_failures",
                "overwritten_blocks",
                "read_calls",
                "write_calls",
                "bounced_blocks",
                "syncs",
                "recovered_blocks",
                "recovery_dropped_rows",
            )
        }
        out.update(counters)
        out.update(
            io_mode="o_direct" if self._direct else "buffered",
            o_direct=int(self._direct),
            checksum=CHECKSUM_NAME,
            state="ok" if degraded is None else "degraded",
            degraded=int(degraded is not None),
            capacity_bytes=slab.capacity_bytes,
            used_bytes=slab.used_bytes,
            used_slots=slab.used_slots,
            free_segments=slab.free_segments,
            quarantined_slots=quarantined,
            quarantined_bytes=quarantined_bytes,
            uncommitted_slots=pending,
            files=len(self._paths),
        )
        return out

    def close(self) -> None:
        """Wait for running transfers, then close files and index. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release_resources()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- opening and recovery

    def _choose_file_bytes(self, file_bytes: int | None) -> int:
        seg = self.allocator.segment_bytes
        want = DEFAULT_FILE_BYTES if file_bytes is None else file_bytes
        if want <= 0:
            raise ValueError(f"file_bytes must be positive, not {want}")
        want = max(want, -(-self.allocator.capacity_bytes // MAX_FILES))
        return -(-want // seg) * seg

    def _lock_directory(self) -> None:
        self._lock_fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            raise TierUnavailable(
                f"L2 directory {self.directory} is in use by another process or DiskTier "
                f"({e.strerror})"
            ) from None

    def _layout(self, capacity_bytes: int) -> list[tuple[Path, int]]:
        """The data files, and their sizes, that hold ``capacity_bytes``."""
        count = -(-capacity_bytes // self._file_bytes)
        return [
            (
                self.directory / f"data-{i:04d}.bin",
                min(self._file_bytes, capacity_bytes - i * self._file_bytes),
            )
            for i in range(count)
        ]

    def _geometry(self) -> dict[str, str]:
        return {
            "format_version": str(FORMAT_VERSION),
            "checksum": CHECKSUM_NAME,
            "capacity_bytes": str(self.allocator.capacity_bytes),
            "segment_bytes": str(self.allocator.segment_bytes),
            "file_bytes": str(self._file_bytes),
        }

    def _open_index(self) -> sqlite3.Connection:
        """The index connection. A corrupt index, one made for another layout (segment or file
        size, format, checksum), or one whose data files are gone is moved aside and replaced
        by an empty one; a changed capacity alone keeps the blocks that still fit."""
        path = self.directory / INDEX_NAME
        existed = path.exists()
        problem = ""
        if existed:
            db = None
            try:
                db = self._connect(path)
                check = db.execute("PRAGMA quick_check").fetchall()
                if check != [("ok",)]:
                    problem = "fails its integrity check: " + "; ".join(
                        str(r[0]) for r in check[:3]
                    )
                else:
                    db.executescript(_SCHEMA)
                    meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
                    want = self._geometry()
                    # Slot ids and offsets depend on everything but the capacity, so a
                    # capacity change keeps the blocks that still fit.
                    changed = [
                        f"{k} {meta.get(k)} -> {v}"
                        for k, v in want.items()
                        if meta.get(k) != v and k != "capacity_bytes"
                    ]
                    if not meta:
                        # The schema and meta are written and synced when an index is
                        # created, so an index without them lost its content.
                        problem = "is empty or truncated (no metadata)"
                    elif changed:
                        log.warning(
                            "L2 index in %s was made for another layout (%s); starting empty",
                            self.directory,
                            ", ".join(changed),
                        )
                        problem = LAYOUT_CHANGED
                    elif not meta.get("capacity_bytes", "").isdigit():
                        problem = "has damaged metadata"
                    else:
                        old_capacity = int(meta["capacity_bytes"])
                        short = self._short_data_files(self._layout(old_capacity))
                        if short and self._index_has_rows(db):
                            problem = short
                        elif old_capacity != self.allocator.capacity_bytes:
                            log.warning(
                                "L2 capacity changes from %d to %d bytes; blocks beyond the "
                                "new capacity are dropped",
                                old_capacity,
                                self.allocator.capacity_bytes,
                            )
                            self._write_meta(db)
                    if not problem:
                        return db
            except sqlite3.Error as e:
                problem = f"cannot be read ({_classify(e).detail})"
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            self._move_aside(path, problem)
        db = self._connect(path)
        db.executescript(_SCHEMA)
        self._write_meta(db)
        _fsync_dir(self.directory)
        return db

    def _connect(self, path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot switch the index to WAL mode (got {mode})")
        # FULL: in WAL mode NORMAL does not sync the WAL at commit, so a commit reported as
        # durable could roll back on power loss. FULL syncs the WAL on every commit; batches
        # amortise that one sync over many blocks.
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA journal_size_limit=67108864")
        return db

    def _write_meta(self, db: sqlite3.Connection) -> None:
        db.execute("BEGIN IMMEDIATE")
        db.execute("DELETE FROM meta")
        db.executemany("INSERT INTO meta VALUES (?, ?)", list(self._geometry().items()))
        db.execute("COMMIT")

    @staticmethod
    def _index_has_rows(db: sqlite3.Connection) -> bool:
        return (
            db.execute("SELECT EXISTS (SELECT 1 FROM blocks)").fetchone()[0]
            or db.execute("SELECT EXISTS (SELECT 1 FROM quarantine)").fetchone()[0]
        )

    @staticmethod
    def _short_data_files(layout: list[tuple[Path, int]]) -> str:
        """Why the data files cannot back the index, or '' when they can."""
        for path, size in layout:
            try:
                have = path.stat().st_size
            except FileNotFoundError:
                return f"names blocks in data file {path.name}, which is missing"
            if have < size:
                return (
                    f"names blocks in data file {path.name}, which has {have} bytes "
                    f"instead of {size}"
                )
        return ""

    def _move_aside(self, path: Path, problem: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self._clock()))
        word = "old" if problem == LAYOUT_CHANGED else "corrupt"
        suffix = f".{word}-{stamp}"
        n = 1
        while path.with_name(path.name + suffix).exists():
            n += 1
            suffix = f".{word}-{stamp}-{n}"
        for name in (path.name, path.name + "-wal", path.name + "-shm"):
            src = path.with_name(name)
            if src.exists():
                src.rename(src.with_name(name + suffix))
        if problem != LAYOUT_CHANGED:
            log.error(
                "L2 index %s %s; moved aside as %s%s and starting EMPTY: no block it named "
                "will be served",
                path,
                problem,
                path.name,
                suffix,
            )
        _fsync_dir(self.directory)

    def _prepare_files(self) -> None:
        """Create and preallocate the data files; TierUnavailable when they do not fit."""
        missing = 0
        for path, size in zip(self._paths, self._file_sizes, strict=True):
            try:
                missing += max(0, size - path.stat().st_blocks * 512)
            except FileNotFoundError:
                missing += size
        vfs = os.statvfs(self.directory)
        free = vfs.f_bavail * vfs.f_frsize
        if missing > free:
            raise TierUnavailable(
                f"L2 directory {self.directory} cannot hold l2.capacity_bytes="
                f"{self.allocator.capacity_bytes}: it needs {missing >> 20} MiB more and the "
                f"filesystem has {free >> 20} MiB free"
            )
        created: list[Path] = []
        try:
            for path, size in zip(self._paths, self._file_sizes, strict=True):
                if not path.exists():
                    created.append(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    if os.fstat(fd).st_size > size:
                        os.ftruncate(fd, size)  # the geometry shrank
                    os.posix_fallocate(fd, 0, size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            for path in created:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise TierUnavailable(
                f"L2 directory {self.directory} cannot hold l2.capacity_bytes="
                f"{self.allocator.capacity_bytes}: preallocating {path.name} failed: "
                f"{e.strerror}"
            ) from None
        extra = sorted(set(self.directory.glob("data-[0-9][0-9][0-9][0-9].bin")) - set(self._paths))
        for path in extra:
            log.info("L2: removing %s, beyond the configured capacity", path)
            path.unlink()
        if created or extra:
            _fsync_dir(self.directory)

    def _open_files(self, direct_io: bool) -> None:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        refusal = ""
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                for path in self._paths:
                    self._fds.append(os.open(path, flags | os.O_DIRECT))
                probe = mmap.mmap(-1, _ALIGN)
                try:
                    os.preadv(self._fds[0], [probe], 0)
                finally:
                    probe.close()
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refusal = f"{e.strerror}"
                self._close_fds()
        elif direct_io:
            refusal = "O_DIRECT is not available on this platform"
        if refusal or not direct_io:
            self._fds = [os.open(p, flags) for p in self._paths]
            self._direct = False
        if refusal:
            log.warning(
                "L2: the filesystem of %s refuses O_DIRECT (%s); using buffered I/O, which goes "
                "through the page cache",
                self.directory,
                refusal,
            )

    def _recover_index(self) -> None:
        assert self._db is not None
        started = time.monotonic()
        drop_rows: list[tuple[int]] = []
        drop_quarantine: list[tuple[int]] = []
        for slot, nbytes in self._db.execute(
            "SELECT slot, nbytes FROM quarantine ORDER BY slot"
        ).fetchall():
            if self._claim(slot, nbytes):
                self._quarantined[slot] = nbytes
            else:
                drop_quarantine.append((slot,))
        blocks: list[RecoveredBlock] = []
        cursor = self._db.execute(
            "SELECT ns, key, slot, nbytes, checksum, written_at FROM blocks ORDER BY slot"
        )
        for ns, key, slot, nbytes, csum, written_at in cursor:
            if slot in self._quarantined or not self._claim(slot, nbytes):
                drop_rows.append((slot,))
                continue
            blocks.append(
                RecoveredBlock(ns, bytes(key), slot, nbytes, _from_i64(csum), float(written_at))
            )
        if drop_rows or drop_quarantine:
            log.warning(
                "L2 index had %d rows whose slots do not fit the tier (or are quarantined); "
                "dropped them",
                len(drop_rows) + len(drop_quarantine),
            )
            with self._transaction() as db:
                db.executemany("DELETE FROM blocks WHERE slot = ?", drop_rows)
                db.executemany("DELETE FROM quarantine WHERE slot = ?", drop_quarantine)
        self._recovered = blocks
        self._counters["recovered_blocks"] = len(blocks)
        self._counters["recovery_dropped_rows"] = len(drop_rows) + len(drop_quarantine)
        log.debug("L2 recovery read %d rows in %.3fs", len(blocks), time.monotonic() - started)

    def _claim(self, slot: int, nbytes: int) -> bool:
        if not isinstance(slot, int) or not isinstance(nbytes, int):
            return False
        if slot < 0 or not self.allocator.fits(nbytes):
            return False
        try:
            self.allocator.claim(slot, nbytes)
        except ValueError:
            return False
        return True

    # --------------------------------------------------------------------- I/O engine

    def _block(
        self,
        pos: int,
        slot: int,
        data: BytesLike,
        nbytes: int,
        writing: bool,
        expected: int = 0,
        key: bytes = b"",
    ) -> _Block:
        slot = int(slot)
        nbytes = int(nbytes)
        padded = self.allocator.slot_bytes_for(nbytes)
        if (
            nbytes <= 0
            or not self.allocator.is_allocated(slot)
            or self.allocator.slot_size(slot) != padded
        ):
            raise ValueError(
                f"L2 slot {slot} is not an allocated slot for a block of {nbytes} bytes"
            )
        buf = _as_bytes(data)
        if len(buf) < nbytes:
            raise ValueError(f"buffer of {len(buf)} bytes is shorter than the block ({nbytes})")
        if not writing and buf.readonly:
            raise ValueError("read buffer is read-only")
        direct = len(buf) >= padded and _address(buf) % _ALIGN == 0
        file, offset = divmod(self.allocator.offset(slot), self._file_bytes)
        return _Block(pos, slot, file, offset, nbytes, padded, buf, direct, expected, key)

    @staticmethod
    def _check_distinct(blocks: list[_Block]) -> None:
        if len({b.slot for b in blocks}) != len(blocks):
            raise ValueError("a batch names the same L2 slot twice")

    def _plan(self, blocks: list[_Block], max_run_bytes: int) -> list[_Run]:
        """Coalesce back-to-back slots into runs, sized so a batch spreads over the threads."""
        if not blocks:
            return []
        total = sum(b.padded for b in blocks)
        target = max(_MIN_RUN_BYTES, min(max_run_bytes, -(-total // self.io_threads)))
        runs: list[_Run] = []
        run: _Run | None = None
        for b in sorted(blocks, key=lambda b: (b.file, b.offset)):
            if (
                run is None
                or b.file != run.file
                or b.offset != run.end
                or run.nbytes + b.padded > target
                or len(run.blocks) >= _MAX_RUN_BLOCKS
            ):
                run = _Run(b.file, b.offset)
                runs.append(run)
            run.blocks.append(b)
            run.nbytes += b.padded
        return runs

    def _execute(
        self,
        runs: list[_Run],
        work: Callable[[_Run], None],
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Run ``work`` on every run, in parallel on the I/O threads, and ``meanwhile`` in this
        thread while they run. Returns when all of it is done."""
        small = sum(r.nbytes for r in runs) < _INLINE_BYTES
        if len(runs) <= 1 and (small or meanwhile is None):
            if meanwhile is not None:
                meanwhile()
            for run in runs:
                work(run)
            return
        assert self._executor is not None
        futures: list[Future[None]] = [self._executor.submit(work, run) for run in runs]
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            # Every run must finish before the batch's buffers go back to the caller.
            wait(futures)
        for f in futures:
            f.result()

    @staticmethod
    def _checksum_sources(blocks: list[_Block]) -> None:
        for b in blocks:
            b.checksum = checksum(b.buf[: b.nbytes])

    def _staging(self, nbytes: int) -> memoryview:
        """This thread's page-aligned bounce buffer, at least ``nbytes`` long."""
        buf: mmap.mmap | None = getattr(self._local, "staging", None)
        if buf is None or len(buf) < nbytes:
            # The old buffer is dropped, not closed: a view of it may still be alive.
            size = 1 << max(16, (nbytes - 1).bit_length())
            buf = self._local.staging = mmap.mmap(-1, size)
        return memoryview(buf)

    def _pad_sink(self) -> memoryview:
        sink: bytearray | None = getattr(self._local, "pad", None)
        if sink is None:
            sink = self._local.pad = bytearray(_ALIGN)
        return memoryview(sink)

    def _iovecs(self, run: _Run, writing: bool) -> tuple[list[memoryview], list[memoryview]]:
        """The run's iovecs, and per block where its ``nbytes`` sit on the disk side of the
        transfer: the caller's buffer itself, or the block's place in the staging buffer."""
        direct = self._direct
        bounced = [b for b in run.blocks if direct and not b.direct]
        staging = self._staging(sum(b.padded for b in bounced)) if bounced else None
        if bounced:
            self._count(bounced_blocks=len(bounced))
        iovs: list[memoryview] = []
        views: list[memoryview] = []
        pos = 0
        last = run.blocks[-1]
        for b in run.blocks:
            if b.direct:
                iovs.append(b.buf[: b.padded])
                views.append(b.buf[: b.nbytes])
            elif direct:
                # O_DIRECT needs aligned memory: stage through this thread's bounce buffer.
                assert staging is not None
                chunk = staging[pos : pos + b.padded]
                pos += b.padded
                if writing:
                    chunk[: b.nbytes] = b.buf[: b.nbytes]
                    chunk[b.nbytes :] = _ZEROS[: b.padded - b.nbytes]
                iovs.append(chunk)
                views.append(chunk[: b.nbytes])
                b.staged = True
            else:
                # Buffered I/O takes any buffer; padding keeps the run contiguous on disk.
                iovs.append(b.buf[: b.nbytes])
                views.append(b.buf[: b.nbytes])
                if b.padded > b.nbytes and b is not last:
                    gap = b.padded - b.nbytes
                    iovs.append(memoryview(_ZEROS)[:gap] if writing else self._pad_sink()[:gap])
        return iovs, views

    def _write_run(self, run: _Run) -> None:
        try:
            iovs, _ = self._iovecs(run, True)
            self._transfer(os.pwritev, run, iovs)
        except OSError as e:
            self._run_failed(run, e, "write")
            return
        for b in run.blocks:
            b.ok = True

    def _execute_reads(self, runs: list[_Run]) -> None:
        """Read the runs on the I/O threads and verify each in this thread as soon as it has
        landed, while the others are still being read."""
        if len(runs) == 1 and runs[0].nbytes < _INLINE_BYTES:
            views = self._read_run(runs[0])
            if views is not None:
                self._verify_run(runs[0], views)
            return
        assert self._executor is not None
        futures = {self._executor.submit(self._read_run, run): run for run in runs}
        try:
            for future in as_completed(futures):
                views = future.result()
                if views is not None:
                    self._verify_run(futures[future], views)
        finally:
            wait(futures)

    def _read_run(self, run: _Run) -> list[memoryview] | None:
        """Read one run. Returns where each block's bytes landed for the caller to verify, or
        None when the run is settled here: failed, or staged (the staging buffer belongs to
        this thread, so its blocks are verified before the thread takes another run)."""
        try:
            iovs, views = self._iovecs(run, False)
            self._transfer(os.preadv, run, iovs)
        except OSError as e:
            self._run_failed(run, e, "read")
            for b in run.blocks:
                self._scrub(b)
            return None
        if any(b.staged for b in run.blocks):
            self._verify_run(run, views)
            return None
        return views

    def _verify_run(self, run: _Run, views: list[memoryview]) -> None:
        bad = 0
        for b, view in zip(run.blocks, views, strict=True):
            if checksum(view) != b.expected:
                b.error = "checksum mismatch"
                bad += 1
                self._scrub(b)
            else:
                if b.staged:
                    # Only verified bytes ever reach the caller's buffer on this path.
                    b.buf[: b.nbytes] = view
                b.ok = True
        if bad:
            self._count(checksum_failures=bad)

    def _transfer(
        self, call: Callable[[int, list[memoryview], int], int], run: _Run, iovs: list[memoryview]
    ) -> None:
        if call is os.preadv:
            self._count(read_calls=1)
        else:
            self._count(write_calls=1)
        try:
            _transfer_all(call, self._fds[run.file], iovs, run.offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self._direct:
                raise
            # Some filesystems accept O_DIRECT at open and refuse it at the first transfer.
            self._fall_back_to_buffered(e)
            _transfer_all(call, self._fds[run.file], iovs, run.offset)

    def _fall_back_to_buffered(self, exc: OSError) -> None:
        with self._state_lock:
            if not self._direct:
                return
            flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
            fds = [os.open(p, flags) for p in self._paths]
            # In-flight transfers may still use the old descriptors; close them at close().
            self._retired_fds.extend(self._fds)
            self._fds = fds
            self._direct = False
        log.warning(
            "L2: the filesystem of %s refused an O_DIRECT transfer (%s); switched to buffered I/O",
            self.directory,
            exc.strerror,
        )

    def _scrub(self, b: _Block) -> None:
        """Zero what a failed read may have left in the caller's buffer."""
        end = b.padded if b.direct else b.nbytes
        with contextlib.suppress(Exception):
            b.buf[:end] = bytes(end)

    def _run_failed(self, run: _Run, exc: OSError, what: str) -> None:
        fault = _classify(exc)
        for b in run.blocks:
            b.ok = False
            b.error = fault.detail
        self._count(io_errors=1)
        self._fault(
            fault,
            f"{what} of {len(run.blocks)} blocks at {self._paths[run.file].name}+{run.offset}",
        )

    def _sync(self, blocks: list[_Block]) -> None:
        """fdatasync the files the blocks went to; a file that fails fails its blocks."""
        files = sorted({b.file for b in blocks})
        if not files:
            return

        def sync(file: int) -> OSError | None:
            try:
                os.fdatasync(self._fds[file])
            except OSError as e:
                return e
            return None

        if len(files) == 1:
            errors = [sync(files[0])]
        else:
            assert self._executor is not None
            errors = list(self._executor.map(sync, files))
        self._count(syncs=len(files))
        for file, err in zip(files, errors, strict=True):
            if err is None:
                continue
            self._count(io_errors=1)
            self._fault(_classify(err), f"fdatasync of {self._paths[file].name}")
            for b in blocks:
                if b.file == file:
                    b.ok = False

    # ---------------------------------------------------------------- faults and state

    def _fault(self, fault: _Fault, what: str) -> None:
        """Count a fault and degrade the tier; log only when the state changes."""
        with self._state_lock:
            if fault.kind == "enospc":
                self._counters["enospc"] += 1
            if what.startswith("index"):
                self._counters["index_errors"] += 1
            before = self._degraded
            # A full disk may clear up; anything else keeps the tier degraded until reopened.
            if before is None or (before.kind == "enospc" and fault.kind != "enospc"):
                self._degraded = _Fault(fault.kind, f"{what}: {fault.detail}")
                self._next_probe = time.monotonic() + self._enospc_retry_s
                changed = True
            else:
                changed = False
        if changed:
            log.error(
                "L2 tier degraded: %s failed (%s); it refuses writes%s and keeps serving reads",
                what,
                fault.detail,
                f" (retrying every {self._enospc_retry_s:g}s)" if fault.kind == "enospc" else "",
            )

    def _admit_writes(self) -> bool:
        with self._state_lock:
            if self._degraded is None:
                return True
            if self._degraded.kind == "enospc" and time.monotonic() >= self._next_probe:
                self._next_probe = time.monotonic() + self._enospc_retry_s
                return True
            return False

    def _is_quarantined(self, slot: int) -> bool:
        with self._state_lock:
            return slot in self._quarantined

    def _quarantine(self, blocks: list[_Block]) -> None:
        now = self._clock()
        with self._state_lock:
            for b in blocks:
                self._quarantined[b.slot] = b.nbytes
                self._durable.pop(b.slot, None)
        # One line per block, with its key, up to a bound: a dying disk fails whole batches.
        for n, b in enumerate(blocks):
            log.log(
                logging.WARNING if n < _LOGGED_FAILURES else logging.DEBUG,
                "L2 block %s (slot %d) failed verification: %s; served as a miss, slot quarantined",
                bytes(b.key).hex(),
                b.slot,
                b.error,
            )
        if len(blocks) > _LOGGED_FAILURES:
            log.warning(
                "L2: %d more blocks of the same read failed (keys logged at DEBUG)",
                len(blocks) - _LOGGED_FAILURES,
            )
        try:
            with self._transaction() as db:
                db.executemany("DELETE FROM blocks WHERE slot = ?", [(b.slot,) for b in blocks])
                db.executemany(
                    "INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?)",
                    [(b.slot, b.nbytes, b.error[:200], now) for b in blocks],
                )
        except sqlite3.Error as e:
            # The slots stay quarantined in memory; after a restart their rows would be
            # served again only if their bytes verify.
            self._fault(_classify(e), "index quarantine update")

    def _count(self, **deltas: int) -> None:
        with self._state_lock:
            for name, n in deltas.items():
                if n:
                    self._counters[name] += n

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._db_lock:
            db = self._db
            if db is None:
                raise sqlite3.ProgrammingError("the L2 index is closed")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the L2 tier is closed")

    def _close_fds(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def _release_resources(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._close_fds()
        for fd in self._retired_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._retired_fds = []
        if self._db is not None:
            with self._db_lock, contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "CHECKSUM_NAME",
    "CommitEntry",
    "DiskTier",
    "PersistItem",
    "ReadItem",
    "RecoveredBlock",
    "WriteItem",
    "WriteOutcome",
    "checksum",
]
