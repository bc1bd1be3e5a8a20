"""Fixtures for tier tests: a scratch folder on a real disk, reproducible block contents, and a
small loop-mounted filesystem (``small_fs``, in tests/conftest.py) for running out of space."""

from __future__ import annotations

import hashlib
import shutil
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
def faulty_files() -> FaultyFiles:
    return FaultyFiles()
