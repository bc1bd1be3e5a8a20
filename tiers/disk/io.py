"""The disk tier's batch I/O engine: coalesced, parallel, verified transfers.

A batch of blocks is planned into *runs*: blocks that lie back to back in one data file move
with one vectored ``preadv``/``pwritev``. Runs are spread over the tier's I/O threads (a
priority pool: a demand read never waits behind background writes, and within a class a
higher rank goes first). Writes hash the source buffers in the calling thread while the I/O
threads write those same (unchanging) buffers; reads are verified run by run as they land.

Buffers: a page-aligned buffer of at least the slot's size (an L1 slot view) is handed to the
kernel as it is; anything else moves through the thread's page-aligned bounce buffer, and a
block bound for an engine pool's pages is scattered there from that buffer only after it
verified. Unverified bytes never reach a buffer the caller may use, except a direct buffer,
which the tier zero-fills when its block fails.

Thread-safety: ``write_set`` and ``read`` may run concurrently on any threads for distinct
slots.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import operator
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, as_completed, wait
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np
import xxhash

from kvtier.tiers.base import Priority
from kvtier.tiers.base import block_checksum as checksum
from kvtier.tiers.disk.files import ALIGN, SlotFiles
from kvtier.tiers.disk.health import Fault, FaultState, classify
from kvtier.tiers.executor import PriorityExecutor, Urgency
from kvtier.tiers.sizes import counted

# Coalesced runs stop growing here, and a batch is spread over all I/O threads. Writes hash
# in the calling thread alongside the I/O, so they take long runs; reads are verified run by
# run as they land, so shorter runs keep verification overlapped with the reads still going.
MAX_WRITE_RUN_BYTES = 32 << 20
MAX_READ_RUN_BYTES = 8 << 20
# Each block takes at most two iovecs (data, padding); stay under IOV_MAX (1024 on Linux).
_MAX_RUN_BLOCKS = 500
# Runs are at least this long when the slots allow: tiny transfers gain nothing from threads.
_MIN_RUN_BYTES = 256 << 10
# A batch smaller than this runs in the calling thread: a hand-off to the pool costs more.
_INLINE_BYTES = 1 << 20
_ZEROS = bytes(ALIGN)

R = TypeVar("R")


def _done() -> None:
    pass


def _address(mv: memoryview) -> int:
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


@dataclass(slots=True)
class Block:
    """One block of a read batch, as the I/O engine moves and verifies it."""

    pos: int  # index in the caller's batch
    slot: int
    file: int
    offset: int  # in its file
    nbytes: int
    padded: int
    buf: memoryview | None  # the caller's contiguous buffer, as bytes (None: ``sink``)
    direct: bool  # buf itself can be handed to the kernel (aligned, long enough)
    expected: int = 0  # reads: the checksum to verify against
    key: bytes = b""
    sink: Callable[[memoryview], None] | None = None  # reads: where verified bytes go
    staged: bool = False  # moved through the bounce buffer
    ok: bool = False
    error: str = ""


@dataclass(slots=True)
class WriteSet:
    """A write batch of one block size as arrays (the tier's ``write``, thousands of small
    blocks at a time): no Python object per block but its buffer. Position ``i`` of every
    array is block ``i`` of the batch."""

    slots: np.ndarray  # int64
    files: np.ndarray  # int64
    offsets: np.ndarray  # int64, in its file
    nbytes: int
    padded: int
    bufs: list[memoryview]  # the caller's buffers as bytes, each at least ``nbytes`` long
    direct: np.ndarray  # bool: the buffer itself can be handed to the kernel
    exact: bool  # every buffer is ``padded`` bytes long: no slicing for the kernel
    checksums: np.ndarray  # uint64, set where a block was written
    ok: np.ndarray  # bool: written (then, once its file is synced, durable)

    def __len__(self) -> int:
        return len(self.slots)


# A block's place on the disk, to sort a batch by (cheaper than a lambda per block).
_PLACE = operator.attrgetter("file", "offset")


@dataclass(slots=True)
class _Run:
    """Blocks that lie back to back in one file: one vectored system call."""

    file: int
    offset: int
    blocks: list[Block] = field(default_factory=list)
    nbytes: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class BatchIO:
    def __init__(
        self, files: SlotFiles, faults: FaultState, executor: PriorityExecutor, threads: int
    ) -> None:
        self.files = files
        self.faults = faults
        self.executor = executor
        self.threads = threads
        self._local = threading.local()

    def make_blocks(
        self,
        slots: Sequence[int],
        tier_offsets: np.ndarray,
        nbytes: int,
        padded: int,
        bufs: Sequence[memoryview | None],
        addresses: Sequence[int] | None = None,
    ) -> list[Block]:
        """The I/O blocks of a batch (``pos``: the index in it) at ``tier_offsets``.
        ``addresses``, when the buffers' maker knows them (an arena's slots), say which
        buffers the kernel can take as they are without asking each view for its own."""
        files, offsets = np.divmod(np.asarray(tier_offsets, dtype=np.int64), self.files.file_bytes)
        if addresses is None:
            aligned = [buf is not None and _address(buf) % ALIGN == 0 for buf in bufs]
        else:
            aligned = (np.asarray(addresses, dtype=np.int64) % ALIGN == 0).tolist()
        return [
            Block(pos, slot, file, offset, nbytes, padded, buf, ok and len(buf) >= padded)  # type: ignore[arg-type]
            for pos, (slot, file, offset, buf, ok) in enumerate(
                zip(slots, files.tolist(), offsets.tolist(), bufs, aligned, strict=True)
            )
        ]

    def make_write_set(
        self,
        slots: np.ndarray,
        tier_offsets: np.ndarray,
        nbytes: int,
        padded: int,
        bufs: list[memoryview],
        lengths: np.ndarray,
        addresses: Sequence[int] | None = None,
    ) -> WriteSet:
        """A write batch of one block size at ``tier_offsets``, as arrays (``lengths``: each
        buffer's length). ``addresses``, when the buffers' maker knows them (an arena's
        slots), say which buffers the kernel can take as they are without asking each view
        for its own."""
        files, offsets = np.divmod(np.asarray(tier_offsets, dtype=np.int64), self.files.file_bytes)
        if addresses is None:
            aligned = np.fromiter(
                (_address(buf) % ALIGN == 0 for buf in bufs), dtype=bool, count=len(bufs)
            )
        else:
            aligned = np.asarray(addresses, dtype=np.int64) % ALIGN == 0
        n = len(slots)
        return WriteSet(
            np.asarray(slots, dtype=np.int64),
            files,
            offsets,
            nbytes,
            padded,
            bufs,
            aligned & (lengths >= padded),
            bool(n) and int(lengths.min()) == int(lengths.max()) == padded,
            np.zeros(n, dtype=np.uint64),
            np.zeros(n, dtype=bool),
        )

    # ------------------------------------------------------------------ writes

    def write_set(
        self,
        ws: WriteSet,
        live: np.ndarray,
        priority: Priority,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> None:
        """Write the blocks ``live`` (positions in ``ws``), not synced (``sync_files`` makes
        them durable); sets ``ok`` (written) and ``checksums`` of each. The source buffers are
        hashed in this thread while the I/O threads write them."""
        self.start_write_set(ws, live, priority, rank, urgency)()

    def start_write_set(
        self,
        ws: WriteSet,
        live: np.ndarray,
        priority: Priority,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> Callable[[], None]:
        """``write_set`` up to the checksums: returns once ``checksums`` is set for ``live``,
        maybe with writes still going, and hands back the call that waits for them (it sets
        ``ok`` and raises what a write raised). Until that call returns, the writes still read
        the source buffers."""

        def checksums() -> None:
            views = ws.bufs if ws.exact and ws.nbytes == ws.padded else None
            if views is None:
                views = [b[: ws.nbytes] for b in ws.bufs]
            if len(live) < len(ws):
                views = [views[i] for i in live.tolist()]
            ws.checksums[live] = np.fromiter(
                map(xxhash.xxh3_64_intdigest, views), dtype=np.uint64, count=len(live)
            )

        runs = self._plan_set(ws, live, MAX_WRITE_RUN_BYTES)
        return self._start(
            runs,
            partial(self._write_set_run, ws),
            priority,
            checksums,
            len(live) * ws.padded,
            rank,
            urgency,
        )

    def _write_set_run(self, ws: WriteSet, run: np.ndarray) -> None:
        first = int(run[0])
        try:
            iovs = self._set_iovecs(ws, run)
            self.faults.count(write_calls=1)
            self.files.transfer(True, int(ws.files[first]), iovs, int(ws.offsets[first]))
        except OSError as e:
            ws.ok[run] = False
            self._count_failed_run(
                e, "write", len(run), int(ws.files[first]), int(ws.offsets[first])
            )
            return
        ws.ok[run] = True

    def sync_files(self, files: Sequence[int], priority: Priority, rank: int = 0) -> set[int]:
        """fdatasync ``files``; returns those that failed (their blocks are not durable)."""
        if not len(files):
            return set()
        if len(files) == 1:
            errors = [self.files.sync(files[0])]
        else:
            futures = [self.executor.submit(priority, self.files.sync, f, rank=rank) for f in files]
            errors = [f.result() for f in futures]
        self.faults.count(syncs=len(files))
        failed: set[int] = set()
        for file, err in zip(files, errors, strict=True):
            if err is None:
                continue
            self.faults.count(io_errors=1)
            self.faults.fault(classify(err), f"fdatasync of {self.files.paths[file].name}")
            failed.add(file)
        return failed

    # ------------------------------------------------------------------ reads

    def read(
        self,
        blocks: list[Block],
        priority: Priority,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> None:
        """Read the blocks and verify each; sets ``ok`` and ``error``."""
        runs = self._plan(blocks, MAX_READ_RUN_BYTES)
        if len(runs) == 1 and runs[0].nbytes < _INLINE_BYTES:
            views = self._read_run(runs[0])
            if views is not None:
                self._verify_run(runs[0], views)
            return
        futures: dict[Future[list[memoryview] | None], _Run] = {
            self.executor.submit(priority, self._read_run, run, rank=rank, urgency=urgency): run
            for run in runs
        }
        try:
            for future in as_completed(futures):
                views = future.result()
                if views is not None:
                    self._verify_run(futures[future], views)
        finally:
            wait(futures)

    def _read_run(self, run: _Run) -> list[memoryview] | None:
        """Read one run. Returns where each block's bytes landed for the caller to verify, or
        None when the run is settled here: failed, or staged (the bounce buffer belongs to
        this thread, so its blocks are verified before the thread takes another run)."""
        try:
            iovs, views = self._iovecs(run)
            self.faults.count(read_calls=1)
            self.files.transfer(False, run.file, iovs, run.offset)
        except OSError as e:
            self._run_failed(run, e, "read")
            for b in run.blocks:
                self.scrub(b)
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
                self.scrub(b)
                continue
            if b.sink is not None:
                b.sink(view)
            elif b.staged:
                # Only verified bytes ever reach the caller's buffer on this path.
                assert b.buf is not None
                b.buf[: b.nbytes] = view
            b.ok = True
        if bad:
            self.faults.count(checksum_failures=bad)

    @staticmethod
    def scrub(b: Block) -> None:
        """Zero what a failed read may have left in the caller's buffer (a block bound for
        pool pages has had nothing written there)."""
        if b.buf is None:
            return
        end = b.padded if b.direct else b.nbytes
        with contextlib.suppress(Exception):
            b.buf[:end] = bytes(end)

    # ------------------------------------------------------------------ planning

    def _plan(self, blocks: list[Block], max_run_bytes: int) -> list[_Run]:
        """Coalesce back-to-back slots into runs, sized so a batch spreads over the threads."""
        if not blocks:
            return []
        total = sum(b.padded for b in blocks)
        target = max(_MIN_RUN_BYTES, min(max_run_bytes, -(-total // self.threads)))
        runs: list[_Run] = []
        run: _Run | None = None
        for b in sorted(blocks, key=_PLACE):
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

    def _plan_set(self, ws: WriteSet, live: np.ndarray, max_run_bytes: int) -> list[np.ndarray]:
        """The positions ``live`` of a ``WriteSet`` coalesced into runs of back-to-back slots,
        as index arrays in disk order, sized so a batch spreads over the threads."""
        n = len(live)
        if n == 0:
            return []
        padded = ws.padded
        order = live[np.lexsort((ws.offsets[live], ws.files[live]))]
        files, offsets = ws.files[order], ws.offsets[order]
        target = max(_MIN_RUN_BYTES, min(max_run_bytes, -(-n * padded // self.threads)))
        per_run = max(1, min(_MAX_RUN_BLOCKS, target // padded))
        # A run ends where the slots stop lying back to back, and every ``per_run`` blocks
        # within such a stretch.
        breaks = np.ones(n, dtype=bool)
        breaks[1:] = (files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1] + padded)
        stretch = np.flatnonzero(breaks)
        within = np.arange(n) - stretch[np.cumsum(breaks) - 1]
        breaks |= within % per_run == 0
        return np.split(order, np.flatnonzero(breaks)[1:])

    def _start(
        self,
        runs: Sequence[R],
        work: Callable[[R], None],
        priority: Priority,
        meanwhile: Callable[[], None] | None,
        nbytes: int,
        rank: int = 0,
        urgency: Urgency | None = None,
    ) -> Callable[[], None]:
        """Start ``work`` on every run, in parallel on the I/O threads, and run ``meanwhile``
        in this thread while they run (``nbytes``: the runs' bytes). Returns once
        ``meanwhile`` is done, with the call that waits for the runs and raises the first
        error of one (a batch small enough is done here: then that call does nothing)."""
        small = nbytes < _INLINE_BYTES
        if len(runs) <= 1 and (small or meanwhile is None):
            if meanwhile is not None:
                meanwhile()
            for run in runs:
                work(run)
            return _done
        futures = [
            self.executor.submit(priority, work, run, rank=rank, urgency=urgency) for run in runs
        ]

        def finish() -> None:
            # Every run must finish before the batch's buffers go back to the caller.
            wait(futures)
            for f in futures:
                f.result()

        try:
            if meanwhile is not None:
                meanwhile()
        except BaseException:
            wait(futures)
            raise
        return finish

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
            sink = self._local.pad = bytearray(ALIGN)
        return memoryview(sink)

    def _iovecs(self, run: _Run) -> tuple[list[memoryview], list[memoryview]]:
        """The iovecs that read a run, and per block where its ``nbytes`` land: the caller's
        buffer itself, or the block's place in the bounce buffer."""
        direct = self.files.direct
        bounced = [b for b in run.blocks if not b.direct and (direct or b.buf is None)]
        staging = self._staging(sum(b.padded for b in bounced)) if bounced else None
        if bounced:
            self.faults.count(bounced_blocks=len(bounced))
        iovs: list[memoryview] = []
        views: list[memoryview] = []
        pos = 0
        last = run.blocks[-1]
        for b in run.blocks:
            if b.direct:
                assert b.buf is not None
                iovs.append(b.buf[: b.padded])
                views.append(b.buf[: b.nbytes])
            elif direct or b.buf is None:
                # O_DIRECT needs aligned memory, and pool pages are not contiguous: stage
                # through this thread's bounce buffer.
                assert staging is not None
                chunk = staging[pos : pos + b.padded]
                pos += b.padded
                iovs.append(chunk)
                views.append(chunk[: b.nbytes])
                b.staged = True
            else:
                # Buffered I/O takes any buffer; padding keeps the run contiguous on disk.
                iovs.append(b.buf[: b.nbytes])
                views.append(b.buf[: b.nbytes])
                if b.padded > b.nbytes and b is not last:
                    gap = b.padded - b.nbytes
                    iovs.append(self._pad_sink()[:gap])
        return iovs, views

    def _set_iovecs(self, ws: WriteSet, run: np.ndarray) -> list[memoryview]:
        """The iovecs that write a ``WriteSet``'s run: direct buffers as they are, the others
        staged through this thread's bounce buffer under O_DIRECT, or (buffered I/O) taken as
        they are with zero padding between blocks to keep the run contiguous on disk."""
        bufs, nbytes, padded = ws.bufs, ws.nbytes, ws.padded
        ids = run.tolist()
        if ws.direct[run].all():
            # Aligned buffers of the slot's size (L1 slots): the common case, no staging.
            if ws.exact:
                return [bufs[i] for i in ids]
            return [bufs[i][:padded] for i in ids]
        direct = self.files.direct
        bounced = int(np.count_nonzero(~ws.direct[run])) if direct else 0
        staging = self._staging(bounced * padded) if bounced else None
        if bounced:
            self.faults.count(bounced_blocks=bounced)
        iovs: list[memoryview] = []
        pos = 0
        last = ids[-1]
        for i, d in zip(ids, ws.direct[run].tolist(), strict=True):
            buf = bufs[i]
            if d:
                iovs.append(buf[:padded])
            elif direct:
                assert staging is not None
                chunk = staging[pos : pos + padded]
                pos += padded
                chunk[:nbytes] = buf[:nbytes]
                chunk[nbytes:] = _ZEROS[: padded - nbytes]
                iovs.append(chunk)
            else:
                iovs.append(buf[:nbytes])
                if padded > nbytes and i != last:
                    iovs.append(memoryview(_ZEROS)[: padded - nbytes])
        return iovs

    def _run_failed(self, run: _Run, exc: OSError, what: str) -> None:
        fault = self._count_failed_run(exc, what, len(run.blocks), run.file, run.offset)
        for b in run.blocks:
            b.ok = False
            b.error = fault.detail

    def _count_failed_run(self, exc: OSError, what: str, n: int, file: int, offset: int) -> Fault:
        """Count and record a failed transfer of ``n`` blocks; returns its classification."""
        fault = classify(exc)
        if what == "read":
            # The extents that failed are quarantined; whether the disk still takes writes is
            # for a write batch let through to tell (FaultState), not a restart.
            fault = Fault("read", fault.detail)
        self.faults.count(io_errors=1)
        self.faults.fault(
            fault, f"{what} of {counted(n, 'block')} at {self.files.paths[file].name}+{offset}"
        )
        return fault
