"""L2 on a filesystem that runs out of space: a real one, a 48 MiB ext4 image loop-mounted for
the test (skipped, with the reason, where the sandbox cannot mount one).

The data files are preallocated, so a full disk shows first where the tier still needs new
blocks: the index's write-ahead log. That is also what happens in production when something
else fills the disk under a running daemon."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from disk_faults import FaultyFiles, fill_disk
from disk_writes import PersistItem, persist
from races import ContendedLock, wait_for

from kvtier.tiers.base import Health, TierUnavailable, WriteOutcome
from kvtier.tiers.disk import DiskTier, ReadItem
from kvtier.tiers.disk.index import DiskIndex
from kvtier.tiers.disk.io import Block as IoBlock
from kvtier.tiers.disk.tier import RESERVE_BYTES, RESERVE_NAME, space_needed

MiB = 1 << 20
Block = Callable[[int, int], tuple[bytes, bytes]]


def test_capacity_beyond_the_filesystem_is_refused(small_fs: Path) -> None:
    with pytest.raises(TierUnavailable, match=r"cannot hold tiers\.l2\.capacity_bytes") as e:
        DiskTier(small_fs / "l2", 64 * MiB, 1 * MiB)
    assert "there, or set a smaller tiers.l2.capacity_bytes" in str(e.value)
    assert "1 MiB for the index, its reserve and the lock)" in str(e.value)
    assert not list((small_fs / "l2").glob("data-*"))


def _stopped_on_a_full_disk(
    small_fs: Path, make_block: Block, crashed: bool
) -> tuple[Path, list[PersistItem], list[int]]:
    """A 16 MiB tier in ``small_fs / "l2"`` holding 40 blocks, stopped (closed, or as a SIGKILL
    leaves it, its WAL and shared memory there), then the disk filled. Returns the folder, the
    blocks and their checksums."""
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB)
    items = _allocate(tier, make_block, 0, 40)
    outs = persist(tier, items)
    assert all(o.ok for o in outs)
    if crashed:
        _crash_copy(directory, small_fs / "killed")
        tier.close()
        shutil.rmtree(directory)
        (small_fs / "killed").rename(directory)
    else:
        tier.close()
    fill_disk(small_fs / "filler")
    return directory, items, [o.checksum for o in outs]


@pytest.mark.parametrize("crashed", [False, True], ids=["stopped", "killed"])
def test_regression_a_restart_on_a_disk_filled_while_stopped_was_refused(
    small_fs: Path, make_block: Block, crashed: bool
) -> None:
    """A disk filled while the daemon was stopped (the data files all allocated, the index
    short of the 1 MiB kept for it) refused the start (TierUnavailable: the daemon exited 1,
    a crash loop under a service manager), for room only L2's writes need. The tier now
    starts degraded by the full disk, serving its blocks and refusing writes, until a write
    let through finds room; after a clean stop (no -shm left, which the index's open must
    make) by giving its reserve back for the open."""
    directory, items, sums = _stopped_on_a_full_disk(small_fs, make_block, crashed)
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)
    health = tier.health()
    assert health.state is Health.DEGRADED_NOSPACE
    assert re.search(r"short of the 1 MiB kept for the index.*: free \d\.\d\d MiB", health.detail)
    assert {r.key for r in tier.recover()} == {it.key for it in items}
    bufs = [bytearray(4096) for _ in items]
    reads = [
        ReadItem(it.slot, buf, 4096, c, it.key)
        for it, buf, c in zip(items, bufs, sums, strict=True)
    ]
    assert all(tier.read_items(reads))
    assert [bytes(b) for b in bufs] == [it.data for it in items]
    assert not list(directory.glob("*corrupt*"))
    more = _allocate(tier, make_block, 40, 41)
    (small_fs / "filler").unlink()
    assert persist(tier, more)[0].ok
    assert tier.health().state is Health.OK
    assert (directory / RESERVE_NAME).stat().st_blocks * 512 >= RESERVE_BYTES
    tier.close()


def test_regression_an_index_opened_on_a_full_disk_was_moved_aside(
    small_fs: Path, make_block: Block
) -> None:
    """An index whose open found no room (SQLite's shared memory file, which the first
    connection after a clean stop makes: SQLITE_IOERR_SHMSIZE) was taken for one SQLite
    cannot read, moved aside, and every block it held lost. Without the reserve to give back
    for that room, the start is now refused, naming the room to free, the index kept."""
    directory, items, _ = _stopped_on_a_full_disk(small_fs, make_block, crashed=False)
    (directory / RESERVE_NAME).unlink()
    fill_disk(small_fs / "filler2")
    with pytest.raises(TierUnavailable, match=r"cannot open the L2 index .*free \d") as e:
        DiskTier(directory, 16 * MiB, 1 * MiB)
    assert f"no {RESERVE_NAME} is left to give back" in str(e.value)
    assert not list(directory.glob("*corrupt*"))
    (small_fs / "filler").unlink()
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in items}
        assert tier.health().state is Health.OK


def test_regression_a_new_index_that_found_no_room_was_moved_aside_in_place_of_the_damaged_one(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged index (no database) on a full disk: moved aside, and the new index made in
    its place found no room. Its file was left, empty; the open tried again with the reserve
    given back took it for a damaged index and moved it aside in turn, a second ERROR, and
    the tier's health and ``index_moved_aside`` named that empty file and "no metadata", not
    the index moved aside and why. The new index's file is now removed where it could not be
    made, and the index moved aside first is reported."""
    directory = small_fs / "l2"
    DiskTier(directory, 16 * MiB, 1 * MiB).close()
    (directory / "index.sqlite3").write_bytes(os.urandom(64 << 10))
    fill_disk(small_fs / "filler")
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
        tier = DiskTier(directory, 16 * MiB, 1 * MiB)
    with tier:
        [aside] = [p.name for p in directory.glob("index.sqlite3.corrupt-*")]
        moved = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
        assert len(moved) == 1 and "SQLITE_NOTADB" in moved[0] and aside in moved[0], moved
        assert tier.stats().counters["index_moved_aside"] == 1
        assert "cannot be read (index: SQLITE_NOTADB" in tier.health().detail
        assert f"moved aside as {aside}" in tier.health().detail
    (small_fs / "filler").unlink()
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert tier.health().state is Health.OK and len(tier.recover()) == 0
        assert [p.name for p in directory.glob("index.sqlite3.corrupt-*")] == [aside]


def test_regression_a_new_index_made_after_the_reserve_was_given_back_recorded_no_index_found(
    small_fs: Path,
) -> None:
    """A damaged index on a full disk: moved aside, the new index found no room, the reserve
    was given back and the open tried again, which made the new index. That start said the
    index was moved aside, but the new index's record of why it was made empty (``MADE_EMPTY``,
    said by each start until a block commits) was the second open's, which had found no index
    at all: "no index was found", the file moved aside and why unnamed. It now names them."""
    directory = small_fs / "l2"
    DiskTier(directory, 16 * MiB, 1 * MiB).close()
    (directory / "index.sqlite3").write_bytes(os.urandom(64 << 10))
    fill_disk(small_fs / "filler")
    DiskTier(directory, 16 * MiB, 1 * MiB).close()  # moved aside, then made on the reserve
    [aside] = [p.name for p in directory.glob("index.sqlite3.corrupt-*")]
    (small_fs / "filler").unlink()
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        detail = tier.health().detail
        assert "index made empty by an earlier start" in detail, detail
        assert "cannot be read (index: SQLITE_NOTADB" in detail, detail
        assert f"moved aside as {aside}" in detail, detail
        assert "no index was found" not in detail, detail


def test_regression_a_start_refused_after_moving_a_damaged_index_aside_said_nothing_of_it(
    small_fs: Path,
) -> None:
    """A damaged index (no database) on a full disk with no reserve left to give back: it was
    moved aside, the new index found no room, and the start was refused as for any full disk,
    "cannot open the L2 index ... free 0.99 MiB there, then restart", nothing saying that the
    index was gone (README: a refused start keeps the index as it was); the next start then
    reported only an index missing beside its data files. The refusal now names the index
    moved aside, why, and that the next start begins empty."""
    directory = small_fs / "l2"
    DiskTier(directory, 16 * MiB, 1 * MiB).close()
    (directory / "index.sqlite3").write_bytes(os.urandom(64 << 10))
    (directory / RESERVE_NAME).unlink()
    fill_disk(small_fs / "filler")
    with pytest.raises(TierUnavailable, match=r"no index\.reserve is left to give back") as e:
        DiskTier(directory, 16 * MiB, 1 * MiB)
    [aside] = [p.name for p in directory.glob("index.sqlite3.corrupt-*")]
    assert "cannot be read (index: SQLITE_NOTADB" in str(e.value), str(e.value)
    assert f"moved aside as {aside}" in str(e.value), str(e.value)


def test_regression_an_index_opened_out_of_inodes_was_moved_aside(
    small_fs: Path, make_block: Block
) -> None:
    """A filesystem out of inodes after a clean stop: SQLite could not make the index's WAL
    (SQLITE_CANTOPEN), which DiskIndex took for an index it cannot read: moved aside, every
    block it held lost, and the new index's own file then ended the start with a raw OSError
    (ENOSPC). The WAL's files are now made before SQLite opens the index, a full disk (ENOSPC)
    where there is no inode: the reserve given back for it, then the start refused, naming
    the inodes, the index kept."""
    directory, items, _ = _stopped_on_a_full_disk(small_fs, make_block, crashed=False)
    (small_fs / "filler").unlink()  # room enough: only the inodes run out
    inodes = _use_up_inodes(small_fs / "inodes")
    with pytest.raises(TierUnavailable, match=r"cannot open the L2 index .*ENOSPC.*df -i"):
        DiskTier(directory, 16 * MiB, 1 * MiB)
    assert not list(directory.glob("*corrupt*"))
    shutil.rmtree(inodes)
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in items}
        assert tier.health().state is Health.OK


def _use_up_inodes(folder: Path) -> Path:
    """Empty files in ``folder`` until the filesystem has no inode left; returns ``folder``."""
    folder.mkdir()
    n = 0
    while True:
        try:
            (folder / str(n)).touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC
            return folder
        n += 1


def test_disk_full_degrades_keeps_serving_reads_and_recovers(
    small_fs: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)
    blocks = {}
    for start in range(0, 64, 16):
        items = []
        for i in range(start, start + 16):
            key, data = make_block(i, 65_536)
            slot = tier.allocator.allocate(65_536)
            assert slot is not None
            items.append(PersistItem(1, key, slot, data, 65_536))
        outs = persist(tier, items)
        assert all(o.ok for o in outs)
        blocks.update({it.key: (it, o.checksum) for it, o in zip(items, outs, strict=True)})

    filler = small_fs / "filler"
    fill_disk(filler)
    failed_at = None
    pending: list[int] = []
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.disk"):
        for attempt in range(50):
            key, data = make_block(1000 + attempt, 65_536)
            slot = tier.allocator.allocate(65_536)
            assert slot is not None
            out = persist(tier, [PersistItem(1, key, slot, data, 65_536)])  # never raises
            if not out[0].ok:
                failed_at = attempt
                pending.append(slot)
                break
            blocks[key] = (PersistItem(1, key, slot, data, 65_536), out[0].checksum)
        assert failed_at is not None, "the disk never filled up"
        assert tier.health().state is Health.DEGRADED_NOSPACE
        # Further writes fail too (each retry meets a full disk), quietly.
        for attempt in range(5):
            key, data = make_block(2000 + attempt, 65_536)
            slot = tier.allocator.allocate(65_536)
            assert slot is not None
            pending.append(slot)
            assert not persist(tier, [PersistItem(1, key, slot, data, 65_536)])[0].ok
    assert len([r for r in caplog.records if "degraded" in r.getMessage()]) == 1
    stats = tier.stats()
    assert stats.counters["enospc"] >= 2
    assert stats.health.state is Health.DEGRADED_NOSPACE

    # Everything committed before the disk filled is still served.
    def read_all(t: DiskTier) -> list[bool]:
        bufs = {k: bytearray(65_536) for k in blocks}
        ok = t.read_items(
            [ReadItem(it.slot, bufs[k], 65_536, c, k) for k, (it, c) in blocks.items()]
        )
        assert all(bufs[k] == it.data for k, (it, _) in blocks.items() if ok)
        return ok

    assert all(read_all(tier))

    # Space comes back: the next write probes, succeeds and the tier is ok again.
    filler.unlink()
    tier.remove(pending)
    key, data = make_block(3000, 65_536)
    slot = tier.allocator.allocate(65_536)
    assert slot is not None
    out = persist(tier, [PersistItem(1, key, slot, data, 65_536)])
    assert out[0].ok, tier.health()
    assert tier.health().state is Health.OK
    blocks[key] = (PersistItem(1, key, slot, data, 65_536), out[0].checksum)
    tier.close()

    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert {r.key for r in tier.recover()} == set(blocks)
        assert all(read_all(tier))


def _crash_copy(directory: Path, to: Path) -> Path:
    """The files of the open tier in ``directory`` as a SIGKILL would leave them (the
    process gone, its committed pages in the index and its WAL), copied to ``to``."""
    to.mkdir(mode=0o700)
    for path in directory.iterdir():
        if path.is_file():
            shutil.copyfile(path, to / path.name)
            os.chmod(to / path.name, 0o600)
    return to


def _allocate(tier: DiskTier, make_block: Block, start: int, stop: int) -> list[PersistItem]:
    items = []
    for i in range(start, stop):
        key, data = make_block(i, 4096)
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        items.append(PersistItem(1, key, slot, data, 4096))
    return items


def _filled(
    tier: DiskTier, small_fs: Path, make_block: Block, rows: int, **options: float
) -> tuple[DiskTier, list[PersistItem]]:
    """``rows`` blocks committed to ``tier`` (a 16 MiB tier in ``small_fs / "l2"``), all in the
    index file; the tier opened again (``enospc_retry_s=0.0``, or ``options``), the disk
    filled and more blocks written until the WAL can grow no more. Returns the tier and the
    blocks committed."""
    items = _allocate(tier, make_block, 0, rows)
    for start in range(0, rows, 250):
        assert all(o.ok for o in persist(tier, items[start : start + 250]))
    tier.close()  # checkpoints: the index file holds every page
    options.setdefault("enospc_retry_s", 0.0)
    tier = DiskTier(small_fs / "l2", 16 * MiB, 1 * MiB, **options)
    tier.recover()
    items += _allocate(tier, make_block, rows, rows + 200)
    fill_disk(small_fs / "filler")
    kept = items[:rows]
    for it in items[rows:]:  # writes until the WAL can grow no more
        if not persist(tier, [it])[0].ok:
            assert tier.remove([it.slot])  # no row: nothing to commit
            break
        kept.append(it)
    assert tier.health().state is Health.DEGRADED_NOSPACE
    return tier, kept


def test_regression_a_delete_on_a_full_disk_came_back_after_a_crash(
    small_fs: Path, make_block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk the index could not commit a removal (SQLITE_FULL: its WAL had no room
    to grow), so ``remove`` failed, the daemon answered the Delete and deferred the free, and
    a SIGKILL before space came back served the deleted blocks again. The tier now keeps a
    reserve file beside its index and gives it back to commit a removal, in steps where one
    transaction would not fit (here 1,000 rows spread over the table: ~160 KiB of WAL in one,
    the reserve made 64 KiB); it is made again once a write commits with space back. The
    deletion's commit on the reserve fails without the fix, and in one transaction."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    directory = small_fs / "l2"
    reserve = directory / RESERVE_NAME
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)
    assert reserve.stat().st_blocks * 512 >= 64 << 10

    tier, kept = _filled(tier, small_fs, make_block, 2000)
    deleted = kept[::2]
    assert tier.remove([it.slot for it in deleted]), tier.health()
    assert not reserve.exists()
    assert tier.stats().counters["removals_on_reserve"] == 1
    # A later removal commits too, the reserve spent: in the room the WAL's file took.
    assert tier.remove([it.slot for it in kept[1::4]]), tier.health()
    crashed = _crash_copy(directory, tmp_path / "crashed")
    with DiskTier(crashed, 16 * MiB, 1 * MiB) as copy:
        assert {r.key for r in copy.recover()} == {it.key for it in kept[3::4]}

    # Space comes back: the next write commits and the reserve is made again.
    (small_fs / "filler").unlink()
    key, data = make_block(5000, 4096)
    slot = tier.allocator.allocate(4096)
    assert slot is not None
    assert persist(tier, [PersistItem(1, key, slot, data, 4096)])[0].ok, tier.health()
    assert tier.health().state is Health.OK
    assert reserve.stat().st_blocks * 512 >= 64 << 10  # made by that write's commit
    tier.close()
    assert reserve.stat().st_blocks * 512 >= 64 << 10


def _remove_after(
    tier: DiskTier,
    monkeypatch: pytest.MonkeyPatch,
    slots: list[int],
    meanwhile: Callable[[], object],
) -> bool:
    """``tier.remove(slots)`` on a full disk, with ``meanwhile`` started on a thread of its
    own once the reserve is given back, and the removal trying again once that thread waits
    for the index or has ended; the thread is waited for."""
    retry = tier._delete_unless_full
    threads: list[threading.Thread] = []
    moved = threading.Event()
    monkeypatch.setattr(tier._idx(), "_lock", ContendedLock(moved, reentrant=True))

    def run() -> None:
        try:
            meanwhile()
        finally:
            moved.set()

    def meanwhile_first(rows: list[int]) -> bool:
        thread = threading.Thread(target=run)
        threads.append(thread)
        thread.start()
        moved.wait()
        return retry(rows)

    monkeypatch.setattr(tier, "_delete_unless_full", meanwhile_first)
    removed = tier.remove(slots)
    for thread in threads:
        thread.join()
    assert threads
    return removed


def test_regression_the_reserve_made_again_during_a_removal_took_back_its_room(
    small_fs: Path, make_block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal on a full disk gave the reserve back, then committed; in between, a write
    committed in the room given back had an I/O thread make the reserve again, which took
    the room back: the removal found none, failed, the Delete was answered with its rows
    kept, and a crash served them again. The reserve is now made only by a write's commit,
    holding the index, which the removal holds from the give-back to its commit: the write
    that would make it again waits for the removal."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)

    tier, kept = _filled(tier, small_fs, make_block, 400)
    written = _allocate(tier, make_block, 1000, 1001)

    removed = _remove_after(
        tier,
        monkeypatch,
        [it.slot for it in kept[::2]],
        lambda: persist(tier, written),
    )
    assert removed, tier.health()
    with DiskTier(_crash_copy(directory, tmp_path / "crashed"), 16 * MiB, 1 * MiB) as copy:
        recovered = {r.key for r in copy.recover()}
    assert recovered - {written[0].key} == {it.key for it in kept[1::2]}
    tier.close()


def test_regression_writes_committed_in_the_room_a_removal_gave_back(
    small_fs: Path, make_block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal on a full disk gave the reserve back, then committed; in between, writes'
    commits grew the index's WAL into the room given back, the removal found none left even
    for its steps, failed, and the Delete was answered with its rows kept. The removal now
    holds the index from the give-back to its commit: the writes commit after it."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)
    tier, kept = _filled(tier, small_fs, make_block, 400)
    later = _allocate(tier, make_block, 1000, 2000)

    def write_until_full() -> None:
        for start in range(0, len(later), 16):
            if not all(o.ok for o in persist(tier, later[start : start + 16])):
                return

    deleted = kept[::2]
    removed = _remove_after(tier, monkeypatch, [it.slot for it in deleted], write_until_full)
    assert removed, tier.health()
    with DiskTier(_crash_copy(directory, tmp_path / "crashed"), 16 * MiB, 1 * MiB) as copy:
        assert not {r.key for r in copy.recover()} & {it.key for it in deleted}
    tier.close()


def test_regression_a_start_growing_the_data_files_lost_their_room_to_the_reserve(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An index past the 1 MiB kept for the tier's other files (its room held, so the space
    check counts none for them) without a reserve (made before it, or given back on a full
    disk), and a start that grows the capacity with room for the data files but not for the
    reserve too: the reserve was made before the data files, took their room, and the start
    failed although the check passed. The data files now come first; the reserve stays
    missing, with a warning."""
    directory = small_fs / "l2"
    with DiskTier(directory, 8 * MiB, 1 * MiB) as tier:
        tier._idx().remember(1, "x" * (1 << 20))
    (directory / RESERVE_NAME).unlink()
    need = space_needed(directory, 16 * MiB, 1 * MiB)
    filler = small_fs / "filler"
    fill_disk(filler)
    with open(filler, "r+b") as f:
        f.truncate(os.fstat(f.fileno()).st_size - need - (128 << 10))
        os.fsync(f.fileno())
    with (
        caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"),
        DiskTier(directory, 16 * MiB, 1 * MiB) as tier,
    ):
        assert tier.allocator.capacity_bytes == 16 * MiB
    assert not (directory / RESERVE_NAME).exists()
    assert "cannot make" in caplog.text


def test_regression_a_remake_of_the_reserve_without_room_for_it_took_the_disks_last_blocks(
    small_fs: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With less than the reserve free (given back by a removal on a full disk), every write's
    commit had an I/O thread try to make it again: its fallocate took the disk's last free
    blocks, failed, and kept them until the file was unlinked, so an allocation meanwhile (a
    write's WAL growth: SQLITE_FULL) found no room. The free space is read first now; the
    reserve stays missing until it fits, and is made at the next commit then; a write does
    not commit meanwhile (the room left is the removals')."""
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, io_threads=1, enospc_retry_s=0.0)
    try:
        assert tier._give_back_reserve()
        filler = small_fs / "filler"
        fill_disk(filler)
        with open(filler, "r+b") as f:
            f.truncate(os.fstat(f.fileno()).st_size - (128 << 10))
            os.fsync(f.fileno())
        fallocate = os.posix_fallocate
        starved: list[str] = []  # what a page's allocation found while a remake failed

        def failing_remake(fd: int, offset: int, length: int) -> None:
            try:
                fallocate(fd, offset, length)
            except OSError:
                probe = os.open(small_fs / "probe", os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    fallocate(probe, 0, 4096)
                except OSError as e:
                    starved.append(e.strerror or "")
                finally:
                    os.close(probe)
                    os.unlink(small_fs / "probe")
                raise

        monkeypatch.setattr(os, "posix_fallocate", failing_remake)
        items = _allocate(tier, make_block, 0, 2)
        assert not persist(tier, items[:1])[0].ok
        assert starved == []
        assert not (directory / RESERVE_NAME).exists()

        filler.unlink()
        os.sync()
        assert persist(tier, items[1:])[0].ok
        assert (directory / RESERVE_NAME).stat().st_blocks * 512 >= RESERVE_BYTES
    finally:
        tier.close()


def test_regression_a_removal_after_one_committed_whole_on_the_reserve_failed(
    small_fs: Path, make_block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal on a full disk that fit the reserve in one transaction left the index's WAL
    holding its pages (the WAL is restarted only between steps), so the next removal, the
    reserve spent, appended its first step past the room given back and failed: the Delete
    was answered with its rows kept, served again after a crash. Each step now restarts the
    WAL before it writes, so the next removal reuses the room the first one took. The
    reserve is kept at its 64 KiB, not grown for the index's growth (to 1 MiB: the second
    removal would fit it whole)."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    monkeypatch.setattr(DiskIndex, "growth_bytes", lambda _: 0)
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)
    tier, kept = _filled(tier, small_fs, make_block, 2000)
    steps: list[int] = []
    in_steps = tier._idx().delete_in_steps
    monkeypatch.setattr(
        tier._idx(), "delete_in_steps", lambda s, n: (steps.append(len(s)), in_steps(s, n))
    )
    first, second = kept[::250], kept[3::40]
    assert tier.remove([it.slot for it in first]), tier.health()
    assert steps == []  # committed whole on the reserve
    assert tier.remove([it.slot for it in second]), tier.health()
    assert steps == [len(second)]
    assert tier.stats().counters["removals_on_reserve"] == 2
    gone = {it.key for it in first + second}
    with DiskTier(_crash_copy(directory, tmp_path / "crashed"), 16 * MiB, 1 * MiB) as copy:
        assert {r.key for r in copy.recover()} == {it.key for it in kept} - gone
    tier.close()


def test_regression_writes_after_a_removal_on_the_reserve_took_the_next_removals_room(
    small_fs: Path, make_block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal on a full disk gave the reserve back and committed; the writes that came
    after it committed in the room left (a commit is how a full disk is found cleared) until
    the index's WAL could grow no more, the reserve still missing (no room to make it), so
    the next removal found no room even for its steps, failed, and its Delete was answered
    with its rows kept: a crash served them again (35 of a delete storm's keys, beside
    writes, in a daemon). While the reserve is missing a write commits only once it is
    made again: the room left stays the removals'."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)
    tier, kept = _filled(tier, small_fs, make_block, 400)
    # Few rows removed and the writes in batches (group commits, as a daemon's): the rows
    # written need index pages beyond the index file's end, so the WAL's restart before the
    # next removal's first step has no room to grow the file to hold them. The writes of a
    # row each into the room of 200 removed rows fit the file, and the removal then passed
    # without the fix.
    assert tier.remove([it.slot for it in kept[::8]]), tier.health()
    later = _allocate(tier, make_block, 1000, 1400)
    for start in range(0, len(later), 16):  # until refused: the room left is the removals'
        if not all(o.ok for o in persist(tier, later[start : start + 16])):
            break
    deleted = kept[1::4]
    assert tier.remove([it.slot for it in deleted]), tier.health()
    with DiskTier(_crash_copy(directory, tmp_path / "crashed"), 16 * MiB, 1 * MiB) as copy:
        assert not {r.key for r in copy.recover()} & {it.key for it in deleted}
    tier.close()


def _removals_after_growth(small_fs: Path, make_block: Block, tmp_path: Path) -> None:
    """2,000 rows committed since the index's last checkpoint (37 pages of growth, about
    150 KiB), the disk filled, blocks written until the WAL can grow no more, then 118
    removals of one row each: each must commit, and a crash copy then holds exactly the
    blocks not removed."""
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0)
    items = _allocate(tier, make_block, 0, 2000)
    for start in range(0, len(items), 250):
        assert all(o.ok for o in persist(tier, items[start : start + 250]))
    fill_disk(small_fs / "filler")
    kept = list(items)
    for it in _allocate(tier, make_block, 2000, 2200):  # writes until the WAL can grow no more
        if not persist(tier, [it])[0].ok:
            assert tier.remove([it.slot])
            break
        kept.append(it)
    assert tier.health().state is Health.DEGRADED_NOSPACE
    gone = kept[::17][:120]
    failed = [n for n, it in enumerate(gone) if not tier.remove([it.slot])]
    assert failed == [], f"{len(failed)} of {len(gone)} removals failed, the first #{failed[0]}"
    with DiskTier(_crash_copy(directory, tmp_path / "crashed"), 16 * MiB, 1 * MiB) as copy:
        assert {r.key for r in copy.recover()} == {it.key for it in kept} - {it.key for it in gone}
    tier.close()


def test_regression_removals_on_a_disk_filled_while_the_index_grew_in_its_wal_failed(
    small_fs: Path, make_block: Block, tmp_path: Path
) -> None:
    """The crash campaign's full-disk series (seed 6101, round 3): deleted blocks came back
    after a SIGKILL. The disk filled while the WAL held the index's growth since its last
    checkpoint (a tier filling up: here 37 pages, the index file one). The first removal
    committed whole in the reserve's room, the next ones appended to the WAL in the room
    left, and once it was spent the WAL's restart before a step had to grow the index file
    to hold those pages and found no room: every removal after that failed (its Delete
    answered, its rows kept). The WAL now restarts on the room given back first."""
    _removals_after_growth(small_fs, make_block, tmp_path)


def test_regression_removals_on_a_full_disk_failed_where_the_index_grew_past_the_reserve(
    small_fs: Path, make_block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the WAL held more of the index's growth since its last checkpoint than the
    reserve (SQLite checkpoints on its own only once the WAL holds 4 MiB; the reserve is
    256 KiB), the WAL's restart on the room a removal on a full disk gave back could not
    grow the index file to hold it: every removal failed, its Delete answered with its rows
    kept, served again after a crash. The reserve is now grown, before a write commits, to
    hold that growth and half its size more. Here the reserve is 64 KiB and the growth
    150 KiB: without its growth every removal fails."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    _removals_after_growth(small_fs, make_block, tmp_path)


def _grow_by_quarantine(tier: DiskTier, disk_dir: Path) -> None:
    """The reads of 2,000 blocks failed (one batch's), each quarantined with a reason of the
    200 characters the index keeps: some 500 KiB of index pages."""
    failed = []
    for pos in range(2000):
        slot = tier.allocator.allocate(4096)
        assert slot is not None
        failed.append(IoBlock(pos, slot, 0, 0, 4096, 4096, None, False, error="E" * 200))
    tier._quarantine(failed)


def _grow_by_namespace_records(tier: DiskTier, disk_dir: Path) -> None:
    """2,000 namespaces bound while another process held the index locked (their records
    kept), the lock let go, one more bound: its commit makes all 2,001, some 200 KiB."""
    other = sqlite3.connect(disk_dir / "index.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    label = "tenant:" + "t" * 64
    for ns in range(1, 2001):
        tier.remember_namespace(ns, label)
    other.execute("ROLLBACK")
    other.close()
    tier.remember_namespace(2001, label)
    assert len(tier.namespaces()) == 2001


def _grow_by_removals_journal(tier: DiskTier, disk_dir: Path) -> None:
    """A Delete of 4,096 blocks while L3 was down: its removals journaled in the index, keys
    of 92 bytes (a 20-character namespace token), some 500 KiB."""
    keys = [b"kvtier:" + b"t" * 20 + b":" + os.urandom(32).hex().encode() for _ in range(4096)]
    assert tier.record_removals([(k, None) for k in keys], [])


@pytest.mark.parametrize(
    "grow", [_grow_by_quarantine, _grow_by_namespace_records, _grow_by_removals_journal]
)
def test_regression_removals_on_a_full_disk_failed_after_commits_the_reserve_did_not_see(
    small_fs: Path,
    make_block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    grow: Callable[[DiskTier, Path], None],
) -> None:
    """The reserve's growth (6c27efc) is checked before a write's commit only: a quarantine,
    namespace records or the L3 removals journal committed without it grew the index past
    the reserve (here 64 KiB) while the disk had room; once it filled, the WAL's restart on
    the room a removal gave back could not grow the index file to hold that growth, and
    removals failed, their Deletes answered with their rows kept (served again after a
    crash). Each of these commits now grows the reserve first where it fits: the quarantine
    and the records are not committed where it does not (a record is kept for the next
    commit; a quarantine is held in memory); the journal, a Delete's own record, is."""
    monkeypatch.setattr("kvtier.tiers.disk.index.BUSY_TIMEOUT_S", 0.2)
    tier, kept = _reserve_of_64_kib(small_fs, make_block, monkeypatch)
    grow(tier, small_fs / "l2")
    _removals_commit_on_a_full_disk(tier, kept, small_fs, tmp_path)


def _reserve_of_64_kib(
    small_fs: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> tuple[DiskTier, list[PersistItem]]:
    """A tier in ``small_fs / "l2"`` whose reserve is 64 KiB (so that an index's growth soon
    outgrows it), with 16 blocks committed; returns it and them."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    tier = DiskTier(small_fs / "l2", 16 * MiB, 1 * MiB, enospc_retry_s=0.0, **options)
    kept = _allocate(tier, make_block, 0, 16)
    assert all(o.ok for o in persist(tier, kept))
    return tier, kept


def _removals_commit_on_a_full_disk(
    tier: DiskTier, kept: list[PersistItem], small_fs: Path, tmp_path: Path
) -> None:
    """Fill the disk, then remove each of ``kept`` on its own: every removal must commit,
    and a crash then bring none back. Closes ``tier``."""
    fill_disk(small_fs / "filler")
    failed = [n for n, it in enumerate(kept) if not tier.remove([it.slot])]
    assert failed == [], f"{len(failed)} of {len(kept)} removals failed, the first #{failed[0]}"
    with DiskTier(_crash_copy(tier.directory, tmp_path / "crashed"), 16 * MiB, 1 * MiB) as copy:
        assert len(copy.recover()) == 0
    tier.close()


def test_regression_removals_on_a_full_disk_failed_after_a_release_quarantined_its_slots_again(
    small_fs: Path,
    make_block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty_files: FaultyFiles,
) -> None:
    """A release of quarantined slots records why each whose check failed stays held (its
    quarantine row made again with that reason, up to 200 characters): the one quarantine
    commit that 9fc4b3c left without the reserve's growth check. 1,000 slots whose extents
    failed their write again grew the index past the reserve (here 64 KiB, grown in steps of
    64 KiB) while the disk had room; once it filled, 15 of 16 removals failed, their Deletes
    answered with their rows kept (served again after a crash). The record now grows the
    reserve first, as a read's quarantine does (refused where it cannot: the slots stay held,
    their rows as they were)."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_GROWTH_STEP_BYTES", 64 << 10)
    tier, kept = _reserve_of_64_kib(small_fs, make_block, monkeypatch, backend=faulty_files)
    held = [tier.allocator.allocate(4096) for _ in range(1000)]
    tier._quarantine(
        [IoBlock(n, s, 0, 0, 4096, 4096, None, False, "E") for n, s in enumerate(held)]
    )

    def failing(*_: object) -> None:
        raise OSError(errno.EIO, "E" * 200)

    faulty_files.faults["pwritev"] = failing
    assert tier.release_quarantined().released == []
    faulty_files.clear()
    assert {q.reason[:20] for q in tier.quarantined()} == {"release: write: EIO:"}
    _removals_commit_on_a_full_disk(tier, kept, small_fs, tmp_path)


def test_regression_a_grown_reserve_given_back_for_a_removal_was_logged_at_its_first_size(
    small_fs: Path,
    make_block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The give-back of the reserve for a removal on a full disk logged RESERVE_BYTES, the
    size it is made at, though 6c27efc grows it to the index's growth: a reserve of 1 MiB
    was logged as 256 KiB (here 64 KiB), which hid its growth from the log (the crash
    campaign's only view of it). It now logs the bytes given back."""
    monkeypatch.setattr("kvtier.tiers.disk.tier.RESERVE_BYTES", 64 << 10)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        _removals_after_growth(small_fs, make_block, tmp_path)
    gave = [r.getMessage() for r in caplog.records if "gave back the" in r.getMessage()]
    assert gave, "no removal gave the reserve back"
    assert "gave back the 1024 KiB reserve" in gave[0], gave[0]


def test_regression_an_idle_tier_stayed_degraded_without_its_reserve_after_space_came_back(
    small_fs: Path, make_block: Block
) -> None:
    """A removal on a full disk gave the reserve back; space came back, but only a write
    batch let through (one per enospc_retry_s) could end the full disk's fault and make the
    reserve again: a node that wrote nothing more to L2 (idle, or read-only) showed it
    degraded for ever, and a Delete on it meanwhile had no reserve to commit on. The tier's
    watch now tries in the writes' turn: it makes the reserve and commits one page. While
    the reserve still does not fit, each try fails (counted) and the tier stays degraded;
    once space is back the first try ends the fault, no write sent. enospc_retry_s is 1 s,
    so that no try comes between the write that failed and the test's look at the state."""
    directory = small_fs / "l2"
    reserve = directory / RESERVE_NAME
    tier = DiskTier(directory, 16 * MiB, 1 * MiB)
    tier, kept = _filled(tier, small_fs, make_block, 400, enospc_retry_s=1.0, index_watch_s=0.02)
    try:
        assert tier.remove([it.slot for it in kept[::2]]), tier.health()
        assert not reserve.exists()
        committed = tier.stats().counters["committed_blocks"]
        tries = tier.stats().counters["enospc"]
        wait_for(lambda: tier.stats().counters["enospc"] >= tries + 2)  # two tries failed
        assert tier.health().state is Health.DEGRADED_NOSPACE
        assert not reserve.exists()

        (small_fs / "filler").unlink()
        wait_for(lambda: tier.health().state is Health.OK)
        assert reserve.stat().st_blocks * 512 >= RESERVE_BYTES
        assert tier.stats().counters["committed_blocks"] == committed  # nothing was written
    finally:
        tier.close()


@pytest.mark.parametrize("why", ["beyond_capacity", "file_recreated"])
def test_regression_a_quarantined_slot_dropped_at_start_on_a_full_disk_failed_the_start(
    small_fs: Path,
    make_block: Block,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    why: str,
) -> None:
    """A start that drops the quarantine rows of slots it does not hold (beyond a smaller
    capacity, or in a data file recreated at the open) on a full disk ended with the raw
    sqlite3 error (SQLITE_FULL) of that drop: the daemon did not start, where a full disk
    elsewhere at the start degrades L2. The start now goes on, degraded by the full disk,
    serving its blocks, the rows kept for a later start to drop; a slot of a recreated file
    stays held as its row says, until released (handed out, a block written there would be
    taken for quarantined at the next start, and lost), and the log no longer says it was
    returned to service."""
    directory = small_fs / "l2"
    with DiskTier(directory, 16 * MiB, 1 * MiB, file_bytes=4 * MiB) as tier:
        items = _allocate(tier, make_block, 0, 8)
        assert all(o.ok for o in persist(tier, items))
        slot = 12 * tier.allocator.slots_cap  # in the 13th of 16 segments: data-0003.bin
        tier._idx().quarantine([(slot, 4096, "read")])
    capacity = 8 * MiB if why == "beyond_capacity" else 16 * MiB
    if why == "file_recreated":
        (directory / "data-0003.bin").unlink()
    real_drop = DiskIndex.drop

    def drop_on_a_full_disk(self: DiskIndex, blocks: list[int], quarantine: list[int]) -> None:
        fill_disk(small_fs / "filler")  # the disk fills as the start goes on
        real_drop(self, blocks, quarantine)

    monkeypatch.setattr(DiskIndex, "drop", drop_on_a_full_disk)
    with (
        caplog.at_level(logging.WARNING, "kvtier.tiers.disk"),
        DiskTier(directory, capacity, 1 * MiB, file_bytes=4 * MiB, enospc_retry_s=0.0) as tier,
    ):
        assert tier.health().state is Health.DEGRADED_NOSPACE
        assert {r.key for r in tier.recover()} == {it.key for it in items}
        held = [q.slot for q in tier.quarantined()]
        assert held == ([] if why == "beyond_capacity" else [slot])
    assert "returned to service" not in caplog.text
    monkeypatch.undo()
    (small_fs / "filler").unlink()
    with DiskTier(directory, capacity, 1 * MiB, file_bytes=4 * MiB) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in items}
        if why == "file_recreated":  # the file is whole now: held until an operator's release
            assert [q.slot for q in tier.quarantined()] == [slot]
            assert tier.release_quarantined().released == [slot]
        assert tier.quarantined() == []
        assert tier._idx().quarantine_records() == {}


def test_regression_a_kept_file_size_was_lost_to_a_full_disk_and_the_index_moved_aside(
    small_fs: Path, make_block: Block
) -> None:
    """The data files' size the index records (kept across a capacity change where the
    ``MAX_FILES`` bound chose it) is read before the index opens, through a read-only
    connection that must make SQLite's shared memory after a clean stop: on a full disk that
    read failed, the size was taken as unknown, and the index, for files of another size,
    moved aside as another layout, every block lost. The read now falls back to the index
    file alone, the WAL empty after a clean stop."""
    directory = small_fs / "l2"
    # 64 KiB files asked for; 256 files at most: 128 KiB files hold the 32 MiB.
    with DiskTier(directory, 32 * MiB, 64 << 10, file_bytes=64 << 10) as tier:
        items = _allocate(tier, make_block, 0, 8)
        assert all(o.ok for o in persist(tier, items))
    fill_disk(small_fs / "filler")
    with DiskTier(directory, 16 * MiB, 64 << 10, file_bytes=64 << 10) as tier:
        assert not list(directory.glob("*.old-*"))
        assert {r.key for r in tier.recover()} == {it.key for it in items}
        assert tier.health().state is Health.DEGRADED_NOSPACE


@contextlib.contextmanager
def _wal_removed_out_of_inodes(small_fs: Path) -> Iterator[Path]:
    """The WAL of the index in ``small_fs / "l2"`` removed while another connection is open
    (so the old files stay: SQLite's last connection would remove them at its close), then
    the filesystem's inodes used up; yields the folder of the files using them up. That
    connection is closed at the end of the block."""
    index = small_fs / "l2" / "index.sqlite3"
    other = sqlite3.connect(f"{index.as_uri()}?mode=ro", uri=True)
    try:
        other.execute("SELECT count(*) FROM meta").fetchall()
        Path(f"{index}-wal").unlink()
        yield _use_up_inodes(small_fs / "inodes")
    finally:
        other.close()


def _wal_made_again_out_of_inodes(
    small_fs: Path, make_block: Block, **options: float
) -> tuple[DiskTier, list[PersistItem], list[WriteOutcome]]:
    """A tier of 4 blocks whose index's WAL was removed while it ran (another connection
    open, so the old files stay), then a write of 4 more on a filesystem out of inodes: its
    commit checkpoints the WAL and opens the index again, whose WAL's files find no inode.
    Returns the open tier, the 4 blocks committed and the write's outcomes."""
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, **options)
    committed = _allocate(tier, make_block, 0, 4)
    assert all(o.ok for o in persist(tier, committed))
    with _wal_removed_out_of_inodes(small_fs):
        outs = persist(tier, _allocate(tier, make_block, 4, 8))
    return tier, committed, outs


def test_regression_a_wal_made_again_out_of_inodes_raised_a_raw_oserror_from_write(
    small_fs: Path, make_block: Block
) -> None:
    """The index's WAL removed while the tier runs (another connection open, so the old
    files stay): the commit checkpoints it and opens the index again, whose WAL's files are
    made before SQLite's open. On a filesystem out of inodes that made them raise OSError
    (ENOSPC) out of ``DiskTier.write``, which only sqlite3 errors are handled around; the
    write now fails its blocks and degrades the tier by the full disk (SQLite's own open,
    before the files were made ahead of it, failed them too, as an I/O error)."""
    tier, _, outs = _wal_made_again_out_of_inodes(small_fs, make_block)
    with tier:
        assert not any(o.ok for o in outs)
        degraded = tier.health()
        assert degraded.state is Health.DEGRADED_NOSPACE
        assert "ENOSPC" in degraded.detail


def test_regression_a_wal_that_could_not_be_made_again_for_an_io_error_raised_it_raw(
    tmp_path: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index's WAL removed while the tier runs (another connection open, so the old
    files stay), and its remake at the commit's reopen failing other than for room (EIO
    here; EACCES, EROFS alike): the OSError went raw out of ``DiskTier.write``, which only
    sqlite3 errors are handled around, as 3f9d1c3 found for ENOSPC. The write now fails its
    blocks and degrades the tier by an I/O fault, the index file keeping what it held."""
    directory = tmp_path / "l2"
    index = directory / "index.sqlite3"
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        first = _allocate(tier, make_block, 0, 4)
        assert all(o.ok for o in persist(tier, first))
        other = sqlite3.connect(f"{index.as_uri()}?mode=ro", uri=True)
        try:
            other.execute("SELECT count(*) FROM meta").fetchall()
            Path(f"{index}-wal").unlink()
            real_open = os.open

            def failing_wal(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
                if str(path).endswith("-wal") and flags & os.O_CREAT:
                    raise OSError(errno.EIO, "Input/output error", str(path))
                return real_open(path, flags, *args, **kwargs)

            monkeypatch.setattr(os, "open", failing_wal)
            outs = persist(tier, _allocate(tier, make_block, 4, 8))
            monkeypatch.undo()
        finally:
            other.close()
        assert not any(o.ok for o in outs)
        health = tier.health()
        assert health.state is Health.DEGRADED_IO
        assert "cannot be opened again for a new WAL (Input/output error)" in health.detail
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in first}


def test_regression_a_wal_that_found_no_inode_to_be_made_again_left_the_index_closed(
    small_fs: Path, make_block: Block
) -> None:
    """The index opened again after its WAL was removed, on a filesystem out of inodes
    (3f9d1c3: a full disk, which a commit ends): the old connection was closed before the
    new one failed, leaving the tier none. Once inodes were freed, every write failed as
    "the L2 index is closed", an I/O fault lasting until a restart, and every removal
    failed. The connection is now opened again at its next use: the removal frees the
    slots, the next write, inodes back, commits, and a restart finds what it committed."""
    tier, committed, outs = _wal_made_again_out_of_inodes(small_fs, make_block, enospc_retry_s=0.0)
    with tier:
        assert not any(o.ok for o in outs)
        assert tier.remove([o.slot for o in outs]), tier.health()
        shutil.rmtree(small_fs / "inodes")
        later = _allocate(tier, make_block, 8, 12)
        assert all(o.ok for o in persist(tier, later)), tier.health()
        assert tier.health().state is Health.OK
        assert tier.remove([committed[0].slot])
    with DiskTier(small_fs / "l2", 16 * MiB, 1 * MiB) as again:
        assert {r.key for r in again.recover()} == {it.key for it in committed[1:] + later}


def test_regression_a_wal_that_could_not_be_made_again_left_the_index_closed_for_good(
    small_fs: Path, make_block: Block
) -> None:
    """The index's WAL removed while the tier runs, and no inode left to make it again: the
    commit that checkpointed it closed the connection before opening the index again, and
    that open failing (a full disk) left the index closed. The next commit, inodes freed,
    raised "the L2 index is closed": the tier degraded_io until a restart, where a full disk
    ends by itself. The connection is now opened again at its next use; the next commit
    makes the WAL again and commits, the tier ok, and a restart finds those blocks."""
    directory = small_fs / "l2"
    with DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0) as tier:
        first = _allocate(tier, make_block, 0, 4)
        assert all(o.ok for o in persist(tier, first))
        with _wal_removed_out_of_inodes(small_fs) as inodes:
            assert not any(o.ok for o in persist(tier, _allocate(tier, make_block, 4, 8)))
            assert tier.health().state is Health.DEGRADED_NOSPACE
            shutil.rmtree(inodes)
            later = _allocate(tier, make_block, 8, 12)
            outs = persist(tier, later)
        assert all(o.ok for o in outs), tier.health()
        assert tier.health().state is Health.OK
        assert (directory / "index.sqlite3-wal").exists()
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in first + later}


def test_a_crash_while_the_index_awaits_an_inode_for_its_new_wal_keeps_what_was_committed(
    small_fs: Path, make_block: Block, tmp_path: Path
) -> None:
    """A SIGKILL while the index's connection is closed, its WAL removed and no inode to make
    it again (the write that found it failed): every block committed before is there at the
    next start, and so is the deletion of one removed meanwhile, which committed on the inode
    its reserve's give-back freed (the campaign removes no WAL: out of its reach)."""
    tier, committed, outs = _wal_made_again_out_of_inodes(small_fs, make_block)
    with tier:
        assert not any(o.ok for o in outs)
        killed = _crash_copy(small_fs / "l2", tmp_path / "killed")
        assert tier.remove([committed[0].slot]), tier.health()
        removed = _crash_copy(small_fs / "l2", tmp_path / "removed")
    for image, kept in ((killed, committed), (removed, committed[1:])):
        with DiskTier(image, 16 * MiB, 1 * MiB) as again:
            assert {r.key for r in again.recover()} == {it.key for it in kept}


def test_regression_a_recovery_after_a_failed_reopen_of_the_index_handed_its_rows_slots_out(
    small_fs: Path, make_block: Block
) -> None:
    """The index's WAL removed before recovery read the rows, and no inode left to make it
    again: the watch's check closed the connection and its reopen failed, so recovery's
    reader and then the tier's own connection failed too. Recovery then ended as if every
    row had been read, the allocator handing their slots out, on the grounds that a closed
    index takes no commit; but the index is opened again at its next use (b304c9b), so
    once inodes were freed a write there replaced a row of a block kept from before the
    start, lost at the next. Nothing is handed out now until a restart reads every row."""
    directory = small_fs / "l2"
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        first = _allocate(tier, make_block, 0, 4)
        assert all(o.ok for o in persist(tier, first))
    with DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0, recover_later=True) as tier:
        with _wal_removed_out_of_inodes(small_fs) as inodes:
            tier._check_index_files()  # the watch's check: its reopen finds no inode
            assert len(tier.recover()) == 0
            shutil.rmtree(inodes)
        assert tier.allocator.allocate(4096) is None
        assert "no new block until restart" in tier.health().detail
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in first}


def test_a_wal_that_could_not_be_made_again_between_recovery_chunks_ends_recovery_there(
    small_fs: Path, make_block: Block
) -> None:
    """Recovery reads a chunk at a time through the tier's own connection (aaf30f3): where
    the watch's check closes it for a new WAL between two chunks and its reopen finds no
    inode, the next chunk's read fails as a read failing partway does (README): the blocks
    read before are served, nothing is handed out until a restart, which reads every row."""
    directory = small_fs / "l2"
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        first = _allocate(tier, make_block, 0, 4)
        assert all(o.ok for o in persist(tier, first))
    with DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0, recover_later=True) as tier:
        chunks = tier.recover_chunks(rows=2)
        assert len(next(chunks)) == 2
        with _wal_removed_out_of_inodes(small_fs) as inodes:
            tier._check_index_files()  # the watch's check: its reopen finds no inode
            assert list(chunks) == []
            shutil.rmtree(inodes)
        assert tier.allocator.allocate(4096) is None
        assert "no new block until restart" in tier.health().detail
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in first}


@pytest.mark.parametrize("how", ["replaced", "removed", "recreated"])
def test_regression_an_index_file_replaced_while_its_reopen_waited_for_room_was_taken_up(
    small_fs: Path, make_block: Block, how: str
) -> None:
    """The index's WAL removed while the tier runs, its reopen finding no inode: the
    connection stays closed until the next use opens the index again (b304c9b). An index
    file replaced meanwhile (here by an older copy) was opened as if it were the tier's own,
    its file check passing against ids taken from it, and the next writes committed into it
    while the blocks committed before were missing from it, lost at the next start; one
    removed was made again, empty, by that open. Either now fails the commit and degrades
    the tier until a restart, as an index replaced or removed while open and not written back
    does. "recreated": the index removed, then the older copy written at its path (``cp``
    after ``rm``): nothing held the closed file, so ext4 gave its inode number to the copy,
    whose (device, inode) then matched the closed file's and the writes went into it."""
    directory = small_fs / "l2"
    index = directory / "index.sqlite3"
    with DiskTier(directory, 16 * MiB, 1 * MiB) as tier:
        assert all(o.ok for o in persist(tier, _allocate(tier, make_block, 0, 4)))
    shutil.copy(index, small_fs / "older")
    with DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0) as tier:
        assert all(o.ok for o in persist(tier, _allocate(tier, make_block, 4, 8)))
        with _wal_removed_out_of_inodes(small_fs) as inodes:
            tier._check_index_files()  # the watch's check: its reopen finds no inode
            shutil.rmtree(inodes)
        if how == "replaced":
            (small_fs / "older").rename(index)
        else:
            index.unlink()
        if how == "recreated":
            shutil.copyfile(small_fs / "older", index)
        outs = persist(tier, _allocate(tier, make_block, 8, 12))
        assert not any(o.ok for o in outs)
        health = tier.health()
        assert health.state is Health.DEGRADED_IO
        assert f"was {'removed' if how == 'removed' else 'replaced'} while" in health.detail
        assert how != "removed" or not index.exists()


def test_regression_a_reserve_that_could_not_be_given_back_at_the_open_ended_it_raw(
    small_fs: Path, make_block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start on a full disk gives the reserve back for the index's open; its own copy of
    the give-back raised an unlink that failed other than ENOENT (EPERM: an immutable file,
    EIO) out of the start as a raw OSError. It now warns, as a removal's give-back does, and
    the start is refused as where no reserve is left, naming the room to free, the index
    kept, and saying the reserve could not be given back (not that none is left)."""
    directory, items, _ = _stopped_on_a_full_disk(small_fs, make_block, crashed=False)
    unlink = Path.unlink

    def immutable_reserve(path: Path, missing_ok: bool = False) -> None:
        if path.name == RESERVE_NAME:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", immutable_reserve)
    with pytest.raises(TierUnavailable, match=r"cannot open the L2 index .*free \d") as e:
        DiskTier(directory, 16 * MiB, 1 * MiB)
    assert f"{RESERVE_NAME} could not be given back" in str(e.value)
    monkeypatch.undo()
    assert (directory / RESERVE_NAME).exists()
    with DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0) as tier:
        assert {r.key for r in tier.recover()} == {it.key for it in items}


@pytest.mark.parametrize("commit", ["refused", "failed"])
def test_regression_a_block_whose_quarantine_did_not_commit_came_back_after_its_delete(
    small_fs: Path,
    make_block: Block,
    faulty_files: FaultyFiles,
    monkeypatch: pytest.MonkeyPatch,
    commit: str,
) -> None:
    """A read that failed once (EIO) on a full disk quarantined its block, but the
    quarantine's commit, which deletes its row, was refused (the reserve, given back by a
    removal, could not be made again) or failed (SQLITE_FULL: the WAL could not grow), and
    nothing deleted the row later: the daemon drops its copy of a block whose read failed,
    so a Delete of its key never reaches the tier. After a restart the row was served again,
    its bytes verifying, and the deleted key came back. The row is now deleted as a
    removal's is, on the reserve where needed; only the quarantine's own row is not written."""
    directory = small_fs / "l2"
    tier = DiskTier(directory, 16 * MiB, 1 * MiB)
    items = _allocate(tier, make_block, 0, 8)
    outs = persist(tier, items)
    assert all(o.ok for o in outs)
    tier.close()  # checkpointed: the WAL starts empty, and must grow for the next commit
    tier = DiskTier(directory, 16 * MiB, 1 * MiB, enospc_retry_s=0.0, backend=faulty_files)
    tier.recover()
    fill_disk(small_fs / "filler")
    if commit == "refused":
        assert tier.remove([items[-1].slot])
        assert tier.stats().counters["removals_on_reserve"] == 1
    answers: list[object] = []
    real_quarantine = tier._idx().quarantine

    def quarantine(*args: Any, **kwargs: Any) -> bool:
        try:
            recorded = real_quarantine(*args, **kwargs)
        except sqlite3.Error as e:
            answers.append(getattr(e, "sqlite_errorname", e))
            raise
        answers.append(recorded)
        return recorded

    monkeypatch.setattr(tier._idx(), "quarantine", quarantine)
    faulty_files.fail("preadv", errno.EIO, times=1)
    failed = items[0]
    read = ReadItem(failed.slot, bytearray(4096), 4096, outs[0].checksum, failed.key)
    assert tier.read_items([read]) == [False]
    assert answers == [False if commit == "refused" else "SQLITE_FULL"]
    assert [q.slot for q in tier.quarantined()] == [failed.slot]
    tier.close()
    (small_fs / "filler").unlink()
    with DiskTier(directory, 16 * MiB, 1 * MiB) as again:
        assert {r.key for r in again.recover()} == {it.key for it in items[1:-1]} | (
            {items[-1].key} if commit == "failed" else set()
        )
