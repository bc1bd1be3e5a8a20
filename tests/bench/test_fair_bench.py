"""``kvtier bench fair`` at a tiny size: one tenant's one-key calls alone and beside another
tenant's batches, and the batches' rate alone and beside them."""

from __future__ import annotations

import pytest
from benchjson import run_json


@pytest.mark.slow  # a daemon and a batching process, ~5 s: `make test-slow`
@pytest.mark.parametrize("op", ["lookup", "get"])
def test_fair_bench_reports_the_small_calls_alone_and_beside_the_batches(op: str) -> None:
    f = run_json(
        "fair", "--op", op, "--calls", "2", "--batch-keys", "256", "--seconds", "0.5",
        report=f"tenant small {op} beside",
    )  # fmt: skip
    assert (f["op"], f["calls"], f["batch_keys"]) == (op, 2, 256)
    for phase in ("alone", "beside"):
        fig = f[phase]
        assert fig["calls"] > 0, phase
        assert 0 < fig["p50_ms"] <= fig["p99_ms"] <= fig["max_ms"], phase
        batch = f[f"batch_{phase}"]
        assert batch["calls_per_s"] > 0 and batch["keys_per_s"] == pytest.approx(
            batch["calls_per_s"] * 256, rel=1e-3
        ), phase
    assert f["p50_ratio"] > 0 and f["p99_ratio"] > 0
