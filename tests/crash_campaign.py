"""A randomized crash campaign: kill -9 the daemon at random moments, restart, check.

``python tests/crash_campaign.py --rounds N [--seed S] [--l3-every K] [--workdir DIR]`` runs
N rounds against one daemon (L1 + L2, and L3 on a real ``redis-server`` in every K-th series
of rounds) on a temporary Unix socket. In a round, four client processes (tenants alice and
bob, two each, with the same keys) put blocks of 4 KiB, 64 KiB, 1 MiB and 5 MiB (durable or
not), delete them and put them again (an overwrite: a put of a key held answers EXISTS),
look up with pins, get and check what they got (keeping a few pinned leases of small blocks
unreleased, which the close of their session gives back); the campaign sends SIGHUP now and
then, then SIGKILLs the daemon at a moment drawn from: a plain moment, during a demotion (L1
full, blocks in flight), during the drain after a SIGTERM, just after a SIGHUP, during the
next start (its recovery of L2's blocks), and once the clients have closed their sessions,
leases still pinned (``kvtier check`` then runs first, on the daemon as they left it). After
the restart it reads every key of both tenants and checks, against the clients' journals
(what was sent, what was answered):

- a key whose put was answered ``persisted`` is there, with those bytes or a newer version's;
- a key whose Delete was answered (and not put since) is absent;
- every block read is a version of this tenant's key that a put sent, whole (a block mixing
  two versions, or another tenant's, is wrong bytes);
- health is SERVING and the daemon's invariant check (``kvtier check``) finds nothing.

In every K-th series (``--full-disk-every K``) L2 lies on a small ext4 filesystem,
loop-mounted (root only), which a filler file fills after each start, leaving 0 to 1 MiB
free: L2's writes then fail (its index's WAL cannot grow) and its removals (Deletes,
evictions) commit on the index's reserve; before most restarts the filler gives 2 MiB back,
and the others start on the disk as full as it was (L2 degraded by it from the start, as
README says, where the room its index may take is short; a start refused there, its index
unable to open with no reserve left to give back, is given the 2 MiB). The checks are the same: a
Delete answered on a full disk stays done, README says, but for the blocks whose slots a
fault kept the tier from freeing (their rows kept: a disk full past the reserve, where a
start found no room to make it), which README says come back: the keys a Delete answered
during a daemon's life whose log says slots could not be freed may come back once, after the
restart (counted, not a problem), over a later put of the key too unless it was answered
persisted. One full-disk series in two is a growth series: one client process of each
tenant also puts the 4,096 keys of ``GROWTH_NAMESPACE`` (4 KiB) in durable batches of up to
256, and its first start (one in four after) leaves 4 MiB free, so that the index's growth in
its WAL since the last checkpoint passes 128 KiB and index.reserve grows past its 256 KiB
before the disk fills; the reserve's size at each kill and the removals that gave a grown
reserve back (the log) are counted.

In every K-th round (``--clients-in-recovery-every K``; but a series' first and a full-disk
series' rounds) the idle daemon is killed first and the clients start with its restart, their
calls running during its recovery of L2 (of its checked keys' rows and of 32,768 more, put
once a series to make it last). Each begins with durable puts (``RECOVERY_PUTS``), which the
daemon answers once L2 takes blocks, and the daemon is killed once each has had its first
answered: a put answered persisted during recovery, its block not on L2 (nor written there
before the kill, as seconds of L1's demotions would), is lost and seen. A put sent before the
campaign saw the start recovered that is answered ``STORED`` (not ``persisted``) of a key
answered persisted before drops that key's row from before the start (README: of other
bytes), so its key need not be there after the next restart; an ``EXISTS`` answer keeps the
key as recovered, still a must.

L1's capacity changes at every restart. Every round prints one line (seed, moment, counts);
a failed check stops the campaign with the seed that reproduces its round's draws. The clients
and the daemon are stopped and the folders removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.client import (
    Client,
    KvtierError,
    PoolLayout,
    ResourceExhaustedError,
    SharedMemoryPool,
    UnavailableError,
)
from kvtier.client.errors import unclean

TENANTS = ("alice", "bob")
# namespace -> (layer count, chunk bytes, keys): blocks of 4 KiB, 64 KiB, 1 MiB and 5 MiB.
SIZES: dict[str, tuple[int, int, int]] = {
    "s4k": (1, 4 << 10, 48),
    "s64k": (2, 32 << 10, 32),
    "s1m": (2, 512 << 10, 12),
    "s5m": (5, 1 << 20, 4),
    # A growth series' own: durable puts of up to BATCH_KEYS 4 KiB blocks a call, whose rows
    # grow the L2 index by some 750 KiB (both tenants' keys), past index.reserve's 256 KiB.
    "s4kb": (1, 4 << 10, 4096),
}
# Each client process of a tenant owns two namespaces (three in a growth series), so every
# key has one writer.
WORKER_NAMESPACES = (("s4k", "s1m"), ("s64k", "s5m"))
GROWTH_NAMESPACE = "s4kb"
# The keys a call names at most: pages 0 to n-1 store, n to 2n-1 load.
BATCH_KEYS = {GROWTH_NAMESPACE: 256}
SMALL_BATCH_KEYS = 4
# Blocks of 4 KiB (GROWTH_NAMESPACE's layout) of alice's, put durable once a series before
# its first round whose clients start with a restart, never read: rows for that recovery to
# read (0.4-0.8 s of it on two cores), which a hundred-odd checked keys' rows (or 8,192 rows)
# ended before a client had its pools registered, and 16,384 rows (0.2-0.5 s) before most
# clients' first durable puts were sent (2 to 10 of their keys a round).
BALLAST_NAMESPACE = "ballast"
BALLAST_KEYS = 32768
# The ops a client process that starts with a restart begins with: durable puts, sent while
# that start's recovery runs (a durable put is answered once the disk tier takes blocks, after
# recovery; one answered during it was not written there). The round's kill comes once every
# client process has had its first answered.
RECOVERY_PUTS = 3


def batch_keys(ns: str) -> int:
    return BATCH_KEYS.get(ns, SMALL_BATCH_KEYS)


OPS = ("put", "overwrite", "delete", "get", "pinget")
MOMENTS = ("plain", "demotion", "drain", "reload", "recovery", "closed")
# Pinned leases a client process keeps unreleased (of its small blocks), which its session's
# close gives back: the oldest is released past this many.
HELD_LEASES = 2
HELD_NAMESPACES = ("s4k", "s64k")


def layout(ns: str) -> PoolLayout:
    layers, chunk, _ = SIZES[ns]
    return PoolLayout.staging(
        num_layers=layers,
        num_pages=2 * batch_keys(ns),
        block_tokens=16,
        chunk_bytes=chunk,
        kv_count=1,
    )


def key_of(ns: str, index: int) -> bytes:
    """The same keys for both tenants: isolation must come from the daemon."""
    return hashlib.sha256(f"crash {ns} {index}".encode()).digest()


def tag(tenant: str, ns: str, index: int, version: str) -> bytes:
    return hashlib.sha256(f"{tenant}|{ns}|{index}|{version}".encode()).digest()


def content(tenant: str, ns: str, index: int, version: str) -> np.ndarray:
    """A block's bytes: its tag repeated, so a block torn between two versions matches none."""
    n = layout(ns).block_bytes
    return np.frombuffer(tag(tenant, ns, index, version) * (n // 32), dtype=np.uint8)


# ---------------------------------------------------------------------------- client process


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.tenant: str = args.tenant
        self.rng = random.Random(args.seed)
        self.round: int = args.round
        self.stop_file = Path(args.stop_file)
        self.journal = open(args.journal, "a", buffering=1)  # noqa: SIM115 - the process's
        self.shms = {
            ns: SharedMemoryPool.for_layout(layout(ns)) for ns in args.namespaces.split(",")
        }
        if args.with_start:
            # Started with the daemon down: its calls begin as soon as its next start binds
            # the socket (the campaign removed the last one's), while recovery runs.
            self.log(op="waiting")
            listening(args.address.removeprefix("unix:"))
        self.client = Client(args.address, token_file=args.token_file, timeout_s=20)
        self.pools: dict[str, Any] = {
            ns: self.client.register_pool(shm, layout(ns)) for ns, shm in self.shms.items()
        }
        self.counter = 0
        self.counts: Counter[str] = Counter()
        self.held: list[int] = []  # pinned leases kept unreleased
        self.durable_puts = RECOVERY_PUTS if args.with_start else 0  # still to begin with
        self.log(op="ready", t=time.monotonic())

    def log(self, **event: Any) -> None:
        self.journal.write(json.dumps(event) + "\n")

    def pages(self, ns: str) -> np.ndarray:
        return self.shms[ns].array().reshape(2 * batch_keys(ns), layout(ns).block_bytes)

    def run(self) -> None:
        while not self.stop_file.exists():
            ns = self.rng.choice(list(self.pools))
            if GROWTH_NAMESPACE in self.pools and self.rng.random() < 0.5:
                ns = GROWTH_NAMESPACE  # its rows grow the index as few other commits do
            counts = (1, 1, 2, 3) if ns not in BATCH_KEYS else (128, batch_keys(ns))
            indexes = self.rng.sample(range(SIZES[ns][2]), self.rng.choice(counts))
            # Mostly puts in a growth series' namespace: its rows are what grows the index.
            op = self.rng.choices(
                OPS, (3, 4, 1, 3, 2) if ns not in BATCH_KEYS else (8, 1, 1, 2, 1)
            )[0]
            if self.durable_puts:
                self.durable_puts -= 1
                op = "durable_put"
            try:
                getattr(self, op)(ns, indexes)
                self.counts[op] += 1
            except KvtierError as e:
                self.counts[type(e).__name__] += 1
                self.log(op="error", what=type(e).__name__)
                time.sleep(0.05)
        self.counts["leases held at the close"] = len(self.held)
        self.log(op="counts", counts=dict(self.counts))
        self.client.close()  # its session ends with the leases held still pinned

    def put(self, ns: str, indexes: list[int], durable: bool = False) -> None:
        # A growth series' batches are durable: their rows commit in the put, growing the index.
        durable = durable or ns in BATCH_KEYS or self.rng.random() < 0.5
        versions = []
        for page, i in enumerate(indexes):
            self.counter += 1
            v = f"{self.round}.{os.getpid()}.{self.counter}"
            versions.append(v)
            self.pages(ns)[page] = content(self.tenant, ns, i, v)
            self.log(op="put", ns=ns, i=i, v=v, durable=durable, t=time.monotonic())
        keys = [key_of(ns, i) for i in indexes]
        pool = self.pools[ns]
        res = self.client.put(
            pool.pool_id, keys, range(len(keys)), durable=durable, namespace=ns, timeout_s=60
        )
        for n, (i, v) in enumerate(zip(indexes, versions, strict=True)):
            persisted = bool(res.persisted[n]) if res.persisted is not None else False
            self.log(op="put_ack", ns=ns, i=i, v=v, status=res.statuses[n].name, p=persisted)

    def durable_put(self, ns: str, indexes: list[int]) -> None:
        self.put(ns, indexes, durable=True)

    def overwrite(self, ns: str, indexes: list[int]) -> None:
        """A new version of held keys: a put of a key held answers EXISTS and keeps it."""
        self.delete(ns, indexes)
        self.put(ns, indexes)

    def delete(self, ns: str, indexes: list[int]) -> None:
        for i in indexes:  # one key a call: its answer says what became of it
            self.log(op="del", ns=ns, i=i)
            try:
                res = self.client.delete([key_of(ns, i)], namespace=ns)
            except KvtierError as e:
                # A Delete L2 could not remove the rows of fails having dropped the key: it
                # may be gone, or back after a restart.
                done = "the keys are dropped here" in str(e)
                self.log(op="del_failed", ns=ns, i=i, not_done=not_done(e) and not done)
                raise
            self.log(op="del_ack", ns=ns, i=i, deleted=res.deleted, missing=res.missing)

    def get(self, ns: str, indexes: list[int], lease_id: int = 0) -> None:
        keys = [key_of(ns, i) for i in indexes]
        first = batch_keys(ns)
        pages = range(first, first + len(keys))
        res = self.client.get(self.pools[ns].pool_id, keys, pages, lease_id=lease_id, namespace=ns)
        for n, i in enumerate(indexes):
            if res.loaded[n]:
                block = self.pages(ns)[first + n]
                self.log(op="read", ns=ns, i=i, tag=block[:32].tobytes().hex(), whole=whole(block))

    def pinget(self, ns: str, indexes: list[int]) -> None:
        found = self.client.lookup([key_of(ns, i) for i in indexes], pin=True, namespace=ns)
        keep = bool(found.lease_id) and ns in HELD_NAMESPACES and self.rng.random() < 0.5
        try:
            self.get(ns, indexes, found.lease_id)
        finally:
            if keep:
                self.held.append(found.lease_id)
            elif found.lease_id:
                self.client.release(found.lease_id)
        while len(self.held) > HELD_LEASES:  # one more after a get that raised
            self.client.release(self.held.pop(0))


def listening(path: str, timeout_s: float = 60) -> None:
    """Wait until a Unix socket at ``path`` takes connections: a gRPC channel that finds it
    not yet listening backs off for a second before it tries again, past most recoveries."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(path)
                return
            except OSError:
                time.sleep(0.001)


def not_done(error: KvtierError) -> bool:
    """Whether a call's failure is the daemon's answer that it did nothing of the call (a
    refusal: a status it answers after deciding the call, or an UNAVAILABLE it answered, as
    a Delete's "not done" while a stop cuts recovery off), rather than the call cut off with
    its outcome unknown (the daemon killed under it)."""
    return not unclean(error) or (isinstance(error, UnavailableError) and error.answered)


def whole(block: np.ndarray) -> bool:
    """Whether the block is its first 32 bytes repeated (one version's bytes, not torn)."""
    return bool((block.reshape(-1, 32) == block[:32]).all())


# ---------------------------------------------------------------------------- the model


@dataclass
class KeyState:
    sent: list[str] = field(default_factory=list)  # versions put since the last Delete, in order
    stored: str | None = None  # the version held, as far as the answers tell
    must: bool = False  # a put of it was answered persisted, no Delete sent since
    must_before_delete: bool = False
    put_at: float = 0.0  # when its last put was sent (time.monotonic(), the host's clock)
    gone: bool = False  # a Delete of it was answered, no put sent since


class Model:
    def __init__(self) -> None:
        self.keys: dict[tuple[str, str, int], KeyState] = {}
        self.tags: dict[bytes, tuple[str, str, int, str]] = {}
        self.problems: list[str] = []
        self.counts: Counter[str] = Counter()
        # When that daemon was seen recovered (time.monotonic()), where the clients started
        # with its start; a put sent before may have run during its recovery. 0: they did not.
        self.recovered_at = 0.0

    def counts_line(self) -> str:
        line = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        self.counts.clear()
        return line

    def feed(self, tenant: str, event: dict[str, Any]) -> None:
        op = event["op"]
        if op == "ready" and event["t"] < self.recovered_at:
            self.counts["clients ready during recovery"] += 1
        if op in ("error", "counts", "ready", "waiting"):
            return
        k = self.keys.setdefault((tenant, event["ns"], event["i"]), KeyState())
        if op == "put":
            k.sent.append(event["v"])
            k.gone = False
            k.put_at = event.get("t", 0.0)
            if k.put_at < self.recovered_at:
                self.counts["puts sent during recovery"] += 1
            self.tags[tag(tenant, event["ns"], event["i"], event["v"])] = (
                tenant,
                event["ns"],
                event["i"],
                event["v"],
            )
        elif op == "put_ack":
            if event["status"] == "STORED":
                k.stored = event["v"]
                if k.must and not event["p"] and k.put_at < self.recovered_at:
                    # Stored while its key's row from before the start was unread: that row,
                    # read after, is dropped (other bytes; README's L2 restart), and this
                    # version, not persisted, may be lost at a kill.
                    k.must = False
                    self.counts["persisted row replaced during recovery"] += 1
            if event["p"]:
                k.must = True
                self.counts["persisted acks"] += 1
                if k.put_at < self.recovered_at:
                    self.counts["persisted acks of puts sent during recovery"] += 1
        elif op == "del":
            # Until its answer says what became of the key, it may be gone.
            k.must_before_delete = k.must
            k.must = False
        elif op == "del_ack":
            if event["deleted"] or event["missing"]:
                self.counts["delete acks"] += 1
                k.sent.clear()
                k.stored = None
                k.gone = True
            else:  # busy: kept as it was
                k.must = k.must_before_delete
        elif op == "del_failed":
            if event["not_done"]:  # refused, nothing done: kept as it was
                k.must = k.must_before_delete
        elif op == "read":
            self.check_block(
                tenant,
                event["ns"],
                event["i"],
                bytes.fromhex(event["tag"]),
                event["whole"],
                "a client's read",
            )

    def check_block(
        self,
        tenant: str,
        ns: str,
        i: int,
        head: bytes,
        is_whole: bool,
        where: str,
    ) -> str | None:
        """The version a block read holds, after checking it may be there (None: a problem).
        A block whose Delete was answered never is, before a restart or after: the Delete
        fails while a persistent tier keeps a row of its key."""
        k = self.keys.setdefault((tenant, ns, i), KeyState())
        who = self.tags.get(head)
        if who is None or not is_whole:
            self.problems.append(f"{where}: wrong bytes for {tenant}/{ns}/{i} (torn or unknown)")
            return None
        if who[:3] != (tenant, ns, i):
            self.problems.append(f"{where}: {tenant}/{ns}/{i} read the block of {who}")
            return None
        if who[3] not in k.sent:
            state = "deleted" if k.gone else "not sent since its last Delete"
            self.problems.append(f"{where}: {tenant}/{ns}/{i} came back ({state}): {who[3]}")
            return None
        return who[3]

    def observed(self, tenant: str, ns: str, i: int, version: str | None) -> None:
        """What the read after a restart found; checks the durability promises."""
        k = self.keys.setdefault((tenant, ns, i), KeyState())
        self.counts["must be there" if k.must else "must be absent" if k.gone else "either"] += 1
        if k.must and version is None:
            self.problems.append(f"{tenant}/{ns}/{i}: persisted, lost ({k.stored} acked)")
        if (
            k.must
            and version is not None
            and k.stored in k.sent
            and k.sent.index(version) < k.sent.index(k.stored)
        ):
            self.problems.append(f"{tenant}/{ns}/{i}: {version} is back over {k.stored}")
        if k.gone and version is not None:
            self.problems.append(f"{tenant}/{ns}/{i}: deleted, came back as {version}")
        k.stored = version


# ---------------------------------------------------------------------------- the campaign

from disk_faults import fill_disk  # noqa: E402 - tests/ is the script's folder
from harness import DaemonProcess  # noqa: E402

from kvtier.bench.redis_proc import RedisServer  # noqa: E402
from kvtier.tiers.disk.tier import RESERVE_BYTES, RESERVE_NAME  # noqa: E402

# What the daemon logs when a persistent tier could not free slots (``SpaceManager``): the
# rows of the blocks evicted meanwhile may be kept, and those blocks back after a restart (a
# Delete answered leaves none: it fails while it cannot delete its keys' rows).
UNFREED = "slots could not be freed"
# A start's refusal on a full disk where its L2 index cannot open for want of room (SQLite's
# shared memory file, after a clean stop) and no reserve is left to give back for it.
NO_ROOM_TO_OPEN = "cannot open the L2 index"
# What a start on a full disk logs where it starts L2 degraded by it.
DEGRADED_AT_START = "L2 tier degraded: start: the disk of"
# What a removal on a full disk logs where it gives index.reserve back (its size then); a start
# that gives it back for the index's open logs "to open the index" there instead.
GAVE_BACK = re.compile(r"to commit a removal; gave back the (\d+) KiB reserve")
# The full-disk series' filesystem; its L2 of 128 MiB holds every key of both tenants (68 MiB)
# as the 256 MiB of the others do (an eviction would drop blocks answered persisted; theirs
# has the BALLAST_KEYS' 128 MiB more), and of 192 MiB in a growth series, GROWTH_NAMESPACE's
# 32 MiB more.
FULL_FS_BYTES = 256 << 20


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(tempfile.mkdtemp(prefix="kvt-crash-", dir=args.workdir))
        self.sockdir = Path(tempfile.mkdtemp(prefix="kvc-", dir="/tmp"))
        self.tokens = {}
        for t in TENANTS:
            path = self.root / f"{t}.token"
            path.write_text(f"a-long-enough-secret-for-tenant-{t}\n")
            path.chmod(0o600)
            self.tokens[t] = path
        self.redis: RedisServer | None = None
        self.clients: list[subprocess.Popen[bytes]] = []
        self.redis_port = 0
        self.daemon: DaemonProcess | None = None
        self.moments: Counter[str] = Counter()
        self.series = -1
        self.model = Model()
        self.l3 = False
        self.l2_bytes = 0
        self.admit_all = False
        self.starts = 0
        self.full_fs: Path | None = None  # the mounted filesystem of a full-disk series
        self.growth = False  # a full-disk series whose index grows past its reserve's size
        self.ballasted = False  # this series' BALLAST_KEYS are put

    # -- processes

    def start_redis(self) -> None:
        # RedisServer chooses its port again if another process takes it before the bind.
        self.redis = RedisServer(self.root / "redis")
        self.redis.start()
        self.redis_port = self.redis.port

    def overrides(self, rng: random.Random) -> list[str]:
        tenants = ", ".join(f"{{name: {t}, token_file: {self.tokens[t]}}}" for t in TENANTS)
        l1_mib = (16, 24, 32) if self.admit_all else (24, 32, 48, 64)
        sets = [
            f"tenants=[{tenants}, {{name: ops, uids: [0], admin: true}}]",
            # Smaller with every block admitted to L2, so that L1's evictions are demotions.
            f"tiers.l1.capacity_bytes={rng.choice(l1_mib)}MiB",
            "tiers.l1.segment_bytes=8MiB",
            "tiers.l2.enabled=true",
            f"tiers.l2.path={self.root / f'series{self.series}' / 'l2'}",
            f"tiers.l2.capacity_bytes={self.l2_bytes >> 20}MiB",
            "tiers.l2.segment_bytes=8MiB",
            f"tiers.l2.file_bytes={32 if self.full_fs else 64}MiB",
        ]
        if self.admit_all:
            # L1's evictions are demotions then; unprotected, L1 takes new blocks by evicting
            # (protect_s of 2 s answered most puts of a round REJECTED_FULL instead).
            sets += ["tiers.l2.admission=always", "policy.protect_s=0"]
        if self.l3:
            sets += [
                "tiers.l3.enabled=true",
                f"tiers.l3.urls=[redis://127.0.0.1:{self.redis_port}]",
                f"tiers.l3.key_prefix='crash{self.series}:'",
                "tiers.l3.admission=always",
                "tiers.l3.op_timeout_s=10",
                "tiers.l3.connect_timeout_s=10",
                "tiers.l3.probe_deadline_ms=3000",
            ]
        return [a for s in sets for a in ("--set", s)]

    def start_daemon(self, rng: random.Random, wait: bool = True) -> DaemonProcess:
        # L2 grows now and then (a smaller one may drop blocks, as README says, which
        # would be no crash's doing); L1 takes another size at every start.
        filler = self.full_fs / "filler" if self.full_fs else None
        first = filler is not None and not filler.exists()  # the series' first start
        # Room to start in; or, one start in four it waits for, none: a start on a full disk.
        full_start = filler is not None and filler.exists() and wait and rng.random() < 0.25
        if filler is not None and filler.exists() and not full_start:
            os.truncate(filler, max(0, filler.stat().st_size - (2 << 20)))
        if filler is None and rng.random() < 0.2 and self.l2_bytes < 512 << 20:
            self.l2_bytes += 64 << 20
            self.moments["L2 grown at a restart"] += 1
        overrides = self.overrides(rng)
        while True:
            # As deployed: L1 pre-faulted on its thread while the daemon recovers and serves.
            d = DaemonProcess(
                self.root, str(self.sockdir / "d.sock"), overrides, l1_prefault="background"
            )
            self.starts += 1
            d.log_path = self.root / f"kvtierd-{self.starts}.log"  # one start's own log
            self.daemon = d
            try:
                d.start(wait)
            except RuntimeError as e:
                # Short of the room its index, reserve and lock may take, the daemon starts, L2
                # degraded by the full disk (README: L2 against the free space); refused only
                # where the index cannot even open, with no reserve left to give back for it.
                if not (full_start and NO_ROOM_TO_OPEN in str(e)) or filler is None:
                    raise
                self.moments["start on a full disk refused (no room to open the index)"] += 1
                os.truncate(filler, max(0, filler.stat().st_size - (2 << 20)))
                full_start = False
                continue
            break
        if full_start:
            degraded = wait and DEGRADED_AT_START in d.log()
            self.moments["start on a full disk" + (", L2 degraded" if degraded else "")] += 1
        if filler is not None and wait:
            fill_disk(filler)
            left = rng.choice((0, 0, 64 << 10, 256 << 10, 1 << 20))
            if self.growth and (first or rng.random() < 0.25):
                # Room for the WAL to take the index's growth (past the reserve's size) and
                # the reserve to grow to hold it, before the disk fills (at its first start,
                # whose index has every row to add).
                left = 4 << 20
            os.truncate(filler, max(0, filler.stat().st_size - left))
            self.moments[f"full disk, {left >> 10} KiB left"] += 1
        return d

    def workers(
        self, rnd: int, seed: int, with_start: bool = False
    ) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
        out = []
        for t in TENANTS:
            for w, namespaces in enumerate(WORKER_NAMESPACES):
                if self.growth and w == 0:
                    namespaces = (*namespaces, GROWTH_NAMESPACE)
                journal = self.root / f"journal-{rnd}-{t}-{w}.jsonl"
                assert self.daemon is not None
                cmd = [
                    sys.executable,
                    __file__,
                    "worker",
                    "--address",
                    self.daemon.address,
                    "--tenant",
                    t,
                    "--token-file",
                    str(self.tokens[t]),
                    "--namespaces",
                    ",".join(namespaces),
                    "--seed",
                    str(seed * 10 + w),
                    "--round",
                    str(rnd),
                    "--journal",
                    str(journal),
                    "--stop-file",
                    str(self.root / "stop"),
                    *(["--with-start"] if with_start else []),
                ]
                out.append((t, subprocess.Popen(cmd), journal))
        self.clients = [p for _, p, _ in out]
        return out

    # -- one round

    def round(self, rnd: int) -> str:
        seed = self.args.seed * 100_000 + rnd
        rng = random.Random(seed)
        if rnd % self.args.series == 0:
            self.new_series(rng)
        assert self.daemon is not None
        d = self.daemon
        moment = rng.choice(MOMENTS)
        (self.root / "stop").unlink(missing_ok=True)
        in_recovery = self.clients_in_recovery(rnd)
        if in_recovery:
            if not self.ballasted:
                self.ballast(d)
            d.kill()  # idle (the last round's checks done): nothing in flight
            Path(d.socket).unlink(missing_ok=True)  # the clients wait for the next start's
        procs = self.workers(rnd, seed, with_start=in_recovery)
        recovered_at = 0.0
        if in_recovery:
            self.started(rnd, procs, "waiting")
            d = self.start_daemon(rng, wait=False)
            d.wait_ready()
            recovered_at = time.monotonic()
            self.moments["clients started with the start"] += 1
            # Killed once every client has had its first durable put answered (or refused):
            # one answered during recovery had its block on L1 only, which demotes nothing
            # before recovery's end; seconds later, its demotions would have written most
            # such blocks to L2, and the kill would find them there.
            moment = "first durable puts answered"
        self.started(rnd, procs, "ready")
        if in_recovery:
            self.started(rnd, procs, "put_ack", "error")
        deadline = time.monotonic() + (0 if in_recovery else rng.uniform(0.5, 4.0))
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.05, 0.5))
            if rng.random() < 0.15:
                assert d.proc is not None
                d.proc.send_signal(signal.SIGHUP)
                self.moments["sighup (not killed)"] += 1
        if moment == "closed":
            # The clients end their sessions, leases still pinned; what they held is given
            # back by then, or owed (Check counts both).
            (self.root / "stop").touch()
            self.wait_clients(rnd, procs)
            self.check(rnd, d, "with the sessions closed")
        hit = self.kill_at(moment, d, rng)
        self.moments[hit] += 1
        (self.root / "stop").touch()
        self.wait_clients(rnd, procs)
        log = d.log()
        self.model.recovered_at = recovered_at
        if UNFREED in log:
            self.moments["slots not freed (log)"] += 1
        if self.growth:
            self.note_reserve(log)
        ops: Counter[str] = Counter()
        for t, p, journal in procs:
            if p.returncode != 0:
                self.model.problems.append(f"round {rnd}: a client exited {p.returncode}")
            for line in journal.read_text().splitlines():
                event = json.loads(line)
                if event["op"] == "counts":
                    ops.update(event["counts"])
                self.model.feed(t, event)
            journal.unlink()
        if moment == "recovery":
            # L2's blocks are indexed in the first tens of milliseconds after the socket is
            # bound (the daemon serves meanwhile); its log says when that ended.
            d = self.start_daemon(rng, wait=False)
            bound_by = time.monotonic() + 60
            while not os.path.exists(d.socket) and time.monotonic() < bound_by:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.08))
            d.kill()
            recovered = "recovered blocks in" in d.log()
            self.moments["start, after recovery" if recovered else "start, during recovery"] += 1
        d = self.start_daemon(rng)
        self.verify(rnd, d)
        calls = ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))
        return f"moment {hit}; calls: {calls}; checked {self.model.counts_line()}"

    def clients_in_recovery(self, rnd: int) -> bool:
        """Whether round ``rnd``'s clients start with a restart of the idle daemon: every K-th
        round's, but a series' first (its L2 empty) and a full-disk series' (its disk filled
        after a start that waits for recovery)."""
        k = self.args.clients_in_recovery_every
        return k > 0 and rnd % k == k - 1 and rnd % self.args.series != 0 and not self.full_fs

    def ballast(self, d: DaemonProcess) -> None:
        lay = layout(GROWTH_NAMESPACE)
        step = batch_keys(GROWTH_NAMESPACE)
        shm = SharedMemoryPool.for_layout(lay)
        try:
            with Client(d.address, token_file=str(self.tokens["alice"]), timeout_s=60) as c:
                pool = c.register_pool(shm, lay)
                for start in range(0, BALLAST_KEYS, step):
                    keys = [key_of(BALLAST_NAMESPACE, i) for i in range(start, start + step)]
                    c.put(
                        pool.pool_id,
                        keys,
                        range(step),
                        durable=True,
                        namespace=BALLAST_NAMESPACE,
                        timeout_s=60,
                    )
        finally:
            shm.close()
        self.ballasted = True

    def started(
        self, rnd: int, procs: list[tuple[str, subprocess.Popen[bytes], Path]], *events: str
    ) -> None:
        """Wait until every client process has journaled one of ``events`` ("waiting": for
        the daemon's socket; "ready": its pools registered; "put_ack" or "error": its first
        call answered)."""
        ready_by = time.monotonic() + 60
        marks = [f'{{"op": "{event}"' for event in events]

        def journaled(journal: Path) -> bool:
            text = journal.read_text() if journal.exists() else ""
            return any(m in text for m in marks)

        while not all(journaled(j) for *_, j in procs):
            if time.monotonic() > ready_by or any(p.poll() is not None for _, p, _ in procs):
                self.model.problems.append(f"round {rnd}: a client did not journal {events}")
                return
            time.sleep(0.02)

    def note_reserve(self, log: str) -> None:
        """Count what a growth series came for: index.reserve grown past its first size (at
        the kill), and removals on a full disk that gave back a grown reserve (the log)."""
        assert self.full_fs is not None
        try:
            reserve = (self.full_fs / "l2" / RESERVE_NAME).stat().st_blocks * 512
        except FileNotFoundError:
            reserve = 0
        if reserve > RESERVE_BYTES:
            self.moments[f"index.reserve at a kill: {reserve >> 10} KiB"] += 1
        for given in GAVE_BACK.findall(log):
            if int(given) << 10 > RESERVE_BYTES:
                self.moments[f"removal on a grown reserve ({given} KiB given back)"] += 1

    def wait_clients(
        self, rnd: int, procs: list[tuple[str, subprocess.Popen[bytes], Path]]
    ) -> None:
        for _, p, _ in procs:
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                self.model.problems.append(f"round {rnd}: a client process hung")

    def kill_at(self, moment: str, d: DaemonProcess, rng: random.Random) -> str:
        assert d.proc is not None
        if moment == "demotion":
            # No gauge says a demotion runs: its counter moving between two polls 10 ms
            # apart is the nearest sign (L1 full of blocks that only it holds).
            with Client(d.address, timeout_s=5) as admin:
                before = -1
                for _ in range(300):
                    try:
                        now = admin.stats().counter("demoted_blocks")
                    except KvtierError:
                        break
                    if 0 <= before < now:
                        d.kill()
                        return "demotion (counter moving)"
                    before = now
                    time.sleep(0.01)
            d.kill()
            return "demotion (none seen: plain)"
        if moment == "drain":
            d.proc.send_signal(signal.SIGTERM)
            time.sleep(rng.uniform(0.0, 0.1))
            exited = d.proc.poll() is not None
            d.kill()
            return "drain (already stopped)" if exited else "drain"
        if moment == "reload":
            d.proc.send_signal(signal.SIGHUP)
            time.sleep(rng.uniform(0.0, 0.05))
        d.kill()
        return "sessions closed, leases pinned" if moment == "closed" else moment

    def new_series(self, rng: random.Random) -> None:
        if self.daemon is not None:
            self.daemon.kill()
        self.series += 1
        self.model = Model()
        self.ballasted = False
        self.unmount()
        k = self.args.full_disk_every
        if k > 0 and self.series % k == k - 1:
            self.full_fs = self.mount(self.root / f"series{self.series}")
        # One full-disk series in two is a growth series (GROWTH_NAMESPACE's keys in use),
        # counted among the full-disk series (series // k of them before this one).
        self.growth = self.full_fs is not None and self.series // k % 2 == 0
        self.l2_bytes = (
            (256 << 20) + BALLAST_KEYS * (4 << 10)
            if not self.full_fs
            else (192 << 20)
            if self.growth
            else (128 << 20)
        )
        self.admit_all = self.series % 4 in (0, 3)  # with and without L3
        self.l3 = self.args.l3_every > 0 and self.series % self.args.l3_every == 1
        if self.l3 and self.redis is None:
            self.start_redis()
        self.start_daemon(rng)

    def mount(self, folder: Path) -> Path | None:
        """A small ext4 filesystem of 4 KiB blocks (as tests/conftest.py's small_fs),
        loop-mounted on folder; None where that cannot be done here (not root, no loop
        device or mkfs.ext4): the series runs on the folder as the others do."""
        image = self.root / f"{folder.name}.img"
        with open(image, "wb") as f:
            f.truncate(FULL_FS_BYTES)
        folder.mkdir()
        for cmd in (
            ["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)],
            ["mount", "-o", "loop", str(image), str(folder)],
        ):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:
                done = subprocess.CompletedProcess(cmd, 1, "", str(e))
            if done.returncode != 0:
                print(f"no full-disk series: {cmd[0]} failed: {done.stderr.strip()}", flush=True)
                self.moments["full disk skipped"] += 1
                return None
        return folder

    def unmount(self) -> None:
        if self.full_fs is None:
            return
        if self.daemon is not None:
            self.daemon.kill()
        if subprocess.run(["umount", str(self.full_fs)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.full_fs)], capture_output=True)
        self.full_fs = None

    def verify(self, rnd: int, d: DaemonProcess) -> None:
        p = self.model.problems
        with Client(d.address, timeout_s=30) as admin:
            if not admin.health():
                p.append(f"round {rnd}: health not SERVING")
        for t in TENANTS:
            with Client(d.address, token_file=str(self.tokens[t]), timeout_s=60) as c:
                for ns, (_, _, n) in SIZES.items():
                    if ns == GROWTH_NAMESPACE and not self.growth:
                        continue
                    shm = SharedMemoryPool.for_layout(layout(ns))
                    step = batch_keys(ns)
                    try:
                        pool = c.register_pool(shm, layout(ns))
                        pages = shm.array().reshape(2 * step, layout(ns).block_bytes)
                        for start in range(0, n, step):
                            idx = list(range(start, min(n, start + step)))
                            keys = [key_of(ns, i) for i in idx]
                            try:
                                lease = c.lookup(keys, pin=True, namespace=ns).lease_id
                            except ResourceExhaustedError:  # more than L1's pin share
                                lease = c.lookup(keys, namespace=ns).lease_id
                            res = c.get(
                                pool.pool_id, keys, range(len(keys)), lease_id=lease, namespace=ns
                            )
                            if lease:
                                c.release(lease)
                            for k, i in enumerate(idx):
                                version = None
                                if res.loaded[k]:
                                    block = pages[k]
                                    version = self.model.check_block(
                                        t,
                                        ns,
                                        i,
                                        block[:32].tobytes(),
                                        whole(block),
                                        f"round {rnd} after restart",
                                    )
                                self.model.observed(t, ns, i, version)
                        c.unregister_pool(pool.pool_id)
                    finally:
                        shm.close()
        self.check(rnd, d, "after restart")

    def check(self, rnd: int, d: DaemonProcess, when: str) -> None:
        """``kvtier check`` of the daemon's invariants (the pins among them)."""
        check = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "--address", d.address, "check", "--settle", "5"],
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            self.model.problems.append(
                f"round {rnd}: kvtier check {when} exited {check.returncode}: "
                f"{check.stdout}{check.stderr}"
            )

    def close(self) -> None:
        for p in self.clients:
            p.kill()
            p.wait()
        if self.daemon is not None:
            self.daemon.kill()
        if self.redis is not None:
            self.redis.kill()
        self.unmount()
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.sockdir, ignore_errors=True)


def campaign(args: argparse.Namespace) -> int:
    # Stopped from outside (a background job ignores SIGINT), it still stops its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    c = Campaign(args)
    print(f"campaign seed {args.seed}, folder {c.root}", flush=True)
    started = time.monotonic()
    held = 0
    try:
        for rnd in range(args.rounds):
            line = c.round(rnd)
            l3 = (" L3" if c.l3 else "") + (" admit-all" if c.admit_all else "")
            l3 += " full-disk" if c.full_fs else ""
            print(
                f"round {rnd} (seed {args.seed * 100_000 + rnd}, series {c.series}{l3}): {line}",
                flush=True,
            )
            if c.model.problems:
                print("PROBLEMS:\n  " + "\n  ".join(c.model.problems), flush=True)
                if c.daemon is not None:
                    print(c.daemon.log()[-4000:])
                return 1
            held += 1
    finally:
        c.close()
        # Also when stopped early: what the rounds so far hit.
        print(
            f"{held} rounds held every check ({time.monotonic() - started:.0f} s); "
            f"moments: {dict(c.moments)}",
            flush=True,
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    for name in ("address", "tenant", "token-file", "namespaces", "journal", "stop-file"):
        w.add_argument(f"--{name}", required=True)
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--round", type=int, required=True)
    w.add_argument("--with-start", action="store_true", help="wait for the daemon's socket")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--series", type=int, default=25, help="rounds on one L2 folder")
    ap.add_argument("--l3-every", type=int, default=2, help="L3 in every K-th series (0: never)")
    ap.add_argument(
        "--full-disk-every",
        type=int,
        default=3,
        help="L2 on a small filesystem kept full in every K-th series (0: never; needs root)",
    )
    ap.add_argument(
        "--clients-in-recovery-every",
        type=int,
        default=4,
        help="in every K-th round the idle daemon is killed and the clients start with its "
        "restart, running during its recovery of L2 (0: never; not on a full disk)",
    )
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the folders")
    args = ap.parse_args()
    # A client's session ending with the daemon killed is the point here, not news.
    logging.getLogger("kvtier.client.session").setLevel(logging.ERROR)
    if args.cmd == "worker":
        Worker(args).run()
        return 0
    return campaign(args)


if __name__ == "__main__":
    sys.exit(main())
