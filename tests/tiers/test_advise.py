"""``tiers.advise``: madvise over a mapping in steps, without the GIL."""

from __future__ import annotations

import errno
import mmap
import re

from kvtier.tiers import advise


def _resident_kib(start: int) -> int:
    """Rss of the mapping that starts at ``start``, from /proc/self/smaps."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                found = int(line.split("-", 1)[0], 16) == start
            elif found and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("mapping not found")


def test_populate_write_faults_in_every_step_and_the_tail_and_dontneed_empties_it():
    size = 2 * advise.CHUNK + 3 * mmap.PAGESIZE  # two whole steps and a short one
    buf = mmap.mmap(-1, size)
    try:
        base = advise.address(buf)
        assert _resident_kib(base) == 0
        assert advise.advise(base, size, advise.POPULATE_WRITE) == 0
        assert _resident_kib(base) == size // 1024
        assert advise.advise(base, size, advise.DONTNEED) == 0
        assert _resident_kib(base) == 0
        buf.close()  # address() left no export behind
    finally:
        if not buf.closed:
            buf.close()


def test_a_refused_advice_returns_its_errno():
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        assert advise.advise(advise.address(buf), len(buf), 12345) == errno.EINVAL
    finally:
        buf.close()
