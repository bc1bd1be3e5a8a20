"""``kvtier bench l3`` runs end to end on a tiny working set against its own redis-server,
gives its figures as the one JSON object on stdout (the report on stderr), and leaves no
server behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchjson import run_json


def _servers_under(base: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "redis-server" in line and str(base) in line]


def test_l3_bench_prints_figures_and_cleans_up(tmp_path: Path) -> None:
    base = tmp_path / "bench"
    base.mkdir()
    args = ["--dir", str(base), "--blocks", "8", "--block-bytes", "262144", "--batch", "2"]
    figures = run_json("l3", *args, "--rounds", "1", "--probes", "20", report="L3 bench (single")
    for name in (
        "put_gbps",
        "raw_set_gbps",
        "put_ratio",
        "raw_set_tier_client_gbps",
        "put_ratio_tier_client",
        "get_gbps",
        "raw_get_gbps",
        "get_ratio",
        "raw_get_tier_client_gbps",
        "get_ratio_tier_client",
        "probe_us",
        "raw_getrange_us",
        "probe_ratio",
    ):
        assert figures[name] > 0, name
    assert figures["chain"] == 64
    assert figures["socket_read_bytes"] == 1 << 20
    assert figures["read_bad_checksum"] == 0 and figures["probe_late"] == 0
    assert not any(base.iterdir())
    assert _servers_under(base) == []
