"""Sizes and counts as messages spell them (``kvtier.tiers.sizes``)."""

from __future__ import annotations

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
