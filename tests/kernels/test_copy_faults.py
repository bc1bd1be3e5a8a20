"""The copy kernel survives memory truncated under it, and leaves every other SIGBUS alone."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from kvtier.kernels import _copy
from kvtier.kernels.copy import MemoryFault, copy_ranges, ensure_fault_handler

SIZE = 1 << 20


@pytest.fixture(autouse=True)
def guarded_copies():
    """The kernel's SIGBUS handler is current, as the daemon makes it at start: pytest's
    faulthandler, or a module a test imported, may have replaced it since the kernel was
    imported (these tests then died of SIGBUS whenever ``tests/tiers`` ran with them)."""
    ensure_fault_handler()


@pytest.fixture
def truncated():
    """A shared mapping of SIZE bytes whose file now has only its first page."""
    fd = os.memfd_create("kvtier-test")
    os.ftruncate(fd, SIZE)
    m = mmap.mmap(fd, SIZE)
    arr = np.frombuffer(m, dtype=np.uint8)
    os.ftruncate(fd, 4096)
    yield arr  # the mapping goes with the last view of it
    os.close(fd)


@pytest.mark.parametrize("threads", [1, 4])
def test_reading_truncated_memory_raises_memory_fault(truncated, threads):
    dst = np.zeros(SIZE, dtype=np.uint8)
    offsets = np.arange(0, SIZE, 1 << 16, dtype=np.uint64)
    with pytest.raises(MemoryFault) as info:
        _copy.copy(dst, truncated, offsets, offsets, 1 << 16, threads)
    assert info.value.side == "src"
    assert 4096 <= info.value.offset < SIZE
    assert info.value.address == truncated.ctypes.data + info.value.offset
    assert "SIGBUS" in str(info.value)


@pytest.mark.parametrize("threads", [1, 4])
def test_writing_truncated_memory_raises_memory_fault(truncated, threads):
    src = np.ones(SIZE, dtype=np.uint8)
    offsets = np.arange(0, SIZE, 1 << 16, dtype=np.uint64)
    with pytest.raises(MemoryFault) as info:
        _copy.copy(truncated, src, offsets, offsets, 1 << 16, threads)
    assert info.value.side == "dst"
    assert info.value.offset >= 4096


def test_the_kernel_keeps_working_after_faults(truncated):
    for _ in range(100):
        with pytest.raises(MemoryFault):
            copy_ranges(
                np.zeros(64, np.uint8),
                truncated,
                np.zeros(1, np.uint64),
                np.array([8192], np.uint64),
                64,
            )
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    assert copy_ranges(dst, src, np.array([0], np.uint64), np.array([0], np.uint64), 256) == 256
    assert np.array_equal(dst, src)
    # The first page is still there and copies.
    out = np.zeros(64, np.uint8)
    copy_ranges(out, truncated, np.zeros(1, np.uint64), np.zeros(1, np.uint64), 64)


def test_faults_in_several_threads_at_once(truncated):
    errors: list[BaseException] = []

    def worker() -> None:
        dst = np.zeros(SIZE, dtype=np.uint8)
        for _ in range(200):
            try:
                copy_ranges(dst, truncated, np.zeros(1, np.uint64), np.zeros(1, np.uint64), SIZE)
            except MemoryFault:
                continue
            except BaseException as e:
                errors.append(e)
                return
            errors.append(AssertionError("a copy of truncated memory did not fault"))
            return

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


UNGUARDED = """
    import mmap, os, sys
    import numpy as np
    {setup}
    from kvtier.kernels import _copy
    {after}
    fd = os.memfd_create("t")
    os.ftruncate(fd, 1 << 20)
    arr = np.frombuffer(mmap.mmap(fd, 1 << 20), dtype=np.uint8)
    os.ftruncate(fd, 0)
    print("reading", flush=True)
    print(int(arr[12345]))
"""


def test_a_fault_outside_a_copy_still_kills_the_process():
    proc = _run(UNGUARDED.format(setup="", after=""))
    assert proc.stdout.strip() == "reading"
    assert proc.returncode == -signal.SIGBUS


def test_a_fault_outside_a_copy_reaches_faulthandler_installed_before():
    proc = _run(UNGUARDED.format(setup="import faulthandler; faulthandler.enable()", after=""))
    assert proc.returncode == -signal.SIGBUS
    assert "Fatal Python error: Bus error" in proc.stderr


def test_a_handler_installed_later_is_chained_after_the_guard_is_taken_back():
    proc = _run(
        UNGUARDED.format(
            setup="",
            after=(
                "import faulthandler; faulthandler.enable()\n"
                "    assert not _copy.fault_handler_installed()\n"
                "    assert _copy.install_fault_handler() and _copy.fault_handler_installed()"
            ),
        )
    )
    assert proc.returncode == -signal.SIGBUS, proc.stderr
    assert "Fatal Python error: Bus error" in proc.stderr


def test_a_sigbus_sent_with_kill_is_not_swallowed():
    proc = _run(
        """
        import os, signal
        from kvtier.kernels import _copy
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived")
        """
    )
    assert proc.returncode == -signal.SIGBUS
    assert "survived" not in proc.stdout


def test_ensure_fault_handler_is_idempotent():
    ensure_fault_handler()
    assert _copy.fault_handler_installed()
    assert ensure_fault_handler() is False
