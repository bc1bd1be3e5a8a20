"""DiskTier beyond the shared contract: restart, verification and quarantine, a damaged index or
data file at open, the O_DIRECT fallback, injected I/O faults, and misuse that must raise."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import logging
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from disk_faults import FaultyFiles
from disk_writes import PersistItem, persist
from peers import NOBODY, NOGROUP, require_root
from races import ContendedLock
from races import wait_for as _wait_for

from kvtier.daemon import preflight
from kvtier.daemon.config import load_config
from kvtier.tiers.base import (
    BlockRef,
    BlockRefs,
    Health,
    HostBuffers,
    Priority,
    QuarantineRelease,
    ReadBatch,
    RecoveredBlocks,
    TierUnavailable,
    WriteBatch,
    WriteOutcome,
)
from kvtier.tiers.disk import DiskTier, ReadItem, checksum
from kvtier.tiers.disk import index as index_module
from kvtier.tiers.disk.tier import RESERVE_NAME, space_shortfall
from kvtier.tiers.host import HostArena

MiB = 1 << 20
Block = Callable[[int, int], tuple[bytes, bytes]]


def _open(directory: Path, **kw: object) -> DiskTier:
    kw.setdefault("file_bytes", 8 * MiB)
    return DiskTier(directory, 32 * MiB, 1 * MiB, **kw)  # type: ignore[arg-type]


def _items(tier: DiskTier, make_block: Block, ids: list[int], nbytes: int) -> list[PersistItem]:
    """Blocks ``ids`` to persist, each in a slot allocated for it."""
    items = []
    for i in ids:
        key, data = make_block(i, nbytes)
        slot = tier.allocator.allocate(nbytes)
        assert slot is not None
        items.append(PersistItem(1, key, slot, data, nbytes))
    return items


def _persist(tier: DiskTier, make_block: Block, ids: list[int], nbytes: int) -> dict[int, tuple]:
    """Persist blocks ``ids``; returns id -> (key, slot, data, checksum)."""
    items = _items(tier, make_block, ids, nbytes)
    outcomes = persist(tier, items)
    assert all(o.ok for o in outcomes), tier.health()
    return {
        i: (it.key, it.slot, it.data, o.checksum)
        for i, it, o in zip(ids, items, outcomes, strict=True)
    }


def _read(tier: DiskTier, blocks: dict[int, tuple]) -> dict[int, bytes | None]:
    bufs = {i: bytearray(len(b[2])) for i, b in blocks.items()}
    items = [ReadItem(b[1], bufs[i], len(b[2]), b[3], b[0]) for i, b in blocks.items()]
    ok = tier.read_items(items)
    return {i: bytes(bufs[i]) if good else None for i, good in zip(blocks, ok, strict=True)}


def _flip(tier: DiskTier, slot: int, at: int = 100) -> None:
    path, offset = tier.slot_location(slot)
    with open(path, "r+b") as f:
        f.seek(offset + at)
        old = f.read(16)
        f.seek(offset + at)
        f.write(bytes(b ^ 0xFF for b in old))
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------ restart


def test_restart_serves_thousands_of_blocks(disk_dir: Path, make_block: Block) -> None:
    sizes = [4096, 5000, 12_288]
    blocks: dict[int, tuple] = {}
    with _open(disk_dir) as tier:
        for n, nbytes in enumerate(sizes):
            ids = list(range(n * 1000, n * 1000 + 1000))
            for start in range(0, len(ids), 250):
                blocks.update(_persist(tier, make_block, ids[start : start + 250], nbytes))
        used = tier.allocator.used_bytes
    with _open(disk_dir) as tier:
        recovered = {r.key: r for r in tier.recover()}
        assert len(tier.recover()) == 0  # handed over once
        assert len(recovered) == 3000
        assert tier.allocator.used_bytes == used
        assert tier.stats().counters["recovered_blocks"] == 3000
        for key, slot, data, csum in blocks.values():
            r = recovered[key]
            assert (r.ns, r.slot, r.nbytes, r.checksum) == (1, slot, len(data), csum)
        items = [(r.slot, r.nbytes, r.checksum, r.key) for r in recovered.values()]
        for start in range(0, len(items), 500):
            chunk = items[start : start + 500]
            bufs = [bytearray(n) for _, n, _, _ in chunk]
            ok = tier.read_items(
                [ReadItem(s, b, n, c, k) for (s, n, c, k), b in zip(chunk, bufs, strict=True)]
            )
            assert all(ok)
            for (_, _, _, key), buf in zip(chunk, bufs, strict=True):
                expect = next(b for b in blocks.values() if b[0] == key)[2]
                assert buf == expect
        # Recovered slots are taken: new allocations never land on them.
        taken = {r.slot for r in recovered.values()}
        fresh = [tier.allocator.allocate(4096) for _ in range(100)]
        assert taken.isdisjoint(fresh)
        assert tier.stats().counters["checksum_failures"] == 0


def _fail_index_inserts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every index insert fails: a write's bytes go down and are synced, its rows never
    land, as when the process dies between the two."""

    def insert(self: object, rows: object, *_: object, **__: object) -> bool:
        raise sqlite3.OperationalError("injected: the process died before the commit")

    monkeypatch.setattr(index_module.DiskIndex, "insert_when", insert)


def test_written_but_uncommitted_slot_is_reclaimed(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _open(disk_dir) as tier:
        kept = _persist(tier, make_block, [1], 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        _fail_index_inserts(monkeypatch)
        key, data = make_block(2, 4096)
        assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
        assert tier.stats().counters["blocks_written"] == 2  # its bytes are on the disk
        monkeypatch.undo()
    with _open(disk_dir) as tier:
        recovered = tier.recover()
        assert [r.key for r in recovered] == [kept[1][0]]
        assert tier.allocator.used_slots == 1


def test_overwrite_without_remove_drops_the_old_row_first(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _open(disk_dir) as tier:
        old = _persist(tier, make_block, [1, 2], 4096)
        slot = old[1][1]
        # New bytes go down over block 1, then the commit of their row fails (as if killed
        # before it): the old row must not come back over the new bytes.
        _fail_index_inserts(monkeypatch)
        key, data = make_block(3, 4096)
        assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
        monkeypatch.undo()
        stats = tier.stats().counters
        assert stats["overwritten_blocks"] == 1 and stats["blocks_written"] == 3
    with _open(disk_dir) as tier:
        assert [r.key for r in tier.recover()] == [old[2][0]]
        assert tier.stats().counters["checksum_failures"] == 0


def test_capacity_change_keeps_the_blocks_that_fit(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(disk_dir) as tier:
        blocks = {}
        for start in range(0, 3000, 500):
            blocks.update(_persist(tier, make_block, list(range(start, start + 500)), 4096))
    with DiskTier(disk_dir, 64 * MiB, 1 * MiB, file_bytes=8 * MiB) as tier:
        assert len(tier.recover()) == 3000
        assert len(list(disk_dir.glob("data-*.bin"))) == 8
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        tier = DiskTier(disk_dir, 8 * MiB, 1 * MiB, file_bytes=8 * MiB)
    with tier:
        # In units, as the config spells the size (it said "from 67108864 to 8388608 bytes").
        assert "L2 capacity changes from 64MiB to 8MiB;" in caplog.text
        kept = {r.key: r for r in tier.recover()}
        assert len(kept) == 8 * 256  # eight 1 MiB segments of 4 KiB slots
        assert sorted(p.name for p in disk_dir.glob("data-*.bin")) == ["data-0000.bin"]
        survivors = {i: b for i, b in blocks.items() if b[0] in kept}
        assert _read(tier, survivors) == {i: b[2] for i, b in survivors.items()}


def test_regression_a_capacity_change_past_max_files_files_keeps_the_blocks(
    disk_dir: Path, make_block: Block
) -> None:
    """Past ``MAX_FILES`` files of ``file_bytes`` (1 TiB of 4 GiB files by default) the size
    of a data file follows the capacity, and a block's file and offset follow that size: a
    capacity grown or shrunk there made the index one of another layout, moved aside, every
    block gone (the index is kept when only the capacity changes). The tier keeps the size
    its index was made for, here 64 KiB files of 64 KiB segments, 256 of them at 16 MiB."""
    seg = 64 * 1024

    def tier(capacity: int) -> DiskTier:
        return DiskTier(disk_dir, capacity, seg, file_bytes=seg)

    with tier(16 * MiB) as t:
        blocks = _persist(t, make_block, list(range(64)), 4096)
        assert len(t.files.paths) == 256
    for capacity, files in ((24 * MiB, 384), (12 * MiB, 192)):
        assert space_shortfall(disk_dir, capacity, seg, seg) is None
        with tier(capacity) as t:
            assert len(t.recover()) == len(blocks)
            assert len(t.files.paths) == files
            assert t.stats().counters["index_moved_aside"] == 0
            assert _read(t, blocks) == {i: b[2] for i, b in blocks.items()}
    assert len(list(disk_dir.glob("index.sqlite3.old-*"))) == 0


def test_regression_a_smaller_file_bytes_setting_was_overridden_by_the_index(
    disk_dir: Path, make_block: Block
) -> None:
    """The size kept across capacity changes (``data_file_bytes``) was also kept where the
    operator had set a smaller ``file_bytes`` (smaller files, on purpose): the setting was
    overridden at every start for good, not taken as the new layout it is (the index moved
    aside, as for any other file size or segment size). Under the same setting a capacity
    change still keeps the size."""
    seg = 64 * 1024
    with DiskTier(disk_dir, 4 * MiB, seg, file_bytes=4 * seg) as t:
        _persist(t, make_block, list(range(4)), 4096)
        assert {p.stat().st_size for p in t.files.paths} == {4 * seg}
    with DiskTier(disk_dir, 4 * MiB, seg, file_bytes=seg) as t:
        assert {p.stat().st_size for p in t.files.paths} == {seg}
        assert len(t.recover()) == 0
        assert t.stats().counters["index_moved_aside"] == 1
    with DiskTier(disk_dir, 16 * MiB, seg, file_bytes=seg) as t:  # 256 files: the bound
        _persist(t, make_block, list(range(4)), 4096)
    with DiskTier(disk_dir, 20 * MiB, seg, file_bytes=seg) as t:
        assert {p.stat().st_size for p in t.files.paths} == {seg}
        assert len(t.recover()) == 4


def test_an_index_with_no_file_bytes_setting_is_used_and_records_one(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index made before ``file_bytes_setting`` was recorded keeps its blocks; the setting
    is recorded at the open, and a write of it that fails (a full disk) is only logged: the
    index is used all the same, not moved aside as one that cannot be read."""
    with _open(disk_dir) as t:
        blocks = _persist(t, make_block, [1, 2, 3], 4096)
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    with db:
        db.execute("DELETE FROM meta WHERE name = 'file_bytes_setting'")
    db.close()

    def disk_full(self: object, db: sqlite3.Connection) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as m:
        m.setattr(index_module.DiskIndex, "_write_meta", disk_full)
        with _open(disk_dir) as t:
            assert len(t.recover()) == 3
            assert t.stats().counters["index_moved_aside"] == 0
    assert "file_bytes_setting" not in index_module.stored_geometry(disk_dir)
    with _open(disk_dir) as t:
        assert _read(t, blocks) == {i: b[2] for i, b in blocks.items()}
    assert index_module.stored_geometry(disk_dir)["file_bytes_setting"] == str(8 * MiB)


# ------------------------------------------------------------------------ zero copy


def test_l1_slot_views_move_without_staging(disk_dir: Path) -> None:
    arena = HostArena(16 * MiB, 16 * MiB)
    nbytes = 256 * 1024
    l1 = [arena.allocator.allocate(nbytes) for _ in range(32)]
    for j, s in enumerate(l1):
        arena.view(s, nbytes)[:] = bytes([j]) * nbytes
    with _open(disk_dir) as tier:
        slots = [tier.allocator.allocate(nbytes) for _ in l1]
        outs = persist(
            tier,
            [
                PersistItem(1, bytes([j]) * 32, s, arena.view(a, nbytes), nbytes)
                for j, (s, a) in enumerate(zip(slots, l1, strict=True))
            ],
        )
        assert all(o.ok for o in outs)
        arena.array[:] = 0
        ok = tier.read_items(
            [
                ReadItem(s, arena.view(a, nbytes), nbytes, o.checksum, b"k")
                for s, a, o in zip(slots, l1, outs, strict=True)
            ]
        )
        assert all(ok)
        stats = tier.stats()
        assert tier.direct_io
        assert stats.counters["bounced_blocks"] == 0
        # 32 adjacent slots move in a few vectored calls, not 32.
        assert stats.counters["write_calls"] <= tier.io_threads
        assert stats.counters["read_calls"] <= tier.io_threads
    for j, s in enumerate(l1):
        assert arena.view(s, nbytes) == bytes([j]) * nbytes
    arena.close()


@pytest.mark.parametrize("known", [True, False], ids=["addresses known", "views only"])
def test_an_arenas_buffers_go_straight_to_the_disk_and_back(disk_dir: Path, known: bool) -> None:
    """A batch from (and into) L1 slots: with the arena's addresses or without them, the
    same blocks go unstaged and come back byte for byte."""
    arena = HostArena(16 * MiB, 16 * MiB)
    src = [arena.allocator.allocate(4096) for _ in range(64)]
    for j, s in enumerate(src):
        arena.view(s, 4096)[:] = bytes([j]) * 4096

    def buffers(slots: list[int]) -> HostBuffers:
        bufs = arena.buffers(slots, 4096)
        return bufs if known else HostBuffers(bufs.views)

    refs = [BlockRef(1, bytes([j]) * 32) for j in range(64)]
    with _open(disk_dir) as tier:
        slots = [tier.allocator.allocate(4096) for _ in src]
        outs = tier.write(WriteBatch(slots, refs, 4096, buffers(src)))
        assert all(o.ok for o in outs)
        dst = [arena.allocator.allocate(4096) for _ in src]
        ok = tier.read(ReadBatch(slots, refs, 4096, buffers(dst), [o.checksum for o in outs]))
        assert all(ok)
        assert tier.stats().counters["bounced_blocks"] == 0
    for j, s in enumerate(dst):
        assert arena.view(s, 4096) == bytes([j]) * 4096
    arena.close()


def test_unaligned_and_odd_sized_buffers_are_staged(disk_dir: Path, make_block: Block) -> None:
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(20)), 10_000)
        assert tier.stats().counters["bounced_blocks"] == 20
        got = _read(tier, blocks)
        assert got == {i: b[2] for i, b in blocks.items()}


# ------------------------------------------------------------- verification, quarantine


def test_corrupt_slot_is_a_counted_logged_miss_and_stays_quarantined(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(8)), 65_536)
        bad_key, bad_slot, _, _ = blocks[3]
        _flip(tier, bad_slot)
        used = tier.allocator.used_slots
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            got = _read(tier, blocks)
        assert got[3] is None
        assert all(got[i] == blocks[i][2] for i in blocks if i != 3)
        assert bad_key.hex() in caplog.text
        stats = tier.stats()
        assert stats.counters["checksum_failures"] == 1
        assert stats.counters["read_failures"] == 1
        assert stats.gauges["quarantined_slots"] == 1
        assert tier.health().state is Health.OK  # one bad block is not a sick disk
        # A second read does no I/O, leaves the buffer alone and still misses.
        buf = bytearray(b"\x55") * 65_536
        assert tier.read_items([ReadItem(bad_slot, buf, 65_536, blocks[3][3], bad_key)]) == [False]
        assert buf == b"\x55" * 65_536
        assert tier.stats().counters["reads_refused_quarantined"] == 1
        # The store drops its copy: removing the slot is harmless and keeps it held.
        assert tier.remove([bad_slot])
        assert tier.allocator.used_slots == used
    with _open(disk_dir) as tier:
        recovered = {r.key for r in tier.recover()}
        assert bad_key not in recovered and len(recovered) == 7
        assert tier.stats().gauges["quarantined_slots"] == 1
        taken = []
        while (slot := tier.allocator.allocate(65_536)) is not None:
            taken.append(slot)
        assert bad_slot not in taken
        assert tier.release_quarantined().released == [bad_slot]
        assert tier.allocator.allocate(65_536) == bad_slot


def test_regression_a_quarantine_outlived_the_data_file_recreated_under_it(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """Quarantined slots of a data file removed (recreated at the next open) stayed out of use
    for good: the tier had shrunk by their size with nothing left to hold them for."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(480)), 65_536)
        place = {i: tier.slot_location(b[1]) for i, b in blocks.items()}
        bad = [next(i for i in blocks if place[i][0].name == f"data-000{n}.bin") for n in (1, 2)]
        for i in bad:
            _flip(tier, blocks[i][1])
        assert _read(tier, {i: blocks[i] for i in bad}) == dict.fromkeys(bad)
        assert tier.stats().gauges["quarantined_slots"] == 2
    (disk_dir / "data-0001.bin").unlink()
    for n in range(2):  # the slot of the intact file stays held after a second restart too
        caplog.clear()
        with caplog.at_level(logging.WARNING, "kvtier.tiers.disk"), _open(disk_dir) as tier:
            tier.recover()
            returned = "1 quarantined slot(s) lay in data files recreated at this open"
            assert (returned in caplog.text) == (n == 0)
            assert tier.stats().gauges["quarantined_slots"] == 1
            assert tier.quarantined_bytes() == 65_536
            taken = set()
            while (slot := tier.allocator.allocate(65_536)) is not None:
                taken.add(slot)
            assert blocks[bad[0]][1] in taken and blocks[bad[1]][1] not in taken


def _quarantine_two(tier: DiskTier, make_block: Block) -> dict[int, tuple]:
    """Persist four blocks and quarantine the slots of blocks 1 and 2 (bytes flipped, read)."""
    blocks = _persist(tier, make_block, list(range(4)), 65_536)
    for i in (1, 2):
        _flip(tier, blocks[i][1])
    assert _read(tier, {i: blocks[i] for i in (1, 2)}) == {1: None, 2: None}
    return blocks


def test_quarantined_slots_are_listed_and_released_once_their_extent_checks_out(
    disk_dir: Path, make_block: Block
) -> None:
    with _open(disk_dir) as tier:
        blocks = _quarantine_two(tier, make_block)
        held = tier.quarantined()
        assert [q.slot for q in held] == [blocks[1][1], blocks[2][1]]
        assert tier.quarantined_bytes() == 2 * 65_536
        for q in held:
            path, offset = tier.slot_location(q.slot)
            assert (q.file, q.offset, q.slot_bytes) == (path.name, offset, 65_536)
            assert q.reason == "checksum mismatch" and q.at > 0
        with pytest.raises(ValueError, match=f"no quarantined slot {blocks[0][1]}"):
            tier.release_quarantined([blocks[0][1], blocks[1][1]])
        assert tier.stats().gauges["quarantined_slots"] == 2  # the refusal changed nothing
        out = tier.release_quarantined([blocks[1][1]])
        assert out.released == [blocks[1][1]] and out.kept == []
        assert [q.slot for q in tier.quarantined()] == [blocks[2][1]]
        assert tier.quarantined_bytes() == 65_536
        assert tier.health().state is Health.OK
    # Crash-safe: the release is durable and brings no old row back.
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[0][0], blocks[3][0]}
        assert [q.slot for q in tier.quarantined()] == [blocks[2][1]]
        assert tier.quarantined_bytes() == 65_536
        taken = set()
        while (slot := tier.allocator.allocate(65_536)) is not None:
            taken.add(slot)
        assert blocks[1][1] in taken and blocks[2][1] not in taken


def _recounted(tier: DiskTier) -> int:
    """The quarantined slots' bytes summed slot by slot, as ``quarantined_bytes`` did before
    it kept a running total."""
    return sum(q.slot_bytes for q in tier.quarantined())


def test_the_quarantined_bytes_are_a_recount_after_each_path(
    disk_dir: Path, make_block: Block
) -> None:
    """``quarantined_bytes`` is a total kept as slots enter and leave quarantine; after each
    way they do or might (reads that fail, a read of a held slot, a remove of their blocks, a
    release, a reopen), it is the sum over the slots held, for blocks smaller than their slots
    too. Two reads failing at once are in the test of a release beside a read in flight."""
    with _open(disk_dir) as tier:
        blocks: dict[int, tuple] = {}
        for n, nbytes in enumerate((40_000, 65_536, 300_000)):
            blocks.update(_persist(tier, make_block, [10 * n + k for k in range(3)], nbytes))
        bad = {i: b for i, b in blocks.items() if i % 10}
        for b in bad.values():
            _flip(tier, b[1])
        assert set(_read(tier, bad).values()) == {None}
        assert tier.quarantined_bytes() == _recounted(tier) == 2 * (40_960 + 65_536 + 303_104)
        assert _read(tier, {1: blocks[1]}) == {1: None}  # refused while held
        assert tier.quarantined_bytes() == _recounted(tier) == 2 * (40_960 + 65_536 + 303_104)
        assert tier.remove([b[1] for b in blocks.values()])  # held all the same
        assert tier.quarantined_bytes() == _recounted(tier) == 2 * (40_960 + 65_536 + 303_104)
        out = tier.release_quarantined([blocks[1][1], blocks[21][1]])
        assert out.released == [blocks[1][1], blocks[21][1]]
        assert tier.quarantined_bytes() == _recounted(tier) == 40_960 + 2 * 65_536 + 303_104
    with _open(disk_dir) as tier:
        tier.recover()
        assert tier.quarantined_bytes() == _recounted(tier) == 40_960 + 2 * 65_536 + 303_104
        tier.release_quarantined()
        assert tier.quarantined_bytes() == _recounted(tier) == 0


def test_a_quarantined_slot_whose_check_fails_stays_held_and_says_why(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    with _open(disk_dir, backend=faulty_files) as tier:
        blocks = _quarantine_two(tier, make_block)
        faulty_files.fail("pwritev", errno.EIO, times=1)
        out = tier.release_quarantined()
        assert out.released == [blocks[2][1]]
        assert [q.slot for q in out.kept] == [blocks[1][1]]
        assert out.kept[0].reason.startswith("release: write: EIO")
        # A suspect extent failing its check does not stop the tier's writes.
        assert tier.health().state is Health.OK
        held = tier.quarantined()
        assert [(q.slot, q.reason) for q in held] == [(blocks[1][1], out.kept[0].reason)]
        faulty_files.fail("preadv", errno.EIO, times=1)
        out = tier.release_quarantined()
        assert out.released == [] and out.kept[0].reason.startswith("release: read back: EIO")
    with _open(disk_dir) as tier:
        tier.recover()
        assert [q.slot for q in tier.quarantined()] == [blocks[1][1]]
        assert tier.release_quarantined().released == [blocks[1][1]]


def test_regression_a_release_whose_quarantine_record_failed_said_nothing_and_kept_the_tier_ok(
    disk_dir: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The record of a release's slots that failed their check again was written with every
    SQLite error suppressed: a failed commit (here an index another process held locked;
    SQLITE_FULL or SQLITE_IOERR alike) was neither counted nor logged, and the tier stayed
    ok, where a read's quarantine record failing degrades it. It is now the tier's fault, as
    a read's is; the slot stays held in memory and its old record in the index."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=0.0) as tier:
        blocks = _quarantine_two(tier, make_block)
        errors = tier.stats().counters["index_errors"]
        faulty_files.fail("pwritev", errno.EIO, times=1)
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
                out = tier.release_quarantined([blocks[1][1]])
        finally:
            other.close()
        assert out.released == [] and [q.slot for q in out.kept] == [blocks[1][1]]
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and "index quarantine update" in health.detail
        assert tier.stats().counters["index_errors"] == errors + 1
        assert [r for r in caplog.records if "index quarantine update" in r.getMessage()]
        held = tier.quarantined()
        assert [(q.slot, q.reason) for q in held] == [
            (blocks[1][1], "checksum mismatch"),
            (blocks[2][1], "checksum mismatch"),
        ]


def test_regression_a_release_naming_no_slot_gave_back_more_than_its_reply_could_list(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A release naming no slot gave back every slot held, and the daemon's reply lists each
    slot released: past server.max_message_bytes (~350k slots at 1 MiB) the reply failed after
    the release was done, and the CLI said 'refused, did nothing'. With ``limit`` it tries that
    many, going on past the last it tried, so a slot failing its check again does not keep
    the rest from their turn."""
    with _open(disk_dir, backend=faulty_files) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 65_536)
        for i in (1, 2, 3):
            _flip(tier, blocks[i][1])
        assert _read(tier, {i: blocks[i] for i in (1, 2, 3)}) == {1: None, 2: None, 3: None}
        first, second, third = sorted(blocks[i][1] for i in (1, 2, 3))
        faulty_files.fail("pwritev", errno.EIO, times=1)
        out = tier.release_quarantined(limit=1)
        assert out.released == [] and [q.slot for q in out.kept] == [first]
        assert tier.release_quarantined(limit=1).released == [second]
        assert tier.release_quarantined(limit=2).released == [first, third]  # wrapped
        assert tier.quarantined() == []
        assert tier.release_quarantined(limit=1) == ([], [])


def test_regression_a_release_naming_no_slot_tells_slots_tried_from_those_left_untried(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A release naming no slot tries at most ``limit``, and every slot it left held looked
    alike: once each slot held had failed its check, a caller told to run it again for the
    rest never ended. Each slot held says whether a release tried it since its quarantine."""
    with _open(disk_dir, backend=faulty_files) as tier:
        blocks = _persist(tier, make_block, list(range(3)), 65_536)
        for i in range(3):
            _flip(tier, blocks[i][1])
        assert _read(tier, blocks) == {0: None, 1: None, 2: None}
        first, second, third = sorted(blocks[i][1] for i in range(3))
        assert [q.tried for q in tier.quarantined()] == [False, False, False]
        faulty_files.fail("pwritev", errno.EIO, times=4)
        assert tier.release_quarantined(limit=2).released == []
        assert [q.tried for q in tier.quarantined()] == [True, True, False]
        out = tier.release_quarantined(limit=2)  # the third, then the first again (wrapped)
        assert out.released == [] and [q.tried for q in out.kept] == [True, True]
        assert [q.tried for q in tier.quarantined()] == [True, True, True]
        assert tier.release_quarantined(limit=2).released == [second, third]
        assert [(q.slot, q.tried) for q in tier.quarantined()] == [(first, True)]


def _device_read_bytes() -> int:
    """The bytes this process has read from storage devices (page cache hits not counted)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def test_regression_a_buffered_release_read_its_check_back_from_the_page_cache(
    disk_dir: Path, make_block: Block
) -> None:
    """Without O_DIRECT (``direct_io`` off, or a filesystem that refuses it) the check's read
    back was served from the pages its write had just filled, so an extent the disk could no
    longer read passed it (seen: read_bytes in /proc/self/io up by 0 across a release of two
    64 KiB slots). The written pages are dropped once synced: the read back is the disk's."""
    with _open(disk_dir, direct_io=False) as tier:
        assert not tier.direct_io
        blocks = _quarantine_two(tier, make_block)
        before = _device_read_bytes()
        assert sorted(tier.release_quarantined().released) == [blocks[1][1], blocks[2][1]]
        assert _device_read_bytes() - before >= 2 * 65_536


def test_quarantined_slots_are_not_released_while_the_tier_is_degraded(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    with _open(disk_dir, backend=faulty_files) as tier:
        blocks = _quarantine_two(tier, make_block)
        faulty_files.fail("pwritev", errno.EIO, times=1)
        assert [o.ok for o in persist(tier, _items(tier, make_block, [9], 65_536))] == [False]
        with pytest.raises(TierUnavailable, match="degraded_io"):
            tier.release_quarantined()
        assert len(tier.quarantined()) == 2
    with _open(disk_dir, recover_later=True) as tier:
        with pytest.raises(TierUnavailable, match="reading its index"):
            tier.release_quarantined()
        list(tier.recover_chunks())
        assert sorted(tier.release_quarantined().released) == [blocks[1][1], blocks[2][1]]


class _ReleaseOnLog(logging.Handler):
    """Releases every quarantined slot of ``tier`` from within the first log line of a failed
    read: after the read's slot is held, before its quarantine is in the index."""

    def __init__(self, tier: DiskTier) -> None:
        super().__init__()
        self.tier = tier
        self.released: list[int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.released is None and "failed verification" in record.getMessage():
            self.released = self.tier.release_quarantined().released


def test_regression_a_release_during_a_failed_reads_quarantine_left_its_row_behind(
    disk_dir: Path, make_block: Block
) -> None:
    """A failed read held its slot in memory before it recorded the quarantine in the index;
    a release in between gave the slot back, and the quarantine row written after it outlived
    the release (seen: the slot free and handed out, yet quarantined in the index, so the
    next open held it again and dropped the block durably written there since)."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(2)), 65_536)
        _flip(tier, blocks[1][1])
        hook = _ReleaseOnLog(tier)
        logger = logging.getLogger("kvtier.tiers.disk")
        logger.addHandler(hook)
        try:
            assert _read(tier, {1: blocks[1]}) == {1: None}
        finally:
            logger.removeHandler(hook)
        assert hook.released == []
        held = tier.quarantined()
        assert [(q.slot, q.reason) for q in held] == [(blocks[1][1], "checksum mismatch")]
        assert tier.release_quarantined().released == [blocks[1][1]]
        again = _persist(tier, make_block, [2], 65_536)
        assert again[2][1] == blocks[1][1]
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[0][0], again[2][0]}
        assert tier.quarantined() == []


def test_regression_a_read_eio_of_an_idle_tier_could_not_be_released(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A failed read degrades the tier until a write gets through; with no write coming (an
    idle daemon) it stayed degraded, and the release of its slots, which writes, syncs and
    reads back the very extents that failed, was refused for it (seen: one preadv EIO, then
    `kvtier quarantine --release`: FAILED_PRECONDITION 'L2 is degraded_io'). The release
    runs, and once every slot passed its check the tier is whole again; a check that fails
    leaves the tier as it was."""
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=3600.0) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 4096)
        faulty_files.fail("preadv", errno.EIO, times=1)
        assert _read(tier, blocks) == dict.fromkeys(blocks)
        assert tier.health().state is Health.DEGRADED_IO
        slots = sorted(b[1] for b in blocks.values())
        faulty_files.fail("pwritev", errno.EIO, times=1)
        out = tier.release_quarantined(slots[:2])
        assert out.released == [slots[1]] and [q.slot for q in out.kept] == [slots[0]]
        assert tier.health().state is Health.DEGRADED_IO
        assert sorted(tier.release_quarantined().released) == [slots[0], *slots[2:]]
        assert tier.health().state is Health.OK
        assert tier.quarantined() == []


class _SecondReadOnLog(logging.Handler):
    """From the first log line of a failed read (before its slot is held), starts another
    read of the same slot on a thread of its own and returns once that one failed too; that
    read then waits at its own log line until ``go`` is set: two reads of a slot in flight
    together (two gets of one block), the second's failure held back."""

    def __init__(self, tier: DiskTier, block: tuple) -> None:
        super().__init__()
        self.second = threading.Thread(target=_read, args=(tier, {1: block}))
        self.failed, self.go = threading.Event(), threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:
        # Without the handler's lock, which the first read holds while it waits here.
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if "failed verification" not in record.getMessage():
            return
        if threading.current_thread() is self.second:
            self.failed.set()
            self.go.wait(30)
        elif not self.second.is_alive() and not self.failed.is_set():
            self.second.start()
            assert self.failed.wait(30)


def test_regression_a_release_gave_back_a_slot_that_a_read_in_flight_then_quarantined(
    disk_dir: Path, make_block: Block
) -> None:
    """Two reads of one slot were in flight together and both failed; a release between the
    first's quarantine and the second's gave the slot back, and the second then held it
    again and recorded it in the index: the slot free and handed out, yet quarantined (the
    block written there since dropped at the next open). A slot a read still has in flight
    stays held by a release, which says why."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(2)), 65_536)
        slot = blocks[1][1]
        _flip(tier, slot)
        hook = _SecondReadOnLog(tier, blocks[1])
        logger = logging.getLogger("kvtier.tiers.disk")
        logger.addHandler(hook)
        try:
            assert _read(tier, {1: blocks[1]}) == {1: None}
            released = tier.release_quarantined()
        finally:
            hook.go.set()
            hook.second.join(30)
            logger.removeHandler(hook)
        assert released.released == []
        assert [(q.slot, q.reason) for q in released.kept] == [
            (slot, "release: a read of it was in flight")
        ]
        assert [q.slot for q in tier.quarantined()] == [slot]
        assert tier.quarantined_bytes() == 65_536  # quarantined twice, held once
        assert tier.release_quarantined().released == [slot]
        assert tier.quarantined_bytes() == 0
        again = _persist(tier, make_block, [2], 65_536)
        assert again[2][1] == slot
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[0][0], again[2][0]}
        assert tier.quarantined() == []


def test_regression_a_release_gave_back_a_quarantined_slot_whose_free_was_under_way(
    disk_dir: Path, make_block: Block
) -> None:
    """A slot quarantined by a failed read whose free the store had under way (a slot of
    ``SpaceManager.read_held``: a read of a recovered copy's replaced slot failed) was given
    back by a release before that free: handed out again, the next block commit deleted the
    row of the block written there (a commit deletes the rows of slots on their way to
    ``remove``), answered persisted and gone after a restart, and the free then released the
    slot under it. A release leaves such a slot held, saying why, after a block commit that
    deleted its row too; the free keeps it held."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [0, 1], 65_536)
        slot = blocks[1][1]
        _flip(tier, slot)
        assert _read(tier, {1: blocks[1]}) == {1: None}
        tier.removing([slot])
        assert tier.release_quarantined().released == []
        other = _persist(tier, make_block, [3], 65_536)
        out = tier.release_quarantined()
        assert out.released == []
        assert [(q.slot, q.reason) for q in out.kept] == [
            (slot, "release: its free was not done yet")
        ]
        again = _persist(tier, make_block, [2], 65_536)
        assert again[2][1] != slot
        assert tier.remove([slot])
        assert [q.slot for q in tier.quarantined()] == [slot]
        assert tier.release_quarantined().released == [slot]
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[0][0], other[3][0], again[2][0]}


def test_regression_a_release_took_the_slots_it_left_unchecked_for_failed_checks(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles, caplog: pytest.LogCaptureFixture
) -> None:
    """A release leaves held, unchecked, a slot whose free is under way (or that a read has in
    flight), and took it for one whose check failed: the quarantine's record of it, why its
    read failed and when, was overwritten with "release: its free was not done yet" (listed by
    `kvtier quarantine` from then on, across restarts), the log counted it among the slots
    that "failed their check", and a tier degraded by a failed read stayed degraded though
    every check that ran passed. Such a slot keeps its record, and only checks that ran count."""
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=3600.0) as tier:
        blocks = _persist(tier, make_block, [0, 1], 4096)
        faulty_files.fail("preadv", errno.EIO, times=1)
        assert _read(tier, blocks) == {0: None, 1: None}
        assert tier.health().state is Health.DEGRADED_IO
        left, checked = blocks[0][1], blocks[1][1]
        [record] = [(q.reason, q.at) for q in tier.quarantined() if q.slot == left]
        tier.removing([left])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            out = tier.release_quarantined()
        assert out.released == [checked]
        assert [(q.slot, q.reason, q.tried) for q in out.kept] == [
            (left, "release: its free was not done yet", False)
        ]
        assert not [r for r in caplog.records if "failed their check" in r.getMessage()]
        assert tier.health().state is Health.OK
        assert [(q.slot, (q.reason, q.at), q.tried) for q in tier.quarantined()] == [
            (left, record, False)
        ]
    with _open(disk_dir) as tier:
        assert [(q.slot, (q.reason, q.at)) for q in tier.quarantined()] == [(left, record)]


def test_regression_a_slot_left_for_a_later_release_stayed_tried_from_an_earlier_check(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A slot whose check had failed once (``tried``) and that a later release left held,
    unchecked, for its free under way stayed ``tried``: the reply of a release naming none
    counted it among the slots that failed their check (`kvtier quarantine --release`: exit 4,
    nothing left to try), though the next release would check it. A slot left for a later
    release is untried, whatever an earlier check found."""
    with _open(disk_dir, backend=faulty_files) as tier:
        blocks = _persist(tier, make_block, [0, 1], 65_536)
        slot = blocks[1][1]
        _flip(tier, slot)
        assert _read(tier, {1: blocks[1]}) == {1: None}
        faulty_files.fail("pwritev", errno.EIO, times=1)
        assert tier.release_quarantined().released == []
        faulty_files.clear()
        assert [(q.slot, q.tried) for q in tier.quarantined()] == [(slot, True)]
        tier.removing([slot])
        out = tier.release_quarantined()
        assert out.released == [] and [(q.slot, q.tried) for q in out.kept] == [(slot, False)]
        assert [(q.slot, q.tried) for q in tier.quarantined()] == [(slot, False)]
        assert tier.remove([slot])
        assert tier.release_quarantined().released == [slot]


def _release_as_a_free_begins(
    tier: DiskTier, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict, int, QuarantineRelease]:
    """Blocks 0 and 1 persisted, block 1's slot quarantined by a failed read, then a release
    during whose check of that slot the slot's free begins (``removing``): the blocks, that
    slot and what the release did."""
    blocks = _persist(tier, make_block, [0, 1], 65_536)
    slot = blocks[1][1]
    _flip(tier, slot)
    assert _read(tier, {1: blocks[1]}) == {1: None}
    check = tier._check_extents

    def free_begins_meanwhile(held: dict[int, int]) -> dict[int, str]:
        tier.removing([slot])
        return check(held)

    monkeypatch.setattr(tier, "_check_extents", free_begins_meanwhile)
    out = tier.release_quarantined()
    monkeypatch.undo()
    return blocks, slot, out


def test_regression_a_release_gave_back_a_slot_whose_free_began_while_its_extent_was_checked(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release looked for slots on their way to ``remove`` (``_freeing``) only before it
    checked the extents: a free begun during the check (a Get that held the quarantined slot
    of a replaced recovered row ended) found the slot given back, and that free's ``remove``
    then released it again under the block handed it meanwhile, which the next block written
    there overwrote (two blocks of one slot; the first gone after a restart). A release now
    leaves such a slot held, as one whose free began before, and a later one gives it back."""
    with _open(disk_dir) as tier:
        blocks, slot, out = _release_as_a_free_begins(tier, make_block, monkeypatch)
        assert out.released == []
        assert [(q.slot, q.reason) for q in out.kept] == [
            (slot, "release: its free was not done yet")
        ]
        other = _persist(tier, make_block, [2], 65_536)
        assert other[2][1] != slot
        assert tier.remove([slot])  # the free under way
        again = _persist(tier, make_block, [3], 65_536)
        assert again[3][1] not in (slot, other[2][1])
        assert tier.release_quarantined().released == [slot]
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[0][0], other[2][0], again[3][0]}


def test_regression_a_slot_whose_free_began_during_its_check_was_listed_as_not_recorded(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot whose check passed while its free began stays held for that free, its rows
    dropped with the others released: `kvtier quarantine` listed it as "not recorded in the
    index", at no time, as if its quarantine had failed to commit, until a later release gave
    it back. It is listed as passed, held for its free, since the release."""
    with _open(disk_dir, clock=lambda: 2_000.0) as tier:
        _, slot, out = _release_as_a_free_begins(tier, make_block, monkeypatch)
        assert out.released == []
        listed = [(q.slot, q.reason, q.at, q.tried) for q in tier.quarantined()]
        assert listed == [
            (
                slot,
                "release: its check passed, its free was not done yet (free after a restart)",
                2_000.0,
                False,
            )
        ]
        assert tier.remove([slot])
        assert tier.release_quarantined().released == [slot]
        assert tier.quarantined() == []


def test_regression_a_slot_that_failed_its_check_was_listed_as_passed_by_an_earlier_release(
    disk_dir: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slot that passed a release's check while its free began, then failed the next
    release's check with that failure's record not committed (the index held by another
    process here; SQLITE_FULL or SQLITE_IOERR alike), was still listed as "release: its check
    passed ... (free after a restart)": the earlier pass outlived the check that failed. It
    is listed as a slot whose record failed to commit, ``tried``."""
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=0.0) as tier:
        _, slot, _ = _release_as_a_free_begins(tier, make_block, monkeypatch)
        assert tier.remove([slot])
        monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
        faulty_files.fail("pwritev", errno.EIO, times=1)
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            out = tier.release_quarantined([slot])
        finally:
            other.close()
        assert out.released == [] and [(q.slot, q.tried) for q in out.kept] == [(slot, True)]
        assert tier.health().state is Health.DEGRADED_IO  # the record's failure
        listed = [(q.slot, q.reason, q.at, q.tried) for q in tier.quarantined()]
        assert listed == [(slot, "not recorded in the index", 0.0, True)]


def test_regression_a_failed_read_on_a_full_disk_let_a_release_end_the_full_disks_fault(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A failed read took the place of a full disk's fault (both pass once a write gets
    through), and since 880c2b9 a release is let run while the tier is degraded by a failed
    read and ends that fault when its checks pass: the release wrote no block, yet the tier
    took writes again at once, the disk still full (seen: DEGRADED_NOSPACE, one preadv EIO,
    a release: OK). A failed read leaves a full disk's fault as it is; the release is
    refused as for any other fault."""
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=3600.0) as tier:
        blocks = _persist(tier, make_block, list(range(2)), 4096)
        faulty_files.fail("pwritev", errno.ENOSPC, times=1)
        assert [o.ok for o in persist(tier, _items(tier, make_block, [9], 4096))] == [False]
        assert tier.health().state is Health.DEGRADED_NOSPACE
        faulty_files.fail("preadv", errno.EIO, times=1)
        assert _read(tier, {1: blocks[1]}) == {1: None}
        assert tier.health().state is Health.DEGRADED_NOSPACE
        with pytest.raises(TierUnavailable, match="degraded_nospace"):
            tier.release_quarantined()
        assert tier.health().state is Health.DEGRADED_NOSPACE
        assert [q.slot for q in tier.quarantined()] == [blocks[1][1]]


def test_read_never_copies_unverified_bytes_through_staging(
    disk_dir: Path, make_block: Block
) -> None:
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [0], 4096)
        _flip(tier, blocks[0][1], at=0)
        dst = bytearray(b"\xaa") * 4096
        assert tier.read_items([ReadItem(blocks[0][1], dst, 4096, blocks[0][3], blocks[0][0])]) == [
            False
        ]
        assert dst == bytes(4096)


# -------------------------------------------------------------- damaged files at open


@pytest.mark.parametrize("damage", ["garbage", "half", "tail", "empty"])
def test_damaged_index_is_moved_aside_and_the_tier_starts_empty(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(500)), 4096)
    index = disk_dir / "index.sqlite3"
    size = index.stat().st_size
    if damage == "garbage":
        with open(index, "r+b") as f:
            f.write(os.urandom(100))
    else:
        os.truncate(index, {"half": size // 2, "tail": size - 4096, "empty": 0}[damage])
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
        tier = _open(disk_dir)
    with tier:
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "moved aside" in errors[0].getMessage()
        assert "starting EMPTY" in errors[0].getMessage()
        assert list(disk_dir.glob("index.sqlite3.corrupt-*"))
        # Visible in the tier's stats, not only in the log.
        assert tier.stats().counters["index_moved_aside"] == 1
        assert "moved aside" in tier.health().detail
        assert len(tier.recover()) == 0
        assert tier.allocator.used_bytes == 0
        again = _persist(tier, make_block, [7], 4096)
        assert _read(tier, again) == {7: again[7][2]}


def _open_paths(directory: Path) -> list[str]:
    """The files of ``directory`` this process has open (its descriptors' targets)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith(f"{directory}/"):
                found.append(os.path.basename(target))
    return found


def test_regression_an_index_moved_aside_stayed_open_until_the_collector_ran(
    disk_dir: Path,
) -> None:
    """An index file that is no database fails the open's ``PRAGMA journal_mode`` (NOTADB),
    and the connection made for it was left to Python's cyclic collector (a cursor and its
    connection refer to each other), which the daemon runs in full rarely: the moved-aside
    file stayed open, so deleting it, as the warning says to free its space, freed nothing.
    The collector is off here as it mostly is in the daemon; the connection is now closed
    where its set-up fails."""
    (disk_dir / "index.sqlite3").write_bytes(os.urandom(8192))
    enabled = gc.isenabled()
    gc.disable()
    try:
        with _open(disk_dir) as tier:
            [aside] = [p.name for p in disk_dir.glob("index.sqlite3.corrupt-*")]
            assert tier.stats().counters["index_moved_aside"] == 1
            assert aside not in _open_paths(disk_dir)
    finally:
        if enabled:
            gc.enable()


def test_regression_a_new_index_that_sqlite_could_not_make_escaped_as_an_sqlite_error(
    disk_dir: Path,
) -> None:
    """A damaged index moved aside, and the new one SQLite could not make for a reason other
    than a full disk (SQLITE_CANTOPEN: a folder where its rollback journal goes, which the
    switch to WAL opens): the open raised that sqlite3 error, which the daemon's start does
    not catch (a traceback), nothing saying the index was moved aside. The start is refused
    (TierUnavailable) naming the index, the cause and the index moved aside."""
    with _open(disk_dir):
        pass
    (disk_dir / "index.sqlite3").write_bytes(os.urandom(8192))
    (disk_dir / "index.sqlite3-journal").mkdir()
    with pytest.raises(TierUnavailable) as e:
        _open(disk_dir)
    [aside] = [p.name for p in disk_dir.glob("index.sqlite3.corrupt-*")]
    assert str(e.value).startswith(
        f"cannot make the L2 index {disk_dir / 'index.sqlite3'} (index: SQLITE_CANTOPEN: "
    ), str(e.value)
    assert "found there cannot be read (index: SQLITE_" in str(e.value), str(e.value)
    assert f"moved aside as {aside}, the next start makes a new" in str(e.value), str(e.value)
    assert not (disk_dir / "index.sqlite3").exists()
    (disk_dir / "index.sqlite3-journal").rmdir()
    with _open(disk_dir) as tier:
        assert tier.health().state is Health.OK


def test_regression_a_new_index_whose_wal_could_not_be_made_was_left_to_be_moved_aside(
    disk_dir: Path, make_block: Block
) -> None:
    """An error of the system's (not SQLite's) making a new index's WAL or shared memory
    (EISDIR here: a folder where its WAL goes; EIO, EACCES) left the index file the open had
    made, empty, and the refusal said "cannot open" and named no index moved aside before.
    The next start took that file for a damaged index and moved it aside ("is empty or
    truncated"), in place of saying that the index was missing beside its data files. The
    open removes what it made, as after SQLite's errors, and the start is refused as one
    that could not make the index."""
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(4)), 4096)
    for end in ("", "-wal", "-shm"):
        (disk_dir / f"index.sqlite3{end}").unlink(missing_ok=True)
    (disk_dir / "index.sqlite3-wal").mkdir()
    with pytest.raises(TierUnavailable) as e:
        _open(disk_dir)
    assert str(e.value).startswith(
        f"cannot make the L2 index {disk_dir / 'index.sqlite3'} (index: EISDIR: "
    ), str(e.value)
    assert not (disk_dir / "index.sqlite3").exists()
    (disk_dir / "index.sqlite3-wal").rmdir()
    with _open(disk_dir) as tier:
        assert tier.health().detail.startswith("index was missing beside 4 data file(s)")
        assert "index_moved_aside" not in tier.faults.snapshot()
    assert not list(disk_dir.glob("index.sqlite3.corrupt-*"))


_EXCLUSIVE_HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA locking_mode=EXCLUSIVE")
db.execute("BEGIN EXCLUSIVE")
db.execute("SELECT count(*) FROM blocks").fetchone()
print("holding", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
"""


@contextlib.contextmanager
def _holding(script: str, index: Path) -> Iterator[tuple[Callable[[], None], int]]:
    """Another process running ``script`` on ``index`` until it prints "holding"; yields a
    call that lets it end (a line on its stdin) and waits for it to exit 0, and its pid.
    Killed where the block ends before."""
    other = subprocess.Popen(
        [sys.executable, "-c", script, str(index)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def let_go() -> None:
        assert other.stdin is not None
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.wait(timeout=30) == 0

    try:
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "holding"
        yield let_go, other.pid
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_regression_an_index_another_process_held_locked_at_the_open_was_moved_aside(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the index locked past the busy timeout as the tier opened (an
    operator's sqlite3 shell in exclusive locking mode): the open's SQLITE_BUSY was taken for
    an index SQLite cannot read, moved aside as corrupt, and the tier started EMPTY, every
    block lost to a lock. The start is now refused, naming the lock, the index kept."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 4096)
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _holding(_EXCLUSIVE_HOLDER, disk_dir / "index.sqlite3") as (let_go, _):
        with pytest.raises(TierUnavailable, match=r"cannot open the L2 index .*locked"):
            _open(disk_dir)
        assert not list(disk_dir.glob("*corrupt*"))
        let_go()
    with _open(disk_dir) as tier:
        assert {bytes(k) for k in tier.recover().keys} == {b[0] for b in blocks.values()}


def test_regression_a_start_refused_for_a_locked_index_did_not_name_the_process_holding_it(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's sqlite3 shell in a write transaction on the index past the busy timeout,
    as the tier opens with another capacity (which its open records: a write): the start was
    refused saying only "another process holds it locked (an sqlite3 shell?)", the operator
    left to find which of the machine's processes. The refusal now names the holder's pid
    and command (the kernel's list of locks, /proc/locks, gives them)."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 4096)
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _holding(_OTHER_WRITER, disk_dir / "index.sqlite3") as (let_go, pid):
        with pytest.raises(TierUnavailable, match=r"cannot open the L2 index .*locked") as e:
            DiskTier(disk_dir, 16 * MiB, 1 * MiB, file_bytes=8 * MiB)
        assert f"holds it locked (pid {pid}, " in str(e.value), str(e.value)
        let_go()
    with _open(disk_dir) as tier:
        assert {bytes(k) for k in tier.recover().keys} == {b[0] for b in blocks.values()}


# An operator's sqlite3 shell in exclusive locking mode that wrote a row: its commit is in the
# WAL, which no other process may read while it holds the lock.
_EXCLUSIVE_WRITER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA locking_mode=EXCLUSIVE")
db.execute("INSERT OR REPLACE INTO namespaces VALUES (7, 'other')")
print("holding", flush=True)
sys.stdin.readline()
"""


def test_regression_a_lock_at_the_geometry_read_moved_the_index_aside_as_another_layout(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A start with a smaller capacity (data files of 128 KiB kept, the size the index was
    made for, where 16 MiB alone makes them 64 KiB) under a lock another process held: the
    read of the stored geometry waited SQLite's default 5 s, not the open's busy timeout,
    and took the lock for "no geometry", so the tier chose 64 KiB files and, the lock let go
    while the open waited, moved the index aside as "another layout (file_bytes 131072 ->
    65536)": all 8 blocks lost (and the daemon's preflight, reading it the same way, said
    "config ok"). A lock at the geometry read now refuses the start as one at the open does,
    naming the holder, after the same timeout, in the preflight as in the tier; the next
    start keeps the blocks."""
    seg = 64 * 1024
    with DiskTier(disk_dir, 32 * MiB, seg, file_bytes=seg) as tier:
        assert {p.stat().st_size for p in tier.files.paths} == {2 * seg}
        blocks = _persist(tier, make_block, list(range(8)), 4096)
    config = load_config(
        None,
        [
            f"server.socket={tmp_path}/s.sock",
            "tiers.l2.enabled=true",
            f"tiers.l2.path={disk_dir}",
            "tiers.l2.capacity_bytes=16MiB",
            "tiers.l2.segment_bytes=64KiB",
            "tiers.l2.file_bytes=64KiB",
        ],
    )
    host = preflight.HostFacts(8 << 30, 16 << 30, None)
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _holding(_EXCLUSIVE_WRITER, disk_dir / "index.sqlite3") as (let_go, pid):
        assert (disk_dir / "index.sqlite3-wal").stat().st_size > 0
        problems = [str(p) for p in preflight.check(config, host)]
        assert len(problems) == 1, problems
        assert problems[0].startswith("tiers.l2.path: cannot open the L2 index "), problems
        assert f"holds it locked (pid {pid}, " in problems[0], problems
        real_init = index_module.DiskIndex.__init__

        def shell_ends_as_the_open_waits(self: object, *a: object, **kw: object) -> None:
            let_go()
            real_init(self, *a, **kw)  # type: ignore[arg-type]

        with monkeypatch.context() as m:
            m.setattr(index_module.DiskIndex, "__init__", shell_ends_as_the_open_waits)
            with pytest.raises(TierUnavailable, match=r"cannot open the L2 index .*locked") as e:
                DiskTier(disk_dir, 16 * MiB, seg, file_bytes=seg)
        assert f"holds it locked (pid {pid}, " in str(e.value), str(e.value)
        let_go()
    assert preflight.check(config, host) == []
    with DiskTier(disk_dir, 16 * MiB, seg, file_bytes=seg) as tier:
        assert tier.stats().counters["index_moved_aside"] == 0
        assert not list(disk_dir.glob("index.sqlite3.old-*"))
        assert {p.stat().st_size for p in tier.files.paths} == {2 * seg}
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


@pytest.mark.parametrize("damage", ["missing", "short", "unreadable"])
def test_a_damaged_data_file_loses_only_its_own_blocks(
    disk_dir: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    """Regression: one truncated data file (of four) used to move the whole index aside, so
    the blocks in the intact files were lost too."""
    with _open(disk_dir) as tier:
        # 1 MiB segments of 64 KiB slots: 16 per segment, 128 per 8 MiB file; 4 files.
        blocks = {}
        for start in range(0, 480, 120):
            blocks.update(_persist(tier, make_block, list(range(start, start + 120)), 65_536))
    by_file: dict[str, set[int]] = {}
    with _open(disk_dir) as tier:
        for i, b in blocks.items():
            by_file.setdefault(tier.slot_location(b[1])[0].name, set()).add(i)
    assert len(by_file) == 4
    victim = disk_dir / "data-0001.bin"
    if damage == "missing":
        victim.unlink()
        lost = by_file[victim.name]
    elif damage == "short":
        os.truncate(victim, 3 * MiB)  # the first three segments survive
        lost = {i for i in by_file[victim.name] if _offset(disk_dir, blocks[i][1]) >= 3 * MiB}
        assert 0 < len(lost) < len(by_file[victim.name])
    else:
        real = faulty_files.preadv

        def unreadable(fd: int, bufs: list, offset: int) -> int:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(victim.name):
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, bufs, offset)

        faulty_files.preadv = unreadable  # type: ignore[method-assign]
        lost = by_file[victim.name]
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        tier = _open(disk_dir, backend=faulty_files)
    if damage == "unreadable":
        faulty_files.preadv = real  # type: ignore[method-assign]
    with tier:
        kept = {r.key for r in tier.recover()}
        survivors = {i: b for i, b in blocks.items() if i not in lost}
        assert kept == {b[0] for b in survivors.values()}
        assert _read(tier, survivors) == {i: b[2] for i, b in survivors.items()}
        reason = {"missing": "missing_file", "short": "short_file", "unreadable": "unreadable_file"}
        counters = tier.stats().counters
        assert counters["blocks_lost_at_recovery"] == len(lost)
        assert counters[f"blocks_lost_at_recovery_{reason[damage]}"] == len(lost)
        health = tier.health()
        assert health.state is Health.OK and "data-0001.bin" in health.detail
        assert "moved aside" not in caplog.text
        assert victim.stat().st_size == 8 * MiB  # recreated or extended for new blocks


def _offset(directory: Path, slot: int) -> int:
    """A 64 KiB slot's offset in its data file (geometry of ``_open``)."""
    seg, index = divmod(slot, MiB // 4096)
    return (seg * MiB + index * 65_536) % (8 * MiB)


def test_changed_geometry_starts_empty(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(10)), 4096)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        tier = DiskTier(disk_dir, 32 * MiB, 2 * MiB, file_bytes=8 * MiB)
    with tier:
        assert "segment_bytes 1048576 -> 2097152" in caplog.text
        assert len(tier.recover()) == 0


def test_regression_a_layout_change_logs_where_the_index_went(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """An index of another layout (here a lowered ``file_bytes``) is moved aside, and the
    warning said only 'starting empty': not that the index was kept, nor under which name,
    which the operator needs to remove it (it holds every row of the old layout) or to find
    it again after a setting changed by mistake. One warning says all three."""
    seg = 64 * 1024
    with DiskTier(disk_dir, 4 * MiB, seg, file_bytes=4 * seg) as t:
        _persist(t, make_block, list(range(4)), 4096)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        tier = DiskTier(disk_dir, 4 * MiB, seg, file_bytes=seg)
    with tier:
        assert len(tier.recover()) == 0
    (moved,) = disk_dir.glob("index.sqlite3.old-*")
    (line,) = [r.getMessage() for r in caplog.records if "index" in r.getMessage()]
    assert "file_bytes 262144 -> 65536" in line
    assert f"moved aside as {moved.name}" in line


def test_rows_that_do_not_fit_are_dropped(disk_dir: Path, make_block: Block) -> None:
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [1, 2], 4096)
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    with db:
        db.execute(
            "INSERT INTO blocks VALUES (1, ?, ?, 4096, 0, 0)", (b"x" * 32, 10**9)
        )  # beyond the tier
        db.execute(
            "INSERT INTO blocks VALUES (1, ?, ?, 65536, 0, 0)", (b"y" * 32, blocks[1][1] + 5)
        )  # a 64 KiB block inside a segment of 4 KiB slots
    db.close()
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[1][0], blocks[2][0]}
        assert tier.stats().counters["recovery_dropped_rows"] == 2


def test_regression_a_row_of_a_negative_slot_was_never_read_by_recovery(
    disk_dir: Path, make_block: Block
) -> None:
    """aaf30f3 read the rows from above slot -1 only (``rows_after(-1, n)``), so a row of a
    negative slot (an index edited by hand, or damaged) was never read: not counted as a
    bad row, not dropped, left in the index at every start. Recovery reads every row."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [1, 2], 4096)
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    with db:
        db.execute("INSERT INTO blocks VALUES (1, ?, -5, 4096, 0, 0)", (b"z" * 32,))
    db.close()
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[1][0], blocks[2][0]}
        assert tier.stats().counters["recovery_dropped_rows"] == 1
        assert tier.lost_at_recovery == {"bad_row": 1}
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    assert db.execute("SELECT count(*) FROM blocks WHERE slot < 0").fetchone() == (0,)
    db.close()


def test_regression_one_row_with_a_short_key_lost_every_block_of_its_chunk(
    disk_dir: Path, make_block: Block
) -> None:
    """A key of another length than 32 bytes in one row (an index edited by hand, or
    damaged) marked every row read with it bad: each block of the chunk was dropped, its slot
    freed (seen: 6 rows, one key shortened, 'L2 recovery dropped 7 index rows (7 bad_row)'
    with the rows of other faults, and 0 blocks recovered). Only that row is dropped."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [1, 2, 3], 4096)
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    with db:
        db.execute("UPDATE blocks SET key = x'0102' WHERE slot = ?", (blocks[2][1],))
    db.close()
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[1][0], blocks[3][0]}
        assert tier.stats().counters["recovery_dropped_rows"] == 1
        del blocks[2]
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


def test_regression_a_short_key_and_a_long_one_in_a_chunk_shifted_the_keys_between_them(
    disk_dir: Path, make_block: Block
) -> None:
    """b0e3943 read a chunk row by row only when its keys together were not 32 bytes each:
    one key a byte short and a later one a byte long made up the length, so the chunk was
    cut into keys of 32 bytes across the rows, and every row between the two (a sound block
    among them) was recovered under a key made of the end of its own and the start of the
    next one's: those blocks were found by no lookup of their keys. Only the two rows whose
    keys have another length are dropped."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [1, 2, 3, 4], 4096)
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    with db:
        short, long = blocks[1], blocks[3]
        db.execute("UPDATE blocks SET key = ? WHERE slot = ?", (short[0][:31], short[1]))
        db.execute("UPDATE blocks SET key = ? WHERE slot = ?", (long[0] + b"x", long[1]))
    db.close()
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[2][0], blocks[4][0]}
        assert tier.stats().counters["recovery_dropped_rows"] == 2
        del blocks[1], blocks[3]
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


class _CountedNs(int):
    """A row's namespace that counts the times it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedNs.compared += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_regression_a_chunk_read_row_by_row_compared_every_row_with_every_sound_one(
    disk_dir: Path, make_block: Block
) -> None:
    """The rows of a chunk read one by one were sorted into bad ones by looking each up in
    the list of sound ones (``r not in sound``): rows squared comparisons, since b0e3943 for
    any chunk with one key of another length (16,384 rows: 11 s here; a chunk of the store's
    32,768 rows about four times that, while requests wait for recovery and L2 allocates
    nothing). One pass sorts them; no row is compared with another."""
    n = 64
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(n)), 4096)
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    with db:
        db.execute("UPDATE blocks SET key = x'0102' WHERE slot = ?", (blocks[0][1],))
    db.close()
    with _open(disk_dir, recover_later=True) as tier:
        rows_of = tier._index_rows

        def counted(rows: int) -> Iterator[list[tuple]]:
            for chunk in rows_of(rows):
                yield [(_CountedNs(r[0]), *r[1:]) for r in chunk]

        tier._index_rows = counted  # type: ignore[method-assign]
        _CountedNs.compared = 0
        assert len(tier.recover()) == n - 1
        assert _CountedNs.compared == 0, _CountedNs.compared


def test_regression_the_recovery_log_rounded_its_blocks_to_whole_mib_and_counted_the_quarantine(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """The line recovery logs gave the tier's used bytes in whole MiB, rounded down: 320 KiB
    of blocks read "0 MiB", as if nothing was recovered; and those bytes were the allocator's,
    the quarantined slots' (claimed before the rows are read) counted as blocks recovered. It
    now gives the bytes of the blocks it recovered, to two decimals."""
    with _open(disk_dir) as tier:
        _quarantine_two(tier, make_block)  # 4 blocks of 64 KiB, 2 of them quarantined
        _persist(tier, make_block, list(range(4, 7)), 65_536)
    with caplog.at_level(logging.INFO, logger="kvtier.tiers.disk"), _open(disk_dir) as tier:
        assert len(tier.recover()) == 5
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("L2 recovered")]
    assert line.startswith("L2 recovered 5 blocks (0.31 MiB) from 5 index rows in "), line


def test_a_slot_whose_row_recovery_drops_is_handed_out_only_once_the_row_is_gone(
    disk_dir: Path, make_block: Block
) -> None:
    """Regression: recovery let the allocator hand out slots again before it deleted the rows
    it dropped (those of a missing data file), so a block written meanwhile into such a slot,
    its commit reported durable, lost its row to that deletion and was gone after a restart."""
    with _open(disk_dir) as tier:
        old = _persist(tier, make_block, [1], 65_536)[1]
    (disk_dir / "data-0000.bin").unlink()
    tier = _open(disk_dir, recover_later=True)
    index = tier._idx()
    real_drop = index.drop
    new: dict[int, tuple] = {}

    def write_then_drop(blocks: list[int], quarantine: list[int]) -> None:
        # Another thread's write, let in between the end of the chunks and the deletion.
        if blocks == [old[1]] and tier.allocator.can_allocate(65_536):
            new.update(_persist(tier, make_block, [2], 65_536))
            assert new[2][1] == old[1]  # the dropped row's slot
        real_drop(blocks, quarantine)

    index.drop = write_then_drop  # type: ignore[method-assign]
    with tier:
        assert len(RecoveredBlocks.concat(list(tier.recover_chunks()))) == 0
        assert tier.stats().counters["recovery_dropped_rows"] == 1
        if not new:
            new.update(_persist(tier, make_block, [2], 65_536))
    with _open(disk_dir) as tier:
        assert [r.key for r in tier.recover()] == [new[2][0]]
        assert _read(tier, new) == {2: make_block(2, 65_536)[1]}


class _PausingDict(dict[int, int]):
    """Once ``armed``, an iteration pauses after its first key (``paused`` set) until
    ``resume`` is set."""

    def __init__(
        self,
        items: dict[int, int],
        armed: threading.Event,
        paused: threading.Event,
        resume: threading.Event,
    ) -> None:
        super().__init__(items)
        self.armed, self.paused, self.resume = armed, paused, resume

    def __iter__(self) -> Iterator[int]:
        for n, key in enumerate(super().__iter__()):
            yield key
            if n == 0 and self.armed.is_set():
                self.paused.set()
                assert self.resume.wait(10)


def test_recovery_reads_the_quarantine_while_a_failed_read_adds_to_it(
    disk_dir: Path, make_block: Block
) -> None:
    """Regression: a recovery chunk read the quarantined slots without the state lock, so a
    read of an already recovered block failing on another thread (a Get served between
    chunks) grew the set mid-iteration and the chunk raised RuntimeError (dictionary changed
    size during iteration), failing the rest of the recovery. Recovery pauses inside its
    iteration of the quarantine; the failed read either runs to its end or waits for the
    lock, and then recovery goes on."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 65_536)
        for i in (2, 3):  # two slots held at the next open
            _flip(tier, blocks[i][1])
        assert _read(tier, {i: blocks[i] for i in (2, 3)}) == {2: None, 3: None}
    armed, paused, resume = threading.Event(), threading.Event(), threading.Event()
    with _open(disk_dir, recover_later=True) as tier:
        tier._quarantined = _PausingDict(tier._quarantined, armed, paused, resume)
        tier._state_lock = ContendedLock(resume)  # type: ignore[assignment]
        chunks = tier.recover_chunks(rows=1)
        first = next(chunks)
        bad = next(i for i in (0, 1) if blocks[i][0] == bytes(first.keys[0]))
        _flip(tier, blocks[bad][1])
        armed.set()
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(next, chunks)
            assert paused.wait(10)
            assert _read(tier, {bad: blocks[bad]}) == {bad: None}
            resume.set()
            rest = RecoveredBlocks.concat([second.result(), *chunks])
        good = 1 - bad
        assert [bytes(k) for k in rest.keys] == [blocks[good][0]]
        assert tier.stats().gauges["quarantined_slots"] == 3
        assert _read(tier, {good: blocks[good]}) == {good: blocks[good][2]}


_FORMAT_1_BLOCKS = """
CREATE TABLE blocks (
    ns INTEGER NOT NULL,
    key BLOB NOT NULL,
    slot INTEGER NOT NULL UNIQUE,
    nbytes INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    written_at REAL NOT NULL,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID
"""


def _blocks_sql(db: sqlite3.Connection) -> str:
    return db.execute("SELECT sql FROM sqlite_master WHERE name = 'blocks'").fetchone()[0]


def test_an_index_of_the_first_format_is_upgraded_in_place(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """An index written before blocks were keyed by slot (a (ns, key) primary key, no
    user_version) keeps every block: it is rewritten at open, in one transaction."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(40)), 4096)
    _make_format_1(disk_dir / "index.sqlite3")
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    assert "WITHOUT ROWID" in _blocks_sql(db)
    db.close()
    with caplog.at_level(logging.INFO, logger="kvtier.tiers.disk"), _open(disk_dir) as tier:
        assert not tier._index.moved_aside  # type: ignore[union-attr]
        assert {(r.key, r.slot) for r in tier.recover()} == {(b[0], b[1]) for b in blocks.values()}
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}
        more = _persist(tier, make_block, [100], 4096)
    assert "upgraded to format 2" in caplog.text and "40 rows" in caplog.text
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    assert "WITHOUT ROWID" not in _blocks_sql(db)
    db.close()
    with _open(disk_dir) as tier:
        assert len(tier.recover()) == 41 and not tier._index.moved_aside  # type: ignore[union-attr]
        assert _read(tier, more) == {100: more[100][2]}


def _make_format_1(path: Path) -> None:
    """Rewrite the index at ``path`` as kvtier wrote it before format 2."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    db.execute("ALTER TABLE blocks RENAME TO blocks_now")
    db.execute(_FORMAT_1_BLOCKS)
    db.execute(
        "INSERT INTO blocks SELECT ns, key, slot, nbytes, checksum, written_at FROM blocks_now"
    )
    db.execute("DROP TABLE blocks_now")
    db.execute("PRAGMA user_version = 0")
    db.execute("COMMIT")
    db.close()


def test_an_upgrade_leaves_out_rows_without_an_integer_slot(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [1, 2], 4096)
    _make_format_1(disk_dir / "index.sqlite3")
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    with db:
        db.execute("INSERT INTO blocks VALUES (1, ?, 'abc', 4096, 0, 0)", (b"z" * 32,))
    db.close()
    with caplog.at_level(logging.INFO, logger="kvtier.tiers.disk"), _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {blocks[1][0], blocks[2][0]}
    assert "2 rows in" in caplog.text and "1 rows without an integer slot left out" in caplog.text


def test_a_failed_upgrade_leaves_the_old_index_as_it_was(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk or an I/O error during the rewrite must not cost the blocks: the open
    fails, nothing is moved aside, and a later start upgrades it."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [1, 2, 3], 4096)
    _make_format_1(disk_dir / "index.sqlite3")
    monkeypatch.setattr(index_module, "_BLOCKS_V2", "CREATE TABLE blocks (x)")  # fails
    with pytest.raises(TierUnavailable, match=r"could not be upgraded.*left as it was"):
        _open(disk_dir)
    assert not list(disk_dir.glob("index.sqlite3.*-*"))
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    assert "WITHOUT ROWID" in _blocks_sql(db)
    assert db.execute("SELECT count(*) FROM blocks").fetchone()[0] == 3
    db.close()
    monkeypatch.undo()
    with _open(disk_dir) as tier:
        assert {r.key for r in tier.recover()} == {b[0] for b in blocks.values()}


def test_an_index_of_a_newer_format_is_moved_aside_as_old(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(disk_dir) as tier:
        _persist(tier, make_block, [1, 2], 4096)
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    db.execute("PRAGMA user_version = 9")
    db.close()
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"), _open(disk_dir) as tier:
        assert len(tier.recover()) == 0
        assert list(disk_dir.glob("index.sqlite3.old-*"))
    assert "format 9, newer than this kvtier's 2" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_index_hands_over_every_row_of_a_repeated_key(
    disk_dir: Path, make_block: Block
) -> None:
    """Rows are keyed by slot: two rows naming one key both come back (the consumer keeps
    the one written last, see RecoveredBlocks.latest_of_each_key) rather than one silently
    replacing the other."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [1], 4096)
        copy = _persist(tier, lambda i, n: (blocks[1][0], blocks[1][2]), [2], 4096)
    with _open(disk_dir) as tier:
        got = tier.recover()
        assert sorted(r.slot for r in got) == sorted([blocks[1][1], copy[2][1]])
        assert got.slots[got.latest_of_each_key()].tolist() == [copy[2][1]]


def test_latest_of_each_key_keeps_the_row_written_last_of_each_namespace_and_key() -> None:
    """Of a key's rows, the one with the latest written_at, whether in a lower or a higher
    slot (the first by position served a deleted version over the one put after it); of rows
    written at the same time, the one in the higher slot."""
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 256, size=(8, 32), dtype=np.uint8)
    keys[3] = keys[0]  # key 0 again, written before: row 0 stays
    keys[5] = keys[1]  # key 1 again, written after: row 5 replaces row 1
    keys[4] = keys[0]  # key 0 in another namespace: distinct
    keys[7] = keys[2]  # key 2 again, written at the same time: the higher slot, row 7
    ns = np.array([1, 1, 1, 1, 2, 1, 1, 1], dtype=np.uint64)
    written = np.array([5.0, 1.0, 3.0, 4.0, 9.0, 2.0, 0.0, 3.0])
    n = len(ns)
    chunk = RecoveredBlocks(
        ns, keys, np.arange(n), np.full(n, 4096), np.zeros(n, np.uint64), written
    )
    assert chunk.latest_of_each_key().tolist() == [0, 4, 5, 6, 7]
    assert chunk.take(np.array([2, 4])).slots.tolist() == [2, 4]
    assert RecoveredBlocks.of([]).latest_of_each_key().tolist() == []


def test_second_open_of_a_directory_is_refused(disk_dir: Path) -> None:
    with _open(disk_dir), pytest.raises(TierUnavailable, match="in use"):
        _open(disk_dir)
    _open(disk_dir).close()


def test_regression_a_refused_second_open_changed_the_holders_file_modes(disk_dir: Path) -> None:
    """A tier sets its files 0600 as it opens the directory, and did so before it locked it:
    a second daemon given the same L2 folder reset the modes of the files the first one held
    open (one an operator had opened to a backup group, say) before the lock refused it."""
    with _open(disk_dir):
        data = next(disk_dir.glob("data-*.bin"))
        data.chmod(0o640)
        with pytest.raises(TierUnavailable, match="in use"):
            _open(disk_dir)
        assert stat.S_IMODE(data.stat().st_mode) == 0o640


def test_capacity_larger_than_the_filesystem_is_refused(disk_dir: Path) -> None:
    free = os.statvfs(disk_dir).f_bavail * os.statvfs(disk_dir).f_frsize
    too_big = (free // MiB + 1024) * MiB
    with pytest.raises(TierUnavailable, match="cannot hold"):
        DiskTier(disk_dir, too_big, 64 * MiB)
    assert not list(disk_dir.glob("data-*.bin"))


# --------------------------------------------------------------------- O_DIRECT fallback


def test_o_direct_refused_at_open_falls_back_with_one_warning(
    disk_dir: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse_direct(path: object, flags: int) -> None:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")

    faulty_files.faults["open"] = refuse_direct
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        tier = _open(disk_dir, backend=faulty_files)
    with tier:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "O_DIRECT" in warnings[0].getMessage()
        assert not tier.direct_io
        # Odd sizes side by side exercise the padding that keeps buffered runs contiguous.
        blocks = _persist(tier, make_block, list(range(16)), 5000)
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}
        assert tier.stats().counters["read_calls"] < 16


def test_o_direct_refused_at_first_transfer_falls_back(
    disk_dir: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _open(disk_dir, backend=faulty_files) as tier:
        faulty_files.fail("pwritev", errno.EINVAL, times=1)
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            blocks = _persist(tier, make_block, [1, 2, 3], 4096)
        assert "switched to buffered" in caplog.text
        assert not tier.direct_io
        assert tier.health().state is Health.OK
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


def test_buffered_writes_read_back_with_o_direct(disk_dir: Path, make_block: Block) -> None:
    with _open(disk_dir, direct_io=False) as tier:
        assert not tier.direct_io
        blocks = _persist(tier, make_block, list(range(12)), 12_345)
    with _open(disk_dir) as tier:
        assert tier.direct_io
        assert len(tier.recover()) == 12
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


# ----------------------------------------------------------------------- injected faults


def test_eio_on_write_degrades_without_raising(
    disk_dir: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _open(disk_dir, backend=faulty_files) as tier:
        before = _persist(tier, make_block, list(range(4)), 65_536)
        faulty_files.fail("pwritev", errno.EIO)
        slots = [tier.allocator.allocate(65_536) for _ in range(12)]
        with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
            for k in range(3):
                items = [
                    PersistItem(1, make_block(100 + j, 8)[0], s, bytes(65_536), 65_536)
                    for j, s in enumerate(slots[k * 4 : k * 4 + 4])
                ]
                assert [o.ok for o in persist(tier, items)] == [False] * 4
        faulty_files.clear()
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
        assert tier.health().state is Health.DEGRADED_IO
        assert "EIO" in tier.health().detail
        stats = tier.stats()
        assert stats.counters["io_errors"] >= 1
        assert stats.counters["writes_refused_degraded"] == 8
        # Reads keep being served; failed slots go back with remove().
        assert _read(tier, before) == {i: b[2] for i, b in before.items()}
        assert tier.remove(slots)
        assert tier.allocator.used_slots == 4


def test_eio_on_read_is_a_miss_and_quarantines(
    disk_dir: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _open(disk_dir, backend=faulty_files) as tier:
        blocks = _persist(tier, make_block, list(range(40)), 4096)
        faulty_files.fail("preadv", errno.EIO)
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            got = _read(tier, blocks)
        faulty_files.clear()
        assert got == dict.fromkeys(blocks)
        stats = tier.stats()
        assert stats.counters["io_errors"] >= 1 and stats.gauges["quarantined_slots"] == 40
        assert tier.health().state is Health.DEGRADED_IO
        # Keys are logged one per line up to a bound, then summarised.
        lines = [r.getMessage() for r in caplog.records]
        assert sum("failed verification" in m for m in lines) == 16
        assert any("24 more blocks" in m for m in lines)


def test_regression_one_read_eio_refused_writes_until_a_restart(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A read that failed with EIO (its slots quarantined) kept the tier refusing writes until
    a restart, though the disk took writes: the batch let through now and then finds that out.
    A write that fails then makes the fault last, as one that failed first does."""
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=0.0) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 4096)
        faulty_files.fail("preadv", errno.EIO, times=1)
        assert _read(tier, blocks) == dict.fromkeys(blocks)
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and "EIO" in health.detail
        assert health.retry_due
        after = _persist(tier, make_block, list(range(4, 8)), 4096)
        assert tier.health().state is Health.DEGRADED_IO  # a write does not say reads work
        assert _read(tier, after) == {i: b[2] for i, b in after.items()}
        assert tier.health().state is Health.OK
        assert tier.stats().gauges["quarantined_slots"] == 4
        faulty_files.fail("preadv", errno.EIO, times=1)
        assert _read(tier, after) == dict.fromkeys(after)
        faulty_files.fail("pwritev", errno.EIO, times=1)
        items = _items(tier, make_block, [8], 4096)
        assert [o.ok for o in persist(tier, items)] == [False]
        items = _items(tier, make_block, [9], 4096)
        assert [o.ok for o in persist(tier, items)] == [False]
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and not health.retry_due
        assert health.detail.startswith("eio: write")


def test_regression_a_disk_failing_every_read_flapped_between_degraded_and_ok(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A disk that fails every read but takes writes: the write batch let through once per
    ``enospc_retry_s`` ended the failed read's fault, so the tier went ok, then degraded at
    the next read, and so on: an operator saw it flap. A write says nothing of reads: the
    tier stays degraded while reads fail, and a read batch that succeeds whole ends it."""
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=0.0) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 4096)
        faulty_files.fail("preadv", errno.EIO)
        states = []
        for round in range(3):
            assert _read(tier, blocks) == dict.fromkeys(blocks)
            states.append(tier.health().state)
            ids = list(range(4 * round + 4, 4 * round + 8))
            blocks = _persist(tier, make_block, ids, 4096)  # the batch let through
            states.append(tier.health().state)
        assert states == [Health.DEGRADED_IO] * 6
        assert tier.stats().counters["committed_blocks"] == 16
        faulty_files.clear()
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}
        assert tier.health().state is Health.OK


def test_regression_a_disk_failing_every_read_went_ok_once_a_full_disk_cleared(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A disk that fails every read and fills up: the read's fault gave way to the full
    disk's (the batch let through failing with ENOSPC), and the next batch's commit, which
    ends a full disk's, left the tier ok, though no read had succeeded: it went degraded
    again at the next read, ok again after the next ENOSPC and commit, and so on. A failed
    read's fault outlasts a full disk's or a lock's that comes over it, or that it comes
    under; a read batch that succeeds whole ends it."""
    with _open(disk_dir, backend=faulty_files, enospc_retry_s=0.0) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 4096)
        faulty_files.fail("preadv", errno.EIO)
        assert _read(tier, blocks) == dict.fromkeys(blocks)
        assert tier.health().state is Health.DEGRADED_IO
        faulty_files.fail("pwritev", errno.ENOSPC, times=1)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        key, data = make_block(9, 4096)
        assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
        assert tier.health().state is Health.DEGRADED_NOSPACE
        blocks = _persist(tier, make_block, list(range(4, 8)), 4096)  # space is back
        health = tier.health()
        assert health.state is Health.DEGRADED_IO and health.detail.startswith("read")  # was ok
        faulty_files.clear()
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}
        assert tier.health().state is Health.OK
        # A read failing while the disk is full: its fault, too, comes back with the commit.
        faulty_files.fail("pwritev", errno.ENOSPC, times=1)
        assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
        faulty_files.fail("preadv", errno.EIO)
        assert _read(tier, blocks) == dict.fromkeys(blocks)
        assert tier.health().state is Health.DEGRADED_NOSPACE
        blocks = _persist(tier, make_block, list(range(8, 12)), 4096)
        assert tier.health().state is Health.DEGRADED_IO  # was ok
        faulty_files.clear()
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}
        assert tier.health().state is Health.OK


def test_fdatasync_failure_fails_the_batch(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    with _open(disk_dir, backend=faulty_files) as tier:
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        faulty_files.fail("fdatasync", errno.EIO)
        out = persist(tier, [PersistItem(1, b"k" * 32, slot, bytes(4096), 4096)])
        faulty_files.clear()
        assert not out[0].ok
        stats = tier.stats().counters
        assert stats["write_failures"] == 1 and stats["committed_blocks"] == 0
    # Written but never durable: no row.
    with _open(disk_dir) as tier:
        assert len(tier.recover()) == 0


def test_enospc_on_data_write_recovers_when_space_returns(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    with _open(disk_dir, enospc_retry_s=0.0, backend=faulty_files) as tier:
        faulty_files.fail("pwritev", errno.ENOSPC)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        key, data = make_block(1, 4096)
        assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
        assert tier.health().state is Health.DEGRADED_NOSPACE
        assert tier.stats().counters["enospc"] == 1
        faulty_files.clear()
        out = persist(tier, [PersistItem(1, key, slot, data, 4096)])
        assert out[0].ok
        assert tier.health().state is Health.OK


# ------------------------------------------------------------------------------ misuse


def test_misuse_raises(disk_dir: Path) -> None:
    with _open(disk_dir) as tier:
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        with pytest.raises(TypeError, match="remove"):
            tier.allocator.free(slot)
        with pytest.raises(ValueError, match="not an allocated slot"):
            persist(tier, [PersistItem(1, b"k" * 32, slot + 1, bytes(4096), 4096)])
        with pytest.raises(ValueError, match="not an allocated slot"):
            persist(tier, [PersistItem(1, b"k" * 32, slot, bytes(8192), 8192)])
        with pytest.raises(ValueError, match="shorter"):
            persist(tier, [PersistItem(1, b"k" * 32, slot, bytes(100), 4096)])
        with pytest.raises(ValueError, match="twice"):
            persist(tier, [PersistItem(1, b"k" * 32, slot, bytes(4096), 4096)] * 2)
        with pytest.raises(ValueError, match="read-only"):
            tier.read_items([ReadItem(slot, bytes(4096), 4096, 0, b"k")])
        assert tier.stats().counters["write_calls"] == 0  # every misuse raised before I/O
        out = persist(tier, [PersistItem(1, b"k" * 32, slot, bytes(4096), 4096)])
        assert out[0].ok and out[0].checksum == checksum(bytes(4096))
    with pytest.raises(RuntimeError, match="closed"):
        tier.read([])


def test_concurrent_writes_share_one_sync_and_one_commit(tmp_path: Path) -> None:
    """Group commit: while one write's sync runs, three more finish their bytes; the next
    group step syncs and commits the three together, and every block is served after a
    restart."""
    files = FaultyFiles()
    tier = _open(tmp_path / "l2", backend=files)
    nbytes = 64 * 1024
    first_sync, release = threading.Event(), threading.Event()

    def hold_first(*_: object) -> None:
        if not first_sync.is_set():
            first_sync.set()
            assert release.wait(10)

    files.faults["fdatasync"] = hold_first
    data = [os.urandom(nbytes) for _ in range(4)]
    refs = [BlockRef(1, os.urandom(32)) for _ in range(4)]
    slots = [tier.allocator.allocate(nbytes) for _ in range(4)]

    def write(i: int) -> list[WriteOutcome]:
        batch = WriteBatch([slots[i]], [refs[i]], nbytes, HostBuffers([memoryview(data[i])]))
        return tier.write(batch)

    before = tier.stats().counters
    with ThreadPoolExecutor(4) as pool:
        leader = pool.submit(write, 0)
        assert first_sync.wait(10)
        followers = [pool.submit(write, i) for i in (1, 2, 3)]
        deadline = time.monotonic() + 10
        while tier.stats().counters["write_calls"] - before["write_calls"] < 4:
            assert time.monotonic() < deadline, "the followers never wrote"
            time.sleep(0.01)
        # Their bytes written, they may still be on their way to the group (a busy machine
        # let the leader's step end first): released once all three wait in it.
        while len(tier._group._waiting) < 3:
            assert time.monotonic() < deadline, "the followers never joined the group"
            time.sleep(0.01)
        release.set()
        outcomes = [leader.result(), *(f.result() for f in followers)]
    assert all(o[0].ok for o in outcomes)
    after = tier.stats().counters
    assert after["commits"] - before["commits"] == 2
    assert after["syncs"] - before["syncs"] == 2
    tier.close()
    again = _open(tmp_path / "l2")
    found = again.recover()
    assert sorted(bytes(k) for k in found.keys) == sorted(r.key for r in refs)
    blocks = {i: (refs[i].key, slots[i], data[i], checksum(data[i])) for i in range(4)}
    assert _read(again, blocks) == {i: data[i] for i in range(4)}
    again.close()


def test_waiting_reads_go_by_class_then_rank(tmp_path: Path, make_block: Block) -> None:
    """A batch's rank reaches the tier's I/O threads: with the one thread held by a read,
    a prefetch read of rank 0, then one of rank 5, then a demand read wait; they run demand
    first, then the rank-5 prefetch, then the rank-0 one."""
    files = FaultyFiles()
    tier = _open(tmp_path / "l2", backend=files, io_threads=1, file_bytes=32 * MiB)
    nbytes = 1 * MiB  # a read of one block is one run, never read inline
    blocks = _persist(tier, make_block, [0, 1, 2, 3], nbytes)
    offsets = {tier.slot_location(b[1])[1]: i for i, b in blocks.items()}
    held, release = threading.Event(), threading.Event()
    order: list[int] = []

    def hold_the_first(fd: int, offset: int) -> None:
        order.append(offsets[offset])
        if not held.is_set():
            held.set()
            assert release.wait(10)

    files.faults["preadv"] = hold_the_first

    def read(i: int, priority: Priority, rank: int = 0) -> bytes | None:
        key, slot, _, csum = blocks[i]
        buf = bytearray(nbytes)
        dest = HostBuffers([memoryview(buf)])
        batch = ReadBatch([slot], [BlockRef(1, key)], nbytes, dest, [csum], priority, rank)
        return bytes(buf) if tier.read(batch)[0] else None

    def queued(n: int) -> None:
        deadline = time.monotonic() + 10
        while tier.stats().gauges["io_queued"] < n:
            assert time.monotonic() < deadline, f"{n} reads never queued"
            time.sleep(0.005)

    with ThreadPoolExecutor(4) as pool:
        reads = [pool.submit(read, 0, Priority.PREFETCH)]
        assert held.wait(10)
        reads.append(pool.submit(read, 1, Priority.PREFETCH, 0))
        queued(1)
        reads.append(pool.submit(read, 2, Priority.PREFETCH, 5))
        queued(2)
        reads.append(pool.submit(read, 3, Priority.DEMAND))
        queued(3)
        release.set()
        assert [r.result() for r in reads] == [blocks[i][2] for i in range(4)]
    assert order == [0, 3, 2, 1]
    tier.close()


def test_a_failed_sync_in_a_group_commits_no_row_for_its_blocks(tmp_path: Path) -> None:
    """Two writes in one group, to two data files; the second file's fdatasync fails (EIO).
    Its block is reported not written and has no row; whatever the tier reports written is
    served after a restart, and nothing else is."""
    files = FaultyFiles()
    tier = _open(tmp_path / "l2", backend=files)
    nbytes = 64 * 1024
    slots = [tier.allocator.allocate(nbytes)]
    first_file = tier.slot_location(slots[0])[0]
    while True:  # a slot in another data file
        slot = tier.allocator.allocate(nbytes)
        assert slot is not None
        if tier.slot_location(slot)[0] != first_file:
            slots.append(slot)
            break
    bad_file = str(tier.slot_location(slots[1])[0])
    first_sync, release = threading.Event(), threading.Event()

    def faults(fd: int) -> None:
        if not first_sync.is_set():  # hold the first group's sync until both writes wait
            first_sync.set()
            assert release.wait(10)
        if os.readlink(f"/proc/self/fd/{fd}") == bad_file:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    files.faults["fdatasync"] = faults
    data = [os.urandom(nbytes) for _ in range(3)]
    refs = [BlockRef(1, os.urandom(32)) for _ in range(3)]
    slots.insert(0, tier.allocator.allocate(nbytes))  # the write that leads the first group

    def write(i: int) -> list[WriteOutcome]:
        batch = WriteBatch([slots[i]], [refs[i]], nbytes, HostBuffers([memoryview(data[i])]))
        return tier.write(batch)

    before = tier.stats().counters["write_calls"]
    with ThreadPoolExecutor(3) as pool:
        leader = pool.submit(write, 0)
        assert first_sync.wait(10)
        grouped = [pool.submit(write, i) for i in (1, 2)]
        deadline = time.monotonic() + 10
        while tier.stats().counters["write_calls"] - before < 3:
            assert time.monotonic() < deadline, "the grouped writes never wrote"
            time.sleep(0.01)
        release.set()
        ok = [leader.result()[0].ok, *(f.result()[0].ok for f in grouped)]
    assert ok[2] is False  # its file's sync failed
    tier.close()
    again = _open(tmp_path / "l2")
    found = {bytes(k) for k in again.recover().keys}
    assert found == {refs[i].key for i in range(3) if ok[i]}
    served = {i: (refs[i].key, slots[i], data[i], checksum(data[i])) for i in range(3) if ok[i]}
    assert _read(again, served) == {i: data[i] for i in served}
    again.close()


def test_rows_inserted_while_bytes_go_down_commit_only_for_the_blocks_written(
    tmp_path: Path,
) -> None:
    """A write's rows go into the index while its bytes are still being written; none is
    visible to another reader before the data file's sync, and the row of a block whose
    write failed (ENOSPC, which leaves commits open) is not committed with the others."""
    files = FaultyFiles()
    tier = _open(tmp_path / "l2", backend=files)
    nbytes = 64 * 1024
    slots = [tier.allocator.allocate(nbytes)]
    while True:  # a slot in another data file
        slot = tier.allocator.allocate(nbytes)
        assert slot is not None
        if tier.slot_location(slot)[0] != tier.slot_location(slots[0])[0]:
            slots.append(slot)
            break
    bad_file = str(tier.slot_location(slots[1])[0])
    index_path = tmp_path / "l2" / "index.sqlite3"
    seen_at_sync: list[int] = []

    def fail_second_file(fd: int, offset: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == bad_file:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def count_rows(fd: int) -> None:
        reader = sqlite3.connect(index_path)
        try:
            seen_at_sync.append(reader.execute("SELECT count(*) FROM blocks").fetchone()[0])
        finally:
            reader.close()

    files.faults["pwritev"] = fail_second_file
    files.faults["fdatasync"] = count_rows
    data = [os.urandom(nbytes) for _ in range(2)]
    refs = [BlockRef(1, os.urandom(32)) for _ in range(2)]
    batch = WriteBatch(slots, refs, nbytes, HostBuffers([memoryview(d) for d in data]))
    outcomes = tier.write(batch)
    files.clear()
    assert [o.ok for o in outcomes] == [True, False]
    assert seen_at_sync == [0]  # the sync came first; the rows were not committed yet
    stats = tier.stats().counters
    assert stats["committed_blocks"] == 1 and stats["write_failures"] == 1
    tier.close()
    again = _open(tmp_path / "l2")
    assert [bytes(k) for k in again.recover().keys] == [refs[0].key]
    block = {0: (refs[0].key, slots[0], data[0], checksum(data[0]))}
    assert _read(again, block) == {0: data[0]}
    again.close()


def test_a_write_of_block_ref_arrays_commits_each_block_under_its_key(tmp_path: Path) -> None:
    """``write`` of a batch whose refs are arrays (``BlockRefs``, as the store sends them)
    and whose buffers mix page-aligned slot views (written as they are) with unaligned bytes
    (staged): every block's outcome carries the checksum of its bytes, and after a restart
    each row holds its own key and slot and reads back its own bytes."""
    n, nbytes = 40, 4096
    arena = HostArena(1 * MiB, 1 * MiB)
    slots_l1 = arena.allocator.allocate_many(nbytes, n // 2)
    aligned = arena.buffers(slots_l1, nbytes)
    data = [os.urandom(nbytes) for _ in range(n)]
    for view, d in zip(aligned.views, data[: n // 2], strict=True):
        view[:nbytes] = d
    views = [*aligned.views, *(memoryview(d) for d in data[n // 2 :])]
    ns = np.arange(n, dtype=np.uint64) + np.uint64(1 << 63)  # above the signed range too
    keys = np.frombuffer(os.urandom(32 * n), dtype=np.uint8).reshape(n, 32)
    refs = BlockRefs(ns, keys)
    with _open(tmp_path / "l2") as tier:
        slots = tier.allocator.allocate_many(nbytes, n)
        out = tier.write(WriteBatch(slots, refs, nbytes, HostBuffers(views)))
        assert [o.ok for o in out] == [True] * n
        assert [o.checksum for o in out] == [checksum(d) for d in data]
        assert [o.slot for o in out] == slots
    with _open(tmp_path / "l2") as tier:
        found = tier.recover()
        rows = {
            int(s): (int(a), bytes(k))
            for s, a, k in zip(found.slots, found.ns, found.keys, strict=True)
        }
        assert rows == {s: (int(ns[j]), keys[j].tobytes()) for j, s in enumerate(slots)}
        blocks = {j: (keys[j].tobytes(), slots[j], data[j], checksum(data[j])) for j in range(n)}
        assert _read(tier, blocks) == dict(enumerate(data))


def test_a_write_whose_refs_or_buffers_do_not_match_its_slots_raises_before_any_io(
    tmp_path: Path,
) -> None:
    """A batch with more or fewer refs (or buffers) than slots is the caller's bug: ``write``
    raises ValueError before a byte is written, so it neither commits rows under refs that
    are not its blocks' nor fails, from inside a group commit, the writes of other threads
    that share it."""
    nbytes = 4096
    data = [os.urandom(nbytes) for _ in range(3)]
    views = [memoryview(d) for d in data]
    with _open(tmp_path / "l2") as tier:
        slots = tier.allocator.allocate_many(nbytes, 3)
        for refs, bufs in (
            ([BlockRef(1, bytes([i]) * 32) for i in range(2)], views),
            ([BlockRef(1, bytes([i]) * 32) for i in range(4)], views),
            (BlockRefs(np.ones(4, np.uint64), np.zeros((4, 32), np.uint8)), views),
            ([BlockRef(1, bytes([i]) * 32) for i in range(3)], views[:2]),
        ):
            with pytest.raises(ValueError, match="slots"):
                tier.write(WriteBatch(slots, refs, nbytes, HostBuffers(bufs)))
        assert tier.stats().counters["write_calls"] == 0
    with _open(tmp_path / "l2") as tier:
        assert len(tier.recover()) == 0


def test_namespace_records_forgotten_stay_forgotten_across_a_reopen(tmp_path):
    tier = _open(tmp_path)
    big = (1 << 64) - 5  # stored as SQLite's signed integer
    for ns in (3, big, 7):
        tier.remember_namespace(ns, f"tenant-{ns % 10}")
    tier.forget_namespaces([big, 3, 11])  # 11 was never recorded
    tier.close()
    tier = _open(tmp_path)
    try:
        assert tier.namespaces() == {7: "tenant-7"}
    finally:
        tier.close()


def test_regression_a_namespace_record_that_failed_was_never_made_though_its_blocks_were(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace record whose commit failed (here an index another process held locked;
    SQLITE_FULL on a full disk alike) was only the tier's fault: blocks of the namespace
    written once the index took commits again came back at a reopen with no record of their
    owner. The record is made by the next commit of block rows, in its transaction; one
    forgotten meanwhile is not."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.0) as tier:
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        tier.remember_namespace(1, "alice")
        tier.remember_namespace(2, "bob")
        assert tier.health().state is not Health.OK
        tier.forget_namespaces([2])
        other.execute("ROLLBACK")
        other.close()
        assert tier.namespaces() == {}
        blocks = _persist(tier, make_block, [0, 1], 4096)  # namespace 1's
        assert tier.namespaces() == {1: "alice"}
    with _open(disk_dir) as tier:
        assert tier.namespaces() == {1: "alice"}
        assert set(tier.recover().ns.tolist()) == {1}
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


def test_regression_a_namespace_forget_that_failed_left_its_record_for_the_next_start(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop of a namespace's record whose commit failed (an index another process held
    locked; SQLITE_FULL on a full disk alike) was only the tier's fault: the record of a
    namespace with no block stayed, and a restart bound it to its tenant again (one namespace
    more toward its limit until unbound again). The drop is kept and made by the next commit
    of block rows, as a failed record is; a record made again meanwhile wins."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.0) as tier:
        for ns, label in ((1, "alice"), (2, "alice"), (3, "bob")):
            tier.remember_namespace(ns, label)
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        tier.forget_namespaces([1, 3])
        assert tier.health().state is not Health.OK
        tier.remember_namespace(3, "bob")  # bound again before the drop was made
        other.execute("ROLLBACK")
        other.close()
        assert tier.namespaces() == {1: "alice", 2: "alice", 3: "bob"}
        _persist(tier, make_block, [0], 4096)
        assert tier.namespaces() == {2: "alice", 3: "bob"}
    with _open(disk_dir) as tier:
        assert tier.namespaces() == {2: "alice", 3: "bob"}


def test_a_namespace_record_kept_after_a_failure_outlives_a_commit_rolled_back(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace record whose commit failed stays kept through a block commit that wrote
    it and was then rolled back (the reserve missing, with no room to make it), and is made
    by the next commit that gets through; a later record of another namespace commits every
    record still kept with its own."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)

    def failed_record(tier: DiskTier, ns: int, label: str) -> None:
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        tier.remember_namespace(ns, label)
        other.execute("ROLLBACK")
        other.close()

    with _open(disk_dir, direct_io=False, enospc_retry_s=0.0) as tier:
        failed_record(tier, 1, "alice")
        assert tier._give_back_reserve()
        with monkeypatch.context() as m:
            m.setattr("kvtier.tiers.disk.tier._free_bytes", lambda _: 128 << 10)
            refused = _items(tier, make_block, [0], 4096)  # namespace 1's
            assert [o.ok for o in persist(tier, refused)] == [False]
        assert tier.namespaces() == {}
        assert tier.remove([refused[0].slot])
        _persist(tier, make_block, [1], 4096)
        assert tier.namespaces() == {1: "alice"}
        failed_record(tier, 2, "bob")
        assert tier.namespaces() == {1: "alice"}
        tier.remember_namespace(3, "carol")
        assert tier.namespaces() == {1: "alice", 2: "bob", 3: "carol"}
    with _open(disk_dir) as tier:
        assert tier.namespaces() == {1: "alice", 2: "bob", 3: "carol"}


def test_a_deleted_index_beside_data_files_is_reported_not_silent(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """Deleting index.sqlite3 between runs lost every block without a word: the tier logged
    'recovered 0 blocks' and reported ok."""
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(50)), 4096)
    (disk_dir / "index.sqlite3").unlink()
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
        tier = _open(disk_dir)
    with tier:
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "index" in errors[0] and "missing" in errors[0]
        assert "data-0000.bin" in errors[0] and "starting EMPTY" in errors[0]
        assert "index was missing" in tier.health().detail
        assert len(tier.recover()) == 0


def test_a_first_start_has_no_missing_index(disk_dir: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"), _open(disk_dir) as tier:
        assert "missing" not in tier.health().detail
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]


def test_regression_a_write_back_finished_at_the_open_was_reported_as_a_missing_index(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """A write-back cut short before its rename (its whole copy beside no index file) is put
    in the index's place by the next open, which serves every block; yet that start reported
    the index missing beside its data files, "starting EMPTY" in an ERROR and in the tier's
    health, as it looked for the index file before the open put the copy there. Whether the
    index was missing is now the open's answer."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(5)), 4096)
    (disk_dir / "index.sqlite3").rename(disk_dir / "index.sqlite3.restore")
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"), _open(disk_dir) as again:
        assert again.faults.snapshot().get("index_restored") == 1
        assert "missing" not in again.health().detail, again.health().detail
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}
    assert not [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_regression_the_start_after_one_refused_once_it_moved_the_index_aside_said_it_was_missing(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """A start that moved a damaged index aside and then could not make a new one was refused
    (its refusal said so); the next start found no index beside the data files and said only
    "index was missing beside 4 data file(s)", as after an index deleted by hand. It now
    says that an earlier start moved it aside as damaged, when, and to which file, where no
    block was written to the data files since; an older one moved aside is not named."""
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(4)), 4096)
    (disk_dir / "index.sqlite3").write_bytes(os.urandom(8192))
    (disk_dir / "index.sqlite3-journal").mkdir()
    with pytest.raises(TierUnavailable, match=r"moved aside as index\.sqlite3\.corrupt-"):
        _open(disk_dir)
    (disk_dir / "index.sqlite3-journal").rmdir()
    [aside] = [p.name for p in disk_dir.glob("index.sqlite3.corrupt-*")]
    stamp = time.strptime(aside.removeprefix("index.sqlite3.corrupt-"), "%Y%m%dT%H%M%S")
    said = f"moved aside as damaged at {time.strftime('%Y-%m-%d %H:%M:%S', stamp)} UTC, to {aside}"
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
        tier = _open(disk_dir)
    with tier:
        assert said in tier.health().detail and "missing" not in tier.health().detail
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and said in errors[0], errors
        assert len(tier.recover()) == 0
        _persist(tier, make_block, [5], 4096)
    (disk_dir / aside).rename(disk_dir / "index.sqlite3.corrupt-20200101T000000")
    (disk_dir / "index.sqlite3").unlink()
    with _open(disk_dir) as tier:
        assert tier.health().detail.startswith("index was missing beside 4 data file(s)")


def test_regression_a_file_named_as_a_moved_aside_index_of_no_such_time_failed_the_start(
    disk_dir: Path, make_block: Block
) -> None:
    """Where the index was missing beside its data files, the start read the time in the name
    of the newest file named as ``_move_aside`` names an index it moves aside; one of no such
    time (month 13: a copy an operator named by hand) raised ValueError out of the open, which
    kvtierd's start does not catch (a traceback), and hid a real one moved aside before it.
    Such a file is not one the tier moved aside: left out."""
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(4)), 4096)
    (disk_dir / "index.sqlite3").unlink()
    later = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() + 3600))
    (disk_dir / f"index.sqlite3.corrupt-{later}").write_bytes(b"")
    (disk_dir / "index.sqlite3.corrupt-99991301T000000").write_bytes(b"")
    with _open(disk_dir) as tier:
        detail = tier.health().detail
        assert f"to index.sqlite3.corrupt-{later} by an earlier start" in detail, detail
    (disk_dir / "index.sqlite3").unlink()
    (disk_dir / f"index.sqlite3.corrupt-{later}").unlink()
    with _open(disk_dir) as tier:
        assert tier.health().detail.startswith("index was missing beside 4 data file(s)")


def _crash_image(directory: Path, to: Path) -> Path:
    """The files of ``directory`` as a crash would leave them to the next start: what their
    paths name now (a file removed while open is gone with the process)."""
    shutil.copytree(directory, to)
    return to


def _unlink_wal(directory: Path) -> None:
    for name in ("index.sqlite3-wal", "index.sqlite3-shm"):
        (directory / name).unlink()


def _recovered_keys(tier: DiskTier) -> set[bytes]:
    return {bytes(k) for k in tier.recover().keys}


def test_regression_a_wal_removed_while_open_loses_no_committed_block(
    disk_dir: Path, make_block: Block, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator removing index.sqlite3-wal (and -shm) while the tier ran: SQLite kept
    committing to the unlinked WAL, every write after it was reported ok, and a crash then
    lost every block, those committed before the removal too (the index file alone had no
    metadata and was moved aside). Now the commit that finds its WAL gone checkpoints it into
    the index file and starts a new one."""
    tier = _open(disk_dir)
    try:
        before = _persist(tier, make_block, list(range(10)), 4096)
        for name in ("index.sqlite3-wal", "index.sqlite3-shm"):
            (disk_dir / name).unlink()
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            after = _persist(tier, make_block, list(range(10, 20)), 4096)
        assert any("WAL was removed" in r.getMessage() for r in caplog.records)
        more = _persist(tier, make_block, list(range(20, 25)), 4096)
        assert tier.health().state == Health.OK
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    with _open(image) as again:
        assert not again.faults.snapshot().get("index_moved_aside")
        recovered = again.recover()
        assert len(recovered) == 25
        blocks = {**before, **after, **more}
        got = _read(again, blocks)
        assert all(got[i] == blocks[i][2] for i in blocks)


@pytest.mark.parametrize("removed", [("index.sqlite3",), ("index.sqlite3", "-wal", "-shm")])
def test_regression_an_index_removed_while_open_is_written_back_and_loses_no_block(
    disk_dir: Path,
    make_block: Block,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    removed: tuple[str, ...],
) -> None:
    """An index file removed while the tier ran (alone, or with its -wal and -shm): the
    commits after it failed and degraded the tier for good, and the blocks committed before
    the removal were lost at the next start too (the open database was no longer reachable
    by its path: the restart found data files without an index and started empty). The
    commit that finds it gone now writes the open index back to its path and goes on."""
    tier = _open(disk_dir)
    try:
        before = _persist(tier, make_block, list(range(5)), 4096)
        for name in removed:
            (disk_dir / ("index.sqlite3" + name if name.startswith("-") else name)).unlink()
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            after = _persist(tier, make_block, list(range(5, 10)), 4096)
        assert tier.health().state == Health.OK
        assert tier.faults.snapshot()["index_restored"] == 1
        assert [r for r in caplog.records if "written back" in r.getMessage()]
        assert not (disk_dir / "index.sqlite3.restore").exists()
        gone = _persist(tier, make_block, [10], 4096)
        assert tier.remove([gone[10][1]])
        more = _persist(tier, make_block, list(range(11, 15)), 4096)
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    with _open(image) as again:
        assert not again.faults.snapshot().get("index_moved_aside")
        blocks = {**before, **after, **more}
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}
        assert _read(again, blocks) == {i: b[2] for i, b in blocks.items()}


def test_an_index_removed_after_the_last_commit_is_written_back_at_close(
    disk_dir: Path, make_block: Block
) -> None:
    """With no commit after the removal to notice it, closing the tier (the daemon's stop)
    writes the index back."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(5)), 4096)
        (disk_dir / "index.sqlite3").unlink()
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}
        assert again.faults.snapshot().get("index_moved_aside", 0) == 0


def test_regression_a_write_back_cut_short_before_its_rename_is_finished_at_the_next_open(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's end between the write-back's synced copy and its rename (here the
    rename fails, leaving the files as a crash at that moment does: the copy whole, the old
    WAL gone, no index file): the next start found no index and started empty, losing every
    block the copy held. It now puts the copy in the index's place."""
    real_replace = os.replace

    def no_rename_of_the_copy(src: object, dst: object) -> None:
        if str(src).endswith(index_module.RESTORE_SUFFIX):
            raise OSError(errno.EIO, "cut short")
        real_replace(src, dst)  # type: ignore[arg-type]

    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(5)), 4096)
        (disk_dir / "index.sqlite3").unlink()
        monkeypatch.setattr(index_module.os, "replace", no_rename_of_the_copy)
        items = _items(tier, make_block, [5, 6], 4096)
        assert not any(o.ok for o in persist(tier, items))
    monkeypatch.undo()
    assert (disk_dir / "index.sqlite3.restore").is_file()
    assert not (disk_dir / "index.sqlite3").exists()
    (disk_dir / "index.sqlite3-wal").write_bytes(b"\0" * 4096)  # a stale WAL is dropped
    with _open(disk_dir) as again:
        assert again.faults.snapshot().get("index_restored") == 1
        assert not again.faults.snapshot().get("index_moved_aside")
        assert _recovered_keys(again) == {b[0] for b in before.values()}
        assert _read(again, before) == {i: b[2] for i, b in before.items()}
    assert not (disk_dir / "index.sqlite3.restore").exists()


def test_regression_a_write_back_cut_short_was_moved_aside_at_a_start_with_another_capacity(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write-back cut short before its rename (the copy whole, no index file), then a start
    with a smaller capacity (data files of 128 KiB kept, the size the index was made for, where
    16 MiB alone makes them 64 KiB): the size kept was read from the index file alone, which
    is missing, so the tier chose 64 KiB files and the copy, put in the index's place by the
    open, was moved aside as another layout: all 8 blocks lost. The copy's geometry is now
    read as the index's."""
    seg = 64 * 1024
    real_replace = os.replace

    def no_rename_of_the_copy(src: object, dst: object) -> None:
        if str(src).endswith(index_module.RESTORE_SUFFIX):
            raise OSError(errno.EIO, "cut short")
        real_replace(src, dst)  # type: ignore[arg-type]

    with DiskTier(disk_dir, 32 * MiB, seg, file_bytes=seg) as tier:
        blocks = _persist(tier, make_block, list(range(8)), 4096)
        (disk_dir / "index.sqlite3").unlink()
        monkeypatch.setattr(index_module.os, "replace", no_rename_of_the_copy)
        assert not any(o.ok for o in persist(tier, _items(tier, make_block, [8], 4096)))
    monkeypatch.undo()
    assert (disk_dir / "index.sqlite3.restore").is_file()
    assert not (disk_dir / "index.sqlite3").exists()
    assert index_module.stored_geometry(disk_dir)["file_bytes"] == str(2 * seg)
    assert not list(disk_dir.glob("index.sqlite3.restore-*"))  # the read made nothing
    with DiskTier(disk_dir, 16 * MiB, seg, file_bytes=seg) as again:
        assert again.faults.snapshot().get("index_restored") == 1
        assert not again.faults.snapshot().get("index_moved_aside")
        assert {p.stat().st_size for p in again.files.paths} == {2 * seg}
        assert _read(again, blocks) == {i: b[2] for i, b in blocks.items()}


def test_a_leftover_write_back_copy_beside_an_index_is_removed_at_open(
    disk_dir: Path, make_block: Block
) -> None:
    """A copy beside a whole index (a write-back cut short before its copy was synced, or
    one whose index came back) is not used, and goes, so no later start can take an old
    copy for the index."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(3)), 4096)
    (disk_dir / "index.sqlite3.restore").write_bytes(b"old")
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}
        assert not again.faults.snapshot().get("index_restored")
    assert not (disk_dir / "index.sqlite3.restore").exists()


def test_an_index_removed_while_open_that_cannot_be_written_back_fails_the_commits(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the open index cannot be written back (here its temporary copy's name is taken
    by a folder) the commits fail and the tier refuses writes until restarted (counted,
    logged), and keeps serving what it holds. Closing it tries once more."""
    in_the_way = disk_dir / "index.sqlite3.restore"
    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(5)), 4096)
        (disk_dir / "index.sqlite3").unlink()
        in_the_way.mkdir()
        (in_the_way / "file").touch()
        items = _items(tier, make_block, list(range(5, 10)), 4096)
        with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
            outcomes = persist(tier, items)
        assert not any(o.ok for o in outcomes)
        health = tier.health()
        assert health.state == Health.DEGRADED_IO and "could not be written back" in health.detail
        assert tier.faults.refuses_commits()
        assert tier.faults.snapshot()["index_restore_failures"] == 1
        assert [r for r in caplog.records if "could not be written back" in r.getMessage()]
        assert _read(tier, before) == {i: b[2] for i, b in before.items()}
        assert not tier.remove([before[0][1]])  # a delete's commit fails too
        assert tier.faults.snapshot()["index_restore_failures"] == 1  # not tried again
        shutil.rmtree(in_the_way)
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == {b[0] for b in before.values()}


@pytest.mark.parametrize("removed", [("index.sqlite3",), ("index.sqlite3", "-wal", "-shm")])
def test_regression_an_index_removed_before_recovery_reads_it_is_written_back_not_recreated_empty(
    disk_dir: Path, make_block: Block, tmp_path: Path, removed: tuple[str, ...]
) -> None:
    """An index file removed between the tier's open and recovery's read of its rows (the
    daemon reads them after its socket opens): recovery's reader, opened read-write, created
    an empty file in its place, so recovery failed (no such table: blocks), the next commit
    took the empty file for a replaced index and degraded the tier for good, and the restart
    found it without metadata and started empty: every block lost. The removed index is now
    written back first, as a commit would, and recovery reads its rows through the tier's own
    connection."""
    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(5)), 4096)
    tier = _open(disk_dir, recover_later=True)
    try:
        for name in removed:
            (disk_dir / ("index.sqlite3" + name if name.startswith("-") else name)).unlink()
        assert _recovered_keys(tier) == {b[0] for b in before.values()}
        assert tier.faults.snapshot()["index_restored"] == 1
        after = _persist(tier, make_block, list(range(5, 10)), 4096)
        assert tier.health().state == Health.OK
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    with _open(image) as again:
        assert not again.faults.snapshot().get("index_moved_aside")
        blocks = {**before, **after}
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}
        assert _read(again, blocks) == {i: b[2] for i, b in blocks.items()}


def test_an_index_removed_before_recovery_that_cannot_be_written_back_still_recovers(
    disk_dir: Path, make_block: Block
) -> None:
    """Where the index removed before recovery cannot be written back (its temporary copy's
    name taken by a folder), recovery reads the rows through the tier's own connection: every
    block is served, and the tier refuses writes until restarted, as after a failed commit.
    Closing it tries the write-back once more."""
    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(5)), 4096)
    in_the_way = disk_dir / "index.sqlite3.restore"
    with _open(disk_dir, recover_later=True) as tier:
        (disk_dir / "index.sqlite3").unlink()
        in_the_way.mkdir()
        (in_the_way / "file").touch()
        assert _recovered_keys(tier) == {b[0] for b in before.values()}
        health = tier.health()
        assert health.state == Health.DEGRADED_IO and "could not be written back" in health.detail
        assert tier.faults.refuses_commits()
        assert _read(tier, before) == {i: b[2] for i, b in before.items()}
        shutil.rmtree(in_the_way)
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == {b[0] for b in before.values()}


def test_regression_a_wal_removed_while_recovery_read_the_index_made_commits_wait_for_its_reader(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery streamed the rows through a second, read-only connection of the daemon's,
    its read transaction open from the first chunk to the last. A WAL removed meanwhile
    could not be checkpointed until that read ended, so every commit (a removal of a block
    handed over already, a quarantine) waited out the busy timeout (30 s) holding the index,
    then failed as "another process holds it", the daemon's own reader being that one. The
    rows are now read a chunk at a time through the tier's own connection, and the removal
    between two chunks commits."""
    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(4)), 4096)
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, recover_later=True) as tier:
        tier._idx().remember(7, "tenant")  # a commit: the reader then reads the WAL too
        chunks = tier.recover_chunks(rows=2)
        first = next(chunks)
        (disk_dir / "index.sqlite3-wal").unlink()
        gone = int(first.slots[0])
        assert tier.remove([gone]), tier.health()
        rest = list(chunks)
        assert sum(len(c) for c in rest) == 2
        assert tier.health().state == Health.OK
    with _open(disk_dir) as again:
        kept = {b[0] for b in before.values() if b[1] != gone}
        assert _recovered_keys(again) == kept and len(kept) == 3


def _watches() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "l2-index-watch"]


def test_the_index_watch_stops_at_close_without_waiting_out_its_period(disk_dir: Path) -> None:
    """The watch thread (one per tier, none when ``index_watch_s`` is 0) is woken by
    ``close`` and gone when it returns, an hour's period notwithstanding: it neither holds up
    the daemon's stop nor outlives its tier."""
    assert _watches() == []
    with _open(disk_dir, index_watch_s=0.0):
        assert _watches() == []
    tier = _open(disk_dir, index_watch_s=3600.0)
    try:
        (watch,) = _watches()
        assert watch.daemon
    finally:
        tier.close()
    assert not watch.is_alive()
    assert _watches() == []


def test_regression_a_recovery_that_raises_in_the_constructor_leaves_no_threads_or_lock(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier recovering in its constructor (``recover_later=False``) whose recovery raised
    (a page the index could not read, say) left its watch thread checking the files for the
    life of the process, its I/O threads waiting, and its folder locked against the next
    open. Now the error goes to the caller with nothing of the tier left running."""

    def unreadable(self: DiskTier) -> Iterator[RecoveredBlocks]:
        raise sqlite3.DatabaseError("database disk image is malformed")
        yield  # a generator, as recover_chunks is

    monkeypatch.setattr(DiskTier, "recover_chunks", unreadable)
    with pytest.raises(sqlite3.DatabaseError, match="malformed"):
        _open(disk_dir, index_watch_s=3600.0)
    assert _watches() == []
    monkeypatch.undo()
    with _open(disk_dir, index_watch_s=3600.0):  # the folder's lock was let go
        assert len(_watches()) == 1
    assert _watches() == []


def test_an_index_removed_while_the_tier_is_idle_is_written_back_by_the_watch(
    disk_dir: Path, make_block: Block, tmp_path: Path
) -> None:
    """No commit after the removal: the watch writes the index back, so a crash then (the
    files as they are, no ``close``) loses no block."""
    tier = _open(disk_dir, index_watch_s=0.05)
    try:
        blocks = _persist(tier, make_block, list(range(5)), 4096)
        commits = tier.faults.snapshot()["commits"]
        (disk_dir / "index.sqlite3").unlink()
        _wait_for(lambda: tier.faults.snapshot().get("index_restored") == 1)
        assert tier.faults.snapshot()["commits"] == commits
        assert tier.health().state == Health.OK
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    with _open(image) as again:
        assert not again.faults.snapshot().get("index_moved_aside")
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}
        assert _read(again, blocks) == {i: b[2] for i, b in blocks.items()}


class _CountedLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.taken += 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_an_index_check_that_finds_nothing_changed_takes_no_lock_and_runs_no_sql(
    disk_dir: Path, make_block: Block
) -> None:
    """The watch's check costs a stat of the index and its WAL while they are unchanged: it
    neither waits for a commit holding the index nor runs a statement."""
    with _open(disk_dir) as tier:
        _persist(tier, make_block, [0], 4096)
        index = tier._index
        assert index is not None and index._db is not None
        statements: list[str] = []
        index._db.set_trace_callback(statements.append)
        lock = _CountedLock()
        index._lock = lock  # type: ignore[assignment]
        for _ in range(3):
            assert not tier._check_index_files()
        assert statements == [] and lock.taken == 0
        (disk_dir / "index.sqlite3-wal").unlink()
        assert not tier._check_index_files()
        assert lock.taken == 1 and any("wal_checkpoint" in s for s in statements)


def test_an_index_replaced_while_open_degrades_the_tier_once_however_often_checked(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """An index file replaced by another (its commits would be lost at a restart) found by
    the watch degrades the tier as a commit would, counted and logged once, with no
    traceback, however many checks find it so."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(3)), 4096)
        copy = disk_dir / "copy"
        shutil.copyfile(disk_dir / "index.sqlite3", copy)
        os.replace(copy, disk_dir / "index.sqlite3")
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            for _ in range(3):
                assert not tier._check_index_files()
        health = tier.health()
        assert health.state == Health.DEGRADED_IO and "was replaced while open" in health.detail
        assert tier.faults.refuses_commits()
        assert tier.faults.snapshot()["index_errors"] == 1
        assert [r.levelno for r in caplog.records] == [logging.ERROR]
        assert caplog.records[0].exc_info is None
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


def test_a_wal_checkpoint_a_reader_holds_up_is_tried_again_by_the_watch_not_a_fault(
    disk_dir: Path,
    make_block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The WAL removed while another process holds a read transaction: the watch's
    checkpoint cannot finish. That is a warning, once, not a fault of the tier (a write
    meanwhile fails as locked, as before); once the reader lets go, the next check
    checkpoints the WAL and a crash then loses no block."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir)
    try:
        blocks = _persist(tier, make_block, list(range(5)), 4096)
        reader = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM blocks").fetchone() == (5,)
            _unlink_wal(disk_dir)
            with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
                assert tier._check_index_files()
                assert tier._check_index_files()
            assert [r.levelno for r in caplog.records] == [logging.WARNING]
            assert "could not be checkpointed" in caplog.records[0].getMessage()
            assert tier.health().state == Health.OK
            assert tier.faults.snapshot().get("index_errors", 0) == 0
        finally:
            reader.close()
        assert not tier._check_index_files()
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    with _open(image) as again:
        assert not again.faults.snapshot().get("index_moved_aside")
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}


def _index_removed_for_good(disk_dir: Path, faulty_files: FaultyFiles) -> Callable[..., None]:
    """A fault (once) that removes the index file and puts a folder in the way of its
    write-back's temporary copy (``index.sqlite3.restore``: removed, the write-back works)."""

    def remove_index(*_: object) -> None:
        faulty_files.clear()
        (disk_dir / "index.sqlite3").unlink()
        (disk_dir / "index.sqlite3.restore").mkdir()
        (disk_dir / "index.sqlite3.restore" / "file").touch()

    return remove_index


def test_regression_a_put_failed_as_its_index_could_not_be_written_back_stays_failed(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """The index file removed while a durable put's transaction ran, and the open index
    could not be written back (its temporary copy's name taken by a folder): the put was
    reported failed, but its rows stayed committed in the open database, and ``close``,
    which tries the write-back once more, wrote them into the index file: a restart served
    the failed put's blocks (7 recovered, 5 persisted). Its rows are now deleted again, as
    for a removed WAL, before the put fails."""
    in_the_way = disk_dir / "index.sqlite3.restore"
    remove_index = _index_removed_for_good(disk_dir, faulty_files)
    with _open(disk_dir, backend=faulty_files) as tier:
        before = _persist(tier, make_block, list(range(5)), 4096)
        faulty_files.faults["fdatasync"] = remove_index  # inside the put's transaction
        items = _items(tier, make_block, [5, 6], 4096)
        assert not any(o.ok for o in persist(tier, items))
        assert "could not be written back" in tier.health().detail
        shutil.rmtree(in_the_way)  # close writes the index back
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == {b[0] for b in before.values()}
        assert _read(again, before) == {i: b[2] for i, b in before.items()}


def test_regression_a_first_put_undone_after_its_commit_deleted_the_made_empty_record(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A new index made beside data files records why (``MADE_EMPTY``) until its first block
    commits. That first put's commit, its file check failing afterwards (the index file
    removed meanwhile, not written back), was undone (its rows deleted again) and the put
    failed, but the record's deletion stayed committed: each later start said nothing of the
    blocks lost. The undo now puts the record back."""
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(3)), 4096)
    (disk_dir / "index.sqlite3").write_bytes(b"not an index" * 512)
    in_the_way = disk_dir / "index.sqlite3.restore"
    remove_index = _index_removed_for_good(disk_dir, faulty_files)
    with _open(disk_dir, backend=faulty_files) as tier:
        assert tier.faults.snapshot().get("index_moved_aside")
        faulty_files.faults["fdatasync"] = remove_index  # inside the put's transaction
        assert not any(o.ok for o in persist(tier, _items(tier, make_block, [5, 6], 4096)))
        shutil.rmtree(in_the_way)  # close writes the index back
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == set()
        detail = again.health().detail
        assert "index made empty by an earlier start" in detail, detail


def test_regression_a_slot_noted_without_its_key_failed_every_delete_under_a_locked_index(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot on its way out noted without its key (``removing`` given no blocks; a failed
    ``remove``) made ``drop_rows_left`` delete its row for any Delete, in a write
    transaction: under a lock another process held, every Delete, of keys never stored or of
    another tenant's keys of the same bytes, failed after the busy timeout. Its row is now
    read (not held up by the lock), kept with the slot, and deleted only for its own block's
    namespace and key."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [0, 1], 4096)
        (key, slot, *_), kept = blocks[0], blocks[1][0]
        tier.removing([slot])  # without its key: it may hold any key's row
        mine, never, theirs = BlockRef(1, key), BlockRef(1, b"\7" * len(key)), BlockRef(2, key)
        assert tier.rows_left([never])
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            assert tier.drop_rows_left([never])
            assert not tier.rows_left([never])  # read once, kept
            assert not tier.rows_left([theirs])
            assert tier.drop_rows_left([theirs])
            assert tier.rows_left([mine])
            assert not tier.drop_rows_left([mine])  # its own: deleted, the lock fails it
        finally:
            other.close()
        assert tier.drop_rows_left([mine])
        assert not tier.rows_left([mine])
        assert tier.remove([slot])
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == {kept}


def test_an_index_replaced_while_open_fails_the_commits_after_it(
    disk_dir: Path, make_block: Block
) -> None:
    """Another file put in the index's place (a copy restored by hand) is not overwritten:
    the commits fail and the tier refuses writes until restarted."""
    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(5)), 4096)
        shutil.copy(disk_dir / "index.sqlite3", tmp := disk_dir / "copy")
        tmp.replace(disk_dir / "index.sqlite3")
        outcomes = persist(tier, _items(tier, make_block, list(range(5, 10)), 4096))
        assert not any(o.ok for o in outcomes)
        health = tier.health()
        assert health.state == Health.DEGRADED_IO and "replaced while open" in health.detail
        assert tier.faults.refuses_commits()
        assert _read(tier, before) == {i: b[2] for i, b in before.items()}


def test_regression_a_data_file_removed_while_open_fails_the_writes_to_it(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """A data file removed while the tier ran: writes went to the unlinked file and were
    reported ok (a real daemon answered persisted=True for 32 blocks lost at the next start,
    as l2_blocks_lost_at_recovery_missing_file). Now its sync fails them and degrades the
    tier, which keeps serving what it holds."""
    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(5)), 4096)
        (disk_dir / "data-0000.bin").unlink()
        items = _items(tier, make_block, list(range(5, 10)), 4096)
        assert all(tier.slot_location(it.slot)[0].name == "data-0000.bin" for it in items)
        with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
            outcomes = persist(tier, items)
        assert not any(o.ok for o in outcomes)
        health = tier.health()
        assert health.state == Health.DEGRADED_IO and "removed or replaced" in health.detail
        assert [r for r in caplog.records if "data-0000.bin was removed" in r.getMessage()]
        assert _read(tier, before) == {i: b[2] for i, b in before.items()}


@contextlib.contextmanager
def _locked_index(
    tier: DiskTier, disk_dir: Path, make_block: Block
) -> Iterator[sqlite3.Connection]:
    """``tier``, with block 0 persisted, degraded by its index locked from another
    connection (an operator's sqlite3 shell) past the busy timeout: block 1's write refused.
    Yields that connection, holding the lock (the caller may let it go); closed after."""
    _persist(tier, make_block, [0], 4096)
    other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        key, data = make_block(1, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
        yield other
    finally:
        other.close()


def test_regression_an_index_locked_by_another_process_degrades_only_until_it_is_let_go(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's sqlite3 shell holding a write transaction on the index past the busy
    timeout: the commit failed with SQLITE_BUSY, rightly, but the tier stayed degraded
    (refusing every write) until the daemon restarted, long after the lock was let go. Now a
    locked index is retried like a full disk: the first write batch after enospc_retry_s
    finds out, and its commit makes the tier whole again."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.1) as tier:
        with _locked_index(tier, disk_dir, make_block) as other:
            health = tier.health()
            assert health.state == Health.DEGRADED_IO and "locked" in health.detail
            other.execute("ROLLBACK")
        time.sleep(0.2)
        # What has the store send it the next batch a tier above demotes.
        assert tier.health().retry_due
        blocks = _persist(tier, make_block, [2, 3], 4096)
        health = tier.health()
        assert health.state == Health.OK and not health.retry_due
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


def test_regression_an_idle_tier_stayed_degraded_after_the_lock_on_its_index_was_let_go(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a write batch let through could end a locked index's fault: a node that wrote
    nothing more to L2 showed it degraded long after the lock was let go. The tier's watch
    now tries in the writes' turn (one page committed), without waiting out the busy timeout
    (an hour here, from once the tier is degraded): each try fails at once while the lock is
    held, so it never holds the index, or the stop that joins the watch, for that long; the
    first try after the lock is let go ends the fault, no write sent."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir, enospc_retry_s=0.05, index_watch_s=0.02)
    try:
        with _locked_index(tier, disk_dir, make_block) as other:
            monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 3600.0)
            with tier._idx().held():  # not between the watch's setting and its reset
                tier._idx()._conn().execute("PRAGMA busy_timeout = 3600000")
            tries = tier.stats().counters["index_errors"]
            _wait_for(lambda: tier.stats().counters["index_errors"] >= tries + 2)
            health = tier.health()
            assert health.state == Health.DEGRADED_IO and "locked" in health.detail
            other.execute("ROLLBACK")
            committed = tier.stats().counters["committed_blocks"]
            _wait_for(lambda: tier.health().state == Health.OK)
            assert tier.stats().counters["committed_blocks"] == committed
    finally:
        tier.close()
    assert _watches() == []


def test_regression_a_wal_removed_while_a_reader_holds_it_is_retried_not_lasting(
    disk_dir: Path,
    make_block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The WAL removed while another process (an operator's sqlite3 shell) held a read
    transaction on the index: the commit that found the WAL gone could not checkpoint it
    (busy) and raised IndexFilesReplaced, a lasting fault, so the tier refused writes until
    restarted, long after the reader let go. A busy checkpoint is now retried like a locked
    index: the tier is degraded while the reader holds on, and the first write batch after
    enospc_retry_s once it let go checkpoints the WAL and makes the tier whole again."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir, enospc_retry_s=0.1)
    try:
        before = _persist(tier, make_block, list(range(5)), 4096)
        reader = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM blocks").fetchone() == (5,)
            for name in ("index.sqlite3-wal", "index.sqlite3-shm"):
                (disk_dir / name).unlink()
            key, data = make_block(5, 4096)
            slot = tier.allocator.allocate(4096)
            assert slot is not None
            assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
            health = tier.health()
            assert health.state == Health.DEGRADED_IO, health
            assert "locked" in health.detail and "checkpointed" in health.detail
            assert not tier.faults.refuses_commits()
            reader.execute("COMMIT")
        finally:
            reader.close()
        time.sleep(0.2)
        after = _persist(tier, make_block, [6, 7], 4096)
        assert tier.health().state == Health.OK
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    with _open(image) as again:
        assert not again.faults.snapshot().get("index_moved_aside")
        # Not the failed put's: it was refused before its row went into the removed WAL.
        assert len(again.recover()) == 7
        blocks = {**before, **after}
        got = _read(again, blocks)
        assert all(got[i] == blocks[i][2] for i in blocks)


@contextlib.contextmanager
def _wal_removed_under_a_reader(
    tier: DiskTier, disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> Iterator[sqlite3.Connection]:
    """``tier``, with block 0 persisted, its WAL removed while another connection (an
    operator's sqlite3 shell) holds a read transaction: block 1's write refused, the tier
    degraded by a locked index (the WAL's checkpoint held up), then the busy timeout set to
    an hour. Yields that connection, holding its read (the caller may end it); closed after."""
    _persist(tier, make_block, [0], 4096)
    reader = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM blocks").fetchone() == (1,)
        for name in ("index.sqlite3-wal", "index.sqlite3-shm"):
            (disk_dir / name).unlink()
        assert not persist(tier, _items(tier, make_block, [1], 4096))[0].ok
        assert tier.faults.lock_held() and "checkpointed" in tier.health().detail
        monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 3600.0)
        # Holding the index: the watch thread's check sets the timeout to 0 for its own
        # checkpoint meanwhile, which this hour, set between, kept waiting (the test hung).
        with tier._idx().held():
            tier._idx()._conn().execute("PRAGMA busy_timeout = 3600000")
        yield reader
    finally:
        reader.close()


def test_regression_the_watchs_retry_waited_out_the_busy_timeout_on_a_removed_wal_held_by_a_reader(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The WAL removed while another process held a read transaction (a locked index's
    fault): the watch's own check gives up on the checkpoint at once, but its retry (06f0c0c)
    checked the files before its commit with the busy timeout, waiting it out (30 s in the
    daemon, an hour here) for the checkpoint while holding the index: every commit and the
    stop waited that long, at each turn. Each try now fails at once while the reader holds
    on; the first after it let go checkpoints the WAL and ends the fault, no write sent."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir, enospc_retry_s=0.05, index_watch_s=0.02)
    try:
        with _wal_removed_under_a_reader(tier, disk_dir, make_block, monkeypatch) as reader:
            tries = tier.stats().counters["index_errors"]
            _wait_for(lambda: tier.stats().counters["index_errors"] >= tries + 2)
            assert tier.faults.lock_held()
            committed = tier.stats().counters["committed_blocks"]
            reader.execute("COMMIT")
        _wait_for(lambda: tier.health().state == Health.OK)
        assert tier.stats().counters["committed_blocks"] == committed
    finally:
        tier.close()


def test_regression_a_write_let_through_waited_out_the_busy_timeout_on_a_removed_wal_held_by_a_reader(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write batch let through to a tier degraded by a removed WAL whose checkpoint another
    process's reader held up (a locked index's fault) tries the lock once, but checked the
    files first with the busy timeout, waiting it out (30 s in the daemon, an hour here) for
    that checkpoint, holding the index and the put that sent it. It now fails at once, as
    for a held lock, and the first batch after the reader let go commits."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir, enospc_retry_s=0.0)
    try:
        with _wal_removed_under_a_reader(tier, disk_dir, make_block, monkeypatch) as reader:
            outcome: list[bool] = []
            items = _items(tier, make_block, [2], 4096)
            put = threading.Thread(
                target=lambda: outcome.extend(o.ok for o in persist(tier, items))
            )
            put.start()
            try:
                _wait_for(lambda: not put.is_alive())
            finally:
                reader.execute("COMMIT")
                put.join()
            assert outcome == [False]
        _persist(tier, make_block, [3], 4096)
        assert tier.health().state == Health.OK
    finally:
        tier.close()


@pytest.mark.parametrize("removed", ["before the put", "while its bytes go down"])
def test_regression_a_put_failed_by_a_busy_wal_checkpoint_frees_its_slots_and_stays_failed(
    disk_dir: Path,
    make_block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty_files: FaultyFiles,
    removed: str,
) -> None:
    """A durable put whose commit found the WAL removed and its checkpoint held up by
    another process's reader failed (IndexCheckpointBusy), but SQLite had committed its rows
    into the removed WAL first. Giving its slots back had to delete those rows, in a commit
    that failed the same way: the slots stayed taken until a restart. And once the reader
    let go, the next commit checkpointed that WAL into the index file: a restart found the
    failed put's blocks. Now a WAL removed before the put fails it before its rows go in,
    and rows a commit put into a WAL removed while it ran are deleted again at once, in the
    same WAL; either way the slots are freed without a commit, and the failed blocks never
    come back."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir, enospc_retry_s=0.1, backend=faulty_files)
    try:
        before = _persist(tier, make_block, list(range(5)), 4096)
        reader = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM blocks").fetchone() == (5,)
            if removed == "before the put":
                _unlink_wal(disk_dir)
            else:  # inside the put's transaction, as its data file is synced
                faulty_files.faults["fdatasync"] = lambda *_: (
                    faulty_files.clear(),
                    _unlink_wal(disk_dir),
                )
            items = _items(tier, make_block, [5, 6], 4096)
            assert not any(o.ok for o in persist(tier, items))
            assert "locked" in tier.health().detail
            used = tier.allocator.used_bytes
            assert tier.remove([it.slot for it in items])
            assert tier.allocator.used_bytes == used - 2 * 4096
            reader.execute("COMMIT")
        finally:
            reader.close()
        time.sleep(0.2)  # enospc_retry_s: the next write is let through
        after = _persist(tier, make_block, [7, 8], 4096)
        assert tier.health().state == Health.OK
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    with _open(image) as again:
        blocks = {**before, **after}
        assert _recovered_keys(again) == {b[0] for b in blocks.values()}
        assert _read(again, blocks) == {i: b[2] for i, b in blocks.items()}


def test_regression_a_delete_after_a_wal_removed_while_open_loses_no_committed_block(
    disk_dir: Path, make_block: Block, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The WAL removed while open, then only deletes (no put) before a crash: the delete's
    commit went to the unlinked WAL unchecked (only a put's commit looked), so the crash lost
    the delete and every block committed before the removal (the index file alone had no
    metadata and was moved aside). Every commit now checks its files, a delete's too."""
    tier = _open(disk_dir)
    try:
        blocks = _persist(tier, make_block, list(range(10)), 4096)
        for name in ("index.sqlite3-wal", "index.sqlite3-shm"):
            (disk_dir / name).unlink()
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            assert tier.remove([blocks[0][1]])
        assert any("WAL was removed" in r.getMessage() for r in caplog.records)
        assert tier.health().state == Health.OK
        image = _crash_image(disk_dir, tmp_path / "image")
    finally:
        tier.close()
    del blocks[0]
    with _open(image) as again:
        assert not again.faults.snapshot().get("index_moved_aside")
        assert len(again.recover()) == 9
        got = _read(again, blocks)
        assert all(got[i] == blocks[i][2] for i in blocks)


# Another process's writer: takes the index's write lock, says so, holds it until told
# (or until its stdin closes with the test), then commits.
_OTHER_WRITER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT OR REPLACE INTO namespaces VALUES (7, 'other')")
print("holding", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
"""


@pytest.mark.parametrize("removed", [("-wal", "-shm"), ("-shm",)], ids=["wal_and_shm", "shm"])
def test_regression_a_wal_and_shm_removed_while_open_left_the_tier_blind_to_other_processes_locks(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch, removed: tuple[str, ...]
) -> None:
    """index.sqlite3-wal and -shm removed while the tier ran: the reopen made its new
    connection while the old one was open (a32cb71), and SQLite hands a process's second
    connection to a file the shared memory its first one maps, here the removed -shm, which
    no other process opens. Another process's writer then held the write lock in the -shm
    its path names, and the tier committed beside it: the index failed its integrity check
    (rows with NULL columns, blocks lost). The old connection is now closed before the new
    one opens, which maps the -shm its path names: the tier's commit waits for that lock.
    "shm": -shm removed alone, which the file check did not look at (the index and its WAL
    only), so the tier kept the removed one for good, and the same writer's commits beside
    the tier's failed the index's integrity check (every block lost at the next start). A
    removed or replaced -shm is now handled as a removed WAL is: checkpointed, reopened."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir, enospc_retry_s=0.0)
    try:
        before = _persist(tier, make_block, list(range(5)), 4096)
        for end in removed:
            (disk_dir / f"index.sqlite3{end}").unlink()
        after = _persist(tier, make_block, list(range(5, 10)), 4096)  # the reopen
        with _holding(_OTHER_WRITER, disk_dir / "index.sqlite3") as (let_go, _):
            items = _items(tier, make_block, [10], 4096)
            assert not persist(tier, items)[0].ok
            assert tier.health().state == Health.DEGRADED_IO
            assert tier.remove([it.slot for it in items])
            let_go()
        later = _persist(tier, make_block, list(range(11, 15)), 4096)
        assert tier.health().state == Health.OK
    finally:
        tier.close()
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("SELECT label FROM namespaces WHERE ns = 7").fetchall() == [("other",)]
    finally:
        db.close()
    with _open(disk_dir) as again:
        assert _recovered_keys(again) == {b[0] for b in {**before, **after, **later}.values()}


def test_regression_an_index_that_cannot_be_checked_fails_the_commit_not_the_writer(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check of the index's files after a commit (``stat`` of index.sqlite3 and -wal)
    failing other than with ENOENT (EACCES: the directory's permissions changed under a
    daemon that is not root) raised an OSError out of the index commit, past the tier's
    ``sqlite3.Error`` handler, into the writer. Now it fails the commit and degrades the tier,
    which keeps serving what it holds."""

    class Os:
        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        def stat(self, path: object) -> os.stat_result:
            if "index.sqlite3" in str(path):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return os.stat(path)  # type: ignore[arg-type]

    with _open(disk_dir) as tier:
        before = _persist(tier, make_block, list(range(3)), 4096)
        monkeypatch.setattr(index_module, "os", Os())
        key, data = make_block(3, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        outcomes = persist(tier, [PersistItem(1, key, slot, data, 4096)])
        assert not outcomes[0].ok
        health = tier.health()
        assert health.state == Health.DEGRADED_IO and "cannot be checked" in health.detail
        monkeypatch.undo()
        assert _read(tier, before) == {i: b[2] for i, b in before.items()}


def test_regression_slots_a_locked_index_kept_from_a_put_are_freed_without_a_commit(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put failed on an index another process held locked, and its slots were given back:
    ``remove`` deleted their rows (none: nothing was committed) in a write transaction that
    the lock failed too, so they stayed allocated for good. Once the lock was let go the tier
    was whole again, but those slots and their owners' quota stayed taken until a restart (a
    real daemon: `kvtier check` exit 1, "16 slots allocated, ... held by blocks" after a 60 s
    lock). Slots without a row are now freed without a write transaction."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.1) as tier:
        blocks = _persist(tier, make_block, [0], 4096)
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            key, data = make_block(1, 4096)
            slot = tier.allocator.allocate(4096)
            assert slot is not None
            assert not persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok
            used = tier.allocator.used_bytes
            assert tier.remove([slot])
            assert tier.allocator.used_bytes == used - 4096
            # A committed block's row still needs the index: its removal waits for the lock.
            assert not tier.remove([blocks[0][1]])
        finally:
            other.close()
        assert tier.remove([blocks[0][1]])
        assert tier.allocator.used_bytes == 0


def test_regression_a_row_whose_remove_failed_stayed_beside_its_key_put_again(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block's ``remove`` failed (the index locked by another process) and the store kept
    its slot to try again; its key, put again with other bytes into another slot, committed a
    second row beside the first. A crash before the retry left both, and the next start's
    recovery, reading a chunk at a time in slot order, handed over the deleted bytes first. A
    block commit now deletes the rows of the slots whose remove failed, in its transaction;
    the retry of their remove then frees them with no row to delete."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.1) as tier:
        first = _persist(tier, make_block, [0], 4096)[0]
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            assert not tier.remove([first[1]])
        finally:
            other.close()
        tier.retry_writes_now()
        _, data = make_block(1, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None and slot != first[1]
        assert persist(tier, [PersistItem(1, first[0], slot, data, 4096)])[0].ok, tier.health()
        # What a crash now leaves in the index.
        db = sqlite3.connect(disk_dir / "index.sqlite3")
        try:
            crashed = db.execute("SELECT key, slot FROM blocks ORDER BY slot").fetchall()
        finally:
            db.close()
        assert crashed == [(first[0], slot)]
        assert tier.remove([first[1]])
        assert tier.allocator.used_bytes == 4096
    with _open(disk_dir) as tier:
        assert [(r.key, r.slot) for r in tier.recover()] == [(first[0], slot)]


def _crash_rows(disk_dir: Path) -> list[tuple[bytes, int]]:
    """The (key, slot) of each block row a crash now leaves in the index, by slot."""
    db = sqlite3.connect(disk_dir / "index.sqlite3")
    try:
        return db.execute("SELECT key, slot FROM blocks ORDER BY slot").fetchall()
    finally:
        db.close()


def _counting_lookups(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The slots of each ``committed_slots`` query the tier makes from now on (the index's
    own answer: the call goes through)."""
    index = tier._idx()
    asked: list[list[int]] = []
    lookup = index.committed_slots

    def counted(slots: Sequence[int]) -> list[int]:
        asked.append(sorted(slots))
        return lookup(slots)

    monkeypatch.setattr(index, "committed_slots", counted)
    return asked


def test_regression_a_block_commit_deleted_the_rows_of_every_slot_on_its_way_out(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block commit deleted, in its transaction, the rows of all slots on their way to
    ``remove``, whatever keys it wrote: a one-block durable put beside an eviction pass of
    16,384 blocks took 23.9 ms instead of 2.4, and their ``remove`` then asked the index
    which of them still had a row. Only a key put again needs its older row gone with its
    commit: a commit now deletes the rows of the keys it writes (and of slots whose keys the
    tier was not told); the others go with their own ``remove``, which asks the index nothing
    of the slots whose rows a commit deleted."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [0, 1, 2], 4096)
        out = [blocks[0][1], blocks[1][1]]
        tier.removing(out, [BlockRef(1, blocks[0][0]), BlockRef(1, blocks[1][0])])
        # A commit of another key leaves their rows to their ``remove``.
        unrelated = _persist(tier, make_block, [3], 4096)[3]
        assert _crash_rows(disk_dir) == sorted(
            [(b[0], b[1]) for b in [*blocks.values(), unrelated]], key=lambda row: row[1]
        )
        # Block 0's key put again (other bytes): its older row goes with the commit.
        _, data = make_block(4, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        assert persist(tier, [PersistItem(1, blocks[0][0], slot, data, 4096)])[0].ok
        crashed = _crash_rows(disk_dir)
        assert [s for k, s in crashed if k == blocks[0][0]] == [slot]
        assert [s for k, s in crashed if k == blocks[1][0]] == [blocks[1][1]]
        asked = _counting_lookups(tier, monkeypatch)
        assert tier.remove(out)
        assert asked == []
        assert [k for k, _ in _crash_rows(disk_dir)].count(blocks[1][0]) == 0
    with _open(disk_dir) as tier:
        assert {r.key: r.slot for r in tier.recover()} == {
            blocks[0][0]: slot,
            blocks[2][0]: blocks[2][1],
            unrelated[0]: unrelated[1],
        }


def test_a_second_slot_of_a_key_on_its_way_out_goes_with_any_block_commit(
    disk_dir: Path, make_block: Block
) -> None:
    """Two slots on their way to ``remove`` named with one key (rows a restart found twice,
    say): the tier follows one slot per key, so the second's row goes with the next block
    commit of any key, and the first's with the next of that key."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [0, 1], 4096)
        named = [BlockRef(1, blocks[0][0])]
        tier.removing([blocks[0][1]], named)
        tier.removing([blocks[1][1]], named)
        unrelated = _persist(tier, make_block, [2], 4096)[2]
        assert _crash_rows(disk_dir) == [(blocks[0][0], blocks[0][1]), unrelated[:2]]
        _, data = make_block(3, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        assert persist(tier, [PersistItem(1, blocks[0][0], slot, data, 4096)])[0].ok
        assert _crash_rows(disk_dir) == [unrelated[:2], (blocks[0][0], slot)]
        assert tier.remove([blocks[0][1], blocks[1][1]])
        assert tier.allocator.used_bytes == 2 * 4096


def test_regression_a_slot_named_twice_at_once_left_a_key_whose_commit_deleted_its_next_row(
    disk_dir: Path, make_block: Block
) -> None:
    """``removing`` given one slot twice with two keys took its bulk path (the keys distinct
    and new): the slot was followed under both keys but kept one, so its ``remove`` forgot
    only that one, and the other key went on naming the slot once it was handed out again: a
    commit of that key then deleted the row of the block written there since. A slot named
    twice is followed as the loop does, under its first key."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, [0, 1], 4096)
        out = blocks[0][1]
        tier.removing([out, out], [BlockRef(1, blocks[0][0]), BlockRef(1, blocks[1][0])])
        assert tier.remove([out])
        reused = _persist(tier, make_block, [2], 4096)[2]
        assert reused[1] == out  # the slot freed is handed out again
        _, data = make_block(3, 4096)
        again = tier.allocator.allocate(4096)
        assert again is not None
        # Block 0's key put again: its older row went with the slot's ``remove``.
        assert persist(tier, [PersistItem(1, blocks[0][0], again, data, 4096)])[0].ok
        assert (reused[0], out) in _crash_rows(disk_dir)
    with _open(disk_dir) as tier:
        assert {r.key: r.slot for r in tier.recover()}[reused[0]] == out


def test_regression_a_failed_remove_made_the_rows_of_its_named_slots_go_with_any_commit(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``remove`` that fails (the index locked by another process) keeps its slots for the
    next commit of their keys, with the keys ``removing`` named: a commit of another key
    leaves their rows, one of such a key deletes its row, and the slot whose row a commit
    deleted before the failure is not asked about again."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.1) as tier:
        blocks = _persist(tier, make_block, [0, 1], 4096)
        out = [blocks[0][1], blocks[1][1]]
        tier.removing(out, [BlockRef(1, blocks[0][0]), BlockRef(1, blocks[1][0])])
        _, data = make_block(2, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        assert persist(tier, [PersistItem(1, blocks[0][0], slot, data, 4096)])[0].ok
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            assert not tier.remove(out)
        finally:
            other.close()
        tier.retry_writes_now()
        unrelated = _persist(tier, make_block, [3], 4096)[3]
        assert (blocks[1][0], blocks[1][1]) in _crash_rows(disk_dir)
        _, data = make_block(4, 4096)
        again = tier.allocator.allocate(4096)
        assert again is not None
        assert persist(tier, [PersistItem(1, blocks[1][0], again, data, 4096)])[0].ok
        assert _crash_rows(disk_dir) == sorted(
            [(blocks[0][0], slot), (unrelated[0], unrelated[1]), (blocks[1][0], again)],
            key=lambda row: row[1],
        )
        asked = _counting_lookups(tier, monkeypatch)
        assert tier.remove(out)
        assert asked == []
        assert tier.allocator.used_bytes == 3 * 4096


def _fail_a_read_on_a_locked_index(tier: DiskTier, disk_dir: Path, block: tuple) -> None:
    """Read ``block`` (its bytes flipped: the read fails) while another connection holds the
    index locked, so its quarantine does not reach the index."""
    _flip(tier, block[1])
    other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        assert _read(tier, {0: block}) == {0: None}
    finally:
        other.close()


def test_regression_a_quarantine_on_a_locked_index_left_its_row_beside_its_key_put_again(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that failed while another process held the index locked quarantined its slot
    in memory alone, its row kept (a second try would wait out the lock again); the store
    forgot the block, and its key, put again into another slot, committed a second row
    beside the first. A crash left both, and the next start's recovery, reading a chunk at a
    time in slot order, handed the quarantined slot's row over first (bytes that fail no
    more, a one-off read error, served as the key's). The next block commit deletes that row
    in its transaction, as it deletes those of slots on their way to ``remove``; a release
    of the slot before that commit deletes it, and the block given the slot keeps its row."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.1) as tier:
        blocks = _persist(tier, make_block, [0, 1], 4096)
        good = bytes(blocks[1][2])
        _fail_a_read_on_a_locked_index(tier, disk_dir, blocks[1])
        tier.retry_writes_now()
        assert [q.slot for q in tier.quarantined()] == [blocks[1][1]]
        _, data = make_block(2, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None and slot not in (blocks[0][1], blocks[1][1])
        assert persist(tier, [PersistItem(1, blocks[1][0], slot, data, 4096)])[0].ok, tier.health()
        # What a crash now leaves in the index.
        db = sqlite3.connect(disk_dir / "index.sqlite3")
        try:
            crashed = db.execute("SELECT slot FROM blocks ORDER BY slot").fetchall()
        finally:
            db.close()
        assert crashed == [(blocks[0][1],), (slot,)]
        # The read error was a one-off: the slot's bytes are whole again.
        path, offset = tier.slot_location(blocks[1][1])
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(good)
    with _open(disk_dir) as tier:
        assert {(r.key, r.slot) for r in tier.recover()} == {
            (blocks[0][0], blocks[0][1]),
            (blocks[1][0], slot),
        }
        assert [q.slot for q in tier.quarantined()] == []
        _fail_a_read_on_a_locked_index(tier, disk_dir, blocks[0])
        tier._retry_commit()  # the lock let go: what the watch finds
        assert tier.release_quarantined().released == [blocks[0][1]]
        again = _persist(tier, make_block, [3], 4096)
        assert again[3][1] == blocks[0][1]
    with _open(disk_dir) as tier:
        assert {(r.key, r.slot) for r in tier.recover()} == {
            (again[3][0], blocks[0][1]),
            (blocks[1][0], slot),
        }


def _returns_on_the_locked_index(
    tier: DiskTier,
    disk_dir: Path,
    make_block: Block,
    monkeypatch: pytest.MonkeyPatch,
    call: Callable[..., None],
    *args: object,
) -> None:
    """Run ``call(*args)`` on ``tier`` degraded by its index locked from another connection
    (``_locked_index``), SQLite's busy timeout then set to an hour: ``call`` must return
    within 20 s, the tier still degraded by the lock, which is let go after."""
    with _locked_index(tier, disk_dir, make_block) as other:
        monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 3600.0)
        with tier._idx().held():  # not between the watch's setting and its reset
            tier._idx()._conn().execute("PRAGMA busy_timeout = 3600000")
        thread = threading.Thread(target=call, args=args)
        thread.start()
        try:
            thread.join(20)  # it waited an hour before
            assert not thread.is_alive()
            health = tier.health()
            assert health.state == Health.DEGRADED_IO and "locked" in health.detail
        finally:
            other.execute("ROLLBACK")
            thread.join()


def test_regression_a_namespace_record_on_a_locked_index_waited_out_the_busy_timeout(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace first bound while another process held the index locked (an operator's
    sqlite3 shell; the tier degraded by that lock) waited out the busy timeout (30 s) for its
    record, holding the index's lock meanwhile: the put binding it took 30 s, and so did the
    writes let through behind it, though a record that fails is kept and made with the next
    commit (779f8e9). It now tries the lock once, as a write let through does, and is made
    with the first write committed once the lock is let go."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.0) as tier:
        record = tier.remember_namespace
        _returns_on_the_locked_index(tier, disk_dir, make_block, monkeypatch, record, 1, "alice")
        assert tier.namespaces() == {}
        _persist(tier, make_block, [2], 4096)
        assert tier.namespaces() == {1: "alice"}
        assert tier.health().state == Health.OK


def test_regression_a_namespace_forget_on_a_locked_index_waited_out_the_busy_timeout(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop of the records of namespaces a bind unbinds, while another process held the
    index locked (the tier degraded by that lock), waited out the busy timeout (30 s) holding
    the index's lock, as a namespace's record did before 8ac3a83: the put binding a namespace
    took that long. It now tries the lock once and is made with the first write committed
    once the lock is let go."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.0) as tier:
        tier.remember_namespace(1, "alice")
        forget = tier.forget_namespaces
        _returns_on_the_locked_index(tier, disk_dir, make_block, monkeypatch, forget, [1])
        assert tier.namespaces() == {1: "alice"}
        _persist(tier, make_block, [2], 4096)
        assert tier.namespaces() == {}
        assert tier.health().state == Health.OK


def test_regression_a_namespace_drop_kept_on_a_tier_that_commits_no_block_was_lost_at_close(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace record or drop whose commit failed is kept for the next commit of block
    rows, but the watch's try that ends the fault (``_retry_commit``) committed one page
    without them: on a tier that commits no block (a node that only reads L2) they stayed in
    memory, and were lost at close, the dropped namespace bound to its tenant again at the
    next start. The try now commits them."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    tier = _open(disk_dir, enospc_retry_s=0.05, index_watch_s=0.02)
    try:
        tier.remember_namespace(1, "alice")
        other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            tier.forget_namespaces([1])
            tier.remember_namespace(2, "bob")
            assert tier.health().state is not Health.OK
        finally:
            other.execute("ROLLBACK")
            other.close()
        _wait_for(lambda: tier.health().state == Health.OK)
        assert tier.namespaces() == {2: "bob"}
    finally:
        tier.close()
    with _open(disk_dir) as tier:
        assert tier.namespaces() == {2: "bob"}


def test_regression_a_watch_check_held_up_by_a_reader_does_not_hold_the_index_for_the_busy_timeout(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The WAL removed while another process holds a read transaction: the watch's check
    finds its checkpoint held up and reports it at once (tried again later) rather than
    waiting out SQLite's busy timeout (30 s) holding the index's lock, which stalled every
    commit and the daemon's stop (``close`` joins the watch) for that long. The busy timeout
    is set far beyond the wait below, so the check can only report the lock while the reader
    still holds it if it did not wait."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 3600.0)
    tier = _open(disk_dir)
    try:
        _persist(tier, make_block, list(range(3)), 4096)
        reader = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        results: list[bool] = []
        check = threading.Thread(target=lambda: results.append(tier._check_index_files()))
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM blocks").fetchone() == (3,)
            _unlink_wal(disk_dir)
            check.start()
            check.join(timeout=60.0)
        finally:
            reader.close()  # lets a check that waited finish: it then reports no lock
            check.join()
        assert results == [True]
        assert tier.health().state == Health.OK
        # The connection's own busy timeout is left as it was for commits.
        index = tier._index
        assert index is not None and index._db is not None
        assert index._db.execute("PRAGMA busy_timeout").fetchone() == (3600000,)
    finally:
        tier.close()


def test_regression_a_removal_in_steps_held_up_by_a_reader_does_not_hold_the_index_for_the_busy_timeout(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal on a full disk takes steps with a WAL restart before each (``delete_in_steps``)
    while a reader holds a read transaction (the recovery's stream, an operator's sqlite3
    shell): each step's checkpoint waited out SQLite's busy timeout (30 s) holding the index's
    lock, which stalled every commit that long per 16 rows. The busy timeout is set far beyond
    the wait below, so the steps can only end while the reader still holds the index if their
    checkpoints did not wait; their rows are deleted either way."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 3600.0)
    tier = _open(disk_dir)
    try:
        blocks = _persist(tier, make_block, list(range(4)), 4096)
        slots = [b[1] for b in blocks.values()]
        index = tier._idx()
        reader = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
        steps = threading.Thread(target=index.delete_in_steps, args=(slots, 2))
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM blocks").fetchone() == (4,)
            steps.start()
            steps.join(timeout=60.0)
            ended_while_held = not steps.is_alive()
        finally:
            reader.close()  # lets steps that waited go on
            steps.join()
        assert ended_while_held
        assert index.committed_slots(slots) == []
        assert index._db is not None
        assert index._db.execute("PRAGMA busy_timeout").fetchone() == (3600000,)
    finally:
        tier.close()


def _reserve_whole(directory: Path) -> bool:
    """Whether the tier in ``directory`` holds its reserve, every byte allocated."""
    return (directory / RESERVE_NAME).stat().st_blocks * 512 >= 256 << 10


def _sqlite_full() -> sqlite3.Error:
    """What SQLite raises where the index's WAL cannot grow on a full disk."""
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]  # SQLITE_FULL
    return full


@pytest.mark.parametrize("io_threads", [1, 2])
def test_regression_a_removal_on_the_reserve_deadlocked_with_a_commit_and_the_remake(
    disk_dir: Path, make_block: Block, io_threads: int
) -> None:
    """A removal on a full disk (SQLITE_FULL) held the reserve's lock across its index calls,
    while the remake of the reserve, asked by an earlier commit, waited for that lock on an
    I/O thread: with one or two I/O threads (one runs all but demand reads), that was the
    thread a commit holding the index waited for to write its blocks, and the removal waited
    for the index. Removal, commit and every later write hung. The removal now holds the
    index alone (the reserve's lock is gone: the reserve is made and given back holding the
    index); the reserve is made again by the next write's commit once the removal is done."""
    tier = _open(disk_dir, io_threads=io_threads, direct_io=False)
    index = tier._idx()
    removed = _persist(tier, make_block, [0], 4096)[0][1]
    written = _items(tier, make_block, [1, 2, 3], 4096)[::2]  # two runs: on the I/O threads
    in_fallback, at_index = threading.Event(), threading.Event()
    real_delete, real_insert = index.delete, index.insert_when
    index._lock = ContendedLock(at_index, reentrant=True)  # type: ignore[assignment]
    tries: list[object] = []

    def delete(slots: object) -> None:
        tries.append(slots)
        if len(tries) == 1:
            raise _sqlite_full()
        in_fallback.set()
        at_index.wait(timeout=10.0)  # the commit holds the index, or waits for it
        real_delete(slots)  # type: ignore[arg-type]

    def insert_when(rows: object, durable: Callable[[], object], **kw: object) -> bool:
        def inside() -> object:
            at_index.set()
            return durable()

        return real_insert(rows, inside, **kw)  # type: ignore[arg-type]

    index.delete = delete  # type: ignore[method-assign]
    index.insert_when = insert_when  # type: ignore[method-assign]
    assert tier._give_back_reserve()  # an earlier removal's
    removals: list[bool] = []
    writes: list[WriteOutcome] = []
    removal = threading.Thread(target=lambda: removals.append(tier.remove([removed])))
    write = threading.Thread(target=lambda: writes.extend(persist(tier, written)))
    try:
        removal.start()
        assert in_fallback.wait(timeout=10.0)
        write.start()
        ends = time.monotonic() + 20.0
        for thread in (removal, write):
            thread.join(timeout=max(0.0, ends - time.monotonic()))
        assert not (removal.is_alive() or write.is_alive())
        assert removals == [True]
        assert [o.ok for o in writes] == [True, True]
        assert index.committed_slots([removed]) == []
        assert _reserve_whole(disk_dir)  # given back above: made again by the write
    finally:
        tier.close()


def test_a_write_commits_once_it_made_the_missing_reserve_or_not_at_all(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the reserve is missing (given back by a removal on a full disk), a write's
    commit makes it first, holding the index, so that no write commits in the room a removal
    needs: on its return the reserve is there, no I/O thread left to make it. Without room
    for it, the write is refused, its row not committed, the tier degraded by the full disk
    (naming the reserve); once space is back, the next write makes it, commits, and the
    tier is whole again."""
    tier = _open(disk_dir, direct_io=False, enospc_retry_s=0.0)
    reserve = disk_dir / RESERVE_NAME
    try:
        assert tier._give_back_reserve()
        _persist(tier, make_block, [0], 4096)
        assert _reserve_whole(disk_dir)
        assert tier.health().state is Health.OK

        assert tier._give_back_reserve()
        monkeypatch.setattr("kvtier.tiers.disk.tier._free_bytes", lambda _: 128 << 10)
        refused = _items(tier, make_block, [1], 4096)
        assert [o.ok for o in persist(tier, refused)] == [False]
        assert tier._idx().committed_slots([refused[0].slot]) == []
        assert not reserve.exists()
        health = tier.health()
        assert health.state is Health.DEGRADED_NOSPACE
        assert RESERVE_NAME in health.detail
        assert tier.remove([refused[0].slot])

        monkeypatch.undo()
        _persist(tier, make_block, [2], 4096)
        assert _reserve_whole(disk_dir)
        assert tier.health().state is Health.OK
    finally:
        tier.close()


def test_regression_a_start_that_could_not_make_the_reserve_said_the_tier_was_ok(
    disk_dir: Path,
    make_block: Block,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A start with no room for the reserve (given back on a full disk before a stop) left
    it missing with a warning, and the tier OK, though no write commits until the reserve is
    made (2859612): ``kvtier stats`` said L2 was OK and took writes, and the store sent it
    demotions, written and synced, until the first commit was refused. The tier now starts
    degraded by the full disk, naming the reserve; a write let through once space is back
    makes it and commits. Its log said "start failed", though the tier started and serves
    reads; it now says what happened."""
    _open(disk_dir, direct_io=False).close()
    (disk_dir / RESERVE_NAME).unlink()
    fallocate = os.posix_fallocate

    def no_room_for_the_reserve(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(RESERVE_NAME):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", no_room_for_the_reserve)
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
        tier = _open(disk_dir, direct_io=False, enospc_retry_s=0.0)
    try:
        health = tier.health()
        assert health.state is Health.DEGRADED_NOSPACE
        assert health.detail.startswith(f"enospc: start: no room to make {RESERVE_NAME}")
        assert "failed" not in caplog.text
        assert f"L2 tier degraded: start: no room to make {RESERVE_NAME}" in caplog.text
        monkeypatch.undo()
        _persist(tier, make_block, [0], 4096)
        assert tier.health().state is Health.OK
        assert _reserve_whole(disk_dir)
    finally:
        tier.close()


def test_a_write_is_committed_only_once_the_reserve_holds_the_index_growth_it_leaves(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reserve is grown, before a write commits, to hold the index's growth the WAL holds
    (which a removal's WAL restart on a full disk grows the index file by) and half its own
    size more, in MiB steps; where that does not fit, the write is not committed and the
    tier is degraded by the full disk, naming the reserve; once it fits, the next write grows
    it and commits."""
    tier = _open(disk_dir, direct_io=False, enospc_retry_s=0.0)
    try:
        index = tier._idx()
        monkeypatch.setattr(index, "growth_bytes", lambda: (3 << 20) + 4096)
        monkeypatch.setattr("kvtier.tiers.disk.tier._free_bytes", lambda _: 1 << 20)
        refused = _items(tier, make_block, [0], 4096)
        assert [o.ok for o in persist(tier, refused)] == [False]
        assert index.committed_slots([refused[0].slot]) == []
        health = tier.health()
        assert health.state is Health.DEGRADED_NOSPACE
        assert f"no room to grow {RESERVE_NAME} to 4.00 MiB" in health.detail
        assert tier.remove([refused[0].slot])

        monkeypatch.undo()
        monkeypatch.setattr(index, "growth_bytes", lambda: (3 << 20) + 4096)
        _persist(tier, make_block, [1], 4096)
        assert tier.health().state is Health.OK
        assert (disk_dir / RESERVE_NAME).stat().st_blocks * 512 >= 4 << 20
    finally:
        tier.close()


def test_the_start_grows_the_reserve_to_the_index_growth_a_crash_left_in_the_wal(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash leaves the WAL holding the index's growth since its last checkpoint: the open
    grows the reserve to hold it before any removal may need it (no write comes first), or,
    where that does not fit, starts degraded by the full disk, naming the reserve."""
    monkeypatch.setattr(index_module.DiskIndex, "growth_bytes", lambda _: (1 << 20) + 4096)
    with _open(disk_dir, direct_io=False) as tier:
        assert tier.health().state is Health.OK
        assert (disk_dir / RESERVE_NAME).stat().st_blocks * 512 >= 2 << 20
    monkeypatch.setattr(index_module.DiskIndex, "growth_bytes", lambda _: (3 << 20) + 4096)
    monkeypatch.setattr("kvtier.tiers.disk.tier._free_bytes", lambda _: 1 << 20)
    with _open(disk_dir, direct_io=False) as tier:
        health = tier.health()
        assert health.state is Health.DEGRADED_NOSPACE
        assert f"no room to grow {RESERVE_NAME} to 4.00 MiB" in health.detail


def test_the_watchs_retry_ends_no_full_disk_while_the_reserve_cannot_grow_to_the_index_growth(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch's retry asks what a write's commit asks: where the reserve cannot grow to
    the index's growth, its tries fail (counted) and the tier stays degraded, rather than
    going ok for the next write to be refused again."""
    tier = _open(disk_dir, direct_io=False, enospc_retry_s=0.05, index_watch_s=0.02)
    try:
        monkeypatch.setattr(tier._idx(), "growth_bytes", lambda: (3 << 20) + 4096)
        monkeypatch.setattr("kvtier.tiers.disk.tier._free_bytes", lambda _: 1 << 20)
        assert [o.ok for o in persist(tier, _items(tier, make_block, [0], 4096))] == [False]
        tries = tier.stats().counters["enospc"]
        _wait_for(lambda: tier.stats().counters["enospc"] >= tries + 2)
        health = tier.health()
        assert health.state is Health.DEGRADED_NOSPACE
        assert f"no room to grow {RESERVE_NAME}" in health.detail
    finally:
        tier.close()


def test_regression_a_reserve_removed_by_hand_kept_writes_from_committing_until_a_restart(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """index.reserve removed by hand (an operator freeing room on a full disk): the tier,
    taking it for made, grew it for the index's growth (6c27efc) by opening it without
    creating it, which failed (ENOENT); every write was refused, the tier degraded as "no
    room to grow" it, until a restart, though the disk had room. A reserve found short is
    now made again, as a missing one is, then grown; the write commits."""
    tier = _open(disk_dir, direct_io=False, enospc_retry_s=0.0)
    try:
        monkeypatch.setattr(tier._idx(), "growth_bytes", lambda: 512 << 10)
        (disk_dir / RESERVE_NAME).unlink()
        for i in range(2):
            _persist(tier, make_block, [i], 4096)
            assert tier.health().state is Health.OK
        assert (disk_dir / RESERVE_NAME).stat().st_blocks * 512 >= 1 << 20
    finally:
        tier.close()


def test_a_reserve_cut_short_by_hand_is_made_whole_before_a_write_commits(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """index.reserve cut short by hand (truncated, its room taken back), what is left still
    holding the index's growth and half the reserve: it is made whole again before a write
    commits, as a missing one is, not left short of the room a removal on a full disk may
    need. (The test above no longer tells: a reserve removed whole is made at once by its
    growth, 1 MiB.)"""
    tier = _open(disk_dir, direct_io=False, enospc_retry_s=0.0)
    try:
        monkeypatch.setattr(tier._idx(), "growth_bytes", lambda: 0)
        os.truncate(disk_dir / RESERVE_NAME, 192 << 10)
        assert not _reserve_whole(disk_dir)
        _persist(tier, make_block, [0], 4096)
        assert _reserve_whole(disk_dir)
        assert tier.health().state is Health.OK
    finally:
        tier.close()


def test_regression_a_commit_that_failed_before_its_rows_blamed_the_missing_reserve(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group commit whose transaction failed before its rows were in (the index locked by
    another process: SQLITE_BUSY) waited for its writes through the step meant for inside
    the transaction, which also tried to make the missing reserve, outside the index, and
    where it did not fit recorded a full disk over the lock: the tier's health named the
    reserve while the lock was what refused the writes. That wait now only waits."""
    tier = _open(disk_dir, direct_io=False, enospc_retry_s=0.0)
    try:
        assert tier._give_back_reserve()
        monkeypatch.setattr("kvtier.tiers.disk.tier._free_bytes", lambda _: 128 << 10)
        busy = sqlite3.OperationalError("database is locked")
        busy.sqlite_errorcode = 5  # type: ignore[attr-defined]  # SQLITE_BUSY

        def locked(*args: object, **kw: object) -> bool:
            raise busy

        monkeypatch.setattr(tier._idx(), "insert_when", locked)
        assert [o.ok for o in persist(tier, _items(tier, make_block, [0], 4096))] == [False]
        health = tier.health()
        assert health.state is Health.DEGRADED_IO
        assert health.detail.startswith("locked: index commit"), health.detail
    finally:
        monkeypatch.undo()
        tier.close()


def test_regression_a_removal_that_could_not_give_the_reserve_back_raised_out_of_remove(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal on a full disk whose unlink of the reserve failed other than as missing (a
    filesystem remounted read-only after an error, EIO) raised that OSError out of
    ``remove``, which answers faults with False, to the store's free. The reserve is now
    taken as not given back: the removal goes on in steps."""
    tier = _open(disk_dir, direct_io=False)
    try:
        index = tier._idx()
        slots = [b[1] for b in _persist(tier, make_block, [0, 1], 4096).values()]
        delete = index.delete
        tries: list[object] = []

        def full_once(rows: object) -> None:
            tries.append(rows)
            if len(tries) == 1:
                raise _sqlite_full()
            delete(rows)  # type: ignore[arg-type]

        unlink = Path.unlink

        def read_only(path: Path, missing_ok: bool = False) -> None:
            if path.name == RESERVE_NAME:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            unlink(path, missing_ok)

        monkeypatch.setattr(index, "delete", full_once)
        monkeypatch.setattr(Path, "unlink", read_only)
        assert tier.remove(slots)
        assert index.committed_slots(slots) == []
        assert (disk_dir / RESERVE_NAME).exists()
    finally:
        monkeypatch.undo()
        tier.close()


def test_regression_a_removal_committed_on_the_reserve_logged_that_the_delete_failed(
    disk_dir: Path,
    make_block: Block,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A removal on a full disk committed on the reserve records the full disk's fault, so
    the tier stays degraded by it; its log line said "index delete failed" though the rows
    were deleted. It now says the delete committed on the reserve; the health detail and
    counters are those of the fault as before."""
    tier = _open(disk_dir, direct_io=False)
    try:
        index = tier._idx()
        slots = [b[1] for b in _persist(tier, make_block, [0, 1], 4096).values()]
        delete = index.delete
        full = [_sqlite_full()]

        def full_once(rows: list[int]) -> None:
            if full:
                raise full.pop()
            delete(rows)

        monkeypatch.setattr(index, "delete", full_once)
        with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
            assert tier.remove(slots)
        assert index.committed_slots(slots) == []
        health = tier.health()
        assert health.state is Health.DEGRADED_NOSPACE
        assert health.detail.startswith("enospc: index delete: index: ")
        counters = tier.stats().counters
        assert (counters["removals_on_reserve"], counters["index_errors"]) == (1, 1)
        assert "failed" not in caplog.text
        assert f"L2 tier degraded: index delete committed on {RESERVE_NAME};" in caplog.text
    finally:
        monkeypatch.undo()
        tier.close()


@pytest.mark.parametrize("name", ["data-0000.bin", "data-0001.bin", "lock"])
def test_regression_a_link_planted_in_the_folder_is_not_followed(
    disk_dir: Path, tmp_path: Path, name: str
) -> None:
    """A symbolic link in the tier's folder where a data file or the lock goes (planted while
    the folder was open to others: `tiers.l2.path` in /tmp, made there by another user): the
    tier followed it, and preallocated, chmod-ed and would have written blocks into the file
    it named, anywhere (as root, any file). It now refuses to open it; the file is intact."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    (disk_dir / name).symlink_to(victim)
    # Refused (the lock), or opened with a file of its own in the link's place (a data file:
    # starting empty without an index, the tier makes its files afresh): either way, not
    # through the link.
    with contextlib.suppress(TierUnavailable, OSError):
        DiskTier(disk_dir, 16 * MiB, 1 * MiB, file_bytes=8 * MiB).close()
    assert victim.read_bytes() == b"precious"
    assert victim.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("name", ["index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm"])
def test_regression_an_index_file_that_is_a_link_is_not_followed(
    disk_dir: Path, tmp_path: Path, make_block: Block, name: str
) -> None:
    """A symbolic link where the index, its WAL or shared memory goes, planted after the
    checks at start: the tier opened the index through it (chmod-ing the file it named 0600,
    then moving the link aside as an unreadable index), and SQLite wrote its WAL through it.
    The open is now refused naming the link; the file it names is as it was."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    (disk_dir / name).symlink_to(victim)
    with pytest.raises(TierUnavailable, match=f"{disk_dir / name} is a symbolic link"):
        tier = _open(disk_dir)
        try:
            _persist(tier, make_block, [1], 4096)
        finally:
            tier.close()
    assert victim.read_bytes() == b"precious"
    assert victim.stat().st_mode & 0o777 == 0o644


def test_regression_an_l2_folder_of_another_user_is_refused(disk_dir: Path) -> None:
    """A folder made by another user (in /tmp, before the daemon): the tier set it 0700 and
    used it, but its owner may loosen it again and plant links where the index goes."""
    require_root()
    os.chown(disk_dir, NOBODY, NOGROUP)
    with pytest.raises(TierUnavailable, match=f"belongs to uid {NOBODY}.*chown"):
        _open(disk_dir).close()
    assert not (disk_dir / "index.sqlite3").exists()
    os.chown(disk_dir, 0, 0)
    _open(disk_dir).close()


def test_regression_an_index_read_that_failed_midway_let_the_slots_of_unread_rows_go(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index read failing after its first chunk (a disk error) ended recovery with the
    error and let the allocator hand out every slot without a read row, the unread rows'
    slots among them: a block written there would meet its slot's old row at the next start.
    What was read is served; the tier is degraded and allocates nothing until reopened."""
    with _open(disk_dir) as tier:
        _persist(tier, make_block, list(range(4)), 65_536)
    with _open(disk_dir, recover_later=True) as tier:
        rows = tier._index_rows

        def first_chunk_then_an_error(n: int) -> Iterator[list]:
            reading = rows(n)
            yield next(reading)
            reading.close()
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(tier, "_index_rows", first_chunk_then_an_error)
        got = RecoveredBlocks.concat(list(tier.recover_chunks(rows=1)))
        assert len(got) == 1
        assert not tier.allocator.can_allocate(65_536)
        assert tier.allocator.allocate(65_536) is None
        assert tier.health().state is not Health.OK


def test_regression_a_recovery_left_before_its_last_chunk_lets_no_slot_of_an_unread_row_go(
    disk_dir: Path, make_block: Block
) -> None:
    """The store leaves ``recover_chunks`` before its end when indexing a chunk raises (it logs
    that and serves what it indexed) or when it stops during recovery (the flush at stop then
    allocates). The generator's close ended recovery as if every row had been read: the
    allocator handed out the slots of the unread rows, and a block written there took the
    place of a durable one (its row replaced at the commit)."""
    with _open(disk_dir) as tier:
        blocks = _persist(tier, make_block, list(range(4)), 65_536)
    with _open(disk_dir, recover_later=True) as tier:
        chunks = tier.recover_chunks(rows=1)
        assert len(next(chunks)) == 1
        chunks.close()
        assert not tier.allocator.can_allocate(65_536)
        assert tier.allocator.allocate(65_536) is None
    with _open(disk_dir) as tier:
        assert len(tier.recover()) == 4
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}


def test_regression_a_transfer_refused_o_direct_while_another_falls_back_is_not_a_fault(
    disk_dir: Path, make_block: Block, faulty_files: FaultyFiles
) -> None:
    """A filesystem that refuses O_DIRECT transfers, and two runs of the first batch in flight
    on the O_DIRECT descriptors: the one refused after the other switched the tier to
    buffered I/O is tried again on the new descriptors, not failed (that failed its blocks
    and degraded the tier for good, as an I/O error)."""
    refused = threading.Barrier(2, timeout=10)
    calls = []
    lock = threading.Lock()

    def refuse_direct(fd: int, offset: int) -> None:
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            return
        with lock:
            calls.append(offset)
            n = len(calls)
        if n <= 2:
            refused.wait()  # both transfers are in flight on the O_DIRECT descriptors
        if n == 2:
            # Refused once the other's refusal switched the tier over.
            give_up = time.monotonic() + 10
            while tier.files.direct and time.monotonic() < give_up:
                time.sleep(0.001)
        raise OSError(errno.EINVAL, "Invalid argument")

    with _open(disk_dir, backend=faulty_files) as tier:
        faulty_files.faults["pwritev"] = refuse_direct
        items = _items(tier, make_block, list(range(8)), MiB)
        outcomes = persist(tier, items)
        assert len(calls) >= 2
        assert not tier.direct_io
        assert tier.health().state is Health.OK, tier.health()
        assert all(o.ok for o in outcomes)


def test_regression_a_write_that_went_down_before_a_failed_sync_of_its_file_is_not_durable(
    disk_dir: Path, faulty_files: FaultyFiles
) -> None:
    """A write whose bytes reached a data file while another group's fdatasync of that file
    was under way, a sync that then failed as the disk was full (ENOSPC: the tier takes
    writes again once space returns). The kernel reports a writeback error to a descriptor
    once: the write's own sync of the file, in the next group, succeeds though its pages may
    have been in the writeback that failed. It was committed and reported durable; it is a
    failed write, with no row."""
    tier = _open(disk_dir, direct_io=False, backend=faulty_files)
    nbytes = 64 * 1024
    slots = [tier.allocator.allocate(nbytes) for _ in range(2)]
    assert tier.slot_location(slots[0])[0] == tier.slot_location(slots[1])[0]
    in_sync, written = threading.Event(), threading.Event()
    syncs = []

    def first_sync_fails(fd: int) -> None:
        syncs.append(fd)
        if len(syncs) == 1:  # the leader's: held until the other write's bytes are down
            in_sync.set()
            assert written.wait(10)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def note_written(fd: int, offset: int) -> None:
        if in_sync.is_set():
            written.set()

    faulty_files.faults["fdatasync"] = first_sync_fails
    data = [os.urandom(nbytes) for _ in range(2)]
    refs = [BlockRef(1, os.urandom(32)) for _ in range(2)]

    def write(i: int) -> bool:
        batch = WriteBatch([slots[i]], [refs[i]], nbytes, HostBuffers([memoryview(data[i])]))
        return bool(tier.write(batch)[0].ok)

    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(write, 0)
        assert in_sync.wait(10)
        faulty_files.faults["pwritev"] = note_written
        follower = pool.submit(write, 1)
        ok = [leader.result(), follower.result()]
    assert len(syncs) == 2  # the follower's own sync, which succeeded
    assert ok == [False, False]
    tier.close()
    with _open(disk_dir) as again:
        assert len(again.recover()) == 0


def test_regression_a_write_let_through_to_a_locked_index_waited_out_the_busy_timeout(
    disk_dir: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write batch a tier degraded by a locked index lets through each enospc_retry_s
    (to find out whether the lock was let go) waited out the busy timeout (30 s) for the
    lock, holding up the put whose demotion sent it (c91f33b has every demotion send it):
    with the lock kept, puts that made room in L1 took 30 s, one after the other. It tries
    the lock once: still held, the batch fails at once and the tier stays degraded."""
    monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 0.2)
    with _open(disk_dir, enospc_retry_s=0.1) as tier:
        with _locked_index(tier, disk_dir, make_block) as other:
            monkeypatch.setattr(index_module, "BUSY_TIMEOUT_S", 3600.0)
            with tier._idx().held():  # not between the watch's setting and its reset
                tier._idx()._conn().execute("PRAGMA busy_timeout = 3600000")
            time.sleep(0.2)
            assert tier.health().retry_due
            key, data = make_block(2, 4096)
            slot = tier.allocator.allocate(4096)
            assert slot is not None
            probe = threading.Thread(
                target=persist, args=(tier, [PersistItem(2, key, slot, data, 4096)])
            )
            probe.start()
            probe.join(20)  # it waited an hour before
            assert not probe.is_alive()
            health = tier.health()
            assert health.state == Health.DEGRADED_IO and "locked" in health.detail
            other.execute("ROLLBACK")
        time.sleep(0.2)
        blocks = _persist(tier, make_block, [3], 4096)
        assert tier.health().state == Health.OK
        assert _read(tier, blocks) == {i: b[2] for i, b in blocks.items()}
