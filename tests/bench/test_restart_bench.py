"""``kvtier bench restart`` at a tiny size: start times, recovered rows, put rates."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchjson import assert_ratio, run_json


@pytest.mark.slow  # nine daemon starts and two fills, ~7 s: `make test-slow`
def test_restart_bench_times_starts_against_their_baselines(tmp_path: Path) -> None:
    base = tmp_path / "bench"
    f = run_json(
        "restart",
        *("--rows", "300", "--batch", "128", "--l1", "64MiB", "--repeats", "1"),
        *("--big-blocks", "2", "--io-threads", "2", "--dir", str(base)),
        report="start to SERVING, medians of 1",
    )
    assert (f["rows"], f["repeats"], f["l1_bytes"]) == (300, 1, 64 << 20)
    # The restarted daemon found every row the fill wrote, each time.
    assert f["l2_blocks_after_restart"] == [300]
    for kind in ("empty", "full", "full_index", "l1", "touch"):
        assert len(f["all_s"][kind]) == 1 and f["all_s"][kind][0] > 0, kind
    assert f["index_ready_s"] >= f["start_full_s"] > 0
    assert_ratio(f, "full_vs_empty", f["start_full_s"], f["start_empty_s"])
    assert_ratio(f, "l1_start_vs_touch", f["start_l1_s"], f["first_touch_s"])
    assert_ratio(f, "durable_4k_ratio", f["durable_4k_blocks_s"], f["raw_4k_blocks_s"])
    assert_ratio(f, "durable_2m_ratio", f["durable_2m_gbps"], f["raw_2m_gbps"])
    assert not any(base.iterdir()), "the scratch folder is removed"
