"""Sizes and counts as messages spell them (``kvtier.tiers.sizes``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.tiers.sizes import counted


def test_regression_messages_said_1_blocks():
    """`kvtier stats` printed "1 blocks" and `kvtier check` "1 blocks' pin counts differ":
    every count in a message now goes through ``counted``, singular for 1 alone."""
    assert counted(1, "block") == "1 block"
    assert [counted(n, "block") for n in (0, 2, 11)] == ["0 blocks", "2 blocks", "11 blocks"]
    phrase = ("block's pin count differs", "blocks' pin counts differ")
    assert counted(1, *phrase) == "1 block's pin count differs"
    assert counted(3, *phrase) == "3 blocks' pin counts differ"
    assert counted(1024, "key", spec=",") == "1,024 keys"
    assert counted(1, "session", spec=">4") == "   1 session"


@pytest.mark.parametrize("tier", ["L0 device arena", "L1 host arena", "L2 disk tier"])
def test_regression_tier_open_logs_gave_segments_under_a_mib_as_0_mib(
    tier: str, disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The line each tier logs as it opens gave its size and its segments in whole MiB,
    rounded down: ``segment_bytes: 64KiB`` (the config takes 4 KiB and up) read "24 segments
    of 0 MiB", 1.5 MiB "1 MiB". They are now spelled as the config does. (L0 on its CPU ops.)"""
    from kvtier.tiers.device import CpuOps, DeviceTier
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.host import HostArena

    size, segment = 1536 << 10, 64 << 10
    with caplog.at_level(logging.INFO, logger="kvtier.tiers"):
        if tier.startswith("L0"):
            DeviceTier(size, segment, ops=CpuOps()).close()
        elif tier.startswith("L1"):
            HostArena(size, segment).close()
        else:
            DiskTier(disk_dir, size, segment).close()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tier)]
    assert "1536KiB" in line and "24 segments of 64KiB" in line, line
    assert " MiB" not in line, line
