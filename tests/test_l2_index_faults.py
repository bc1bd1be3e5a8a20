"""Faults of the disk tier's index inside a running daemon: frees that fail and are retried,
a durable put failed by a removed WAL, an index file removed while the daemon runs. Each
ends with the daemon's invariants whole, exact bytes or misses, and no block that was
reported persisted lost at a restart."""

from __future__ import annotations

import shutil
import sqlite3

import numpy as np
import pytest
from disk_faults import fill_disk
from harness import entry_setting
from test_l2_daemon import LAYOUT, SMALL_L1, fill, keys, l2_args, page, wait_for

from kvtier.client import SharedMemoryPool, Tier, UnavailableError

# A lock held by another process fails a commit after 0.2 s, not 30, and a free that failed
# is tried again after 0.2 s, not 1.
FAST_FAULTS = entry_setting(
    {
        "kvtier.tiers.disk.index.BUSY_TIMEOUT_S": 0.2,
        "kvtier.daemon.space.FREE_RETRY_S": 0.2,
    }
)


def _read_back(client, pool_id: int, ks: list[bytes], shm, want: list[bytes]) -> None:
    """Key i loads into page i with the bytes ``want[i]``."""
    shm.array()[:] = 0
    assert client.get(pool_id, ks, range(len(ks))).prefix_len == len(ks)
    got = shm.array()
    for p, data in enumerate(want):
        assert page(got, p) == data, f"page {p} differs"


def _persisted(d, n: int, tag: int) -> tuple[list[bytes], np.ndarray]:
    """``n`` keys put durably from pages 0.. of a pool filled with ``fill(shm, tag)``, each
    answered persisted: the keys and the pool's pages."""
    ks = keys(n, tag)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        src = fill(shm, tag)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks, range(n), durable=True).persisted == [True] * n
    return ks, src


def _all_on_l2_after_sigkill(d, ks: list[bytes], src) -> None:
    """SIGKILL and restart ``d``: it does not start empty, finds every key of ``ks`` on L2,
    loads key i's page i of ``src`` byte for byte, and its check finds nothing wrong."""
    d.kill()
    d.start()
    assert "starting EMPTY" not in d.log()
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.lookup(ks).tiers == [Tier.L2_DISK] * len(ks)
        _read_back(client, pool.pool_id, ks, shm, [page(src, p) for p in range(len(ks))])
        assert client.check().problems == []


def test_regression_slots_a_locked_index_kept_from_a_delete_are_freed_once_it_is_let_go(
    daemon_factory, tmp_path
):
    """A Delete while another process held the index locked: the tier could not delete the
    blocks' rows, so their slots, and the room they held in their tenant's quota, stayed
    taken until a restart (`kvtier check`: "L2: 8 slots allocated, 4 held by blocks"; the
    tenant "holds reserved slots no copy uses"), long after the lock was let go. The free is
    now tried again, and once the lock is gone the slots are free, the quota given back, and
    the deleted blocks stay deleted across a restart."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2), entry=FAST_FAULTS)
    ks = keys(8, 460)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        src = fill(shm, 460)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks, range(8), durable=True).persisted == [True] * 8
        other = sqlite3.connect(l2 / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(UnavailableError, match="a restart would bring the blocks back"):
                client.delete(ks[:4])  # dropped here, its rows not deleted: not acknowledged
            problems = client.check().problems
            assert any("8 slots allocated, 4 held by blocks" in p for p in problems), problems
            assert any("reserved slots no copy uses" in p for p in problems), problems
        finally:
            other.close()
        wait_for(lambda: client.check().problems == [])
        counters = client.stats().counters
        assert counters['frees_deferred{tier="L2"}'] == 4
        assert counters['frees_retried{tier="L2"}'] == 4
        assert client.lookup(ks).tiers == [Tier.ABSENT] * 4 + [Tier.L1_HOST] * 4
    assert "slots that could not be freed are free now" in d.log()
    d.kill()
    d.start()
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.lookup(ks).tiers == [Tier.ABSENT] * 4 + [Tier.L2_DISK] * 4
        _read_back(client, pool.pool_id, ks[4:], shm, [page(src, p) for p in range(4, 8)])
        assert client.check().problems == []


def test_regression_a_durable_put_failed_by_a_busy_wal_checkpoint_leaves_nothing_behind(
    daemon_factory, tmp_path
):
    """index.sqlite3-wal removed while an operator's sqlite3 shell held a read transaction:
    a durable put failed (persisted False), but its rows had gone into the removed WAL, so
    giving its slots back failed the same way and they stayed taken (`kvtier check`: "L2: 8
    slots allocated, 4 held by blocks") while the shell held on. Now the put fails before its
    rows go in: its slots are free at once, the tier takes writes again once the shell lets
    go, and a restart serves exactly the blocks reported persisted."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2, "tiers.l2.enospc_retry_s=0.1"), entry=FAST_FAULTS)
    ks = keys(12, 461)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        src = fill(shm, 461)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks[:4], range(4), durable=True).persisted == [True] * 4
        reader = sqlite3.connect(l2 / "index.sqlite3", isolation_level=None)
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM blocks").fetchone() == (4,)
            for name in ("index.sqlite3-wal", "index.sqlite3-shm"):
                (l2 / name).unlink()
            res = client.put(pool.pool_id, ks[4:8], range(4, 8), durable=True)
            assert res.persisted == [False] * 4
            assert client.check().problems == []
        finally:
            reader.close()

        def persisted_again() -> bool:
            res = client.put(pool.pool_id, ks[8:], range(8, 12), durable=True)
            return res.persisted == [True] * 4

        wait_for(persisted_again)
        assert client.check().problems == []
    d.kill()
    d.start()
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert (
            client.lookup(ks).tiers == [Tier.L2_DISK] * 4 + [Tier.ABSENT] * 4 + [Tier.L2_DISK] * 4
        )
        kept = ks[:4] + ks[8:]
        _read_back(
            client, pool.pool_id, kept, shm, [page(src, p) for p in (0, 1, 2, 3, 8, 9, 10, 11)]
        )
        assert client.check().problems == []


def test_regression_an_index_removed_while_the_daemon_runs_loses_no_persisted_block(
    daemon_factory, tmp_path
):
    """index.sqlite3 removed while the daemon ran: the durable puts after it failed, and
    the SIGKILLed daemon's restart lost the 4 blocks it had reported persisted before the
    removal too (data files without an index: started empty). The tier now writes its open
    index back to its path and goes on: every block reported persisted is served after the
    restart, byte for byte."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2))
    ks = keys(8, 462)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        src = fill(shm, 462)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks[:4], range(4), durable=True).persisted == [True] * 4
        (l2 / "index.sqlite3").unlink()
        res = client.put(pool.pool_id, ks[4:], range(4, 8), durable=True)
        assert res.persisted == [True] * 4
        counters = client.stats().counters
        assert counters["l2_index_restored"] == 1 and counters["l2_index_errors"] == 0
        assert client.check().problems == []
    assert "written back to its path" in d.log()
    _all_on_l2_after_sigkill(d, ks, src)


def test_regression_blocks_deleted_under_a_locked_index_stay_deleted_across_a_stop(
    daemon_factory, tmp_path
):
    """A Delete while another process held the index locked, the lock let go, then SIGTERM
    before the retry's wait was over (up to 60 s once a few tries failed): the stop did not
    try the frees again, the index kept the deleted blocks' rows, and the restart served
    the 4 deleted blocks. The stop now tries them once more before the tiers close."""
    l2 = tmp_path / "l2"
    slow_retry = entry_setting(
        {
            "kvtier.tiers.disk.index.BUSY_TIMEOUT_S": 0.2,
            "kvtier.daemon.space.FREE_RETRY_S": 3600.0,
        }
    )
    d = daemon_factory(*l2_args(l2), entry=slow_retry)
    ks = keys(8, 463)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        src = fill(shm, 463)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks, range(8), durable=True).persisted == [True] * 8
        other = sqlite3.connect(l2 / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(UnavailableError, match="a restart would bring the blocks back"):
                client.delete(ks[:4])  # dropped here, its rows not deleted: not acknowledged
        finally:
            other.close()
        assert client.stats().counters['frees_deferred{tier="L2"}'] == 4
    assert d.stop() == 0
    assert "slots that could not be freed are free now" in d.log()
    d.start()
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.lookup(ks).tiers == [Tier.ABSENT] * 4 + [Tier.L2_DISK] * 4
        _read_back(client, pool.pool_id, ks[4:], shm, [page(src, p) for p in range(4, 8)])
        assert client.check().problems == []


@pytest.mark.parametrize(
    "removed",
    [
        ("index.sqlite3",),
        ("index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm"),
        ("index.sqlite3-wal", "index.sqlite3-shm"),
    ],
    ids=["index", "index and WAL", "WAL"],
)
def test_regression_index_files_removed_while_the_daemon_is_idle_lose_nothing_at_a_crash(
    daemon_factory, tmp_path, removed: tuple[str, ...]
):
    """Index files removed (an operator's clean-up) while the daemon was idle, then SIGKILL
    before any commit: only a commit or the stop noticed the removal, so the restart found
    data files without an index (started EMPTY), or an index without the WAL that held every
    commit, and served none of the 8 blocks reported persisted. The tier's index watch now
    writes the index back, or checkpoints the WAL, within tiers.l2.index_watch_s."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2, "tiers.l2.index_watch_s=0.1"))
    ks, src = _persisted(d, 8, 464)
    with d.client() as client:
        commits = client.stats().counters["l2_commits"]
        for name in removed:
            (l2 / name).unlink()
        if "index.sqlite3" in removed:
            wait_for(lambda: client.stats().counters["l2_index_restored"] == 1)
        else:
            wait_for(lambda: "its WAL was removed or replaced while open" in d.log())
        counters = client.stats().counters
        assert counters["l2_index_errors"] == 0
        assert counters["l2_commits"] == commits  # mended by the watch, not by a commit
    _all_on_l2_after_sigkill(d, ks, src)


def test_regression_a_flush_at_stop_onto_a_degraded_l2_said_it_ran_out_of_time(
    daemon_factory, tmp_path
):
    """The L2 folder removed while the daemon ran (the tier degraded: it refuses writes),
    then SIGTERM: the flush wrote none of the 4 blocks held only in L1, at once, and its
    warning said they were "not written within tiers.l2.flush_timeout_s (60s)", sending the
    operator to raise a timeout that played no part. It now says that L2 refuses writes, and
    why."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2, "tiers.l2.index_watch_s=0.1"))
    ks = keys(4, 465)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        fill(shm, 465)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks, range(4)).stored == 4
        assert client.lookup(ks).tiers == [Tier.L1_HOST] * 4
        shutil.rmtree(l2)

        def l2_state() -> str:
            return next(t.state for t in client.stats().tiers if t.tier == Tier.L2_DISK)

        wait_for(lambda: l2_state().startswith("degraded_io"))
    assert d.stop() == 0
    log = d.log()
    assert "flushed 0 of 4 volatile-only blocks to L2" in log
    assert "not written within" not in log
    assert "lost (held only in memory): 4 not written: L2 refuses writes (degraded_io: " in log


def test_regression_l2_degraded_by_a_locked_index_took_no_demotion_again_once_let_go(
    daemon_factory, tmp_path
):
    """A demotion whose index commit another process's lock held up degrades L2 (it refuses
    writes, letting one batch through each tiers.l2.enospc_retry_s to see whether the fault
    cleared); but only a durable put ever sent it that batch: demotions and the balancer skip a
    tier that refuses writes, so with non-durable puts L2 stayed degraded until a restart,
    long after the lock was let go, and every block L1 made room by was dropped."""
    l2 = tmp_path / "l2"
    d = daemon_factory(
        *SMALL_L1, *l2_args(l2, "tiers.l2.enospc_retry_s=0.1"), l1_bytes="1MiB", entry=FAST_FAULTS
    )
    ks = keys(1024, 466)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        fill(shm, 466)
        pool = client.register_pool(shm, LAYOUT)

        def l2_state() -> str:
            return next(t.state for t in client.stats().tiers if t.tier == Tier.L2_DISK)

        assert client.put(pool.pool_id, ks[:16], range(16)).stored == 16  # L1 full
        other = sqlite3.connect(l2 / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            client.put(pool.pool_id, ks[16:24], range(16, 24))  # L1 makes room: demotes
            wait_for(lambda: l2_state().startswith("degraded"))
        finally:
            other.close()
        more = iter(range(24, len(ks)))

        def takes_writes_again() -> bool:
            k = next(more)  # a new block each time: L1 makes room for it
            assert client.put(pool.pool_id, [ks[k]], [k % 64]).stored == 1
            return l2_state() == "ok"

        wait_for(takes_writes_again)
        assert Tier.L2_DISK in client.lookup(ks).tiers
        assert client.check().problems == []


def test_regression_a_flush_at_stop_onto_l2_degraded_by_a_fault_since_passed_wrote_nothing(
    daemon_factory, tmp_path
):
    """L2 degraded by a fault that passes (a full disk; here an index another process kept
    locked) refuses writes but one batch per tiers.l2.enospc_retry_s (30 s by default). An
    operator who freed the disk (let the lock go) and restarted the daemon within that time
    lost every block held only in L1: the flush at stop wrote none ("L2 refuses writes"), though
    the disk took writes again. The flush is the last chance for those blocks: it now lets its
    first batch through, and the batches sent while that one is in flight (one block each
    here), and writes them all."""
    l2 = tmp_path / "l2"
    d = daemon_factory(
        *l2_args(l2, "tiers.l2.enospc_retry_s=30", "mover.batch_bytes=64KiB"), entry=FAST_FAULTS
    )
    ks = keys(5, 467)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        src = fill(shm, 467)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks[:4], range(4)).stored == 4  # in L1 only
        other = sqlite3.connect(l2 / "index.sqlite3", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            put = client.put(pool.pool_id, ks[4:], [4], durable=True)
            assert put.persisted == [False]
        finally:
            other.close()
        state = next(t.state for t in client.stats().tiers if t.tier == Tier.L2_DISK)
        assert state.startswith("degraded_io: locked")
    assert d.stop() == 0
    assert "flushed 5 of 5 volatile-only blocks to L2" in d.log()
    d.start()
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.lookup(ks).tiers == [Tier.L2_DISK] * 5
        _read_back(client, pool.pool_id, ks, shm, [page(src, p) for p in range(5)])
        assert client.check().problems == []


@pytest.mark.slow  # 4-6 s: two starts on a loop-mounted disk, filled
def test_regression_a_delete_answered_on_a_full_disk_came_back_after_a_sigkill(
    daemon_factory, small_fs
):
    """A Delete on L2 degraded by a full disk was answered, but the index could not commit
    the removal of the keys' rows (SQLITE_FULL: its WAL had no room to grow): the free was
    deferred, and a SIGKILL before space came back served the 16 deleted keys again after
    the restart. The removal now commits on the reserve the tier keeps beside its index."""
    l2 = small_fs / "l2"
    d = daemon_factory(*l2_args(l2, "tiers.l2.capacity_bytes=16MiB"), entry=FAST_FAULTS)
    ks = keys(64, 464)
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        src = fill(shm, 464)
        pool = client.register_pool(shm, LAYOUT)
        assert client.put(pool.pool_id, ks[:32], range(32), durable=True).persisted == [True] * 32
        fill_disk(small_fs / "filler")
        held = 32
        while held < 64:  # until the index's WAL can grow no more
            if client.put(pool.pool_id, ks[held : held + 1], [held], durable=True).persisted != [
                True
            ]:
                break
            held += 1
        assert held < 64, "the disk never filled up"
        assert client.delete(ks[:16]).deleted == 16
        assert client.stats().counters.get('frees_deferred{tier="L2"}', 0) == 0
    d.kill()
    (small_fs / "filler").unlink()
    d.start()
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.lookup(ks[:held]).tiers == [Tier.ABSENT] * 16 + [Tier.L2_DISK] * (held - 16)
        _read_back(client, pool.pool_id, ks[16:32], shm, [page(src, p) for p in range(16, 32)])
        assert client.check().problems == []


def test_regression_a_daemon_whose_l2_disk_filled_while_it_was_stopped_did_not_start(
    daemon_factory, small_fs
):
    """kvtierd stopped, its L2 disk filled meanwhile (the data files all allocated, less
    free than the 1 MiB its index may take): the host checks refused the start, exit status
    1, a crash loop under a service manager for room only L2's writes need. It now serves,
    L2 degraded by the full disk (its writes refused, the detail naming how much to free),
    its blocks read back."""
    l2 = small_fs / "l2"
    d = daemon_factory(*l2_args(l2, "tiers.l2.capacity_bytes=16MiB"))
    ks, src = _persisted(d, 8, 465)
    assert d.stop() == 0
    fill_disk(small_fs / "filler")
    d.start()
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        state = next(t.state for t in client.stats().tiers if t.tier == Tier.L2_DISK)
        assert state.startswith("degraded_nospace: enospc: start: the disk of"), state
        assert "short of the 1 MiB kept for the index" in state
        pool = client.register_pool(shm, LAYOUT)
        assert client.lookup(ks).tiers == [Tier.L2_DISK] * 8
        _read_back(client, pool.pool_id, ks, shm, [page(src, p) for p in range(8)])
        more = keys(1, 466)
        assert client.put(pool.pool_id, more, [0], durable=True).persisted == [False]
        assert client.check().problems == []


def test_regression_a_new_l2_index_sqlite_could_not_make_ended_the_start_in_a_traceback(
    daemon_factory, tmp_path
):
    """A new L2 index that SQLite could not make for a reason other than a full disk (here
    SQLITE_CANTOPEN: a folder path longer than the 512 bytes SQLite's own paths hold, which
    the host checks, taking the OS's limit, pass) ended kvtierd's start in a Python
    traceback. The start is refused as other L2 start failures are: one line naming the
    index and the cause, exit status 1."""
    l2 = tmp_path.joinpath(*["l2" * 100] * 3)
    l2.mkdir(mode=0o700, parents=True)
    d = daemon_factory(*l2_args(l2), wait=False)
    assert d.proc is not None and d.proc.wait(60) == 1
    log = d.log()
    assert "Traceback" not in log, log
    [line] = [x for x in log.splitlines() if "cannot start" in x]
    assert f"cannot make the L2 index {l2 / 'index.sqlite3'} (index: SQLITE_CANTOPEN" in line, log
    assert not (l2 / "index.sqlite3").exists()


def test_regression_a_folder_at_the_l2_index_journal_moved_a_healthy_index_aside(
    daemon_factory, tmp_path
):
    """The host checks looked at the L2 index, its WAL, shared memory and write-back copy,
    not at its rollback journal: a folder at index.sqlite3-journal made the open of a
    healthy index fail (SQLITE_IOERR), and the start moved it aside as damaged and started
    empty, every block lost. The start is refused, naming the folder; with it gone, the
    next start finds every block."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2))
    ks, _ = _persisted(d, 4, 467)
    assert d.stop() == 0
    journal = l2 / "index.sqlite3-journal"
    journal.mkdir()
    d.start(wait=False)
    assert d.proc is not None and d.proc.wait(60) == 1
    log = d.log()
    [line] = [x for x in log.splitlines() if "cannot start" in x]
    assert f"L2 file {journal} is a directory" in line, log
    assert not list(l2.glob("index.sqlite3.corrupt-*"))
    journal.rmdir()
    d.start()
    with d.client() as client:
        assert client.lookup(ks).tiers == [Tier.L2_DISK] * 4


def _address_space_short_of(l1_bytes: int) -> tuple[str, ...]:
    """A daemon entry whose address space (RLIMIT_AS), set as the L1 arena is made, holds
    what the process maps by then and half an arena of ``l1_bytes``: the host checks (memory,
    the cgroup's limit) pass and the start is refused after L2 opened, L1's map failing
    (ENOMEM), as where host memory ran short between the checks and the map. No memory is
    taken (the arena's map is what fails), and the limit needs no guess of what the daemon
    maps before it."""
    lines = [
        "import resource, sys",
        "from kvtier.daemon.entry import main",
        "from kvtier.tiers.host import HostArena",
        "make = HostArena.__init__",
        "def short(self, *args, **kw):",
        "    with open('/proc/self/status') as f:",
        "        vm = next(int(x.split()[1]) for x in f if x.startswith('VmSize:')) << 10",
        f"    limit = vm + {l1_bytes // 2}",
        "    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))",
        "    make(self, *args, **kw)",
        "HostArena.__init__ = short",
        "sys.exit(main())",
    ]
    return ("-c", "\n".join(lines))


def test_regression_a_start_after_one_refused_past_making_a_new_index_said_nothing_of_the_loss(
    daemon_factory, tmp_path
):
    """A damaged index moved aside by a start that made a new, empty one and was then refused
    (L2 opens before L1, whose map failed): that start's log said the blocks were lost, but
    the next start found an index as any other beside the data files and said nothing, its
    health OK. The new index now records when and why it was made, until its first block
    commits, and each start until then says so (log, health detail)."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2))
    ks, _ = _persisted(d, 4, 468)
    assert d.stop() == 0
    (l2 / "index.sqlite3").write_bytes(b"not an index" * 512)
    l1_bytes = 512 << 20
    refused = daemon_factory(
        *l2_args(l2), l1_bytes=str(l1_bytes), wait=False, entry=_address_space_short_of(l1_bytes)
    )
    assert refused.proc is not None and refused.proc.wait(60) == 1, refused.log()
    assert "cannot start" in refused.log(), refused.log()
    [aside] = list(l2.glob("index.sqlite3.corrupt-*"))
    assert (l2 / "index.sqlite3").exists()  # made, empty
    before = len(d.log())
    d.start()
    said = d.log()[before:]
    assert "was made empty by an earlier start" in said, said
    assert f"moved aside as {aside.name}" in said, said
    with d.client() as client:
        assert client.lookup(ks).tiers == [Tier.ABSENT] * 4
        assert client.check().problems == []
    d.kill()
    d.start()  # no block committed since: said again
    assert d.log().count("was made empty by an earlier start") == 2
    _persisted(d, 1, 469)  # the index in service: said no more
    d.kill()
    d.start()
    assert d.log().count("was made empty by an earlier start") == 2


def test_an_index_deleted_by_hand_beside_its_wal_starts_empty_the_stale_wal_not_replayed(
    daemon_factory, tmp_path
):
    """index.sqlite3 deleted by hand after a SIGKILL, its WAL (holding the last commits) and
    shared memory left: the start makes a new index, which SQLite opens empty, dropping the
    stale WAL (replayed onto it, the WAL's pages would name blocks beside pages that are not
    there: a damaged index). The start says the index was missing beside the data files and
    starts empty, its index sound: a block put then is served after the next SIGKILL. Until
    then each start says the blocks were lost."""
    l2 = tmp_path / "l2"
    d = daemon_factory(*l2_args(l2))
    ks, _ = _persisted(d, 4, 470)
    d.kill()
    assert (l2 / "index.sqlite3-wal").stat().st_size > 0  # the commits since a checkpoint
    (l2 / "index.sqlite3").unlink()
    d.start()
    log = d.log()
    assert "is missing but 4 data file(s) are there" in log, log
    with d.client() as client:
        assert client.lookup(ks).tiers == [Tier.ABSENT] * 4
        assert client.check().problems == []
    d.kill()
    d.start()
    assert "no index was found, and no block was committed since" in d.log(), d.log()
    more, src = _persisted(d, 4, 471)
    d.kill()
    d.start()
    assert d.log().count("no index was found, and no block was committed since") == 1
    with d.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        assert client.lookup(ks + more).tiers == [Tier.ABSENT] * 4 + [Tier.L2_DISK] * 4
        _read_back(client, pool.pool_id, more, shm, [page(src, p) for p in range(4)])
        assert client.check().problems == []
