"""The disk tier's fault state: what went wrong, whether the tier takes writes, and counters.

A fault never raises out of the tier; it is counted and may degrade the tier. ENOSPC (a full
disk) and an index locked by another process past the busy timeout (SQLITE_BUSY: an operator's
``sqlite3`` shell left in a write transaction; or, its WAL removed, one in a read transaction
that keeps the checkpoint from finishing) degrade it until a write gets through again (one
write batch per ``enospc_retry_s`` is let through to find out; the stop's flush lets every
batch through until one fails, ``retry_now``; with no batch to let through, the tier's watch
commits one page in its turn, ``take_retry``). So does a failed read of data
blocks (kind ``read``, whatever its errno; a full disk's or a lock's fault stays in its place,
as no release may end it, and the read's comes back when that one ends, as would a full
disk's or a lock's coming over it): its slots are quarantined by the tier, and it lasts until
reads succeed again: a read batch whose every block was read and verified (``read_succeeded``), or a
release of quarantined slots whose every check passed (``read_checked``). A write is no such
proof: a disk that fails every read but takes writes stays degraded (were the batch let
through to end it, the tier went degraded and back to ok once per ``enospc_retry_s``). That
batch still finds out whether the disk takes writes: a write or sync that fails turns the
fault into one that lasts. EIO and
other faults of writes, syncs and the index degrade it until it is reopened. Reads are served
while degraded.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from collections import Counter
from typing import NamedTuple

from kvtier.tiers.base import Health, TierHealth

log = logging.getLogger("kvtier.tiers.disk")

# SQLite primary result codes (the sqlite3 module exports them from Python 3.11 on).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_NOTADB = 26
# An extended code: the WAL's shared memory file could not be grown (a full disk, as the
# first connection to an index whose -shm is missing makes it).
_SQLITE_IOERR_SHMSIZE = _SQLITE_IOERR | (19 << 8)


class Fault(NamedTuple):
    kind: str  # "enospc", "locked", "read", "eio", "corrupt" or "io"
    detail: str


# Fault kinds that may clear by themselves: the tier lets a write through now and then to see.
_PASSING = ("enospc", "locked", "read")


def classify(exc: BaseException) -> Fault:
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return Fault("enospc", f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc}")
        if exc.errno == errno.EIO:
            return Fault("eio", f"EIO: {exc}")
        return Fault("io", f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc}")
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        name = getattr(exc, "sqlite_errorname", type(exc).__name__)
        if code == _SQLITE_FULL or getattr(exc, "sqlite_errorcode", 0) == _SQLITE_IOERR_SHMSIZE:
            return Fault("enospc", f"index: {name}: {exc}")
        if code in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return Fault("locked", f"index: {name}: {exc}")
        if code == _SQLITE_IOERR:
            return Fault("eio", f"index: {name}: {exc}")
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return Fault("corrupt", f"index: {name}: {exc}")
        return Fault("io", f"index: {name}: {exc}")
    return Fault("io", f"{type(exc).__name__}: {exc}")


class FaultState:
    def __init__(self, enospc_retry_s: float) -> None:
        self._lock = threading.Lock()
        self._enospc_retry_s = enospc_retry_s
        self._degraded: Fault | None = None
        # A failed read's fault until reads succeed, whatever fault is shown meanwhile: a
        # full disk's or a lock's in its place ends with a commit, which says nothing of reads.
        self._read_fault: Fault | None = None
        self._next_probe = 0.0
        # Set by ``retry_now``: writes are let through until the next fault.
        self._retrying = False
        self.counters: Counter[str] = Counter()
        # Things an operator must see that did not stop the tier (an index moved aside at
        # start, blocks lost with a damaged data file): shown with the health state.
        self._notes: list[str] = []

    def note(self, text: str) -> None:
        with self._lock:
            self._notes.append(text)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                if n:
                    self.counters[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    @property
    def degraded(self) -> Fault | None:
        return self._degraded

    def fault(self, fault: Fault, what: str, happened: str | None = None) -> None:
        """Count a fault and degrade the tier; log only when the state changes, saying
        ``happened`` where ``what`` did not fail (a start, or a removal committed on the
        reserve: the disk is full all the same), else that ``what`` failed."""
        with self._lock:
            if fault.kind == "enospc":
                self.counters["enospc"] += 1
            if what.startswith("index"):
                self.counters["index_errors"] += 1
            before = self._degraded
            self._retrying = False
            if fault.kind == "read":
                self._read_fault = Fault(fault.kind, f"{what}: {fault.detail}")
            # A full disk, a lock or a failed read may clear up; anything else keeps the tier
            # degraded until reopened. A failed read does not take a full disk's or a lock's
            # place: a read batch that succeeds, or a release whose checks pass, ends a failed
            # read's fault, with no write let through to find out whether the disk still
            # takes them.
            changed = before is None or (
                before.kind in _PASSING and fault.kind not in (before.kind, "read")
            )
            if changed:
                self._degraded = Fault(fault.kind, f"{what}: {fault.detail}")
                self._next_probe = time.monotonic() + self._enospc_retry_s
        if changed:
            log.error(
                "L2 tier degraded: %s; it refuses writes%s and keeps serving reads",
                happened or f"{what} failed ({fault.detail})",
                f" (retrying every {self._enospc_retry_s:g}s)" if fault.kind in _PASSING else "",
            )

    def admit_writes(self) -> bool:
        with self._lock:
            if self._degraded is None:
                return True
            if self._degraded.kind in _PASSING and self._retrying:
                return True
            if self._degraded.kind in _PASSING and time.monotonic() >= self._next_probe:
                self._next_probe = time.monotonic() + self._enospc_retry_s
                return True
            return False

    def take_retry(self) -> bool:
        """Whether the tier's own retry (``DiskTier._retry_commit``) is due: it is degraded by
        a full disk or a lock, which an index commit ends, and no write batch was let through
        for ``enospc_retry_s``. True takes the turn a batch let through would take, so that
        writes and retries together try once per ``enospc_retry_s``."""
        with self._lock:
            if self._degraded is None or self._degraded.kind not in ("enospc", "locked"):
                return False
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + self._enospc_retry_s
            return True

    def retry_now(self) -> None:
        """If a fault that may pass degrades the tier, let every write batch through from now
        until one fails (or a commit ends the fault), rather than one per ``enospc_retry_s``:
        the stop's flush is the last chance for the blocks it writes, the fault may have
        passed since the last batch let through, and a batch refused while the first is in
        flight would be lost."""
        with self._lock:
            if self._degraded is not None and self._degraded.kind in _PASSING:
                self._retrying = True

    def lock_held(self) -> bool:
        """Whether the tier is degraded by an index another process keeps locked."""
        with self._lock:
            return self._degraded is not None and self._degraded.kind == "locked"

    def read_failed(self) -> bool:
        """Whether the tier is degraded by a failed read (and nothing since)."""
        with self._lock:
            return self._degraded is not None and self._degraded.kind == "read"

    def read_checked(self) -> None:
        """Extents were written, synced and read back, and the index committed: a tier
        degraded by a failed read is whole again (one that reads nothing has no read to tell)."""
        self._end_read_fault("a release checked the quarantined extents")

    def read_succeeded(self) -> None:
        """A read batch was read and verified whole: a tier degraded by a failed read is whole
        again (the disk reads)."""
        if self._degraded is not None:  # read unlocked: every read batch asks
            self._end_read_fault("a read succeeded")

    def _end_read_fault(self, why: str) -> None:
        with self._lock:
            self._read_fault = None
            if self._degraded is None or self._degraded.kind != "read":
                return
            self._degraded = None
        log.warning("L2 tier admits writes again: %s", why)

    def refuses_commits(self) -> bool:
        """Index commits stop on faults other than a full disk, a locked index or a failed
        read (a commit is how each is found to have cleared)."""
        with self._lock:
            return self._degraded is not None and self._degraded.kind not in _PASSING

    def space_returned(self) -> None:
        """An index commit succeeded: a full disk or a lock has cleared (a failed read has not:
        see the module docstring)."""
        with self._lock:
            if self._degraded is None or self._degraded.kind not in ("enospc", "locked"):
                return
            self._degraded = read = self._read_fault
        if read is None:
            log.warning("L2 tier admits writes again: an index commit succeeded")
        else:
            log.warning(
                "L2 tier: an index commit succeeded, but it stays degraded by a failed read "
                "(%s) until a read succeeds",
                read.detail,
            )

    def health(self) -> TierHealth:
        with self._lock:
            fault, notes = self._degraded, "; ".join(self._notes)
            due = fault is not None and fault.kind in _PASSING
            due = due and (self._retrying or time.monotonic() >= self._next_probe)
        if fault is None:
            return TierHealth(Health.OK, notes)
        state = Health.DEGRADED_NOSPACE if fault.kind == "enospc" else Health.DEGRADED_IO
        detail = f"{fault.kind}: {fault.detail}" + (f"; {notes}" if notes else "")
        return TierHealth(state, detail, retry_due=due)
