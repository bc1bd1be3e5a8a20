"""``kvtier bench flood`` at a tiny size: the victim's figures with and without the flood,
and the flood's calls, each refused as the daemon refuses a Put naming no session."""

from __future__ import annotations

import pytest
from benchjson import run_json


@pytest.mark.slow  # a daemon and a flooding process, ~5 s: `make test-slow`
def test_flood_bench_reports_the_victims_lookups_with_and_without_the_flood() -> None:
    f = run_json(
        "flood", "--calls", "4", "--request-bytes", "200KB", "--seconds", "0.5",
        report="victim lookup flooded",
    )  # fmt: skip
    assert f["calls"] == 4 and f["request_bytes"] == 200_000
    for phase in ("quiet", "flooded"):
        fig = f[phase]
        assert fig["calls"] > 0, phase
        assert 0 < fig["p50_ms"] <= fig["p99_ms"] <= fig["max_ms"], phase
    assert set(f["flood_codes"]) == {"NOT_FOUND"}
    assert f["flood_calls_per_s"] > 0
