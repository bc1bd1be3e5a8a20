"""``kvtier bench l1`` at a tiny size: figures, the same-thread baseline, ratios."""

from __future__ import annotations

from benchjson import assert_ratio, run_json


def test_l1_bench_reports_ratios_to_a_copy_with_the_daemons_thread_count() -> None:
    f = run_json(
        "l1",
        *("--batch", "4", "--rounds", "2", "--lookups", "3", "--lookup-keys", "8"),
        *("--copy-threads", "3"),
        report="medians of 2 rounds",
    )
    assert f["copy_threads"] == 3
    assert (f["batch_blocks"], f["rounds"], f["lookup_keys"]) == (4, 2, 8)
    assert f["block_bytes"] == 2 << 20
    for name in ("put_gbps", "get_gbps", "memcpy_gbps", "memcpy_1thread_gbps"):
        assert f[name] > 0, name
    assert_ratio(f, "put_ratio", f["put_gbps"], f["memcpy_gbps"])
    assert_ratio(f, "get_ratio", f["get_gbps"], f["memcpy_gbps"])
    assert 0 < f["lookup_p50_ms"] <= f["lookup_p99_ms"]
    assert_ratio(f, "lookup_vs_health_p50", f["lookup_p50_ms"], f["health_p50_ms"])
