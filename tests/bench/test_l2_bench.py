"""``kvtier bench l2`` at a tiny size: through the daemon, next to raw I/O, cleaned up."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchjson import assert_ratio, run_json


@pytest.mark.slow  # daemon restarts and raw O_DIRECT runs, ~4 s: `make test-slow`
def test_l2_bench_measures_the_daemon_against_raw_io_and_cleans_up(tmp_path: Path) -> None:
    base = tmp_path / "bench"
    f = run_json(
        "l2",
        *("--dir", str(base), "--blocks", "8", "--block-bytes", "262144", "--batch", "4"),
        *("--rounds", "2", "--io-threads", "2", "--keep-cache"),
        report="durable put, first fill:",
    )
    assert (f["blocks"], f["batch"], f["io_threads"], f["rounds"]) == (8, 4, 2, 2)
    assert f["raw_io"] in ("o_direct", "buffered")
    assert f["page_cache_dropped"] is False  # --keep-cache: a test leaves the cache alone
    # One write pass per round, the first a first fill; one cold read after each.
    assert len(f["put_gbps_all"]) == 2
    assert len(f["raw_write_fill_gbps_all"]) == len(f["raw_write_overwrite_gbps_all"]) == 2
    assert len(f["daemon_start_s"]) == 3
    assert f["put_first_fill_gbps"] == f["put_gbps_all"][0]
    assert f["raw_write_first_fill_gbps"] == f["raw_write_fill_gbps_all"][0]
    assert_ratio(
        f, "put_first_fill_ratio", f["put_first_fill_gbps"], f["raw_write_first_fill_gbps"]
    )
    # With two passes the overwrite figures are those of the second alone.
    assert f["put_gbps"] == f["put_gbps_all"][1]
    assert f["raw_write_gbps"] == f["raw_write_overwrite_gbps_all"][1]
    assert_ratio(f, "put_ratio", f["put_gbps"], f["raw_write_gbps"])
    assert_ratio(f, "get_cold_ratio", f["get_cold_gbps"], f["raw_read_gbps"])
    assert not any(base.iterdir()), "the scratch folder is removed"
