"""L2: the disk tier. Block slots in preallocated files, a crash-safe SQLite index, checksums.

Layout of the tier's directory (mode 0700, owned by root or the daemon's user, which the open
checks; every file in it 0600, none opened through a symbolic link)::

    lock                  flock()ed while a DiskTier has the directory open (shared, for a
                          moment, by ``kvtierd --check-config``)
    data-0000.bin ...     preallocated data files; each holds a whole number of segments
    index.sqlite3         (+ -wal, -shm) the index: slot -> ns, key, nbytes, checksum, written_at
    index.reserve         preallocated room the tier gives back to commit a removal on a full
                          disk (``RESERVE_NAME``)

Slots come from a SlabAllocator over the concatenated data files: a slot is one contiguous,
4 KiB-aligned extent of one file, so a block moves with one aligned ``O_DIRECT`` transfer, and
adjacent slots of a batch move with one vectored ``preadv``/``pwritev`` (``io.BatchIO``).

Invariants:
- A block's index row is committed only after its bytes are durable (``fdatasync`` of the data
  file returned). Concurrent ``write`` calls share these steps (group commit): one caller
  inserts the rows of every write waiting so far in one transaction (their checksums are
  known before their bytes are down, so SQLite works while the disk does), waits for those
  writes, syncs their files and only then commits, while the others wait for its answer.
  A crash at any moment therefore loses at most blocks still in flight (an uncommitted
  transaction is rolled back) and never makes a row point at a half-written slot. A block
  whose write failed, or in a file one of whose syncs failed since its write started (a
  failed writeback is reported once), has its row deleted before the commit.
- A slot is given back to the allocator only after the deletion of its row is durable, and a
  slot rewritten in place loses its row (durably) before the new bytes go down, so no crash
  can leave a row over bytes it does not describe.
- Every read is verified against the checksum (xxh3-64 of the block's ``nbytes`` bytes) that
  was computed from the source buffer when the block was written. A block that fails (checksum
  mismatch or I/O error) is a miss: its row is deleted, its slot is quarantined (held, never
  handed out again, also across restarts, until ``release_quarantined`` or an open that
  recreates the part of its data file it lies in), and the event is counted and logged with
  the key. Where the quarantine's record does not commit (refused on a full disk, or failed
  but for a lock another process held past the busy timeout) the row is deleted all the same,
  as a removal's (``_delete_rows``), and the slot held until a restart, which frees it.
- I/O faults never raise out of the data verbs: they are results, counters and the tier's
  health. ENOSPC and EIO degrade the tier: it refuses writes and keeps serving reads (after
  a full disk or a locked index, until a write let through now and then, or the index
  watch's page in its turn (``_retry_commit``), commits; after a failed read, until a read
  batch succeeds whole or a release of quarantined slots passes every check:
  ``FaultState``).
- Damage found at open stays partial: a data file that is missing, shorter than the index
  needs or unreadable loses only the blocks whose slots lie in its damaged part (rows dropped,
  counted by reason in ``blocks_lost_at_recovery_*``, shown in the health detail), and the file
  is recreated; an index SQLite cannot use is moved aside (``index_moved_aside``, health
  detail) and the tier starts empty, as it does, saying so, when the index is missing beside
  data files. A disk full at open is no damage: the tier starts degraded by it where only
  the room kept for the index is short and the index opens (its reserve given back for that,
  where needed), and is refused, the index kept, where it cannot open.

The data path is POSIX ``preadv``/``pwritev`` on host memory (L1 slots, or a bounce buffer for
an engine pool's pages). kvikio is not used: its gain is GPUDirect Storage for device buffers,
which belongs to an L0<->L2 path.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import functools
import logging
import mmap
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from itertools import repeat
from pathlib import Path
from typing import NamedTuple, TypeAlias

import numpy as np

from kvtier.tiers.base import (
    BlockRef,
    BlockRefs,
    Health,
    HostBuffers,
    Priority,
    QuarantinedSlot,
    QuarantineRelease,
    ReadBatch,
    RecoveredBlocks,
    TierHealth,
    TierKind,
    TierStats,
    TierUnavailable,
    WriteBatch,
    WriteOutcomes,
    ref_columns,
    ref_keys,
)
from kvtier.tiers.buffers import get_block, put_block
from kvtier.tiers.disk.files import (
    ALIGN,
    DATA_GLOB,
    FILE_MODE,
    LOCK_NAME,
    FileBackend,
    OsFiles,
    SlotFiles,
    damage,
    fsync_dir,
    layout,
    lock_exclusive,
    lock_holders,
)
from kvtier.tiers.disk.health import Fault, FaultState, classify
from kvtier.tiers.disk.index import (
    INDEX_NAME,
    BlockRow,
    DiskIndex,
    IndexFilesReplaced,
    IndexNotMade,
    IndexUpgradeFailed,
    last_moved_aside,
    stored_geometry,
)
from kvtier.tiers.disk.io import BatchIO, Block, WriteSet, checksum
from kvtier.tiers.executor import PriorityExecutor, Urgency
from kvtier.tiers.sizes import counted, format_size
from kvtier.tiers.slab import LockedSlab

log = logging.getLogger("kvtier.tiers.disk")

BytesLike: TypeAlias = "bytes | bytearray | memoryview | np.ndarray"
"""Anything that ``memoryview()`` accepts as one C-contiguous run of bytes."""

CHECKSUM_NAME = "xxh3_64"
FORMAT_VERSION = 1
DIR_MODE = 0o700
DEFAULT_FILE_BYTES = 4 << 30
MAX_FILES = 256
# A capacity change keeps the data files' size the index was made for while at most this
# many files of it hold the new capacity (``data_file_bytes``).
MAX_KEPT_FILES = 2 * MAX_FILES
# Room a directory must have, beside its data files, for the tier's other files (the index,
# its -wal and -shm, the reserve, the lock) and the folder itself: a new index alone takes
# ~20 KiB, made after the space is checked. Counted less what those files already hold, so
# the check before anything exists (``kvtierd --check-config``, the daemon's preflight) and
# the tier's own give the same answer (a capacity within ~20 KiB of the free space passed the
# first and failed the second).
AUX_RESERVE_BYTES = 1 << 20
# A file beside the index, preallocated within ``AUX_RESERVE_BYTES``, that the tier gives back
# to the filesystem when the index has no room to commit a removal (SQLITE_FULL: its WAL
# cannot grow on a full disk), so that a removal, which only shrinks the tier, still becomes
# durable there; made again before a write commits, which waits for space back. 256 KiB: 60
# WAL pages, the deletion of 60 rows spread over the table, or 4,000 of consecutive slots, in
# one transaction. Grown, before a write commits (and a quarantine, a namespace record or the
# L3 removals journal: ``_reserve_grown``), to hold the index's growth the WAL holds too (up
# to some 4 MiB, SQLite checkpointing on its own at 1,000 WAL pages; unbounded while another
# process's reader holds that checkpoint back), which the WAL's restart on the room given back
# grows the index file by, and half of ``RESERVE_BYTES`` more for the removal's own pages:
# ``_reserve_ready``, in steps of ``RESERVE_GROWTH_STEP_BYTES`` (a tier filling up grows it a
# few times in all); it does not shrink again until given back (its growth lies beyond
# ``AUX_RESERVE_BYTES``, as the index's own does).
RESERVE_NAME = "index.reserve"
RESERVE_BYTES = 256 << 10
RESERVE_GROWTH_STEP_BYTES = 1 << 20
# The rows a removal on the reserve deletes per transaction: one WAL page each at worst (rows
# spread over the table), 64 KiB of WAL.
_RESERVE_STEP_ROWS = 16

_LOGGED_FAILURES = 16
# The extents a release checks at once: their bytes are held in memory, written, synced and
# read back together.
_CHECK_GROUP_BYTES = 64 << 20
# What ``quarantined`` lists for a slot that passed a release's check while its free began:
# held for that free, no longer in the index (a restart finds it free).
_PASSED_REASON = "release: its check passed, its free was not done yet (free after a restart)"


# ---------------------------------------------------------------------------------- space


def choose_file_bytes(capacity_bytes: int, segment_bytes: int, file_bytes: int | None) -> int:
    """The size of each data file: ``file_bytes`` (default ``DEFAULT_FILE_BYTES``) rounded up
    to whole segments, and large enough that at most ``MAX_FILES`` files hold the capacity."""
    want = DEFAULT_FILE_BYTES if file_bytes is None else file_bytes
    if want <= 0:
        raise ValueError(f"file_bytes must be positive, not {want}")
    want = max(want, -(-capacity_bytes // MAX_FILES))
    return -(-want // segment_bytes) * segment_bytes


def data_file_bytes(
    directory: str | os.PathLike[str],
    capacity_bytes: int,
    segment_bytes: int,
    file_bytes: int | None,
) -> int:
    """The size of each data file of a tier of this geometry in ``directory``:
    ``choose_file_bytes``, unless the index there was made for files of another size, at
    least ``file_bytes``, of which at most ``MAX_KEPT_FILES`` hold the capacity: that size is
    kept. A size the ``MAX_FILES`` bound made larger than ``file_bytes`` depends on the
    capacity, and a block's file and offset depend on the size: any change of a capacity
    above ``MAX_FILES`` files of ``file_bytes`` (1 TiB by default), or across it, moved the
    index aside and started the tier empty. A ``file_bytes`` other than the one the index
    records (``file_bytes_setting``) is the operator's new layout: not kept.
    (``capacity_bytes``: whole segments.) Raises TierUnavailable where another process holds
    the index locked past the busy timeout (``_locked_index``)."""
    chosen = choose_file_bytes(capacity_bytes, segment_bytes, file_bytes)
    try:
        meta = stored_geometry(Path(directory))
    except sqlite3.Error as e:
        raise _locked_index(Path(directory), e) from e
    stored = meta.get("file_bytes", "")
    if not stored.isdigit() or int(stored) == chosen:
        return chosen
    kept = int(stored)
    wanted = DEFAULT_FILE_BYTES if file_bytes is None else file_bytes
    # An index of the code before ``file_bytes_setting`` has none: a setting below the size
    # kept is then taken as a size the bound made.
    setting = meta.get("file_bytes_setting", str(wanted))
    if (
        meta.get("segment_bytes") != str(segment_bytes)
        or setting != str(wanted)
        or kept % segment_bytes
        or kept < wanted
        or -(-capacity_bytes // kept) > MAX_KEPT_FILES
    ):
        return chosen
    return kept


def _last_written(directory: Path, names: list[str]) -> float | None:
    """When the latest of the files ``names`` of ``directory`` was last written (its mtime),
    None where there is none or one cannot be looked at."""
    try:
        return max((os.stat(directory / name).st_mtime for name in names), default=None)
    except OSError:
        return None


def _locked_index(directory: Path, e: Exception) -> TierUnavailable:
    """The refusal of a start that found the index in ``directory`` locked by another process
    past the busy timeout (``e``, SQLITE_BUSY or SQLITE_LOCKED), naming the processes that hold
    it where the kernel lists them (``lock_holders``)."""
    path = directory / INDEX_NAME
    holders = lock_holders([path, path.with_name(INDEX_NAME + "-shm")])
    return TierUnavailable(
        f"cannot open the L2 index {path} ({classify(e).detail}): another process holds it "
        f"locked ({holders or 'an sqlite3 shell?'}): let it go, then restart"
    )


class SpaceShortfall(NamedTuple):
    """What an L2 directory lacks: the bytes its files still need (``data_bytes`` of them its
    data files') and the filesystem's free bytes (fewer than needed)."""

    directory: Path
    capacity_bytes: int
    needed_bytes: int
    free_bytes: int
    data_bytes: int
    index_exists: bool

    @property
    def refuses_start(self) -> bool:
        """Whether the tier cannot start at all: its data files do not fit, or it has no index
        yet, which a start makes (a new tier, or one whose index is gone: the capacity is for
        another disk). Otherwise only the room kept for the index's other files is short (a
        disk filled while the daemon was stopped): the tier starts degraded by the full disk,
        as it would be had the disk filled under it, serving what it holds."""
        return not self.index_exists or self.data_bytes > self.free_bytes

    def index_room(self) -> str:
        """What a tier that starts short of room for its index lacks, and what to free."""
        return (
            f"the disk of {self.directory} has {_mib(self.free_bytes)} free, short of the "
            f"{AUX_RESERVE_BYTES >> 20} MiB kept for the index, its reserve and the lock: free "
            f"{_mib(self.needed_bytes - self.free_bytes)} there"
        )

    def __str__(self) -> str:
        # A smaller capacity needs fewer data-file bytes, never less than the index's room:
        # where that does not fit either (a disk filled under a tier whose data files are
        # all allocated), freeing space is the one fix.
        smaller = (
            ", or set a smaller tiers.l2.capacity_bytes"
            if self.free_bytes >= AUX_RESERVE_BYTES
            else ""
        )
        return (
            f"L2 directory {self.directory} cannot hold tiers.l2.capacity_bytes="
            f"{format_size(self.capacity_bytes)}: its files need {_mib(self.needed_bytes)} "
            f"more (the data files, and up to {AUX_RESERVE_BYTES >> 20} MiB for the index, its "
            f"reserve and the lock) and the filesystem has {_mib(self.free_bytes)} free: free "
            f"{_mib(self.needed_bytes - self.free_bytes)} there{smaller}"
        )


def owner_problem(directory: Path, owner: int) -> str | None:
    """Why the L2 folder ``directory``, owned by uid ``owner``, may not hold the tier, or
    None. The tier sets it 0700, but its owner may loosen that again and plant links where
    the index, its WAL or journal goes, which SQLite follows (for a daemon run as root, to
    any file): only root and the daemon's own user may own it, as the socket's folder."""
    euid = os.geteuid()
    if owner in (0, euid):
        return None
    return (
        f"the L2 folder {directory} belongs to uid {owner}, who could plant links to other "
        f"files in it; chown it to uid {euid} (chown -R {euid} {directory}) or use a folder "
        "only the daemon may write"
    )


def space_shortfall(
    directory: str | os.PathLike[str],
    capacity_bytes: int,
    segment_bytes: int,
    file_bytes: int | None = None,
) -> SpaceShortfall | None:
    """Whether the filesystem of ``directory`` (made or not) lacks room for a tier of this
    geometry (``space_needed``). The one rule of the daemon's preflight and of ``DiskTier``'s
    open. Reads only; creates nothing. Raises TierUnavailable where another process holds the
    index locked (``data_file_bytes``)."""
    directory = Path(os.path.abspath(directory))
    data, aux = _space_parts(directory, capacity_bytes, segment_bytes, file_bytes)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = _free_bytes(existing)
    if data + aux <= free:
        return None
    index_exists = (directory / INDEX_NAME).exists()
    return SpaceShortfall(directory, capacity_bytes, data + aux, free, data, index_exists)


def space_needed(
    directory: str | os.PathLike[str],
    capacity_bytes: int,
    segment_bytes: int,
    file_bytes: int | None = None,
) -> int:
    """The bytes a tier of this geometry in ``directory`` (made or not) has yet to allocate:
    its data files' bytes not yet allocated, plus ``AUX_RESERVE_BYTES`` less what the tier's
    other files and the folder already hold. Reads only. Raises TierUnavailable where another
    process holds the index locked (``data_file_bytes``)."""
    return sum(_space_parts(Path(directory), capacity_bytes, segment_bytes, file_bytes))


def _space_parts(
    directory: Path, capacity_bytes: int, segment_bytes: int, file_bytes: int | None
) -> tuple[int, int]:
    """``space_needed`` in two parts: the data files' bytes, and the other files'."""
    directory = Path(os.path.abspath(directory))
    capacity = capacity_bytes // segment_bytes * segment_bytes  # as the allocator rounds it
    files = layout(
        directory, capacity, data_file_bytes(directory, capacity, segment_bytes, file_bytes)
    )
    needed = sum(max(0, size - _allocated(path)) for path, size in files)
    aux = (LOCK_NAME, INDEX_NAME, f"{INDEX_NAME}-wal", f"{INDEX_NAME}-shm", RESERVE_NAME)
    held = _allocated(directory) + sum(_allocated(directory / name) for name in aux)
    return needed, max(0, AUX_RESERVE_BYTES - held)


def _free_bytes(path: Path) -> int:
    """The bytes the filesystem of ``path`` lets an unprivileged process allocate."""
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def _mib(nbytes: int) -> str:
    if nbytes >= 10 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.2f} MiB"


# ---------------------------------------------------------------------------------- items


class ReadItem(NamedTuple):
    """Read ``nbytes`` of ``slot`` into ``out`` and verify them against ``checksum``.
    ``key`` is only used to name the block in logs. ``out`` may be written beyond ``nbytes``
    up to the slot's size when it is that long (the zero-copy path)."""

    slot: int
    out: BytesLike
    nbytes: int
    checksum: int
    key: bytes


class _Ticket:
    """One ``write`` call waiting for its group's durability step, its writes maybe still
    going: ``finish_writes`` waits for them (the group's leader calls it, or the writer
    itself once its step is over; never both at once)."""

    __slots__ = (
        "batch",
        "committed",
        "done",
        "error",
        "io_error",
        "live",
        "sync_failures",
        "wait",
        "ws",
    )

    def __init__(
        self,
        ws: WriteSet,
        started: tuple[np.ndarray, Callable[[], None]] | None,
        batch: WriteBatch,
        sync_failures: np.ndarray,
    ) -> None:
        self.ws = ws
        # How many syncs of each data file had failed before the writes started.
        self.sync_failures = sync_failures
        # The positions whose writes started (their checksums are set), and the call that
        # waits for those writes; None: nothing was attempted.
        self.live: np.ndarray | None = None
        self.wait: Callable[[], None] | None = None
        if started is not None:
            self.live, self.wait = started
        self.batch = batch
        self.committed = False
        self.done = False
        self.error: BaseException | None = None
        self.io_error: BaseException | None = None  # what a write raised: no block is ok

    @property
    def attempted(self) -> bool:
        return self.live is not None

    def finish_writes(self) -> None:
        """Wait for the writes (``ws.ok`` is final after this); idempotent."""
        wait, self.wait = self.wait, None
        if wait is None:
            return
        try:
            wait()
        except BaseException as e:
            self.io_error = e
            self.ws.ok[:] = False


class _GroupCommit:
    """Leader and followers: a thread that finds no group step running takes every ticket
    waiting (its own included) and runs the step for all of them; the others wait for its
    answer, and one of those that arrived meanwhile leads the next step.

    Thread-safety: ``join`` from any thread."""

    def __init__(self, step: Callable[[list[_Ticket]], None]) -> None:
        self._step = step
        self._cond = threading.Condition()
        self._waiting: list[_Ticket] = []
        self._running = False

    def join(self, ticket: _Ticket) -> None:
        with self._cond:
            self._waiting.append(ticket)
            while not ticket.done:
                if self._running:
                    self._cond.wait()
                    continue
                group, self._waiting = self._waiting, []
                self._running = True
                self._cond.release()
                try:
                    self._step(group)
                except BaseException as e:
                    for t in group:
                        t.error = e
                finally:
                    self._cond.acquire()
                    for t in group:
                        t.done = True
                    self._running = False
                    self._cond.notify_all()


def _as_bytes(data: BytesLike) -> memoryview:
    if type(data) is memoryview and data.format == "B" and data.ndim == 1:
        return data  # already bytes (an arena's slot views): no new view per block
    mv = memoryview(data)  # type: ignore[arg-type]
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class _RowMap:
    """Which slots have a committed index row, as one bit array per segment in use (a
    million 4 KiB blocks cost about a megabyte), so a rewrite finds the rows it must drop
    first without asking SQLite. Callers serialise access."""

    def __init__(self, slots_cap: int) -> None:
        self._cap = slots_cap
        self._segs: dict[int, np.ndarray] = {}

    def add_array(self, slots: np.ndarray) -> None:
        seg, idx = np.divmod(np.asarray(slots, dtype=np.int64), self._cap)
        for s in np.unique(seg).tolist():
            bits = self._segs.get(s)
            if bits is None:
                bits = self._segs[s] = np.zeros(self._cap, dtype=bool)
            bits[idx[seg == s]] = True

    def discard(self, slots: Iterable[int]) -> None:
        for slot in slots:
            seg, idx = divmod(int(slot), self._cap)
            bits = self._segs.get(seg)
            if bits is not None:
                bits[idx] = False

    def present(self, slots: Sequence[int] | np.ndarray) -> list[int]:
        slot_arr = np.asarray(slots, dtype=np.int64)
        segs, at = np.divmod(slot_arr, self._cap)
        hit = np.zeros(len(slot_arr), dtype=bool)
        for s in np.unique(segs).tolist():
            seg_bits = self._segs.get(s)
            if seg_bits is not None:
                mine = segs == s
                hit[mine] = seg_bits[at[mine]]
        return slot_arr[hit].tolist()  # type: ignore[no-any-return]


class _Slab(LockedSlab):
    """The tier's allocator. ``free`` is refused: an L2 slot must lose its index row (durably)
    before it is reused, which only ``DiskTier.remove`` does. While the index's rows are
    still being read (``recovering``), and after a read of them failed, nothing is handed
    out: a slot whose row was not read would be given twice."""

    recovering = False

    def _take(self, nbytes: int, count: int) -> list[int]:
        if self.recovering:
            return []
        return super()._take(nbytes, count)

    def can_allocate(self, nbytes: int) -> bool:
        return not self.recovering and super().can_allocate(nbytes)

    def free_slots(self, nbytes: int) -> int:
        return 0 if self.recovering else super().free_slots(nbytes)

    def free(self, slot: int) -> None:
        raise TypeError(
            f"L2 slot {slot}: free disk slots with DiskTier.remove(), which deletes their "
            "index rows before the slots can be reused"
        )

    def release(self, slot: int) -> None:
        super().free(slot)


# ---------------------------------------------------------------------------------- tier


class DiskTier:
    """The L2 tier: block slots in files on a local disk, and their durable index.

    Thread-safety: the data verbs (``write``/``read``/``read_items``/``remove``),
    ``stats`` and ``health`` may be called concurrently from any threads, and ``allocator``
    may be used from any thread, provided two calls in flight never name the same slot (the
    store's in-flight marks guarantee this). Index updates are serialised internally (a
    group commit holds the index from its insert to its commit, its writes and sync
    included, so a ``remove`` or a quarantine meanwhile waits that long); data transfers
    run in parallel on ``io_threads`` worker threads, most urgent first. With
    ``index_watch_s``, one more thread of the tier (``l2-index-watch``, a daemon thread)
    checks the index files between commits under the index's lock, and commits a page there
    to find out whether a full disk or a lock has cleared; ``close`` wakes it and
    waits for its last check. The constructor, ``recover`` and ``close`` must not overlap any
    other call. Every data method blocks: call it from a worker thread, never from an event
    loop.

    Ordering: when ``write`` returns ok for a block, its bytes and its row are durable and
    survive SIGKILL and power loss; when ``remove`` returns True, the rows are durably gone
    and only then are the slots free.
    """

    kind = TierKind.DISK
    persistent = True
    checksummed = True

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
        index_watch_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        backend: FileBackend | None = None,
        recover_later: bool = False,
    ) -> None:
        """Open (or create) the tier in ``directory`` and recover its index (with
        ``recover_later``, the rows are read when ``recover_chunks`` is consumed, and the
        tier allocates nothing until then).

        ``file_bytes``: size of each data file (rounded up to whole segments; default
        ``DEFAULT_FILE_BYTES``, and never more than ``MAX_FILES`` files; an index made for
        files of another size, at least this, under this same setting, keeps that size while
        at most ``MAX_KEPT_FILES`` of them hold the capacity: ``data_file_bytes``).
        ``direct_io=False``
        forces buffered I/O. ``enospc_retry_s``: while degraded by a full disk or a locked index,
        one write batch per this many seconds is let through to find out whether it cleared.
        ``index_watch_s``: how often a thread of the tier checks the index files between
        commits (``_watch_index``), so that an index or WAL removed while the tier is idle is
        mended before a crash loses the blocks they held, and tries a tier degraded by a full
        disk or a lock in the turn of a write let through when none was (``_retry_commit``);
        0 (the default) checks them only at commits and at ``close``, and such a tier waits
        for a write. ``clock`` gives ``written_at``. ``backend`` makes the data
        files' system calls (tests inject faults through it).

        A directory short only of the room kept for the index's other files (a disk filled
        while the daemon was stopped: ``SpaceShortfall.refuses_start``) opens degraded by the
        full disk, as a disk filling under the tier degrades it.

        Raises TierUnavailable when the directory cannot hold the data files (or a new
        index), the index cannot be opened or made (for want of room, or any other error of
        SQLite's or the system's: ``_open_index``) or another
        process holds it locked past the busy timeout (where its geometry is read, or at its
        open: the start waits that long once), is in use by another DiskTier or holds an index
        of an older format that could not be upgraded (left as it was), ValueError for a bad
        geometry.
        """
        if io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, not {io_threads}")
        if not index_watch_s >= 0:
            raise ValueError(f"index_watch_s must be 0 or more, not {index_watch_s}")
        started = time.monotonic()
        self.directory = Path(directory)
        self.allocator = _Slab(capacity_bytes, segment_bytes)
        self.io_threads = io_threads
        self._clock = clock
        # The size asked for, recorded in the index beside the size the files have.
        self._file_bytes_setting = DEFAULT_FILE_BYTES if file_bytes is None else file_bytes
        self._file_bytes = choose_file_bytes(
            self.allocator.capacity_bytes, self.allocator.segment_bytes, file_bytes
        )
        self._backend = backend or OsFiles()
        self.faults = FaultState(enospc_retry_s)
        self._enospc_retry_s = enospc_retry_s
        self._index_watch_s = index_watch_s
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None
        self._watch_problem = ""  # what the watch's last check reported, '' when it passed
        self._state_lock = threading.Lock()  # quarantine and the committed-row map
        # Whether ``RESERVE_NAME`` is missing (given back, or not made for want of room): its
        # make warns once while it is, and says when it is made again. Read and set, and the
        # file made or given back, at the open or holding the index: a removal using the room
        # given back holds it until its rows are deleted, so the reserve is not made again
        # meanwhile.
        self._reserve_missing = False
        self._release_lock = threading.Lock()  # one release_quarantined at a time
        self._quarantined: dict[int, int] = {}  # slot -> nbytes
        # The slot bytes of ``_quarantined``, kept as slots enter and leave it: the space
        # manager reads it at every displacing put (summed there, 0.8 ms at 10,000 slots).
        self._quarantined_slot_bytes = 0
        # The last slot a bounded release naming none tried: the next one goes on past it (in
        # memory: after a restart, releases begin again at the first slot held).
        self._release_after = -1
        # Held slots whose check a release tried since their quarantine, and failed: a release
        # naming none leaves the others for the next one (in memory, as the cursor).
        self._tried: set[int] = set()
        # Held slots whose check passed but whose free began meanwhile (``release_quarantined``:
        # their rows dropped, so the index records nothing of them) -> when: ``quarantined``
        # says so, until a release gives them back, a check of theirs fails or a read
        # quarantines them again.
        self._passed_at: dict[int, float] = {}
        # Slots with a read in flight -> how many: a release leaves these held, since a read
        # that fails after it would quarantine the slot again (even once it was handed out).
        self._reading: Counter[int] = Counter()
        # Failed syncs of each data file (``_sync_written``).
        self._sync_failures = np.zeros(0, dtype=np.int64)
        self._group = _GroupCommit(self._make_durable)
        self._pending_recovery: tuple[list[tuple[Path, int]], list[int], dict[int, str]] | None
        self._pending_recovery = None
        self._recovered: RecoveredBlocks | None = None
        self._committed = _RowMap(self.allocator.slots_cap)
        # Slots on their way to ``remove`` (``removing``) or whose ``remove`` failed (the
        # store tries again), and quarantined ones whose rows a lock kept (``_quarantine``):
        # their rows may still be in the index. A block commit deletes those of the keys it
        # writes (below) in its own transaction (``_make_durable``), so no row commits beside an
        # older row of its key that a Delete or an eviction dropped; a crash between left
        # both, and a Get during the next start's recovery served the older one until a
        # later chunk's newer row replaced it.
        self._unremoved: set[int] = set()
        # The key of each of those whose block ``removing`` named, and the slot of each such
        # key; the others (``_unkeyed``: the quarantined, those ``remove`` was given alone, a
        # second of one key) go with any block commit. A commit deletes only the rows of the
        # keys it writes, and of the unkeyed slots: the others' rows harm no put, and go with
        # their own ``remove`` (a delete of 16,384 rows in a one-block commit took it from 2.4
        # to 23.9 ms).
        self._unremoved_keys: dict[int, bytes] = {}
        self._unremoved_of_key: dict[bytes, int] = {}
        self._unkeyed: set[int] = set()
        # slot -> (ns, key) of the row of a slot of ``_unremoved``, where ``drop_rows_left``
        # read it from the index.
        self._unremoved_rows: dict[int, tuple[int, bytes]] = {}
        # Those slots, and the ones whose rows a commit deleted since, until a ``remove``
        # frees them: the store still hands them to ``remove``, so a release of a quarantined
        # one leaves it held (``release_quarantined``).
        self._freeing: set[int] = set()
        self.lost_at_recovery: Counter[str] = Counter()
        self._closed = False
        self._lock_fd = -1
        self._index: DiskIndex | None = None
        self._executor: PriorityExecutor | None = None
        self.files = SlotFiles(
            self.directory,
            layout(self.directory, self.allocator.capacity_bytes, self._file_bytes),
            self._file_bytes,
            self._backend,
        )
        try:
            self._make_directory()
            self._lock_directory()
            self._make_files_private()
            self._keep_file_bytes(file_bytes)
            shortfall = space_shortfall(
                self.directory,
                capacity_bytes,
                self.allocator.segment_bytes,
                self._file_bytes,
            )
            if shortfall is not None and shortfall.refuses_start:
                raise TierUnavailable(str(shortfall))
            # The index is made before the data files, so data files where the open found no
            # index (nor a write-back's copy it puts in the index's place) mean it was deleted
            # (by hand, or a clean-up script): their blocks cannot be found again. Listed
            # before the open, which may make the files of a new index.
            data_files = sorted(p.name for p in self.directory.glob(DATA_GLOB))
            written = _last_written(self.directory, data_files)
            try:
                self._index = self._open_index(clock, len(data_files))
            except IndexUpgradeFailed as e:
                raise TierUnavailable(f"{e}: free space or mend the disk, then restart") from e
            except IndexFilesReplaced as e:
                raise TierUnavailable(f"L2 index: {e}: remove it, then restart") from e
            if self._index.moved_aside:
                self.faults.count(index_moved_aside=1)
                if self._index.moved_aside != "was made for another layout":
                    self.faults.note(
                        f"index {self._index.moved_aside}: moved aside as {self._index.moved_to}"
                        ", started empty"
                    )
            orphans = data_files if self._index.found_none and not self._index.moved_aside else []
            if orphans:
                self._missing_index(orphans, written)
            if self._index.made_empty:
                # Said by the start that made it; the next ones (that start refused after the
                # open, by L1) found an index as any other, and nothing said the blocks lost.
                log.error(
                    "L2 index %s was made empty by an earlier start %s, and no block was "
                    "committed since: the blocks those data files held are lost",
                    self.directory / INDEX_NAME,
                    self._index.made_empty,
                )
                self.faults.note(
                    f"index made empty by an earlier start {self._index.made_empty}; no block "
                    "committed since"
                )
            capacity_before = self._index.previous_capacity or self.allocator.capacity_bytes
            before = layout(self.directory, capacity_before, self._file_bytes)
            sizes = self._file_sizes(before)
            damaged = damage(before, self._backend)
            for file, reason in damaged.items():
                if reason == "unreadable_file":
                    # Recreated by prepare(); its blocks are lost either way.
                    with contextlib.suppress(OSError):
                        before[file][0].unlink()
            self.files.prepare(self.allocator.capacity_bytes)
            if shortfall is not None:
                # Named before the reserve's fault, which a missing reserve adds: the same
                # kind, it leaves this detail, the room to free.
                fault = Fault("enospc", shortfall.index_room())
                self.faults.fault(fault, "start", f"start: {fault.detail}")
            # After the data files: where the index holds the room kept for the tier's other
            # files (``space_needed`` counts none then), a reserve made first took theirs.
            # No write commits until it is made, and holds the growth a crash left in the
            # WAL: not OK till then.
            self._reserve_ready("start")
            self.files.open(direct_io)
            self._claim_quarantine(sizes, damaged)
            # Rows are read by recover_chunks(); until then the tier allocates nothing.
            self._pending_recovery = (before, sizes, damaged)
            self.allocator.recovering = True
        except BaseException:
            self._release_resources()
            raise
        self._sync_failures = np.zeros(len(self.files.paths), dtype=np.int64)
        try:
            self._executor = PriorityExecutor(io_threads, "l2-io")
            self._io = BatchIO(self.files, self.faults, self._executor, io_threads)
            if index_watch_s > 0:
                self._watch = threading.Thread(
                    target=self._watch_index, name="l2-index-watch", daemon=True
                )
                self._watch.start()
            if not recover_later:
                self._recovered = RecoveredBlocks.concat(list(self.recover_chunks()))
        except BaseException:
            # A recovery that raised leaves no watch, I/O threads or lock behind.
            self._release_resources()
            raise
        log.info(
            "L2 disk tier in %s: %s in %d file(s), %d segments of %s, %s I/O, "
            "%d threads; opened in %.2fs",
            self.directory,
            format_size(self.allocator.capacity_bytes),
            len(self.files.paths),
            self.allocator.num_segments,
            format_size(self.allocator.segment_bytes),
            "O_DIRECT" if self.files.direct else "buffered",
            io_threads,
            time.monotonic() - started,
        )

    # ------------------------------------------------------------------ tier verbs

    def write(self, batch: WriteBatch) -> WriteOutcomes:
        """Write the batch's blocks, make them durable and commit them to the index, sharing
        the ``fdatasync`` of each data file and the transaction with the writes of other
        threads that finish meanwhile (group commit). The batch goes as arrays
        (``WriteSet``), its outcomes too: thousands of small blocks cost no object each."""
        self._check_open()
        n = len(batch.slots)
        views = _host_views(batch.src, n, batch.nbytes)
        if not len(views) == len(batch.blocks) == n:
            # Before any I/O: found in the group step, it would fail the other writers too.
            raise ValueError(
                f"a write batch of {n} slots has {len(views)} buffers and {len(batch.blocks)} refs"
            )
        addresses = batch.src.addresses if isinstance(batch.src, HostBuffers) else None
        ws = self._write_set(batch.slots, views, batch.nbytes, addresses)
        with self._state_lock:
            failures = self._sync_failures.copy()  # before any byte goes down
        ticket = _Ticket(ws, self._start_writes(ws, batch), batch, failures)
        try:
            self._group.join(ticket)
        finally:
            ticket.finish_writes()  # done by the group step, unless it failed first
        if ticket.io_error is not None:
            raise ticket.io_error
        if ticket.error is not None:
            raise ticket.error
        if not ticket.committed:
            return WriteOutcomes(ws.slots, np.zeros(len(ws), dtype=bool), ws.checksums)
        return WriteOutcomes(ws.slots, ws.ok, ws.checksums)

    def _make_durable(self, tickets: list[_Ticket]) -> None:
        """The group step of ``write``: insert the rows of every ticket's blocks in one
        transaction while their writes finish, then sync the files written, count, and commit
        the rows of the blocks whose bytes are durable (those of the others are deleted
        first). The rows are built from the checksums, known before the writes end; nothing
        is committed before the sync of its bytes returned."""
        attempted = [t for t in tickets if t.attempted]
        rows: list[BlockRow] = []
        now = self._clock()
        for t in attempted:
            live = t.live
            assert live is not None
            if len(live):
                ns, keys = ref_columns(t.batch.blocks, live)
                rows += zip(
                    ns.view(np.int64).tolist(),
                    keys,
                    t.ws.slots[live].tolist(),
                    repeat(t.ws.nbytes),
                    t.ws.checksums[live].view(np.int64).tolist(),
                    repeat(now),
                    strict=False,
                )
        ran = False
        unremoved: list[int] = []

        def durable() -> list[int] | None:
            nonlocal ran, unremoved
            ran = True
            self._sync_written(attempted)
            wrote = any(t.ws.ok.any() for t in attempted)
            if wrote and self.faults.refuses_commits():
                self.faults.count(commits_refused_degraded=1)
                return None
            if wrote and not self._reserve_ready():
                return None
            failed = [
                t.ws.slots[live[~t.ws.ok[live]]] for t in attempted if (live := t.live) is not None
            ]
            # Read holding the index (inside its transaction): a slot freed since is not here,
            # and one here is not freed until this commit ends (``remove`` deletes first).
            # Those of the keys written (a key put again over its Delete or eviction), and
            # those whose keys are not known; the others wait for their ``remove``.
            if rows:
                with self._state_lock:
                    if of_key := self._unremoved_of_key:
                        keys = (row[1] for row in rows)
                        mine = self._unkeyed.union([of_key[k] for k in keys if k in of_key])
                    else:
                        mine = self._unkeyed
                    unremoved = sorted(mine)
            return [*(np.concatenate(failed).tolist() if failed else []), *unremoved]

        if not rows:
            durable()
            committed = True
        elif self.faults.refuses_commits():
            durable()  # counts the refusal if a block was written
            committed = False
        else:
            try:
                # A write let through while another process held the lock tries it once:
                # waiting out the busy timeout held up the put whose demotion sent it.
                committed = self._idx().insert_when(
                    rows, durable, wait_busy=not self.faults.lock_held()
                )
            except sqlite3.Error as e:
                self.faults.fault(classify(e), "index commit")
                committed = False
            finally:
                if not ran:  # the insert failed before the writes were waited for
                    self._sync_written(attempted)  # nothing to commit: no reserve to make
        good = np.concatenate([t.ws.slots[t.ws.ok] for t in attempted] or [_NO_SLOTS])
        if committed and unremoved:
            # Their rows are gone: their ``remove`` frees them with no write transaction
            # (none if it ran meanwhile: ``_delete_rows``).
            with self._state_lock:
                self._forget_unremoved(unremoved)
                self._committed.discard(unremoved)
        if committed and len(good):
            with self._state_lock:
                self._committed.add_array(good)
            self.faults.count(commits=1, committed_blocks=len(good))
            self.faults.space_returned()
        for t in tickets:
            t.committed = committed

    def _sync_written(self, attempted: list[_Ticket]) -> None:
        """Wait for the tickets' writes, sync the files they wrote and count the blocks
        written. A block is not ok in a file whose sync failed since its write started, this
        one or an earlier group's: the kernel reports a failed writeback once per open file,
        so a later sync of the file succeeds though the block's pages may have been in the
        writeback that failed (a sync that failed as the disk was full leaves the tier
        taking writes)."""
        for t in attempted:
            t.finish_writes()
        written = [t.ws.files[t.ws.ok] for t in attempted]
        files = np.unique(np.concatenate(written)).tolist() if written else []
        if files:
            # At the most urgent class among the writers, and the highest rank within it.
            first = min(attempted, key=lambda t: (t.batch.priority, -t.batch.rank)).batch
            failed = self._io.sync_files(files, first.priority, first.rank)
            with self._state_lock:
                self._sync_failures[list(failed)] += 1
                failures = self._sync_failures.copy()
            for t in attempted:
                lost = np.flatnonzero(failures != t.sync_failures)
                if len(lost):
                    t.ws.ok &= ~np.isin(t.ws.files, lost)
        for t in attempted:
            ok = int(np.count_nonzero(t.ws.ok))
            self.faults.count(
                blocks_written=ok,
                bytes_written=ok * t.ws.nbytes,
                write_failures=len(t.ws) - ok,
            )

    def _write_set(
        self,
        slots: Sequence[int],
        bufs: list[memoryview],
        nbytes: int,
        addresses: Sequence[int] | None,
    ) -> WriteSet:
        """The I/O engine's view of a write batch of one block size, as arrays, every slot
        and buffer checked first (vectorised): a misuse raises before any I/O."""
        nbytes = int(nbytes)
        slot_arr, padded = self._check_slots(slots, nbytes)
        lengths = np.fromiter(map(len, bufs), dtype=np.int64, count=len(bufs))
        if len(lengths) and int(lengths.min()) < nbytes:
            raise ValueError(
                f"buffer of {int(lengths.min())} bytes is shorter than the block ({nbytes})"
            )
        # Slots fresh from the allocator come in increasing order: no sort needed to see them
        # distinct.
        if not (slot_arr[1:] > slot_arr[:-1]).all() and len(np.unique(slot_arr)) != len(slot_arr):
            raise ValueError("a batch names the same L2 slot twice")
        return self._io.make_write_set(
            slot_arr, self.allocator.offsets(slot_arr), nbytes, padded, bufs, lengths, addresses
        )

    def _start_writes(
        self, ws: WriteSet, batch: WriteBatch
    ) -> tuple[np.ndarray, Callable[[], None]] | None:
        """Start writing the set's bytes, not to be synced yet, skipping quarantined slots
        and first dropping the rows of rewritten ones; returns once the checksums of the
        blocks written are set, with their positions and the call that waits for the writes
        (it sets ``ok`` where a write succeeded). None when none was attempted (degraded
        tier, or the rows of rewritten slots could not be dropped)."""
        if not len(ws):
            return np.zeros(0, dtype=np.int64), _nothing
        if not self.faults.admit_writes():
            self.faults.count(writes_refused_degraded=len(ws))
            return None
        with self._state_lock:
            held = np.fromiter(self._quarantined, dtype=np.int64, count=len(self._quarantined))
        live = np.flatnonzero(~np.isin(ws.slots, held)) if len(held) else np.arange(len(ws))
        self.faults.count(writes_refused_quarantined=len(ws) - len(live))
        if not self._drop_rows_before_overwrite(ws.slots[live]):
            return None
        return live, self._io.start_write_set(ws, live, batch.priority, batch.rank, batch.urgency)

    def read(self, batch: ReadBatch) -> list[bool]:
        """Read and verify the batch's blocks into its destination (host buffers directly;
        pool pages through a bounce buffer, scattered only once verified)."""
        self._check_open()
        n = len(batch.slots)
        sums = batch.checksums
        if len(sums) != n:
            raise ValueError(f"{len(sums)} checksums for {n} blocks")
        dest = batch.dest
        if isinstance(dest, HostBuffers):
            blocks = self._blocks(
                batch.slots,
                [_as_bytes(v) for v in dest.views],
                batch.nbytes,
                dest.addresses,
            )
        else:
            blocks = self._blocks(batch.slots, [None] * n, batch.nbytes)
            for j, b in enumerate(blocks):
                b.sink = lambda view, j=j: put_block(dest, j, view, batch.nbytes)  # type: ignore[misc]
        keys = ref_keys(batch.blocks) if batch.blocks else [b""] * n
        for b, expected, key in zip(blocks, sums, keys, strict=True):
            b.expected = int(expected)
            b.key = key
        return self._read_blocks(blocks, batch.priority, batch.rank, batch.urgency)

    def removing(self, slots: Sequence[int], refs: Sequence[BlockRef] | None = None) -> None:
        """Note slots ``remove`` will be given (``_unremoved``): their blocks are gone, or
        their rows replaced (the slots kept for reads in flight till then). ``refs``: the
        block each held, whose key's next commit deletes its row; without, any block commit
        does."""
        slots = [int(s) for s in slots]
        keys = ref_keys(refs) if refs is not None else None
        if keys is not None and len(keys) != len(slots):
            raise ValueError(f"{len(keys)} blocks named for {len(slots)} slots on their way out")
        with self._state_lock:
            self._note_unremoved(slots, keys)
            self._freeing.update(slots)

    def _note_unremoved(self, slots: list[int], keys: list[bytes] | None) -> None:
        """Add ``slots`` to ``_unremoved``, each with the key of its block (``keys``, None:
        not known) where no other slot there has it (else unkeyed); one there already stays
        as it was, and so does one named twice, under its first key; the state lock held. An
        eviction names thousands at once, on the event loop: in bulk (C loops) where none is
        there yet and they and their keys are distinct and new."""
        known, of_key, unremoved = self._unremoved_keys, self._unremoved_of_key, self._unremoved
        given = set(slots)
        if unremoved.isdisjoint(given):
            if keys is None:
                unremoved.update(given)
                self._unkeyed.update(given)
                return
            fresh = dict(zip(keys, slots, strict=True))
            # A slot named twice with two keys would be followed under both, forgotten
            # under one (``_forget_unremoved``): the other's commit, once the slot is handed
            # out again, would delete the row of the block written there.
            distinct = len(given) == len(fresh) == len(slots)
            if distinct and of_key.keys().isdisjoint(fresh):
                unremoved.update(slots)
                known.update(zip(slots, keys, strict=True))
                of_key.update(fresh)
                return
        named: Sequence[bytes | None] = [None] * len(slots) if keys is None else keys
        for slot, key in zip(slots, named, strict=True):
            if slot in unremoved:
                continue
            unremoved.add(slot)
            if key is None or key in of_key:
                self._unkeyed.add(slot)
            else:
                known[slot] = key
                of_key[key] = slot

    def rows_left(self, refs: Sequence[BlockRef]) -> bool:
        """Whether the index may hold a row of one of ``refs``' blocks in a slot of
        ``_unremoved`` (``_maybe_rows``)."""
        with self._state_lock:
            if not self._unkeyed and not self._unremoved_of_key:
                return False
            return bool(self._maybe_rows(_ref_pairs(refs)))

    def _maybe_rows(self, wanted: set[tuple[int, bytes]]) -> list[int]:
        """The slots of ``_unremoved`` that may hold a row of one of ``wanted`` (ns, key):
        noted with such a key or without one (``_unkeyed``), and whose row, where read
        (``_unremoved_rows``), is of one of them; the state lock held."""
        of_key, read = self._unremoved_of_key, self._unremoved_rows
        named = {of_key[key] for _, key in wanted if key in of_key}
        return [s for s in named.union(self._unkeyed) if (r := read.get(s)) is None or r in wanted]

    def drop_rows_left(self, refs: Sequence[BlockRef]) -> bool:
        """Delete the rows of ``refs``' blocks (namespace and key) in slots of ``_unremoved``
        in one commit (on a full disk on the reserve, as a removal's: ``_delete_rows``), as a
        block commit of those keys deletes them (``_make_durable``): nothing freed, their
        ``remove`` frees the slots with no write transaction. The rows of the slots
        ``rows_left`` finds are read first (``_unremoved_rows``): no commit where none is of
        ``refs``. False where the read or the commit failed (the tier's fault, as a failed
        removal's): the rows may still be there."""
        self._check_open()
        wanted = _ref_pairs(refs)
        mine: list[int] = []
        try:
            # Read and forgotten holding the index: a slot freed since is not here, and one
            # here is not freed before its row is gone (``remove`` deletes first).
            with self._idx().held():
                with self._state_lock:
                    maybe = self._maybe_rows(wanted)
                    read = self._unremoved_rows
                    unread = [s for s in maybe if s not in read]
                # The rows of slots noted without their key (or under a key of another
                # namespace) are read, not deleted unseen: a write transaction for every
                # Delete, which a lock another process holds fails after the busy timeout,
                # for rows of other keys. Kept with the slot: no slot here is written again.
                found = self._idx().block_keys(unread) if unread else {}
                with self._state_lock:
                    read.update((s, row) for s, row in found.items() if s in self._unremoved)
                    mine = sorted(s for s in maybe if read.get(s) in wanted)
                if mine:
                    self._delete_rows(mine)
                with self._state_lock:
                    self._forget_unremoved(mine)
                    self._committed.discard(mine)
        except sqlite3.Error as e:
            self.faults.fault(classify(e), "index delete")
            self.faults.count(remove_failures=len(mine))
            return False
        return True

    def _forget_unremoved(self, slots: Iterable[int]) -> None:
        """Take ``slots`` off ``_unremoved`` (their rows are gone); the state lock held."""
        known, of_key = self._unremoved_keys, self._unremoved_of_key
        for slot in slots:
            self._unremoved.discard(slot)
            self._unkeyed.discard(slot)
            self._unremoved_rows.pop(slot, None)
            key = known.pop(slot, None)
            if key is not None:
                del of_key[key]

    def remove(self, slots: Iterable[int]) -> bool:
        """Delete the index rows of these slots (one transaction) and free the slots.

        Works for committed blocks and for slots whose write or commit failed. Quarantined
        slots lose their row but stay held. Returns False when the index could not be
        updated: then nothing was freed and the rows may still exist. Slots the index holds
        no row for (a put that failed or was refused) take no write transaction, so an index
        another process keeps locked does not keep them taken after it is let go.
        """
        self._check_open()
        slots = [int(s) for s in slots]
        if not slots:
            return True
        try:
            self._delete_rows(slots)
        except sqlite3.Error as e:
            self.faults.fault(classify(e), "index delete")
            self.faults.count(remove_failures=len(slots))
            with self._state_lock:
                # Not those whose rows a block commit deleted (``_delete_rows``): none is left.
                kept = [s for s in slots if s in self._unremoved or s not in self._freeing]
                self._note_unremoved(kept, None)
                self._freeing.update(slots)
            return False
        freed = 0
        with self._state_lock:
            # With the release, under one hold of the lock: a commit that finds a slot here
            # (``_make_durable``) finds it not yet handed out again.
            self._forget_unremoved(slots)
            self._freeing.difference_update(slots)
            self._committed.discard(slots)
            for slot in slots:
                if slot in self._quarantined:
                    continue
                self.allocator.release(slot)
                freed += 1
        self.faults.count(removed_slots=freed)
        return True

    def _delete_rows(self, slots: list[int]) -> None:
        """Delete the block rows of ``slots`` in one transaction; none when no slot has one
        (``_committed``, else the index says). Where the index has no room for it
        (SQLITE_FULL: a full disk), give the reserve back to the filesystem, restart
        the WAL on that room and try again; still short, or the reserve spent by an earlier
        removal, delete them ``_RESERVE_STEP_ROWS`` at a time, the WAL restarted before each,
        so that a larger removal commits within the reserve, and later ones within the room
        the WAL's file took from it; the index held from the give-back on. Raises what the
        last try raised."""
        with self._state_lock:
            rows = self._committed.present(slots)
            # On their way here, their rows deleted by a block commit (``_make_durable``
            # takes them off ``_unremoved``; no block is written to them meanwhile).
            known = set(rows).union(
                s for s in slots if s in self._freeing and s not in self._unremoved
            )
        if len(known) < len(slots):
            rows += self._idx().committed_slots([s for s in slots if s not in known])
        if not rows:
            return
        try:
            self._idx().delete(rows)
            return
        except sqlite3.Error as e:
            fault = classify(e)
            if fault.kind != "enospc":
                raise
        # From the give-back to the commit nothing else may take the room given back: no
        # other commit (a write's WAL growth took it), nor a remake of the reserve (a write's
        # commit makes it): the index held.
        with self._idx().held():
            gave_back = self._give_back_reserve()
            if gave_back:
                # The room given back goes to the WAL's restart first: where the WAL holds
                # the index's growth since its last checkpoint, the restart grows the index
                # file to hold it, which WAL appends would have taken, leaving later removals
                # neither room to append nor to restart the WAL.
                self._idx().restart_wal()
            if not (gave_back and self._delete_unless_full(rows)):
                self._idx().delete_in_steps(rows, _RESERVE_STEP_ROWS)
        self.faults.fault(
            fault, "index delete", f"index delete committed on {RESERVE_NAME}; the disk is full"
        )
        self.faults.count(removals_on_reserve=1)

    def _delete_unless_full(self, rows: list[int]) -> bool:
        """``DiskIndex.delete``; False where the index had no room for it."""
        try:
            self._idx().delete(rows)
        except sqlite3.Error as e:
            if classify(e).kind != "enospc":
                raise
            return False
        return True

    def _missing_index(self, orphans: list[str], written: float | None) -> None:
        """Report an index missing beside the data files ``orphans`` (``written``: when one was
        last written to, None where unknown). Where an earlier start moved the index aside
        (a damaged one, whose new index that start could not make, and so was refused) and
        no block was written since, the blocks they hold were that index's: said so, when
        and to which file, rather than "missing" as after an index deleted by hand."""
        files = f"{len(orphans)} data file(s)"
        aside = last_moved_aside(self.directory)
        # The name's time is to the second: a write later within that second is taken for
        # one before.
        if aside is not None and written is not None and int(written) <= aside.at:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(aside.at))
            moved = f"moved aside {aside.why} at {when}, to {aside.name}"
            log.error(
                "L2 index %s was %s, by an earlier start, and no block was written since; "
                "starting EMPTY beside %s (%s): no block they held can be found without it",
                self.directory / INDEX_NAME,
                moved,
                files,
                ", ".join(orphans),
            )
            self.faults.note(f"index {moved} by an earlier start; started empty beside {files}")
            return
        log.error(
            "L2 index %s is missing but %s are there (%s); starting EMPTY: no block they held "
            "can be found without it",
            self.directory / INDEX_NAME,
            files,
            ", ".join(orphans),
        )
        self.faults.note(f"index was missing beside {files}, started empty")

    def _open_index(self, clock: Callable[[], float], data_files: int) -> DiskIndex:
        """The index, opened. Where the disk has no room for what its open makes (SQLite's
        shared memory file, 32 KiB, made by the first connection after a clean stop removed
        it), the reserve is given back to the filesystem for it, as for a removal, and the
        open tried once more (made again once there is room). So where the filesystem has no
        inode for the WAL's files (ENOSPC), and where a new index finds no room (``IndexNotMade``:
        what that open moved aside is reported as the next one's). Raises TierUnavailable where
        it still finds no room, where another process holds the index locked past the busy
        timeout, and where the index cannot be opened or made for any other cause (SQLite's
        or the system's error, named with the index and one it moved aside), IndexFilesReplaced
        for a link."""
        moved = ("", "")  # what an open that failed to make a new index moved aside first
        while True:
            try:
                index = DiskIndex(
                    self.directory,
                    self._geometry(),
                    clock,
                    count=self.faults.count,
                    data_files=data_files,
                    moved=moved,
                )
            except (sqlite3.Error, OSError) as e:
                if isinstance(e, IndexFilesReplaced):
                    raise  # a link: refused by the caller
                if isinstance(e, IndexNotMade) and e.moved_aside:
                    moved = (e.moved_aside, e.moved_to)
                fault = classify(e)
                # A damaged index this start moved aside is gone whatever the cause: said
                # here, as the next start finds only no index.
                aside = (
                    f" (the index found there {moved[0]}: moved aside as {moved[1]}, the next "
                    "start makes a new, empty one)"
                    if moved[0]
                    else ""
                )
                if fault.kind == "locked":
                    raise _locked_index(self.directory, e) from e
                if fault.kind != "enospc":
                    # Raised as it was, an sqlite3 error (SQLITE_CANTOPEN, SQLITE_IOERR,
                    # SQLITE_READONLY) ended the daemon's start in a traceback.
                    made = "make" if isinstance(e, IndexNotMade) else "open"
                    raise TierUnavailable(
                        f"cannot {made} the L2 index {self.directory / INDEX_NAME} "
                        f"({fault.detail}){aside}: mend {self.directory} or its disk, then "
                        "restart"
                    ) from e
                if self._give_back_reserve("open the index"):
                    continue
                short = space_shortfall(
                    self.directory,
                    self.allocator.capacity_bytes,
                    self.allocator.segment_bytes,
                    self._file_bytes,
                )
                room = (
                    short.index_room()
                    if short is not None
                    else f"the disk of {self.directory} is full (its space, or its inodes: "
                    "df -i): free some there"
                )
                kept = (self.directory / RESERVE_NAME).exists()  # its unlink failed
                raise TierUnavailable(
                    f"cannot open the L2 index {self.directory / INDEX_NAME} ({fault.detail}) "
                    + (
                        f"and {RESERVE_NAME} could not be given back (the log says why)"
                        if kept
                        else f"and no {RESERVE_NAME} is left to give back"
                    )
                    + f"{aside}: {room}, then restart"
                ) from e
            return index

    def _make_reserve(self) -> None:
        """Make ``RESERVE_NAME`` (preallocated, durable) unless it holds its bytes already;
        where the filesystem has no room for it, it stays missing (tried again by the next
        commit that grows the index: ``_reserve_ready``). Called at the open or holding the
        index."""
        path = self.directory / RESERVE_NAME
        short = RESERVE_BYTES - _allocated(path)
        if short <= 0:
            self._reserve_missing = False
            return
        try:
            # A fallocate that fails keeps what it took until the unlink below: the disk's
            # last blocks, which another program's allocation meanwhile would not find (none
            # of this tier's: its index is held, or not open yet).
            self._allocate_reserve(RESERVE_BYTES, short)
            fsync_dir(self.directory)
        except OSError as e:
            with contextlib.suppress(OSError):
                path.unlink()
            if not self._reserve_missing:
                log.warning(
                    "L2: cannot make %s (%s): writes do not commit, and a removal on a "
                    "full disk may not, until space is freed for it",
                    path,
                    e,
                )
            self._reserve_missing = True
            return
        if self._reserve_missing:
            log.warning("L2: %s made again", path)
        self._reserve_missing = False

    def _allocate_reserve(self, size: int, short: int) -> None:
        """Preallocate ``RESERVE_NAME`` to ``size`` bytes, made where missing, and sync it;
        ENOSPC at once where the filesystem has fewer than the ``short`` bytes it lacks free
        (a fallocate that fails keeps what it took)."""
        if _free_bytes(self.directory) < short:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        path = self.directory / RESERVE_NAME
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.posix_fallocate(fd, 0, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _reserve_ready(self, what: str = "index commit") -> bool:
        """Whether the reserve is there for a commit that grows the index (a write's, a
        quarantine's, a namespace record's; ``_reserve_grown`` for the L3 removals journal's),
        holding the index's growth that the WAL holds (``growth_bytes``, this commit's transaction
        included), which the WAL's restart on the room a removal on a full disk gives back must grow
        the index file by, and half of ``RESERVE_BYTES`` more for the removal's pages: made now
        where it is short of ``RESERVE_BYTES`` (given back, never made, or removed or cut by hand,
        which the tier does not see), then grown where the growth asks. Where either does not fit, a
        full disk's fault is recorded and the commit is refused: committed in the room a removal
        gave back, or with more growth than the reserve holds, it left a later removal on the full
        disk without room, which failed, its Delete answered with its rows kept (served again after
        a crash). Called at the open or holding the index, so no removal is using the room given
        back meanwhile."""
        path = self.directory / RESERVE_NAME
        have = _allocated(path)
        if have < RESERVE_BYTES:
            self._make_reserve()
            if self._reserve_missing:
                fault = Fault(
                    "enospc", f"no room to make {RESERVE_NAME} (kept for removals), writes wait"
                )
                self.faults.fault(fault, what, f"{what}: {fault.detail}")
                return False
            have = _allocated(path)
        need = self._idx().growth_bytes() + RESERVE_BYTES // 2
        if need <= have:
            return True
        size = -(-need // RESERVE_GROWTH_STEP_BYTES) * RESERVE_GROWTH_STEP_BYTES
        try:
            self._allocate_reserve(size, size - have)
        except OSError as e:
            fault = Fault(
                "enospc",
                f"no room to grow {RESERVE_NAME} to {_mib(size)} for the index's "
                f"growth ({e.strerror}), writes wait",
            )
            self.faults.fault(fault, what, f"{what}: {fault.detail}")
            return False
        return True

    def _reserve_grown(self, what: str) -> bool:
        """``_reserve_ready`` for the L3 removals journal's record, which it never refuses:
        True. The record is a Delete's own (refused, the Delete's keys would come back from
        L3 after a restart), a removal's as a block row's deletion is: it may commit in the
        room a removal on a full disk gave back, and beyond the reserve where it cannot grow
        (the tier then degraded by the full disk, as a write would find it)."""
        self._reserve_ready(what)
        return True

    def _give_back_reserve(self, need: str = "commit a removal") -> bool:
        """Unlink ``RESERVE_NAME`` so its blocks are free again for what ``need`` names (the
        warning's words); False when it was missing, or could not be unlinked (a fault the
        removal's steps, or the index's open, then meet or not). Called holding the index,
        which the removal holds until its rows are deleted, or at the open, before it."""
        path = self.directory / RESERVE_NAME
        given = _allocated(path)  # grown past RESERVE_BYTES where the index's growth asked
        try:
            path.unlink()
        except FileNotFoundError:
            self._reserve_missing = True
            return False
        except OSError as e:
            log.warning("L2: cannot give back %s (%s)", path, e)
            return False
        self._reserve_missing = True
        # ext4 hands freed blocks out again only once the journal has committed their free.
        with contextlib.suppress(OSError):
            fsync_dir(self.directory)
        log.warning(
            "L2: no room on the disk to %s; gave back the %d KiB reserve beside the index "
            "(writes commit again once it is made, space back)",
            need,
            given >> 10,
        )
        return True

    def recover_chunks(self, rows: int = 65536) -> Iterator[RecoveredBlocks]:
        """The blocks the index holds from before this open, ``rows`` at a time, each chunk's
        slots claimed in ``allocator`` as it is handed over. Rows whose bytes are gone (a
        damaged data file) or that do not fit the tier are dropped and counted by reason.
        Until the last chunk is out the allocator hands out nothing (for good when the
        consumer leaves before it, closing the generator); once it is, every slot without a
        row is free. Handed over once; later calls yield nothing."""
        if self._recovered is not None:
            done, self._recovered = self._recovered, None
            if len(done):
                yield done
            return
        if self._pending_recovery is None:
            return
        before, sizes, damaged = self._pending_recovery
        self._pending_recovery = None
        started = time.monotonic()
        lost: Counter[str] = Counter()
        lost_files: Counter[str] = Counter()
        drop: list[int] = []
        total = kept = kept_bytes = 0
        index_rows = self._index_rows(rows)
        # Until every row is read: a consumer may also leave before the end (the generator
        # closed at a yield), and the slots of the rows it did not take stay unavailable.
        unread = True
        try:
            try:
                for chunk in index_rows:
                    total += len(chunk)
                    blocks = self._recover_chunk(
                        chunk, before, sizes, damaged, lost, lost_files, drop
                    )
                    kept += len(blocks)
                    kept_bytes += int(blocks.nbytes.sum())
                    if len(blocks):
                        yield blocks
                unread = False
            except GeneratorExit:
                log.warning(
                    "L2 recovery was left after %d index rows, before the last: the tier "
                    "stores no new block until a restart reads them all",
                    total,
                )
                self.faults.note("recovery left before its last row: no new block until restart")
                raise
            except sqlite3.Error as e:
                # The rows not read yet still name their slots: handed out, a slot would meet
                # its old row at the next start. Nothing is allocated until a restart reads
                # them all; what was read is served. Noted: the fault may end (a full disk
                # freed) long before that restart.
                self.faults.fault(classify(e), "index read")
                self.faults.note(
                    "recovery could not read every index row: no new block until restart"
                )
            if drop:
                log.warning(
                    "L2 recovery dropped %d index rows (%s)%s",
                    len(drop),
                    ", ".join(f"{n} {r}" for r, n in sorted(lost.items())),
                    f"; blocks lost with damaged data files: {dict(lost_files)}"
                    if lost_files
                    else "",
                )
                # Before the allocator hands their slots out: a block written there meanwhile
                # would lose its row to this deletion.
                try:
                    self._idx().drop(drop, [])
                except sqlite3.Error as e:
                    self.faults.fault(classify(e), "index delete")
        finally:
            index_rows.close()
            self.allocator.recovering = unread
        damaged_total = sum(lost_files.values())
        if damaged_total:
            self.faults.note(
                f"lost {counted(damaged_total, 'block')} at start with damaged data files "
                + ", ".join(f"{name} ({n})" for name, n in sorted(lost_files.items()))
            )
        self.lost_at_recovery = lost
        self.faults.count(
            recovered_blocks=kept,
            blocks_lost_at_recovery=sum(lost.values()),
            recovery_dropped_rows=len(drop),
        )
        log.info(
            "L2 recovered %d blocks (%s) from %d index rows in %.2fs",
            kept,
            _mib(kept_bytes),
            total,
            time.monotonic() - started,
        )

    def _index_rows(self, rows: int) -> Generator[list[BlockRow], None, None]:
        """The index's block rows, ``rows`` at a time in slot order, each chunk read through
        the tier's own connection between commits (``DiskIndex.rows_after``), which holds the
        same database whether or not its path still names it. The files are checked first, as
        by the watch: an index file removed since the open is written back; one that cannot
        be, degrading the tier as at a commit, is read all the same (only ``close`` tries the
        write-back again). Raises where a read fails (the index closed: its write-back failed,
        or its reopen after a WAL made again found no room), as a read failing midway does."""
        index = self._idx()
        try:
            index.check_files()
        except IndexFilesReplaced as e:
            self.faults.fault(classify(e), "index read")
        except sqlite3.Error:
            pass  # found again by the next commit's check, or the watch's
        after: int | None = None
        while chunk := index.rows_after(after, rows):
            yield chunk
            after = chunk[-1][2]

    def recover(self) -> RecoveredBlocks:
        """Every block ``recover_chunks`` hands over, at once."""
        return RecoveredBlocks.concat(list(self.recover_chunks()))

    def health(self) -> TierHealth:
        return self.faults.health()

    def retry_writes_now(self) -> None:
        """Degraded by a fault that may pass (a full disk, a locked index), let the next write
        batch through now to find out (``FaultState.retry_now``)."""
        self.faults.retry_now()

    def stats(self) -> TierStats:
        slab = self.allocator.stats()
        counters = dict.fromkeys(_COUNTERS, 0)
        counters.update(self.faults.snapshot())
        for reason, n in self.lost_at_recovery.items():
            counters[f"blocks_lost_at_recovery_{reason}"] = n
        with self._state_lock:
            quarantined = len(self._quarantined)
            quarantined_bytes = self._quarantined_slot_bytes
        gauges = {
            "o_direct": float(self.files.direct),
            "used_slots": float(slab.used_slots),
            "free_segments": float(slab.free_segments),
            "quarantined_slots": float(quarantined),
            "quarantined_bytes": float(quarantined_bytes),
            "files": float(len(self.files.paths)),
            # I/O jobs (read and write runs, syncs) waiting for an I/O thread.
            "io_queued": float(self._executor.queued if self._executor is not None else 0),
        }
        health = self.health()
        if quarantined:
            # Not in health(), which the store asks at every write: the note is for the
            # operator reading Stats, whose tier state said "ok" while slots were held out of
            # use for blocks the disk returned wrong.
            note = (
                f"{counted(quarantined, 'slot')} ({format_size(int(quarantined_bytes))}) "
                "quarantined after reads that failed verification (checksum mismatch or I/O "
                "error, each logged with its key), held out of use: check the disk, then give "
                "them back with `kvtier quarantine --release`"
            )
            health = dataclasses.replace(
                health, detail="; ".join(x for x in (health.detail, note) if x)
            )
        return TierStats(self.kind, health, slab.capacity_bytes, slab.used_bytes, counters, gauges)

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

    # ------------------------------------------------------------------ item verbs

    def read_items(
        self, items: Sequence[ReadItem], priority: Priority = Priority.DEMAND
    ) -> list[bool]:
        """Read blocks into ``out`` buffers and verify each against its checksum.

        Returns one bool per item. True: ``out[:nbytes]`` holds exactly the bytes written.
        False (checksum mismatch, I/O error, quarantined slot): a miss. The content of ``out``
        is then unspecified and must not be used or copied anywhere (the tier zero-fills what
        it wrote there, best effort); the block's row is deleted and its slot quarantined, so
        the caller drops its L2 copy (``remove`` of the slot is allowed and changes nothing).
        Reads are served while the tier is degraded.
        """
        self._check_open()
        blocks: list[Block] = []
        for nbytes in sorted({int(it.nbytes) for it in items}):
            group = [(i, it) for i, it in enumerate(items) if int(it.nbytes) == nbytes]
            made = self._blocks(
                [it.slot for _, it in group], [_as_bytes(it.out) for _, it in group], nbytes
            )
            for (i, it), b in zip(group, made, strict=True):
                b.pos, b.expected, b.key = i, it.checksum, it.key
            blocks += made
        blocks.sort(key=lambda b: b.pos)
        return self._read_blocks(blocks, priority)

    def namespaces(self) -> dict[int, str]:
        """What ``remember_namespace`` recorded (survives restarts with the blocks). A
        failed read degrades the tier and raises: recovery reads this first, and ended by
        it, leaves every row unread (nothing allocated, no Delete) until a restart."""
        try:
            return self._idx().namespaces()
        except sqlite3.Error as e:
            self.faults.fault(classify(e), "index read")
            raise

    def remember_namespace(self, ns: int, label: str) -> None:
        """Record who namespace ``ns`` belongs to, durably, beside its blocks' rows (a
        tenant's name: recovered blocks keep their owner). A record that fails (a full disk,
        a locked index) is a fault of the tier, not raised: the next commit of blocks makes
        it in its transaction (``DiskIndex.remember``), so no block of ``ns`` is committed
        without it, and a put is not failed by the record alone. While another process holds
        the index locked, it tries the lock once, as a write does: waiting out the busy
        timeout held up the put that binds ``ns``, and every commit behind it. It commits only
        where the reserve holds the index's growth (``_reserve_ready``), or is kept too."""
        what = "index namespace update"
        try:
            self._idx().remember(
                ns,
                label,
                wait_busy=not self.faults.lock_held(),
                room=functools.partial(self._reserve_ready, what),
            )
        except sqlite3.Error as e:
            self.faults.fault(classify(e), what)

    def forget_namespaces(self, names: list[int]) -> None:
        """Drop the records of namespaces that hold no block any more (their owner moved on;
        one recorded again when it is bound again). A drop that fails is a fault of the tier,
        not raised, and made by the next commit, as a failed record is
        (``remember_namespace``), trying the lock once while another process holds it, and
        kept where the reserve does not hold the index's growth."""
        what = "index namespace update"
        try:
            self._idx().forget(
                names,
                wait_busy=not self.faults.lock_held(),
                room=functools.partial(self._reserve_ready, what),
            )
        except sqlite3.Error as e:
            self.faults.fault(classify(e), what)

    def removals(self) -> list[tuple[bytes, float | None]]:
        """The key-addressed tier's removals kept by ``record_removals`` (``RemovalJournal``);
        none when the index cannot be read (a fault of the tier)."""
        try:
            return self._idx().l3_removals()
        except sqlite3.Error as e:
            self.faults.fault(classify(e), "index read")
            return []

    def record_removals(
        self, added: Sequence[tuple[bytes, float | None]], dropped: Sequence[bytes]
    ) -> bool:
        """Keep ``added`` and forget ``dropped`` durably, in the index beside the blocks'
        rows (``RemovalJournal``), the reserve grown first for the index's growth where it
        fits (``_reserve_grown``). False: not recorded (a fault of the tier)."""
        what = "index removals update"
        try:
            self._idx().record_l3_removals(
                added, dropped, room=functools.partial(self._reserve_grown, what)
            )
        except sqlite3.Error as e:
            self.faults.fault(classify(e), what)
            return False
        return True

    def quarantined_bytes(self) -> int:
        """The slot bytes quarantined slots hold out of use: room no block can take until a
        release (the space manager leaves it out of the room tenants share)."""
        return self._quarantined_slot_bytes

    def quarantined(self) -> list[QuarantinedSlot]:
        """Every slot held out of use, in slot order, with where it lies and why (the reason
        and time the index recorded; for a slot that passed a release's check while its free
        began, which the index no longer records, that and when; none for a slot whose record
        failed to commit)."""
        self._check_open()
        with self._state_lock:
            held = sorted(self._quarantined.items())
            tried = set(self._tried)
            passed_at = dict(self._passed_at)
        try:
            recorded = self._idx().quarantine_records()
        except sqlite3.Error as e:
            self.faults.fault(classify(e), "index read")
            recorded = {}
        unknown = ("not recorded in the index", 0.0)
        for slot, at in passed_at.items():
            recorded.setdefault(slot, (_PASSED_REASON, at))
        return [
            self._held(slot, nbytes, *recorded.get(slot, unknown), slot in tried)
            for slot, nbytes in held
        ]

    def release_quarantined(
        self, slots: Sequence[int] | None = None, limit: int | None = None
    ) -> QuarantineRelease:
        """Give quarantined slots back to use (an operator's decision, e.g. after the disk
        was checked): ``slots``, or when None every one held, or with ``limit`` that many
        at most (the reply that lists them is bounded), in slot order from past the last one
        that an earlier release naming none tried (wrapping), so that slots failing their
        check again do not keep the rest from their turn. Each slot's extent first takes
        a write of fresh random bytes, a sync and a read back (from the disk: with
        ``O_DIRECT``, or past the page cache, ``_check_extents``); one whose check fails
        stays held, its recorded reason saying why (the record refused where the reserve
        cannot hold the index's growth, or failed, the tier's fault, as a read's
        quarantine's is: the reason it had stays), and so does one that a read begun before
        its quarantine still has in flight (that read, failing, would hold it again, perhaps
        once handed out), or that the store is freeing still (``removing``: handed out, its
        new block's row would go with the next block commit, and the slot with that free):
        these two are left unchecked, their record (why their read failed, and when) as it
        was, and not ``tried`` (whatever an earlier check found). A slot whose check failed is ``tried`` in ``quarantined``
        until it is released or a read quarantines it again, so that a caller of releases
        naming none can tell when the slots left are only those (one kept for a read in
        flight, or a free, is not). The
        rows of the slots released (their quarantine rows, and a block
        row that a failed quarantine update left) are durably deleted before the allocator
        may hand them out, so a crash after a release brings no old block back.

        A failed write or read of a checked extent keeps its slot and is counted
        (``io_errors``), without degrading the tier (the extent was suspect already); a failed
        sync degrades it, as any does (the sync covers the whole file, whose other writes the
        error may be about). Degraded by a failed read, the tier is whole again once every
        slot checked passed (the extents took writes, a sync and reads, and the index a
        commit): a tier that nothing reads from has no read batch to find that out (a write
        batch is no such proof: ``FaultState``). Raises TierUnavailable
        while the tier is degraded by another fault (it may be what failed the reads; release
        once it is ok) or recovering, ValueError for a slot not held; either changes
        nothing."""
        self._check_open()
        with self._release_lock:
            health = self.health()
            if health.state is not Health.OK and not self.faults.read_failed():
                raise TierUnavailable(
                    f"L2 is {health.state.value}: quarantined slots are released only while it "
                    "is ok or degraded by a failed read alone (mend the fault, and restart the "
                    "daemon for one that lasts)"
                )
            if self.allocator.recovering:
                raise TierUnavailable(
                    "L2 is still reading its index (or failed to): no slot is released before "
                    "every row is read"
                )
            with self._state_lock:
                held = dict(self._quarantined)
            if slots is None:
                order = sorted(held)
                start = bisect.bisect_right(order, self._release_after)
                todo = (order[start:] + order[:start])[:limit]
                self._release_after = todo[-1] if todo else -1
                todo.sort()
            else:
                todo = sorted({int(s) for s in slots})
            stray = [s for s in todo if s not in held]
            if stray:
                shown = ", ".join(map(str, stray[:8])) + (", ..." if len(stray) > 8 else "")
                raise ValueError(f"L2 holds no quarantined slot {shown}")
            with self._state_lock:
                # Read before their quarantine, and failing yet: given back now, a slot would be
                # quarantined again by that read, perhaps once handed out to another block.
                skipped = {s: "a read of it was in flight" for s in todo if s in self._reading}
                # On their way to ``remove`` (``_freeing``): handed out again, a slot's new
                # row would go with the next block commit, and the slot with that remove.
                for s in todo:
                    if s in self._freeing and s not in skipped:
                        skipped[s] = "its free was not done yet"
            # Not checked: the next release tries them again. No check of theirs failed, so
            # they keep their quarantine's record (why their read failed, and when) and count
            # neither as tried nor against a read fault's end.
            check = [s for s in todo if s not in skipped]
            checked: dict[int, str] = {}
            group: dict[int, int] = {}
            group_bytes = 0
            for slot in check:
                group[slot] = held[slot]
                group_bytes += self.allocator.slot_bytes_for(held[slot])
                if group_bytes >= _CHECK_GROUP_BYTES or slot == check[-1]:
                    checked.update(self._check_extents(group))
                    group, group_bytes = {}, 0
            passed = [slot for slot, error in checked.items() if not error]
            failed = {slot: error for slot, error in checked.items() if error}
            if passed:
                try:
                    self._idx().drop(passed, passed)
                except sqlite3.Error as e:
                    self.faults.fault(classify(e), "index update")
                    failed.update(dict.fromkeys(passed, f"index update: {classify(e).detail}"))
                    passed = []
            if failed:
                # In memory they are held still where this is not committed: refused where
                # the reserve cannot hold the index's growth (``_reserve_ready``), or failed,
                # the tier's fault, as a read's quarantine is (each row made again with a
                # reason of up to 200 characters); their rows keep the reason they had.
                what = "index quarantine update"
                try:
                    self._idx().quarantine(
                        [(slot, held[slot], f"release: {why}") for slot, why in failed.items()],
                        room=functools.partial(self._reserve_ready, what),
                    )
                except sqlite3.Error as e:
                    self.faults.fault(classify(e), what)
            with self._state_lock:
                # A free begun while the extents were checked (``removing``): given back, the
                # slot would be released again by that free's ``remove``, under the block
                # handed it meanwhile. Held in memory only (its rows are dropped: a restart
                # finds it free), as one whose free began before; a later release gives it back,
                # and ``quarantined`` says meanwhile that it passed (``_passed_at``).
                late = [s for s in passed if s in self._freeing]
                if late:
                    passed = [s for s in passed if s not in self._freeing]
                    skipped.update(dict.fromkeys(late, "its free was not done yet"))
                    self._passed_at.update(dict.fromkeys(late, self._clock()))
                self._tried.update(failed)
                # Passed no longer: their record is this failure's, or none where it did not
                # commit (``quarantined`` must not say an earlier check passed).
                for slot in failed:
                    self._passed_at.pop(slot, None)
                # Left for a later release, no check of theirs failed: untried, whatever an
                # earlier release found, so that a caller of releases naming none is told to
                # call again (``untried_count``), not that only failed slots are left.
                self._tried.difference_update(skipped)
                # Their block rows are gone with the drop: handed out, a slot left here
                # would lose its new row to the next block commit.
                self._forget_unremoved(passed)
                for slot in passed:
                    self._quarantined_slot_bytes -= self.allocator.slot_bytes_for(
                        self._quarantined.pop(slot)
                    )
                    self._tried.discard(slot)
                    self._passed_at.pop(slot, None)
                    self.allocator.release(slot)
        if passed:
            log.warning("L2: %d quarantined slot(s) checked and returned to service", len(passed))
        if checked and not failed:
            self.faults.read_checked()
        if failed:
            log.warning(
                "L2: %d quarantined slot(s) failed their check and stay quarantined (first: "
                "slot %d: %s)",
                len(failed),
                *next(iter(failed.items())),
            )
        if skipped:
            log.info(
                "L2: %d quarantined slot(s) left held, unchecked, for a later release (first: "
                "slot %d: %s)",
                len(skipped),
                *next(iter(skipped.items())),
            )
        now = self._clock()
        kept = [(slot, why, True) for slot, why in failed.items()]
        kept += [(slot, why, False) for slot, why in skipped.items()]
        return QuarantineRelease(
            passed,
            [
                self._held(slot, held[slot], f"release: {why}", now, tried)
                for slot, why, tried in sorted(kept)
            ],
        )

    def _check_extents(self, held: dict[int, int]) -> dict[int, str]:
        """Write the whole extent of each quarantined slot of ``held`` (slot -> nbytes) with
        random bytes, sync the files written once, and read the extents back: slot -> what
        failed, '' for one that came back whole. The read back is the disk's: with
        ``O_DIRECT``, or else after the written files' clean pages are dropped from the page
        cache (what they cached is read from the disk again)."""
        out: dict[int, str] = {}
        written: dict[int, tuple[int, int, mmap.mmap]] = {}
        try:
            for slot, nbytes in held.items():
                size = self.allocator.slot_bytes_for(nbytes)
                file, offset = self.files.locate(self.allocator.offset(slot))
                # Anonymous maps are page-aligned, as O_DIRECT wants its buffers.
                buf = mmap.mmap(-1, size)
                buf[:] = os.urandom(size)
                written[slot] = (file, offset, buf)
                try:
                    self.files.transfer(True, file, [memoryview(buf)], offset)
                except OSError as e:
                    self.faults.count(io_errors=1)
                    out[slot] = f"write: {classify(e).detail}"
            files = sorted({file for slot, (file, _, _) in written.items() if slot not in out})
            for file in files:
                error = self.files.sync(file)
                self.faults.count(syncs=1)
                if error is None:
                    continue
                with self._state_lock:
                    self._sync_failures[file] += 1  # the group commit's writes to it too
                self.faults.count(io_errors=1)
                self.faults.fault(classify(error), f"fdatasync of {self.files.paths[file].name}")
                for slot, (f, _, _) in written.items():
                    if f == file:
                        out.setdefault(slot, f"sync: {classify(error).detail}")
            if not self.files.direct:
                # A buffered read back would come from the pages the write just filled, not
                # from the disk: once synced they are clean, and dropped. The whole file's: a
                # page cache folio may span more than an extent (readahead makes large ones),
                # and one a range only partly covers stays.
                for file in files:
                    os.posix_fadvise(self.files.fds[file], 0, 0, os.POSIX_FADV_DONTNEED)
            for slot, (file, offset, buf) in written.items():
                if slot in out:
                    continue
                with mmap.mmap(-1, len(buf)) as back:
                    try:
                        self.files.transfer(False, file, [memoryview(back)], offset)
                    except OSError as e:
                        self.faults.count(io_errors=1)
                        out[slot] = f"read back: {classify(e).detail}"
                        continue
                    if back[:] != buf[:]:
                        out[slot] = "read back: the bytes differ from those written"
        finally:
            for _, _, buf in written.values():
                buf.close()
        return {slot: out.get(slot, "") for slot in held}

    def _held(self, slot: int, nbytes: int, reason: str, at: float, tried: bool) -> QuarantinedSlot:
        path, offset = self.slot_location(slot)
        return QuarantinedSlot(
            slot, self.allocator.slot_bytes_for(nbytes), path.name, offset, reason, at, tried
        )

    def slot_location(self, slot: int) -> tuple[Path, int]:
        """The data file holding an allocated slot, and the slot's byte offset in it."""
        file, offset = self.files.locate(self.allocator.offset(slot))
        return self.files.paths[file], offset

    @property
    def direct_io(self) -> bool:
        return self.files.direct

    # ------------------------------------------------------------------ internals

    def _read_blocks(
        self,
        blocks: list[Block],
        priority: Priority,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> list[bool]:
        self._check_distinct(blocks)
        live = []
        with self._state_lock:
            for b in blocks:
                if b.slot in self._quarantined:
                    b.error = "slot is quarantined"
                else:
                    live.append(b)
                    self._reading[b.slot] += 1
        try:
            self.faults.count(reads_refused_quarantined=len(blocks) - len(live))
            self._io.read(live, priority, rank, urgency)
            ok = [b for b in live if b.ok]
            failed = [b for b in live if not b.ok]
            self.faults.count(
                blocks_read=len(ok), bytes_read=sum(b.nbytes for b in ok), read_failures=len(failed)
            )
            if failed:
                self._quarantine(failed)
            elif ok:
                self.faults.read_succeeded()
        finally:
            with self._state_lock:
                for b in live:
                    if self._reading[b.slot] == 1:
                        del self._reading[b.slot]
                    else:
                        self._reading[b.slot] -= 1
        return [b.ok for b in blocks]

    def _drop_rows_before_overwrite(self, slots: np.ndarray) -> bool:
        """Durably delete the rows of committed blocks in ``slots`` (a slot rewritten without
        ``remove``): a crash while the new bytes go down must not leave the old row over them.
        False when the index could not be updated."""
        if not len(slots):
            return True
        with self._state_lock:
            stale = self._committed.present(slots)
        try:
            if stale:
                self._idx().delete(stale)
                with self._state_lock:
                    self._committed.discard(stale)
                self.faults.count(overwritten_blocks=len(stale))
        except sqlite3.Error as e:
            self.faults.fault(classify(e), "index delete")
            self.faults.count(write_failures=len(slots))
            return False
        return True

    def _quarantine(self, blocks: list[Block]) -> None:
        """Hold the slots of ``blocks``, whose reads failed, out of use: recorded in the index
        first, then in memory, so that a release (which takes the slots it gives back from
        memory and deletes their rows) never runs between the two and leaves a quarantine row
        behind for a slot it handed out. Meanwhile no call but another read names these slots
        (the store's in-flight marks), and one that fails again only quarantines them again: a
        release leaves a slot held while a read of it is in flight (``_reading``)."""
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
        # Committed only where the reserve holds the index's growth (``_reserve_ready``): a
        # quarantine of a batch's blocks adds up to ~250 bytes of index per slot (a reason
        # of 200 characters; ~40 for "checksum mismatch"). Not committed, or failed, the
        # slots are quarantined in memory all the same, until a restart.
        what = "index quarantine update"
        fault: Fault | None = None
        try:
            recorded = self._idx().quarantine(
                [(b.slot, b.nbytes, b.error) for b in blocks],
                room=functools.partial(self._reserve_ready, what),
            )
        except sqlite3.Error as e:
            fault = classify(e)
            self.faults.fault(fault, what)
            recorded = False
        kept_rows = not recorded
        if not recorded and (fault is None or fault.kind != "locked"):
            # The store forgets its copy of these blocks, so no Delete of their keys reaches
            # their rows: left, they were served again after a restart where their bytes
            # verified (a one-off read error), a deleted key back. Deleted as a removal's
            # rows are, which commit on a full disk (``_delete_rows``): only the quarantine's
            # own rows go unwritten. Not after a lock another process held past the busy
            # timeout, which a second try would wait out again, holding up this read.
            try:
                self._delete_rows([b.slot for b in blocks])
                kept_rows = False
            except sqlite3.Error as e:
                self.faults.fault(classify(e), "index delete")
        with self._state_lock:
            for b in blocks:
                # A slot two reads found bad at once is quarantined twice: counted once.
                held = self._quarantined.get(b.slot)
                self._quarantined_slot_bytes += self.allocator.slot_bytes_for(b.nbytes) - (
                    0 if held is None else self.allocator.slot_bytes_for(held)
                )
                self._quarantined[b.slot] = b.nbytes
                self._tried.discard(b.slot)  # a new failure, for the next release to try
                self._passed_at.pop(b.slot, None)  # its record now this read's, if any
            self._committed.discard(b.slot for b in blocks)
            if kept_rows:
                # Left, a put of one of their keys committed beside its row (the store
                # forgets these blocks, and no ``remove`` reaches them): the next block
                # commit deletes them, whatever its keys (no Delete of theirs reaches them
                # either: a crash after one brought them back).
                self._note_unremoved([b.slot for b in blocks], None)

    def _blocks(
        self,
        slots: Sequence[int],
        bufs: Sequence[memoryview | None],
        nbytes: int,
        addresses: Sequence[int] | None = None,
    ) -> list[Block]:
        """The I/O engine's blocks for a read batch of one block size, every slot and buffer
        checked first (vectorised): a misuse raises before any I/O. ``addresses``: the
        buffers' addresses, when known (``HostBuffers.addresses``)."""
        nbytes = int(nbytes)
        slot_arr, padded = self._check_slots(slots, nbytes)
        alloc = self.allocator
        for buf in bufs:
            if buf is not None:
                if len(buf) < nbytes:
                    raise ValueError(
                        f"buffer of {len(buf)} bytes is shorter than the block ({nbytes})"
                    )
                if buf.readonly:
                    raise ValueError("read buffer is read-only")
        return self._io.make_blocks(
            slot_arr.tolist(), alloc.offsets(slot_arr), nbytes, padded, bufs, addresses
        )

    def _check_slots(self, slots: Sequence[int], nbytes: int) -> tuple[np.ndarray, int]:
        """The slots as an array, and the slot size of ``nbytes``; raises ValueError unless
        every slot is allocated for a block of that size."""
        slot_arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        alloc = self.allocator
        padded = alloc.slot_bytes_for(nbytes) if nbytes > 0 else 0
        good = alloc.allocated(slot_arr)
        good &= alloc.slot_sizes(np.where(good, slot_arr, 0)) == padded
        if nbytes <= 0 or not good.all():
            bad = int(slot_arr[int(np.argmin(good))]) if len(slot_arr) else -1
            raise ValueError(
                f"L2 slot {bad} is not an allocated slot for a block of {nbytes} bytes"
            )
        return slot_arr, padded

    @staticmethod
    def _check_distinct(blocks: list[Block]) -> None:
        if len({b.slot for b in blocks}) != len(blocks):
            raise ValueError("a batch names the same L2 slot twice")

    def _idx(self) -> DiskIndex:
        if self._index is None:
            raise sqlite3.ProgrammingError("the L2 index is closed")
        return self._index

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the L2 tier is closed")

    # ------------------------------------------------------------------ index watch

    def _watch_index(self) -> None:
        """The watch thread: check the index files every ``index_watch_s`` until ``close``;
        after a check another process's lock held up, wait ``enospc_retry_s`` at least, as
        a write into a locked index does, so the watch does not hold the index most of the
        time trying again. A tier degraded by a full disk or a lock that no write batch was
        let through to for ``enospc_retry_s`` is tried by the watch (``_retry_commit``)."""
        wait_s = self._index_watch_s
        while not self._watch_stop.wait(wait_s):
            locked = self._check_index_files()
            if self.faults.take_retry():
                self._retry_commit()
            wait_s = (
                max(self._index_watch_s, self._enospc_retry_s) if locked else self._index_watch_s
            )

    def _retry_commit(self) -> None:
        """Find out whether a full disk or a lock has cleared on a tier that gets no write to
        let through (an idle or read-only node, whose tier stayed degraded, and without its
        reserve, after space came back): commit one page and the namespace records kept
        (``DiskIndex.probe``), the reserve made where it is missing and grown for the index's
        growth in the transaction, as a write's commit does (``_reserve_ready``); its commit
        ends the fault as a write's does. Where the reserve still does not fit, or the commit
        fails, the tier stays degraded (counted as a batch let through is)."""
        index = self._idx()
        try:
            if not index.probe(room=functools.partial(self._reserve_ready, "index retry")):
                return
        except sqlite3.Error as e:
            self.faults.fault(classify(e), "index retry")
            return
        except Exception:  # a bug: the watch goes on, the next turn tries again
            log.exception("L2 retry of a full disk or a locked index failed unexpectedly")
            return
        self.faults.space_returned()

    def _check_index_files(self) -> bool:
        """One check of the watch (``DiskIndex.check_files``): a removed index is written
        back, a removed WAL checkpointed, as at a commit. A replaced index file, or one that
        cannot be written back, degrades the tier as it does at a commit; a checkpoint that
        another process's lock holds up only warns (the next check, or commit, tries again).
        Each problem is counted and logged once, not at every check while it lasts. True when
        the index was locked."""
        try:
            self._idx().check_files()
        except sqlite3.Error as e:
            fault = classify(e)
            if fault.detail != self._watch_problem:
                self._watch_problem = fault.detail
                if fault.kind == "locked":
                    log.warning(
                        "L2 index check: %s; tried again in %gs",
                        fault.detail,
                        max(self._index_watch_s, self._enospc_retry_s),
                    )
                else:
                    self.faults.fault(fault, "index file check")
            return fault.kind == "locked"
        except Exception as e:  # a bug: logged with its traceback once, the watch goes on
            if repr(e) != self._watch_problem:
                self._watch_problem = repr(e)
                log.exception("L2 index check failed unexpectedly; the index watch goes on")
            return False
        self._watch_problem = ""
        return False

    # ------------------------------------------------------------- opening and recovery

    def _make_directory(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        # Checked again here: another user may make the folder after the checks at start.
        if (problem := owner_problem(self.directory, self.directory.stat().st_uid)) is not None:
            raise TierUnavailable(problem)
        os.chmod(self.directory, DIR_MODE)

    def _make_files_private(self) -> None:
        """Once the directory is locked: before, the files may be another tier's, held open."""
        for path in self.directory.iterdir():
            if path.is_file() and not path.is_symlink():
                with contextlib.suppress(OSError):
                    os.chmod(path, FILE_MODE)

    def _lock_directory(self) -> None:
        """Lock the directory exclusively (``lock_exclusive``: refused at once while another
        tier holds it, waiting out checks)."""
        path = self.directory / LOCK_NAME
        self._lock_fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE
        )
        if (refused := lock_exclusive(self._lock_fd, path)) is not None:
            raise TierUnavailable(
                f"L2 directory {self.directory} is in use by another process or DiskTier "
                f"({refused.strerror})"
            )

    def _keep_file_bytes(self, file_bytes: int | None) -> None:
        """Keep the size of data file the index was made for where a capacity change alone
        would change it (``data_file_bytes``)."""
        alloc = self.allocator
        kept = data_file_bytes(
            self.directory, alloc.capacity_bytes, alloc.segment_bytes, file_bytes
        )
        if kept == self._file_bytes:
            return
        log.warning(
            "L2 keeps data files of %s, the size its index was made for, not %s: the blocks "
            "stay where they are",
            format_size(kept),
            format_size(self._file_bytes),
        )
        self._file_bytes = kept
        self.files = SlotFiles(
            self.directory, layout(self.directory, alloc.capacity_bytes, kept), kept, self._backend
        )

    def _geometry(self) -> dict[str, str]:
        return {
            "format_version": str(FORMAT_VERSION),
            "checksum": CHECKSUM_NAME,
            "capacity_bytes": str(self.allocator.capacity_bytes),
            "segment_bytes": str(self.allocator.segment_bytes),
            "file_bytes": str(self._file_bytes),
            "file_bytes_setting": str(self._file_bytes_setting),
        }

    @staticmethod
    def _file_sizes(files: list[tuple[Path, int]]) -> list[int]:
        """The bytes each data file really has now (0 when missing)."""
        out = []
        for path, _ in files:
            try:
                out.append(path.stat().st_size)
            except OSError:
                out.append(0)
        return out

    def _claim_quarantine(self, sizes: list[int], damaged: dict[int, str]) -> None:
        """Hold the slots the index keeps quarantined, but those whose bytes lie wholly in a
        data file's part made anew at this open (a file missing or unreadable, recreated; a
        short file's extension): the extents that failed are gone, so keeping them out of use
        would shrink the tier for good. Their rows are dropped (a drop that fails, the disk
        full, degrades the tier: the rows stay, and so do those slots held)."""
        rows = self._idx().quarantine_rows()
        if not rows:
            return
        slots = np.fromiter((r[0] for r in rows), np.int64, len(rows))
        nbytes = np.fromiter((r[1] for r in rows), np.int64, len(rows))
        file, offset = self._slot_places(slots, nbytes)
        renewed = np.zeros(len(rows), dtype=bool)
        for f, why in damaged.items():
            renewed |= (file == f) & (why != "short_file" or offset >= sizes[f])
        ok = ~renewed
        ok[ok] = self.allocator.claim_many(slots[ok], nbytes[ok])
        if not ok.all():
            try:
                self._idx().drop([], slots[~ok].tolist())
            except sqlite3.Error as e:
                # A full disk, as recovery's own drop meets it: the start goes on, degraded,
                # the rows kept for a later start. The renewed slots stay held as their rows
                # say: handed out, a block written there would be taken as quarantined then.
                self.faults.fault(classify(e), "index delete")
                ok[renewed] = self.allocator.claim_many(slots[renewed], nbytes[renewed])
        if (returned := int((renewed & ~ok).sum())) > 0:
            log.warning(
                "L2: %d quarantined slot(s) lay in data files recreated at this open; "
                "returned to service",
                returned,
            )
        self._quarantined = dict(zip(slots[ok].tolist(), nbytes[ok].tolist(), strict=True))
        self._quarantined_slot_bytes = int(self.allocator.slot_bytes_for(nbytes[ok]).sum())

    def _slot_places(self, slots: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The data file number and offset in it of each slot holding ``nbytes`` (vectorised;
        a slot below 0 counts as 0)."""
        alloc = self.allocator
        padded = -(-np.maximum(nbytes, 1) // alloc.align) * alloc.align
        seg, index = np.divmod(np.maximum(slots, 0), alloc.slots_cap)
        start = seg * alloc.segment_bytes + index * padded
        file, offset = np.divmod(start, self._file_bytes)
        return file, offset

    def _recover_chunk(
        self,
        chunk: list[tuple[int, bytes, int, int, int, float]],
        before: list[tuple[Path, int]],
        sizes: list[int],
        damaged: dict[int, str],
        lost: Counter[str],
        lost_files: Counter[str],
        drop: list[int],
    ) -> RecoveredBlocks:
        """Validate and claim one chunk of index rows, vectorised. ``before`` are the data
        files the index was written for, ``sizes`` their real sizes and ``damaged`` the
        reason each damaged one cannot back its blocks, all taken before the files were
        recreated or extended."""
        n = len(chunk)
        try:
            ns = np.fromiter((r[0] for r in chunk), np.int64, n).view(np.uint64)
            slots = np.fromiter((r[2] for r in chunk), np.int64, n)
            nbytes = np.fromiter((r[3] for r in chunk), np.int64, n)
            sums = np.fromiter((r[4] for r in chunk), np.int64, n).view(np.uint64)
            written = np.fromiter((r[5] for r in chunk), np.float64, n)
            # A key of another length sends the chunk row by row, so that it costs only its
            # own row. Each key's length, not the joined length: a short key and a long one
            # add up to 32 bytes a row, and the rows between them took their neighbours' bytes.
            if any(len(r[1]) != 32 for r in chunk):
                raise ValueError("a key of another length than 32 bytes")
            keys = np.frombuffer(b"".join(bytes(r[1]) for r in chunk), np.uint8).reshape(n, 32)
        except (TypeError, ValueError, OverflowError):
            return self._recover_rows_one_by_one(
                chunk, before, sizes, damaged, lost, lost_files, drop
            )
        alloc = self.allocator
        good = (slots >= 0) & (nbytes > 0)
        padded = -(-np.maximum(nbytes, 1) // alloc.align) * alloc.align
        good &= padded <= alloc.segment_bytes
        reason = np.where(good, "", "bad_row").astype(object)
        file, offset = self._slot_places(slots, nbytes)
        for f, why in damaged.items():
            hit = good & (file == f)
            if why == "short_file":
                hit &= offset + padded > sizes[f]
            reason[hit] = why
            good &= ~hit
            if hit.any():
                lost_files[before[f][0].name] += int(hit.sum())
        # Under the lock: a read failing on another thread (a Get served between chunks)
        # quarantines a slot meanwhile.
        with self._state_lock:
            held = np.fromiter(self._quarantined, np.int64, len(self._quarantined))
        if len(held):
            reason[good & np.isin(slots, held)] = "quarantined"
            good &= ~np.isin(slots, held)
        claimed = np.zeros(n, dtype=bool)
        sel = np.flatnonzero(good)
        claimed[sel] = alloc.claim_many(slots[sel], nbytes[sel])
        reason[good & ~claimed] = "beyond_capacity"
        with self._state_lock:
            self._committed.add_array(slots[claimed])
        for why, count in zip(
            *np.unique(reason[~claimed].astype(str), return_counts=True), strict=True
        ):
            lost[str(why)] += int(count)
        drop += slots[~claimed].tolist()
        return RecoveredBlocks(
            ns[claimed],
            keys[claimed],
            slots[claimed],
            nbytes[claimed],
            sums[claimed],
            written[claimed],
        )

    def _recover_rows_one_by_one(
        self,
        chunk: list[tuple[int, bytes, int, int, int, float]],
        before: list[tuple[Path, int]],
        sizes: list[int],
        damaged: dict[int, str],
        lost: Counter[str],
        lost_files: Counter[str],
        drop: list[int],
    ) -> RecoveredBlocks:
        """A chunk with rows of the wrong types or keys of another length (a hand-edited or
        damaged index): keep the rows that are sound."""
        # One pass: looking each row up among the sound ones compared rows squared times.
        sound: list[tuple[int, bytes, int, int, int, float]] = []
        bad: list[object] = []
        for r in chunk:
            if (
                isinstance(r[0], int)
                and isinstance(r[1], bytes)
                and len(r[1]) == 32
                and all(isinstance(x, int) for x in r[2:5])
                and isinstance(r[5], (int, float))
                and -(1 << 63) <= r[0] < 1 << 63
            ):
                sound.append(r)
            else:
                bad.append(r[2])
        lost["bad_row"] += len(bad)
        drop += [b for b in bad if isinstance(b, int)]
        if not sound:
            return RecoveredBlocks.of([])
        return self._recover_chunk(sound, before, sizes, damaged, lost, lost_files, drop)

    def _release_resources(self) -> None:
        if self._watch is not None:
            # Woken at once; its last check is one the index's close would make anyway.
            self._watch_stop.set()
            self._watch.join()
            self._watch = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.files.close()
        if self._index is not None:
            self._index.close()
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1


_NO_SLOTS = np.zeros(0, dtype=np.int64)


def _ref_pairs(refs: Sequence[BlockRef]) -> set[tuple[int, bytes]]:
    """The (ns, key) of each of ``refs``, as the index's rows name them (``block_keys``)."""
    if isinstance(refs, BlockRefs):
        return set(zip(refs.ns.tolist(), refs.key_bytes(), strict=True))
    return {(int(r[0]), bytes(r[1])) for r in refs}


def _nothing() -> None:
    pass


def _host_views(src: object, n: int, nbytes: int) -> list[memoryview]:
    """Contiguous bytes of each block of a batch's source."""
    if isinstance(src, HostBuffers):
        return list(map(_as_bytes, src.views))
    return [get_block(src, j, nbytes) for j in range(n)]  # type: ignore[arg-type]


_COUNTERS = (
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
    "index_moved_aside",
    "index_restored",
    "index_restore_failures",
    "commits",
    "committed_blocks",
    "commits_refused_degraded",
    "removed_slots",
    "remove_failures",
    "removals_on_reserve",
    "overwritten_blocks",
    "read_calls",
    "write_calls",
    "bounced_blocks",
    "syncs",
    "recovered_blocks",
    "recovery_dropped_rows",
    "blocks_lost_at_recovery",
)

__all__ = [
    "ALIGN",
    "CHECKSUM_NAME",
    "BlockRef",
    "DiskTier",
    "ReadItem",
    "checksum",
    "fsync_dir",
]
