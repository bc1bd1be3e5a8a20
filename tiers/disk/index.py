"""The disk tier's index: a SQLite database (WAL, ``synchronous=FULL``) of every durable block.

Tables: ``meta`` (the geometry the data files were made with; in a new index made beside
data files whose blocks it cannot name, until its first block commits, when and why:
``MADE_EMPTY``), ``blocks`` (``slot -> ns, key,
nbytes, checksum, written_at``), ``quarantine`` (slots whose bytes failed, held out of
service across restarts), ``namespaces`` (their owners' labels) and ``l3_removals`` (store keys
whose removal from L3 the store has not confirmed yet, with when the store drops them anyway:
kept here for the L3 tier, which has no disk of its own). No block row commits without the
record of its namespace that the owner asked for: a record whose own commit failed is written
by the next commit of block rows, in its transaction (``remember``), and so is the drop of one
(``forget``).

``blocks`` is keyed by slot, with no index on ``(ns, key)``: the daemon keeps the key map in memory
and needs the index only to recover it, to delete rows by slot and to check slots. A row insert then
costs one append near the end of one B-tree (slots are handed out low first) rather than two random
descents (a primary key on 32 random bytes, plus a unique slot index), which made commits of 4,096
rows into an index of 400,000 about 8x slower (115 vs 14.5 ms). The index does not enforce one row
per key: a key gets a new slot only after losing its old one, and a block commit deletes, in its own
transaction, the rows of its keys in slots whose blocks are gone but whose delete failed or was not
tried yet (``DiskTier.removing``), or whose quarantine a lock kept from the index, so a key put
again meanwhile does not commit beside its older row; an
index an earlier kvtier wrote may hold two, of which recovery's consumer keeps the row written last
(``RecoveredBlocks.latest_of_each_key``). Index format 1 (``(ns,
key)`` primary key, written before ``PRAGMA user_version`` was set) is migrated at open, in one
transaction (rows whose slot is not an integer, which recovery would drop anyway, are left out and
counted in the log); when that fails (a full disk, an I/O error) the open fails with
``IndexUpgradeFailed`` and the old index stays as it was. A format newer than this code knows is
moved aside.

At open, an index SQLite cannot read or that fails ``quick_check``, or one without its
metadata, is moved aside (renamed with a timestamp) and replaced by an empty one; so is one
made for another geometry (segment or file size, format, checksum), since its slot numbers
would mean other bytes. A full disk (SQLITE_FULL, no room for the shared memory file:
SQLITE_IOERR_SHMSIZE, or no inode for the WAL's files: ENOSPC) is no reason to move one aside,
nor is a lock another process holds past the busy timeout (SQLITE_BUSY): the open raises it. A
changed capacity alone keeps the index: the rows beyond it are dropped by recovery (and the tier
keeps the file size the index was made for where the capacity alone would change it:
``tier.data_file_bytes``, which reads it with ``stored_geometry``: a lock there is raised too,
never taken for an index of no geometry). What happened is reported (``moved_aside``), not only
logged.

While open, every commit (a block's, a delete's, a quarantine's) checks that the index file,
its WAL and its shared memory are still the ones its path names (device and inode): SQLite
keeps writing to files removed or replaced under it, and a restart would not find those commits
(nor would another process's writer see the locks in a removed shared memory). A removed WAL
(or shared memory) is checkpointed (from the open, unlinked file) into the index file and new
ones started, so the commits stand; while another process's read transaction keeps that
checkpoint from finishing, the commit fails as busy (``IndexCheckpointBusy``, SQLITE_BUSY),
which the tier retries as it does a locked index, and the next commit tries the checkpoint
again. The files are checked before each write transaction too, so that nothing goes into a WAL
removed since the last commit (a busy checkpoint fails the write before it starts); a block
commit that found the WAL removed during its transaction deletes its rows again, in that same
WAL, before it fails, so a later checkpoint brings the rows to the index file with their
deletion or not at all: a block whose write was reported failed never comes back at a restart.
A removed index file is written back from the open connection (SQLite's backup API, into
``index.sqlite3.restore``, synced, then renamed into place, the old WAL and shared memory
removed first so they are not replayed onto it), and commits go on into it: a restart finds
every block committed before and after the removal (counted as ``index_restored``). A removal
after the last commit is mended by the tier's watch, which calls ``check_files`` between
commits (every ``index_watch_s`` of the tier: a stat of the three files when nothing changed,
no lock and no SQLite; the commit's check when something did), so a crash while the tier is
idle loses nothing either; and by ``close``. A write-back that the daemon's end cut short after
its copy was synced is finished at the next open (``_finish_restore``). Recovery reads the rows
through the same connection, a chunk at a time between commits (``rows_after``), its files
checked first (the tier calls ``check_files``): an index removed before recovery read it is
written back, and no second connection of the process shares this one's locks and shared memory
(SQLite keeps one of each per file in a process). Where it cannot be written back, and where
the index file was replaced by another, the commit fails (``IndexFilesReplaced``), which
degrades the tier for good; a block commit's rows are deleted again first, as ``close`` may yet
write the index back.

Thread-safety: every method may be called from any thread; the connection is serialised.
"""

from __future__ import annotations

import calendar
import contextlib
import errno
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.tiers.disk.files import FILE_MODE, fsync_dir
from kvtier.tiers.disk.health import classify
from kvtier.tiers.sizes import format_size

log = logging.getLogger("kvtier.tiers.disk")

INDEX_NAME = "index.sqlite3"
# The copy of an index removed while open is written here, then renamed to ``INDEX_NAME``.
RESTORE_SUFFIX = ".restore"
LAYOUT_CHANGED = "was made for another layout"
# How long a statement waits for a lock another process holds on the index (an operator's
# ``sqlite3`` shell in a write transaction) before it fails with SQLITE_BUSY.
BUSY_TIMEOUT_S = 30.0
# Rows per statement when slots are listed in an IN (...) clause.
_CHUNK = 500
# Block rows per INSERT statement: binding rows one statement step each cost about 60% more
# (4,096 rows: 6.6 vs 4.0 ms in memory, 14 ms on the disk thread of a durable 4 KiB put).
# 128 rows are 768 parameters, under the 999 that SQLite before 3.32 allows.
_INSERT_ROWS = 128
_ROW_VALUES = "(?, ?, ?, ?, ?, ?)"
_INSERT_ONE = f"INSERT OR REPLACE INTO blocks VALUES {_ROW_VALUES}"
_INSERT_MANY = f"INSERT OR REPLACE INTO blocks VALUES {', '.join([_ROW_VALUES] * _INSERT_ROWS)}"

# The ``meta`` row a new index made beside data files whose blocks it cannot name (the index
# found there moved aside as damaged, or none found) holds until its first block commits:
# when, and why. A start refused after the open (L1's) left the next start an index that opened
# as any other and nothing to say of the blocks lost; that start says it now (``made_empty``).
MADE_EMPTY = "made_empty"

# The index format this code writes, in ``PRAGMA user_version`` (0: format 1, made before it
# was recorded: blocks keyed by (ns, key)).
INDEX_FORMAT = 2
# Format 2's blocks table, keyed by slot (the rowid).
_BLOCK_COLUMNS = """(
    ns INTEGER NOT NULL,
    key BLOB NOT NULL,
    slot INTEGER PRIMARY KEY,
    nbytes INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    written_at REAL NOT NULL
)"""
# The L3 tier's unconfirmed removals: a table of this index, or of a ``removals_file`` of its
# own (``kvtier.tiers.remote.journal``), read and written by the two functions below alike.
L3_REMOVALS_SCHEMA = """
CREATE TABLE IF NOT EXISTS l3_removals (
    key BLOB PRIMARY KEY,
    until REAL
) WITHOUT ROWID;
"""
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blocks {_BLOCK_COLUMNS};
CREATE TABLE IF NOT EXISTS namespaces (
    ns INTEGER PRIMARY KEY,
    label TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS quarantine (
    slot INTEGER PRIMARY KEY,
    nbytes INTEGER NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
{L3_REMOVALS_SCHEMA}"""
# The table a format-1 index's rows are copied into before it takes the name ``blocks``.
_BLOCKS_V2 = f"CREATE TABLE blocks_v2 {_BLOCK_COLUMNS}"


def read_l3_removals(db: sqlite3.Connection) -> list[tuple[bytes, float | None]]:
    """Every entry of ``l3_removals``: ``(store key, until)``, until a wall-clock time (None:
    never)."""
    rows = db.execute("SELECT key, until FROM l3_removals").fetchall()
    return [(bytes(key), None if until is None else float(until)) for key, until in rows]


def write_l3_removals(
    db: sqlite3.Connection,
    added: Sequence[tuple[bytes, float | None]],
    dropped: Sequence[bytes],
) -> None:
    """Delete ``dropped`` from ``l3_removals`` and add (or replace) ``added``, in the
    caller's transaction."""
    db.executemany("DELETE FROM l3_removals WHERE key = ?", [(k,) for k in dropped])
    db.executemany("INSERT OR REPLACE INTO l3_removals VALUES (?, ?)", added)


_NS_MASK = (1 << 64) - 1  # a row's namespace (signed, ``_signed``) as the unsigned one


def _signed(ns: int) -> int:
    """A 64-bit namespace id as SQLite's signed integer."""
    return ns - (1 << 64) if ns >= 1 << 63 else ns


def _insert(db: sqlite3.Connection, rows: Sequence[BlockRow]) -> None:
    """Insert or replace block rows, ``_INSERT_ROWS`` per statement (in the caller's
    transaction)."""
    full = len(rows) // _INSERT_ROWS * _INSERT_ROWS
    flat = list(chain.from_iterable(rows[:full]))
    if len(flat) != 6 * full:
        raise ValueError("a block row has 6 values")
    width = 6 * _INSERT_ROWS
    if full:
        db.executemany(_INSERT_MANY, [flat[i : i + width] for i in range(0, len(flat), width)])
    if full < len(rows):
        db.executemany(_INSERT_ONE, rows[full:])


# Geometry kept in ``meta`` that a slot's place does not depend on: an index made for other
# values is used, and its ``meta`` updated. ``file_bytes_setting`` (the file size configured,
# where ``file_bytes`` is the size the files have) tells a size kept across capacity changes
# from a smaller one the operator set (``tier.data_file_bytes``).
NOT_LAYOUT = ("capacity_bytes", "file_bytes_setting")


def stored_geometry(directory: Path) -> dict[str, str]:
    """The geometry the index in ``directory`` was made for (its ``meta``), read through a
    read-only connection that changes nothing; {} where there is no index, one of its files
    is a symbolic link, or it cannot be read so (the open then decides what it holds).
    Without an index file, a write-back's whole copy (``RESTORE_SUFFIX``, no journal beside
    it) is what the open puts in its place (``DiskIndex._finish_restore``): its geometry.
    Raises the sqlite3.Error where another process holds it locked past ``BUSY_TIMEOUT_S``
    (``classify``: "locked"), as the open would: a lock says nothing of what it holds."""
    path = directory / INDEX_NAME
    files = [path.with_name(path.name + end) for end in ("", "-wal", "-shm", "-journal")]
    copy = path.with_name(path.name + RESTORE_SUFFIX)
    try:
        if not os.path.lexists(path) and copy.is_file() and not copy.is_symlink():
            # Read from the index file alone, the size kept was unknown: with the capacity
            # changed, the copy put in place was moved aside as another layout, every block
            # lost. Read alone (immutable): nothing writes a whole copy, and a connection in
            # WAL mode would leave a WAL and shared memory beside it.
            if os.path.lexists(copy.with_name(copy.name + "-journal")):
                return {}  # cut short: not used
            return _read_meta(f"{copy.absolute().as_uri()}?immutable=1")
        if not path.is_file() or any(f.is_symlink() for f in files):
            return {}
        try:
            return _read_meta(f"{path.absolute().as_uri()}?mode=ro")
        except sqlite3.Error as e:
            # After a clean stop SQLite must make its shared memory file to read, which a
            # full disk refuses: the size kept was then taken as unknown, and the index, made
            # for files of that size, moved aside as another layout. With the WAL empty
            # (or gone), the index file holds every page: read alone, it is the same meta.
            if classify(e).kind == "locked" or (files[1].exists() and files[1].stat().st_size):
                raise
            return _read_meta(f"{path.absolute().as_uri()}?immutable=1")
    except (OSError, sqlite3.Error) as e:
        # A lock taken for "no geometry" had the tier choose its files' size by the config
        # alone: with the capacity changed, the index (once let go) moved aside as another
        # layout, every block lost.
        if classify(e).kind == "locked":
            raise
        return {}


class MovedAside(NamedTuple):
    """An index an open moved aside (``DiskIndex._move_aside``), as its name tells."""

    name: str  # the file's name in the tier's folder
    why: str  # "as damaged", or "as made for another layout"
    at: float  # when, in seconds since the epoch (to the second)


# ``DiskIndex._move_aside``'s names: the index's name, why, the UTC time, and a count where
# one of that second was there already.
_ASIDE_STAMP = "%Y%m%dT%H%M%S"
_ASIDE_NAME = re.compile(rf"{re.escape(INDEX_NAME)}\.(corrupt|old)-(\d{{8}}T\d{{6}})(?:-(\d+))?")
_ASIDE_WHY = {"corrupt": "as damaged", "old": "as made for another layout"}


def last_moved_aside(directory: Path) -> MovedAside | None:
    """The index an open moved aside in ``directory`` last, as the names ``_move_aside`` gives
    the files tell; None where there is none. A name of that form whose time is no time
    (month 13: a copy named by hand) is no file ``_move_aside`` made: left out."""
    found: list[tuple[int, int, str, str]] = []
    for path in directory.glob(f"{INDEX_NAME}.*-*"):
        if (m := _ASIDE_NAME.fullmatch(path.name)) is None:
            continue
        try:
            at = calendar.timegm(time.strptime(m[2], _ASIDE_STAMP))
        except ValueError:
            continue
        found.append((at, int(m[3] or 1), m[1], path.name))
    if not found:
        return None
    at, _, word, name = max(found)
    return MovedAside(name, _ASIDE_WHY[word], float(at))


def _read_meta(uri: str) -> dict[str, str]:
    # The open's busy timeout: SQLite's default (5 s) gave up on a lock the open waited out.
    db = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S)
    try:
        return {str(k): str(v) for k, v in db.execute("SELECT name, value FROM meta")}
    finally:
        db.close()


def _count_nothing(**_: int) -> None:
    pass


class IndexUpgradeFailed(Exception):
    """An index of an older format could not be rewritten; it is left untouched."""


class IndexFilesReplaced(sqlite3.OperationalError):
    """The index file was removed or replaced while open: commits no longer reach it."""


class IndexCheckpointBusy(sqlite3.OperationalError):
    """The WAL (or shared memory) was removed or replaced while open, and another connection's
    read transaction kept its checkpoint into the index file from finishing: transient, so it
    carries SQLITE_BUSY's code, as a lock held past the busy timeout does
    (``health.classify``)."""

    sqlite_errorcode = 5  # SQLITE_BUSY
    sqlite_errorname = "SQLITE_BUSY"


class IndexNoRoom(sqlite3.OperationalError):
    """No room (space, or an inode: ENOSPC, EDQUOT) for a file of the index made before
    SQLite opens it: it carries SQLITE_FULL's code, a full disk as SQLite's own (``classify``)."""

    sqlite_errorcode = 13  # SQLITE_FULL
    sqlite_errorname = "SQLITE_FULL"


class IndexNotMade(sqlite3.OperationalError):
    """A new index (none was found, or the one found was moved aside: ``moved_aside``,
    ``moved_to``) could not be made, its file removed again so that the next open makes it
    anew. It carries the failure's SQLite code, read by ``classify`` as that failure's; for
    an error of the system's making one of its files (EIO, EACCES), named by its errno, a full
    disk's read as SQLITE_FULL."""

    def __init__(self, cause: sqlite3.Error | OSError, moved_aside: str, moved_to: str) -> None:
        super().__init__(str(cause))
        if isinstance(cause, OSError):
            full = classify(cause).kind == "enospc"
            self.sqlite_errorcode = IndexNoRoom.sqlite_errorcode if full else 0
            self.sqlite_errorname = errno.errorcode.get(cause.errno or 0, type(cause).__name__)
        else:
            self.sqlite_errorcode = getattr(cause, "sqlite_errorcode", 0)
            self.sqlite_errorname = getattr(cause, "sqlite_errorname", type(cause).__name__)
        self.moved_aside = moved_aside
        self.moved_to = moved_to


class _NoRoom(Exception):
    """A transaction's ``room`` check refused its commit (``DiskIndex.transaction``)."""


FileId = tuple[int, int] | None  # (st_dev, st_ino) of a file, None when there is none
# Whether a commit may take the room its pages need (``DiskIndex.transaction``).
Room = Callable[[], bool]


BlockRow = tuple[int, bytes, int, int, int, float]  # ns, key, slot, nbytes, checksum, written_at


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection, *, wait_busy: bool = True) -> Iterator[sqlite3.Connection]:
    """One write transaction on ``db``: committed when the block ends, rolled back when it
    raises (anything, the raise going on); ``wait_busy`` as for ``_begin``."""
    _begin(db, wait_busy=wait_busy)
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise


def _begin(db: sqlite3.Connection, *, wait_busy: bool = True) -> None:
    """Begin a write transaction on ``db``. ``wait_busy=False``: a lock another process holds
    fails it at once (SQLITE_BUSY) instead of after ``BUSY_TIMEOUT_S``."""
    with contextlib.nullcontext() if wait_busy else _no_busy_wait(db):
        db.execute("BEGIN IMMEDIATE")


@contextlib.contextmanager
def _no_busy_wait(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``db`` with no busy timeout for the block: a lock another connection holds fails at
    once (SQLITE_BUSY) instead of after ``BUSY_TIMEOUT_S``."""
    db.execute("PRAGMA busy_timeout = 0")
    try:
        yield db
    finally:
        db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")


class DiskIndex:
    def __init__(
        self,
        directory: Path,
        geometry: dict[str, str],
        clock: Callable[[], float] = time.time,
        count: Callable[..., None] | None = None,
        data_files: int = 0,
        moved: tuple[str, str] = ("", ""),
    ) -> None:
        """Open (or create) the index of ``directory`` for ``geometry`` (name -> value; the
        key ``capacity_bytes`` may differ from the stored one). ``count`` is called with
        counter increments (``index_restored=1``) for what the index mends by itself.
        ``data_files``: how many the tier found before the open; a new index made beside
        some (none found, or the one found moved aside as damaged) records so
        (``MADE_EMPTY``) until its first block commits. ``moved``: what an earlier open of
        this start moved aside (why, and as what) before it could not make the new index
        (``IndexNotMade``), taken as this open's (``moved_aside``, and that record)."""
        self.path = directory / INDEX_NAME
        self._directory = directory
        self._geometry = geometry
        self._clock = clock
        self._count: Callable[..., None] = count or _count_nothing
        self._unrestorable = ""  # why an index removed while open could not be written back
        # While ``_check_files`` has the connection closed to start a new WAL, until the open
        # (``_reopen``) at its next use succeeds: an ``O_PATH`` descriptor of the index file
        # it closed, which keeps that file's inode (and so its number: ``_reopen`` compares
        # it) from going to another file. ``O_PATH``: closing it does not drop the process's
        # POSIX locks on the file, as closing any other would. No connection and nothing
        # held: the index is closed for good (``close``, or a write-back that failed).
        self._held: int | None = None
        # Namespace records whose commit failed (ns -> label; None: the record dropped, by
        # ``forget``): made by the next commit.
        self._unrecorded: dict[int, str | None] = {}
        # Reentrant: a caller holding it across several calls (``held``) makes them as usual.
        self._lock = threading.RLock()
        # Why the index found at open (or by an earlier open: ``moved``) was moved aside, if
        # it was, and as what.
        self.moved_aside, self.moved_to = moved
        # Whether the open found no index (nor a write-back's copy to put in its place) and
        # made a new one: the tier's cue for an index missing beside its data files.
        self.found_none = False
        # What makes an index of another layout (LAYOUT_CHANGED) unusable: logged with the
        # name it is moved aside as, in one warning.
        self._layout_change = ""
        self.previous_capacity: int | None = None  # the stored capacity when it differs
        # The ``MADE_EMPTY`` record of the index found: an earlier start made it empty beside
        # data files, and no block committed since ('': none); and the record the index holds
        # (this open's too; '': none), which the first block commit deletes.
        self.made_empty = ""
        self._made_empty_kept = ""
        self._data_files = data_files
        self._db = self._open()
        self._ids = self._file_ids()

    # ------------------------------------------------------------------ reading

    def quarantine_rows(self) -> list[tuple[int, int]]:
        """The quarantine's rows, ``(slot, nbytes)`` (the block rows: ``rows_after``)."""
        with self._lock:
            return self._conn().execute("SELECT slot, nbytes FROM quarantine").fetchall()

    def quarantine_records(self) -> dict[int, tuple[str, float]]:
        """slot -> (reason, time) of each quarantine row."""
        with self._lock:
            rows = self._conn().execute("SELECT slot, reason, at FROM quarantine").fetchall()
        return {int(slot): (str(reason), float(at)) for slot, reason, at in rows}

    def rows_after(self, slot: int | None, count: int) -> list[BlockRow]:
        """Up to ``count`` block rows of the slots above ``slot`` (None: from the first, a
        negative slot's row too, which recovery drops as bad), in slot order (a range of
        the table's key). Recovery reads the rows so, a chunk at a time through this
        connection, commits going on between chunks, rather than streaming them through a
        second connection of this process: SQLite shares one set of locks and one shared
        memory per file in a process, so a reopen for a new WAL (``_check_files``) beside that
        reader mapped the removed WAL's shared memory, ``_connect``'s own open and close of
        the files dropped the reader's locks, and a removed WAL's checkpoint waited out the
        busy timeout for the reader's read transaction, holding the index."""
        select = "SELECT ns, key, slot, nbytes, checksum, written_at FROM blocks"
        with self._lock:
            db = self._conn()
            if slot is None:
                return db.execute(f"{select} ORDER BY slot LIMIT ?", (count,)).fetchall()
            return db.execute(
                f"{select} WHERE slot > ? ORDER BY slot LIMIT ?", (slot, count)
            ).fetchall()

    def namespaces(self) -> dict[int, str]:
        """The labels the tier's owner recorded for namespace ids (``remember``)."""
        with self._lock:
            rows = self._conn().execute("SELECT ns, label FROM namespaces").fetchall()
        return {int(ns) & ((1 << 64) - 1): str(label) for ns, label in rows}

    def remember(
        self, ns: int, label: str, *, wait_busy: bool = True, room: Room | None = None
    ) -> bool:
        """Record ``label`` for namespace ``ns``, with the records kept since their commit
        failed. Raises what the commit raised (a full disk, a lock), and returns False where
        ``room`` refused it (``transaction``); the record is then kept and made by the next commit
        of block rows, in its transaction (``insert_when``), or of a record, so that no block row
        commits without its namespace's record. ``wait_busy=False``: a lock another process holds
        fails it at once, as in ``insert_when``."""
        return self._commit_names({ns: label}, wait_busy=wait_busy, room=room)

    def forget(
        self, names: Sequence[int], *, wait_busy: bool = True, room: Room | None = None
    ) -> bool:
        """Drop the records of ``names`` (those kept since their commit failed too), as
        ``remember`` makes one: where the commit fails, the drop is kept for the next commit,
        so that a namespace with no block is not bound to its owner again at the next open;
        a record made again meanwhile replaces it."""
        return self._commit_names(dict.fromkeys(names), wait_busy=wait_busy, room=room)

    def _commit_names(
        self, changes: dict[int, str | None], *, wait_busy: bool, room: Room | None
    ) -> bool:
        """Commit ``changes`` (ns -> label, None to drop its record) with those kept since
        their commit failed; kept in turn where this commit fails or ``room`` refuses it
        (False)."""
        with self._lock:
            self._unrecorded.update(changes)
            try:
                with self.transaction(wait_busy=wait_busy, room=room) as db:
                    self._record_names(db)
            except _NoRoom:
                return False
            self._unrecorded.clear()
        return True

    def _record_names(self, db: sqlite3.Connection) -> None:
        """Write the namespace records (and drops) ``remember`` and ``forget`` could not
        commit yet, in the caller's transaction. Called holding ``_lock``."""
        kept = [(_signed(ns), label) for ns, label in self._unrecorded.items() if label is not None]
        dropped = [(_signed(ns),) for ns, label in self._unrecorded.items() if label is None]
        if kept:
            db.executemany("INSERT OR REPLACE INTO namespaces VALUES (?, ?)", kept)
        if dropped:
            db.executemany("DELETE FROM namespaces WHERE ns = ?", dropped)

    def l3_removals(self) -> list[tuple[bytes, float | None]]:
        """What ``record_l3_removals`` left (``read_l3_removals``)."""
        with self._lock:
            return read_l3_removals(self._conn())

    def record_l3_removals(
        self,
        added: Sequence[tuple[bytes, float | None]],
        dropped: Sequence[bytes],
        room: Room | None = None,
    ) -> None:
        """``write_l3_removals`` in one transaction; ``room`` as for ``transaction``, but it
        must not refuse: the tier never refuses this record (``DiskTier._reserve_grown``)."""
        with self.transaction(room=room) as db:
            write_l3_removals(db, added, dropped)

    def committed_slots(self, slots: Sequence[int]) -> list[int]:
        """Which of ``slots`` have a block row."""
        return [row[0] for row in self._block_rows_of("slot", slots)]

    def block_keys(self, slots: Sequence[int]) -> dict[int, tuple[int, bytes]]:
        """slot -> (ns, key) of the block row of each of ``slots`` that has one: a read,
        which another process's write transaction does not hold up (WAL)."""
        rows = self._block_rows_of("slot, ns, key", slots)
        return {int(slot): (int(ns) & _NS_MASK, bytes(key)) for slot, ns, key in rows}

    def _block_rows_of(self, columns: str, slots: Sequence[int]) -> list[tuple[Any, ...]]:
        """``columns`` of the block rows of ``slots`` (those that have one), in chunks."""
        found: list[tuple[Any, ...]] = []
        with self._lock:
            db = self._conn()
            for start in range(0, len(slots), _CHUNK):
                chunk = list(slots[start : start + _CHUNK])
                marks = ",".join("?" * len(chunk))
                query = f"SELECT {columns} FROM blocks WHERE slot IN ({marks})"
                found += db.execute(query, chunk).fetchall()
        return found

    # ------------------------------------------------------------------ writing

    def insert_when(
        self,
        rows: Sequence[BlockRow],
        durable: Callable[[], Sequence[int] | None],
        *,
        wait_busy: bool = True,
    ) -> bool:
        """Insert or replace ``rows``, and the namespace records ``remember`` and ``forget``
        could not commit, in a transaction that commits only once ``durable`` returns, so that
        SQLite inserts while the rows' bytes are still going to disk. ``durable`` runs inside the
        transaction, holding the index (it must not commit through it; ``growth_bytes`` reads the
        transaction's size through it), and returns the slots whose rows the transaction deletes
        (of ``rows``, those not to commit after all; others, older rows on their way out), or None
        to commit nothing. True when the rows, less those, are committed; what
        ``durable`` raises rolls the rows back and propagates. ``wait_busy=False``: a lock another
        process holds fails the transaction at once (SQLITE_BUSY) instead of after the busy timeout
        (a write let through to find out whether that lock was let go), and so does the checkpoint
        of a removed WAL that another process's reader holds up."""
        with self._lock:
            db = self._checked_conn(wait_busy=wait_busy)
            _begin(db, wait_busy=wait_busy)
            try:
                _insert(db, rows)
                if self._unrecorded:
                    self._record_names(db)
                drop = durable()
                if drop is None:
                    db.execute("ROLLBACK")
                    return False
                if len(drop):
                    db.executemany("DELETE FROM blocks WHERE slot = ?", [(s,) for s in drop])
                record = self._made_empty_kept
                cleared = bool(record) and not {row[2] for row in rows}.issubset(drop)
                if cleared:  # a block commits: the index is in service
                    db.execute("DELETE FROM meta WHERE name = ?", (MADE_EMPTY,))
                db.execute("COMMIT")
                if cleared:
                    self._made_empty_kept = ""
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            try:
                self._check_files(db)
            except sqlite3.Error:
                # The rows are committed, maybe only into a WAL that was removed meanwhile (a
                # later checkpoint would bring them to the index file), or into an index file
                # removed meanwhile that could not be written back yet (``close`` tries
                # again): a restart would serve blocks whose write failed. Deleted again in
                # the same connection, they reach the index file with their deletion or not
                # at all; so does the ``MADE_EMPTY`` record it deleted, put back.
                self._undo_insert(db, rows, drop, record if cleared else "")
                raise
            self._unrecorded.clear()
        return True

    def delete(self, slots: Sequence[int]) -> None:
        with self.transaction() as db:
            db.executemany("DELETE FROM blocks WHERE slot = ?", [(s,) for s in slots])

    def delete_in_steps(self, slots: Sequence[int], step: int) -> None:
        """Delete the rows of ``slots`` ``step`` at a time, each step its own transaction
        after ``restart_wal``, so that the step writes over the WAL file's room (what an
        earlier removal or the writes before the disk filled grew it to), or grows it by about
        one step's pages (a removal on a full disk). A crash between steps keeps the steps
        committed; the rows not reached stay, as after a failed ``delete``."""
        for start in range(0, len(slots), step):
            self.restart_wal()
            self.delete(slots[start : start + step])

    def restart_wal(self) -> None:
        """Checkpoint the whole WAL so that the next commit writes over its file from the
        start. Where it fails (a reader holds the WAL: it does not wait, as waiting would hold
        the index's lock for the busy timeout; or short of room where the WAL holds pages
        beyond the index file's end, which the checkpoint grows the file to hold) the next
        commit appends to the WAL."""
        with self._lock, contextlib.suppress(sqlite3.Error), _no_busy_wait(self._conn()) as db:
            db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()

    def probe(self, room: Room | None = None) -> bool:
        """Commit a transaction that writes one page (the header's ``user_version``, set to
        what it holds), and the namespace records and drops kept since their commit failed
        (``remember``, ``forget``: a tier that commits no block would keep them till closed),
        synced as every commit is, not waiting for a lock another process holds, nor for its
        reader holding up the checkpoint of a removed WAL: whether the index takes commits
        again (a full disk freed, a lock let go). ``room`` as for ``transaction``: False
        where it refused the commit. Raises what the commit raised."""
        with self._lock:
            db = self._checked_conn(wait_busy=False)
            try:
                with _no_busy_wait(db), _immediate(db):
                    db.execute(f"PRAGMA user_version = {INDEX_FORMAT}")
                    self._record_names(db)
                    if room is not None and not room():
                        raise _NoRoom
            except _NoRoom:
                return False
            self._check_files(db, wait_busy=False)
            self._unrecorded.clear()
        return True

    def growth_bytes(self) -> int:
        """The bytes of pages the WAL holds past the index file's end (in a write transaction,
        its pages too): the index's growth since its last checkpoint, which a checkpoint, the
        WAL's restart included, must grow the file by. A page count and a ``stat``; 0 where
        the file cannot be looked at (the next commit's check reports it)."""
        with self._lock:
            pages, page_bytes = (
                self._conn()
                .execute("SELECT * FROM pragma_page_count(), pragma_page_size()")
                .fetchone()
            )
            try:
                return max(0, pages * page_bytes - os.stat(self.path).st_size)
            except OSError:
                return 0

    def quarantine(self, entries: Sequence[tuple[int, int, str]], room: Room | None = None) -> bool:
        """Hold ``(slot, nbytes, reason)`` out of service and delete their block rows; False
        where ``room`` refused the commit (``transaction``)."""
        now = self._clock()
        try:
            with self.transaction(room=room) as db:
                db.executemany("DELETE FROM blocks WHERE slot = ?", [(e[0],) for e in entries])
                db.executemany(
                    "INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?)",
                    [(slot, nbytes, reason[:200], now) for slot, nbytes, reason in entries],
                )
        except _NoRoom:
            return False
        return True

    def drop(self, block_slots: Sequence[int], quarantine_slots: Sequence[int]) -> None:
        with self.transaction() as db:
            db.executemany("DELETE FROM blocks WHERE slot = ?", [(s,) for s in block_slots])
            db.executemany(
                "DELETE FROM quarantine WHERE slot = ?", [(s,) for s in quarantine_slots]
            )

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the index across several calls of this thread: no other thread commits
        meanwhile."""
        with self._lock:
            yield

    @contextlib.contextmanager
    def transaction(
        self, *, wait_busy: bool = True, room: Room | None = None
    ) -> Iterator[sqlite3.Connection]:
        """One write transaction, the files checked before and after it (``_check_files``).
        ``room`` is called once the block's statements ran, before the commit, holding the
        index (``growth_bytes`` counts the transaction's pages), as ``insert_when`` calls
        ``durable``: False rolls the transaction back and raises ``_NoRoom``, which
        ``remember``, ``forget`` and ``quarantine`` answer as False."""
        with self._lock:
            db = self._checked_conn(wait_busy=wait_busy)
            with _immediate(db, wait_busy=wait_busy):
                yield db
                if room is not None and not room():
                    raise _NoRoom
            self._check_files(db)

    def check_files(self) -> None:
        """Between commits: mend the index's files as a commit's check does (``_check_files``:
        a removed index written back, a removed WAL or shared memory checkpointed), so that a crash
        before the next commit does not lose what the removed files held. When nothing changed this
        is a stat of the index file, its WAL and its shared memory, taking neither the lock nor
        SQLite (a commit holding the lock checks the files itself). A WAL checkpoint another
        process's reader holds up fails at once (``IndexCheckpointBusy``) instead of waiting out the
        busy timeout holding the lock, which would stall every commit and ``close`` that long; the
        caller tries again later. Raises as that check does; a no-op once closed."""
        try:
            if self._file_ids() == self._ids:
                return
        except OSError:
            pass  # reported by the check, under the lock
        with self._lock:
            if self._db is not None:
                self._check_files(self._db, wait_busy=False)

    def close(self) -> None:
        """Close the connection; an index file removed since the last commit is first
        written back (``_restore``), so that the next start finds its blocks."""
        with self._lock:
            if self._db is not None:
                self._unrestorable = ""  # the last chance to save its blocks
                with contextlib.suppress(sqlite3.Error):
                    self._check_files(self._db)
            if self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
                self._db = None
            self._let_go()

    def _file_ids(self) -> tuple[FileId, ...]:
        """(device, inode) of the index file, of its WAL and of its shared memory as their
        paths name them now. The shared memory's too: one removed (or replaced) alone left
        the connection on the removed file for good, which no other process maps, so another
        process's writer committed beside the tier's and damaged the index."""
        ids: list[FileId] = []
        for end in ("", "-wal", "-shm"):
            try:
                st = os.stat(self.path.with_name(self.path.name + end))
            except FileNotFoundError:
                ids.append(None)
            else:
                ids.append((st.st_dev, st.st_ino))
        return tuple(ids)

    def _checked_conn(self, *, wait_busy: bool = True) -> sqlite3.Connection:
        """The connection, once its files are checked (``_check_files``) before a write
        transaction: a WAL removed since the last commit is checkpointed first, or, while
        another reader holds that up, the write fails as busy before anything goes into the
        removed WAL (at once with ``wait_busy=False``, as for the transaction's lock). Called
        holding ``_lock``."""
        self._check_files(self._conn(), wait_busy=wait_busy)
        return self._conn()  # reopened when the WAL was replaced

    def _undo_insert(
        self,
        db: sqlite3.Connection,
        rows: Sequence[BlockRow],
        dropped: Sequence[int],
        made_empty: str,
    ) -> None:
        """Delete the rows of a committed insert whose file check failed, in the connection
        that committed them (its WAL, removed or not), without checking the files again, and
        write back the ``MADE_EMPTY`` record ``made_empty`` it deleted (''; none): no block
        of it committed after all.
        Best effort: the commit's failure is what the caller reports. Nothing to do where
        that connection was closed (an index file that could not be put back in place): no
        restart reads what it committed."""
        if self._db is not db:
            return
        gone = set(dropped)
        slots = [(row[2],) for row in rows if row[2] not in gone]
        try:
            with _immediate(db):
                db.executemany("DELETE FROM blocks WHERE slot = ?", slots)
                if made_empty:
                    db.execute(
                        "INSERT OR REPLACE INTO meta VALUES (?, ?)", (MADE_EMPTY, made_empty)
                    )
            if made_empty:
                self._made_empty_kept = made_empty
        except sqlite3.Error as e:
            log.error(
                "L2 index %s: the rows of %d blocks whose commit failed could not be deleted "
                "again (%s); a restart may find them",
                self.path,
                len(slots),
                classify(e).detail,
            )

    def _check_files(self, db: sqlite3.Connection, *, wait_busy: bool = True) -> None:
        """Before a write transaction and after its commit: that commits reach the files the
        index's path names. A removed or replaced WAL or shared memory (an operator cleaning
        up ``-wal`` or ``-shm`` files) is checkpointed into the index file, then the
        connection is reopened with new ones; a removed index file is written back
        (``_restore``); a replaced one, or one that cannot be written back, raises
        ``IndexFilesReplaced``, a checkpoint another reader keeps from finishing
        ``IndexCheckpointBusy``, and files that cannot be looked at (EACCES) an
        ``sqlite3.OperationalError``: each fails the commit and degrades the tier rather than
        reach its writer as an OSError. ``wait_busy=False``: the checkpoint
        does not wait out the busy timeout for that reader (the watch's check, which holds
        the lock meanwhile and tries again later). Called holding ``_lock``."""
        try:
            ids = self._file_ids()
        except OSError as e:
            raise sqlite3.OperationalError(
                f"{self.path} cannot be checked after a commit ({e.strerror}): a restart may "
                "not find its commits"
            ) from e
        if ids == self._ids:
            return
        if ids[0] is None:
            self._restore(db)
            return
        if ids[0] != self._ids[0]:
            raise IndexFilesReplaced(
                f"{self.path} was replaced while open: its commits would be lost at the next start"
            )
        with contextlib.nullcontext() if wait_busy else _no_busy_wait(db):
            busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            # The files keep their ids until the checkpoint gets through, so the next commit
            # (once the reader lets go) finds them changed and tries it again.
            raise IndexCheckpointBusy(
                f"the WAL or shared memory of {self.path} was removed or replaced while open "
                "and its commits could not be checkpointed into the index yet (another "
                "process holds it)"
            )
        self._hold()
        self._db = None
        with contextlib.suppress(sqlite3.Error):
            db.close()
        self._reopen()
        log.warning(
            "L2 index %s: its WAL was removed or replaced while open, or its shared memory "
            "was; its commits were checkpointed into the index file and a new WAL started",
            self.path,
        )

    def _restore(self, db: sqlite3.Connection) -> None:
        """The index file was removed while open: write the open database (its WAL's
        commits included) back to its path, through a temporary file renamed into place once
        synced, and go on with a connection to it, so that a restart finds every block
        committed before and after. Raises ``IndexFilesReplaced`` when it cannot be written
        (the tier then refuses writes until restarted), and again without another try at the
        later commits (``close`` tries once more). Called holding ``_lock``."""
        if self._unrestorable:
            raise IndexFilesReplaced(self._unrestorable)  # tried once: a lasting fault
        tmp = self.path.with_name(self.path.name + RESTORE_SUFFIX)
        wal, shm = (self.path.with_name(self.path.name + end) for end in ("-wal", "-shm"))
        started = time.monotonic()
        try:
            for stale in (tmp, tmp.with_name(tmp.name + "-journal")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
            os.close(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE))
            copy = sqlite3.connect(tmp, isolation_level=None)
            try:
                db.backup(copy)
            finally:
                copy.close()
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except (OSError, sqlite3.Error) as e:
            self._count(index_restore_failures=1)
            detail = e.strerror if isinstance(e, OSError) else classify(e).detail
            self._unrestorable = (
                f"{self.path} was removed while open and could not be written back ({detail}): "
                "its commits would be lost at the next start"
            )
            raise IndexFilesReplaced(self._unrestorable) from e
        # The old WAL (if still named) is the open database's, all in the copy now: left
        # beside the copy, it would be replayed onto it at the next open.
        self._db = None
        with contextlib.suppress(sqlite3.Error):
            db.close()
        try:
            for old in (wal, shm):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)
            os.replace(tmp, self.path)
            fsync_dir(self._directory)
            self._db = self._connect()
        except (OSError, sqlite3.Error) as e:
            self._count(index_restore_failures=1)
            self._unrestorable = (
                f"{self.path} was removed while open and could not be written back: its copy "
                f"{tmp.name} could not be put in its place ({e})"
            )
            raise IndexFilesReplaced(self._unrestorable) from e
        self._ids = self._file_ids()
        self._count(index_restored=1)
        log.warning(
            "L2 index %s was removed while open; the open index was written back to its "
            "path in %.2fs (every committed block kept) and the tier goes on",
            self.path,
            time.monotonic() - started,
        )

    # ------------------------------------------------------------------ opening

    def _conn(self) -> sqlite3.Connection:
        """The connection; opened again where ``_check_files`` closed it to start a new WAL
        and its open failed (no room to make the WAL: ``IndexNoRoom``), which the next use
        tries again (raising as that open does), so a full disk's fault ends once room is
        back. Closed by ``close``, or with an index that could not be written back, nothing is
        held (``_held``) and it stays closed."""
        if self._db is None:
            if self._held is None:
                raise sqlite3.ProgrammingError("the L2 index is closed")
            return self._reopen()
        return self._db

    def _hold(self) -> None:
        """Hold the index file the connection has open (``_held``) before ``_check_files``
        closes it: a file removed then, and another made at its path, could otherwise take
        its inode number, and ``_reopen`` would take that file for the tier's own. Raises as
        a replaced index where the path names another file already. Called holding
        ``_lock``."""
        try:
            held = os.open(self.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(held)
            except OSError:
                os.close(held)
                raise
        except OSError as e:
            raise sqlite3.OperationalError(f"{self.path} cannot be checked ({e.strerror})") from e
        if (st.st_dev, st.st_ino) != self._ids[0]:
            os.close(held)
            raise IndexFilesReplaced(
                f"{self.path} was replaced while open: its commits would be lost at the next start"
            )
        self._held = held

    def _let_go(self) -> None:
        """Close ``_held``, once the index file is open again (or the index closed)."""
        if self._held is not None:
            os.close(self._held)
            self._held = None

    def _reopen(self) -> sqlite3.Connection:
        """Open again the index file ``_check_files`` closed (held meanwhile: ``_hold``), as
        a commit's check finds it: one removed or replaced meanwhile raises
        ``IndexFilesReplaced`` (each time, the file still held), rather than being taken for
        the tier's own, or made again empty, as the open would; nothing can write a removed
        one back, its connection closed. Where the open fails (``IndexNoRoom``: no inode for
        the new WAL; an ``sqlite3.OperationalError`` for any other OSError, EIO or EACCES
        making the WAL, which callers handle as they do SQLite's own), the next use tries
        again. Called holding ``_lock``."""
        try:
            found = self._file_ids()[0]
            if found != self._ids[0]:
                raise IndexFilesReplaced(
                    f"{self.path} was {'removed' if found is None else 'replaced'} while its "
                    "connection was closed to start a new WAL: its commits would be lost at "
                    "the next start"
                )
            self._db = db = self._connect()
            self._let_go()  # the connection holds the file now
            # The index file's id as checked: one replaced since is found by the next check.
            self._ids = (found, *self._file_ids()[1:])
        except OSError as e:
            raise sqlite3.OperationalError(
                f"{self.path} cannot be opened again for a new WAL ({e.strerror})"
            ) from e
        return db

    def _open(self) -> sqlite3.Connection | None:
        self._finish_restore()
        problem = ""
        self.found_none = not self.path.exists()
        if not self.found_none:
            db = None
            try:
                db = self._connect()
                problem = self._check(db)
                if not problem:
                    return db
            except IndexFilesReplaced:
                raise  # a link: not an index to move aside
            except sqlite3.Error as e:
                if classify(e).kind in ("enospc", "locked"):
                    # A full disk says nothing of the index (its -shm, or a write of the
                    # open's, found no room), nor does a lock another process held past the
                    # busy timeout (an operator's sqlite3 shell): raised, not moved aside,
                    # which would lose every block it holds (the tier gives its reserve back
                    # for the open; it refuses a locked one's start).
                    if db is not None:
                        with contextlib.suppress(sqlite3.Error):
                            db.close()
                    raise
                problem = f"cannot be read ({classify(e).detail})"
            except IndexUpgradeFailed:
                db.close()  # type: ignore[union-attr]
                raise
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            self._move_aside(problem)
        made: sqlite3.Connection | None = None
        record = self._made_empty_record()
        try:
            made = self._connect()
            made.executescript(_SCHEMA)
            made.execute(f"PRAGMA user_version = {INDEX_FORMAT}")
            self._write_meta(made, record)
            self._made_empty_kept = record
        except IndexFilesReplaced:
            raise  # a link at a path: not a file made here
        except (sqlite3.Error, OSError) as e:
            # Left, the files (an index empty or without its metadata, a WAL of its schema)
            # were taken by the next open, the tier's once its reserve was given back for
            # the room, for a damaged index: moved aside as such, it named the wrong file and
            # reason in place of the one moved aside here (or the index missing beside its
            # data files). They hold nothing yet: the next open makes them anew. So after a
            # system call's error too (EIO, EACCES or EISDIR making the WAL: ``_connect``).
            if made is not None:
                with contextlib.suppress(sqlite3.Error):
                    made.close()
            for end in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):  # gone, or kept (taken as before)
                    os.unlink(self.path.with_name(self.path.name + end))
            raise IndexNotMade(e, self.moved_aside, self.moved_to) from e
        fsync_dir(self._directory)
        return made

    def _made_empty_record(self) -> str:
        """The ``MADE_EMPTY`` record of the new index this open makes: '' where it found no
        data file, or moved the index aside as made for another layout (the operator's
        change)."""
        if not self._data_files or self.moved_aside == LAYOUT_CHANGED:
            return ""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self._clock()))
        if self.moved_aside:
            why = f"the index found {self.moved_aside}: moved aside as {self.moved_to}"
        else:
            why = "no index was found"
        return f"at {when} beside {self._data_files} data file(s): {why}"

    def _finish_restore(self) -> None:
        """A write-back (``_restore``) that the daemon's end interrupted left its copy
        beside the index. Without an index file, the copy is what the last run wrote back,
        synced and whole unless its own journal says the backup was cut short (SQLite rolls
        such a copy back to empty at its open, so it is not used): it is put in the index's
        place, any WAL and shared memory beside it being the removed index's, all in the copy
        (replayed onto it they would write old pages over it). Beside an index file the copy
        is a leftover and goes. So a crash between the copy's sync and its rename no longer
        starts the tier empty, and no old copy stays to be taken by a later start."""
        tmp = self.path.with_name(self.path.name + RESTORE_SUFFIX)
        journal = tmp.with_name(tmp.name + "-journal")
        if not tmp.is_file():
            return
        if self.path.exists() or journal.exists():
            for stale in (tmp, journal):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
            return
        for old in (self.path.name + "-wal", self.path.name + "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path.with_name(old))
        os.replace(tmp, self.path)
        fsync_dir(self._directory)
        self._count(index_restored=1)
        log.warning(
            "L2 index %s: the last run's write-back of the removed index was cut short before "
            "its copy took the index's place; the copy (%s) is used",
            self.path,
            tmp.name,
        )

    def _check(self, db: sqlite3.Connection) -> str:
        """Why the index cannot be used as it is, or ''."""
        check = db.execute("PRAGMA quick_check").fetchall()
        if check != [("ok",)]:
            return "fails its integrity check: " + "; ".join(str(r[0]) for r in check[:3])
        problem = self._upgrade(db)
        if problem:
            return problem
        db.executescript(_SCHEMA)
        meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
        if not meta:
            # Schema and meta are written and synced when an index is created, so an index
            # without them lost its content.
            return "is empty or truncated (no metadata)"
        self.made_empty = meta.get(MADE_EMPTY, "")
        self._made_empty_kept = self.made_empty
        # Slot ids and offsets depend on everything but the capacity (and the file size
        # asked for, which the size the files have, ``file_bytes``, answers for).
        changed = [
            f"{k} {meta.get(k)} -> {v}"
            for k, v in self._geometry.items()
            if meta.get(k) != v and k not in NOT_LAYOUT
        ]
        if changed:
            self._layout_change = f"was made for another layout ({', '.join(changed)})"
            return LAYOUT_CHANGED
        old = meta.get("capacity_bytes", "")
        if not old.isdigit():
            return "has damaged metadata"
        if int(old) != int(self._geometry["capacity_bytes"]):
            self.previous_capacity = int(old)
            log.warning(
                "L2 capacity changes from %s to %s; blocks beyond the new capacity are dropped",
                format_size(int(old)),
                format_size(int(self._geometry["capacity_bytes"])),
            )
            self._write_meta(db)
        elif meta.get("file_bytes_setting") != self._geometry.get("file_bytes_setting"):
            # Not needed to use the index (the open that lacks it takes a smaller setting as
            # a kept size, as before it was recorded): a write that fails, the disk full,
            # must not move the index aside.
            try:
                self._write_meta(db)
            except sqlite3.Error as e:
                with contextlib.suppress(sqlite3.Error):
                    db.rollback()
                log.warning(
                    "L2 index in %s: recording tiers.l2.file_bytes failed (%s)",
                    self._directory,
                    classify(e).detail,
                )
        return ""

    def _upgrade(self, db: sqlite3.Connection) -> str:
        """Bring an index of an older format to ``INDEX_FORMAT`` (one transaction: a crash
        leaves the old one whole); why it cannot be used, or ''."""
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version == INDEX_FORMAT:
            return ""
        if version > INDEX_FORMAT:
            self._layout_change = f"has format {version}, newer than this kvtier's {INDEX_FORMAT}"
            return LAYOUT_CHANGED
        found = db.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'blocks'"
        ).fetchone()
        rewrite = found is not None and "WITHOUT ROWID" in str(found[0]).upper()
        started = time.monotonic()
        try:
            with _immediate(db):
                before = kept = 0
                if rewrite:
                    before = db.execute("SELECT count(*) FROM blocks").fetchone()[0]
                    db.execute(_BLOCKS_V2)
                    kept = db.execute(
                        "INSERT INTO blocks_v2 (ns, key, slot, nbytes, checksum, written_at) "
                        "SELECT ns, key, slot, nbytes, checksum, written_at FROM blocks "
                        "WHERE typeof(slot) = 'integer' ORDER BY slot"
                    ).rowcount
                    db.execute("DROP TABLE blocks")
                    db.execute("ALTER TABLE blocks_v2 RENAME TO blocks")
                db.execute(f"PRAGMA user_version = {INDEX_FORMAT}")
        except sqlite3.Error as e:
            raise IndexUpgradeFailed(
                f"the L2 index in {self._directory} could not be upgraded to format "
                f"{INDEX_FORMAT} ({classify(e).detail}); it is left as it was"
            ) from e
        if rewrite:
            log.info(
                "L2 index in %s upgraded to format %d (blocks keyed by slot): %d rows in %.2fs%s",
                self._directory,
                INDEX_FORMAT,
                kept,
                time.monotonic() - started,
                f"; {before - kept} rows without an integer slot left out" if kept < before else "",
            )
        return ""

    def _connect(self) -> sqlite3.Connection:
        """A connection to the index file, created owner-only before SQLite does (its journal
        files take its mode). SQLite follows a symbolic link at the index, its WAL or shared
        memory, and would create or write the file it names: none may be one (the checks at
        start refuse them too), so the file is made without following one and the journals
        are looked at just before. Raises ``IndexFilesReplaced`` for a link."""
        try:
            fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE
            )
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise IndexFilesReplaced(f"{self.path} is a symbolic link; not following it") from e
        try:
            os.fchmod(fd, FILE_MODE)
        finally:
            os.close(fd)
        for journal in ("-wal", "-shm", "-journal"):
            if (path := self.path.with_name(self.path.name + journal)).is_symlink():
                raise IndexFilesReplaced(f"{path} is a symbolic link; not following it")
        # The WAL and its shared memory, which SQLite makes at the first read after a clean
        # stop removed them, are made here (empty, as SQLite makes them): on a filesystem out
        # of inodes its open fails as SQLITE_CANTOPEN, which said nothing of the index and
        # had it moved aside; here it is the ENOSPC it is (``classify``: a full disk).
        # No room is raised as SQLite's own SQLITE_FULL (``IndexNoRoom``), which every caller
        # handles, a reopen while the tier runs (a removed WAL) included.
        for journal in ("-wal", "-shm"):
            path = self.path.with_name(self.path.name + journal)
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            try:
                os.close(os.open(path, flags, FILE_MODE))
            except OSError as e:
                if (fault := classify(e)).kind == "enospc":
                    raise IndexNoRoom(f"{path} cannot be made ({fault.detail})") from e
                raise
        db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S
        )
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot switch the index to WAL mode (got {mode})")
            # FULL: in WAL mode NORMAL does not sync the WAL at commit, so a commit reported as
            # durable could roll back on power loss. FULL syncs the WAL on every commit; batches
            # amortise that one sync over many blocks.
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA journal_size_limit=67108864")
        except BaseException:
            # Closed now, not by the cyclic collector (a cursor and its connection refer to
            # each other), which the daemon runs in full rarely: until then the file stayed
            # open, a moved-aside index's space not freed by its deletion.
            with contextlib.suppress(sqlite3.Error):
                db.close()
            raise
        return db

    def _write_meta(self, db: sqlite3.Connection, made_empty: str = "") -> None:
        """Write the geometry (a ``MADE_EMPTY`` record kept), and ``made_empty`` as that
        record where given, in one transaction."""
        db.execute("BEGIN IMMEDIATE")
        db.execute("DELETE FROM meta WHERE name <> ?", (MADE_EMPTY,))
        db.executemany("INSERT INTO meta VALUES (?, ?)", list(self._geometry.items()))
        if made_empty:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (MADE_EMPTY, made_empty))
        db.execute("COMMIT")

    def _move_aside(self, problem: str) -> None:
        stamp = time.strftime(_ASIDE_STAMP, time.gmtime(self._clock()))
        word = "old" if problem == LAYOUT_CHANGED else "corrupt"
        suffix = f".{word}-{stamp}"
        n = 1
        while self.path.with_name(self.path.name + suffix).exists():
            n += 1
            suffix = f".{word}-{stamp}-{n}"
        for name in (self.path.name, self.path.name + "-wal", self.path.name + "-shm"):
            src = self.path.with_name(name)
            if src.exists():
                src.rename(src.with_name(name + suffix))
        self.moved_aside = problem
        self.moved_to = self.path.name + suffix
        if problem == LAYOUT_CHANGED:
            log.warning(
                "L2 index %s %s; moved aside as %s (nothing reads it again: delete it to free "
                "its space) and starting empty",
                self.path,
                self._layout_change,
                self.moved_to,
            )
        else:
            log.error(
                "L2 index %s %s; moved aside as %s and starting EMPTY: no block it named will "
                "be served",
                self.path,
                problem,
                self.moved_to,
            )
        fsync_dir(self._directory)
