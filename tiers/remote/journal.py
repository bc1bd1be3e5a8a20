"""A small SQLite file that keeps the L3 tier's unconfirmed removals across restarts on a node
without a disk tier (whose index keeps them otherwise): a ``RemovalJournal``.

Invariants: a ``record_removals`` that returns True is durable (WAL, ``synchronous=FULL``;
the folder synced once the file is made); one that fails changes nothing and answers False
(logged), never raises. One table, ``l3_removals (key, until)``, as in the disk tier's index.
One ``RemovalFile`` at a time holds the file (an exclusive ``flock`` until ``close``): another
daemon taking up removals this one keeps would send them again after this one wrote their
keys again, deleting the values written.

Thread-safety: every method may be called from any thread; the connection is serialised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from kvtier.tiers.disk.files import FILE_MODE, fsync_dir, lock_exclusive
from kvtier.tiers.disk.index import L3_REMOVALS_SCHEMA, read_l3_removals, write_l3_removals

log = logging.getLogger(__name__)

# How long a statement waits for a lock another process holds (an operator's shell).
_BUSY_TIMEOUT_S = 30.0


class RemovalFileError(Exception):
    """The file cannot be opened or made (the daemon does not start: removals would be lost)."""


class RemovalFile:
    """``RemovalJournal`` in its own file (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._broken = ""  # the last failure logged, so that a failing disk logs once
        made = not self.path.exists()
        try:
            # Owner-only before SQLite makes it (its WAL takes the file's mode). Kept open,
            # locked, until ``close``: flock does not touch SQLite's own (fcntl) locks.
            self._lock_fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            raise RemovalFileError(f"L3 removals_file {self.path}: {e}") from None
        # Waiting out the daemon's checks, which take the lock shared for a moment
        # (``kvtierd --check-config`` beside a restart made the start fail).
        if (refused := lock_exclusive(self._lock_fd, self.path)) is not None:
            os.close(self._lock_fd)
            raise RemovalFileError(
                f"L3 removals_file {self.path} is in use by another process ({refused.strerror})"
            )
        self._db: sqlite3.Connection | None = None
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_S
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(L3_REMOVALS_SCHEMA)
            if made:
                fsync_dir(self.path.parent.absolute())
        except (OSError, sqlite3.Error) as e:
            self.close()
            raise RemovalFileError(f"L3 removals_file {self.path}: {e}") from None

    def removals(self) -> list[tuple[bytes, float | None]]:
        try:
            with self._lock:
                return read_l3_removals(self._conn())
        except sqlite3.Error as e:
            self._failed("read", e)
            return []

    def record_removals(
        self, added: Sequence[tuple[bytes, float | None]], dropped: Sequence[bytes]
    ) -> bool:
        try:
            with self._lock:
                db = self._conn()
                db.execute("BEGIN IMMEDIATE")
                try:
                    write_l3_removals(db, added, dropped)
                    db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as e:
            self._failed("update", e)
            return False
        self._broken = ""
        return True

    def close(self) -> None:
        with self._lock:
            if self._lock_fd >= 0:
                if self._db is not None:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.close()
                    self._db = None
                os.close(self._lock_fd)  # after SQLite's: lets the next daemon in
                self._lock_fd = -1

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise sqlite3.ProgrammingError("closed")
        return self._db

    def _failed(self, what: str, e: sqlite3.Error) -> None:
        if str(e) != self._broken:
            self._broken = str(e)
            log.error("L3 removals_file %s: %s failed: %s", self.path, what, e)
