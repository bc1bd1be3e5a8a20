"""Crash safety of L2: a writer killed with SIGKILL in the middle of heavy writes (slots being
evicted and reused as it goes) loses nothing it reported committed and never serves a block
that fails verification. Then one committed slot is corrupted on purpose."""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.tiers.disk import DiskTier, ReadItem

CAPACITY = 8 << 20
SEGMENT = 1 << 20
WRITER = Path(__file__).with_name("crash_writer.py")
Block = Callable[[int, int], tuple[bytes, bytes]]


def _run_and_kill(directory: Path, commits: int, timeout_s: float = 60.0) -> list[str]:
    """Start the writer, SIGKILL it once it reported ``commits`` commits, return its lines."""
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(directory), str(CAPACITY), str(SEGMENT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    seen = 0
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while seen < commits:
            if time.monotonic() > deadline or proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.poll() is not None else ""
                pytest.fail(f"writer stopped or stalled after {seen} commits: {err}")
            if not sel.select(timeout=1.0):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            buf += chunk
            *done, buf = buf.split(b"\n")
            for line in done:
                lines.append(line.decode())
                seen += line.startswith(b"C ")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        sel.close()
    # Lines printed before the kill still count: each was printed after its commit.
    rest = proc.stdout.read()
    proc.stdout.close()
    proc.stderr.close()
    lines.extend(line.decode() for line in (buf + rest).split(b"\n") if line)
    assert proc.returncode == -signal.SIGKILL
    return lines


def test_sigkill_mid_write_loses_nothing_committed_and_serves_nothing_corrupt(
    disk_dir: Path, make_block: Block, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer makes ``write`` batches of BlockRefs from two threads sharing the group
    commit (the store's path)."""
    lines = _run_and_kill(disk_dir, commits=600)
    committed = {int(x[2:]) for x in lines if x.startswith("C ")}
    dropped = {int(x[2:]) for x in lines if x.startswith("D ")}
    must_have = committed - dropped
    assert dropped, "the writer never reused a slot; make the tier smaller"
    assert len(must_have) > 20

    sizes = (16_384, 100_000, 262_144)  # as crash_writer.SIZES

    with DiskTier(disk_dir, CAPACITY, SEGMENT, file_bytes=SEGMENT * 4) as tier:
        recovered = {r.key: r for r in tier.recover()}
        ids = {make_block(i, 8)[0]: i for i in committed | set(range(max(committed) + 64))}
        # Every recovered row is a block the writer made, stored with its own size.
        for key, r in recovered.items():
            assert key in ids, "a row for a key the writer never wrote"
            assert r.nbytes == sizes[ids[key] % len(sizes)]
        missing = [i for i in must_have if make_block(i, 8)[0] not in recovered]
        assert not missing, f"committed blocks lost: {missing[:10]}"

        def read_all() -> dict[int, bytes | None]:
            out: dict[int, bytes | None] = {}
            for key, r in recovered.items():
                buf = bytearray(r.nbytes)
                ok = tier.read_items([ReadItem(r.slot, buf, r.nbytes, r.checksum, key)])[0]
                out[ids[key]] = bytes(buf) if ok else None
            return out

        got = read_all()
        for i, data in got.items():
            assert data == make_block(i, sizes[i % len(sizes)])[1], f"block {i} not byte-exact"
        assert tier.stats().counters["checksum_failures"] == 0

        # Corrupt one committed block on purpose: it becomes a counted, logged miss.
        victim = sorted(must_have)[len(must_have) // 2]
        vkey = make_block(victim, 8)[0]
        path, offset = tier.slot_location(recovered[vkey].slot)
        with open(path, "r+b") as f:
            f.seek(offset + 4096)
            f.write(b"\x00garbage\x00" * 8)
            f.flush()
            os.fsync(f.fileno())
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            got = read_all()
        assert got[victim] is None
        assert vkey.hex() in caplog.text
        stats = tier.stats()
        assert stats.counters["checksum_failures"] == 1
        assert stats.gauges["quarantined_slots"] == 1
        for i, data in got.items():
            if i != victim:
                assert data == make_block(i, sizes[i % len(sizes)])[1]
