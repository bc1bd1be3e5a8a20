"""``kvtier bench rpc`` at a tiny size: every phase for each client count, ratios to both
pings (asyncio's loop and uvloop), the daemon on the loop asked for."""

from __future__ import annotations

import pytest
from benchjson import assert_ratio, run_json


@pytest.mark.slow  # a daemon, a ping server and client processes, ~4 s: `make test-slow`
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_rpc_bench_reports_each_call_against_the_bare_ping(loop: str) -> None:
    f = run_json(
        "rpc", "--ops", "20", "--warmup", "2", "--rounds", "1", "--clients", "2,1",
        "--event-loop", loop, report="single-block RPCs, 4096 B blocks",
    )  # fmt: skip
    assert f["daemon_event_loop"] == loop
    assert f["clients"] == [1, 2]
    assert f["block_bytes"] == 4096
    for k in (1, 2):
        per_op = f[f"clients_{k}"]
        assert set(per_op) == {"ping", "ping_uv", "health", "put", "get", "lookup"}
        for op, fig in per_op.items():
            assert 0 < fig["p50_ms"] <= fig["p99_ms"], op
            assert fig["ops_s"] > 0, op
            # Counted in clock ticks: a phase this short may see none on either side.
            assert fig["client_cpu_us"] >= 0 and fig["server_cpu_us"] >= 0, op
    r, one, two = f["ratios"], f["clients_1"], f["clients_2"]
    for op in ("health", "put", "get", "lookup"):
        assert_ratio(r, f"{op}_p50_vs_ping", one[op]["p50_ms"], one["ping"]["p50_ms"])
        assert_ratio(r, f"{op}_p50_vs_ping_2clients", two[op]["p50_ms"], two["ping"]["p50_ms"])
        assert_ratio(r, f"{op}_ops_vs_ping", two[op]["ops_s"], two["ping"]["ops_s"])
        uv1, uv2 = one["ping_uv"], two["ping_uv"]
        assert_ratio(r, f"{op}_p50_vs_ping_uvloop", one[op]["p50_ms"], uv1["p50_ms"])
        assert_ratio(r, f"{op}_p50_vs_ping_uvloop_2clients", two[op]["p50_ms"], uv2["p50_ms"])
        assert_ratio(r, f"{op}_ops_vs_ping_uvloop", two[op]["ops_s"], uv2["ops_s"])
