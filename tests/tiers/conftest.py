"""Fixtures for tier tests: a scratch folder on a real disk, reproducible block contents, and a
small loop-mounted filesystem for running out of space."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from disk_faults import FaultyFiles

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A fresh folder under the worktree's ``var/``: a real disk filesystem, so O_DIRECT is
    exercised (pytest's tmp_path may be on tmpfs elsewhere)."""
    base = REPO / "var" / "test-tiers"
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="l2-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def block_data(i: int, nbytes: int) -> bytes:
    return np.random.default_rng(i).bytes(nbytes)


@pytest.fixture
def make_block() -> Callable[[int, int], tuple[bytes, bytes]]:
    """(key, bytes) of block ``i``, the same in every process."""
    return lambda i, nbytes: (block_key(i), block_data(i, nbytes))


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB ext4 filesystem, loop-mounted, for tests that fill a disk. Skips when the
    sandbox cannot mount one (needs root, loop devices and mkfs.ext4)."""
    if os.geteuid() != 0:
        pytest.skip("loop-mounting a small filesystem needs root")
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("mkfs.ext4 or mount is not installed")
    image = tmp_path / "small.img"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(48 << 20)
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    mounted = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount a filesystem here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def faulty_files() -> FaultyFiles:
    return FaultyFiles()
