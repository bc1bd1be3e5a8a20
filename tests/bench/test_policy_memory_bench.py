"""``kvtier bench policy_memory`` at a tiny size: every figure, as the one JSON object on
stdout, the table of bytes per block on stderr."""

from __future__ import annotations

import pytest
from benchjson import run_json


@pytest.mark.slow  # measures every structure under tracemalloc, ~7 s of CPU: `make test-slow`
def test_policy_memory_bench_reports_bytes_per_block_of_every_structure() -> None:
    f = run_json("policy_memory", "--blocks", "2000", report="bytes per block at 2,000 blocks")
    assert f["blocks"] == 2000
    for tiers in (1, 2, 4):
        assert f[f"index_{tiers}_tier_B"] > 0
        # Each figure is rounded to 0.1 B on its own.
        total = f[f"index_{tiers}_tier_B"] + f["heat_table_B"]
        assert f[f"index_{tiers}_tier_plus_heat_B"] == pytest.approx(total, abs=0.15)
    for name in ("heat", "density", "lru", "arc"):
        assert 0 < f[f"policy_{name}_B"] <= f[f"policy_{name}_hinted_B"], name
    for name in ("heat", "density"):
        assert f[f"history_{name}_B"] > 0 and f[f"history_{name}_per_remembered_B"] > 0, name
