"""``kvtier bench l2`` runs end to end on a tiny working set and ends with its JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench import run_bench


def test_l2_bench_prints_figures_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "bench"
    args = ["--dir", str(base), "--blocks", "16", "--block-bytes", "262144", "--batch", "8"]
    assert run_bench("l2", [*args, "--rounds", "1"], as_json=True) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    for name in (
        "read_gbps",
        "write_gbps",
        "raw_read_gbps",
        "raw_write_gbps",
        "read_ratio",
        "write_ratio",
        "checksum_gbps",
    ):
        assert figures[name] > 0, name
    assert figures["checksum_failures"] == 0
    assert not base.exists() or not any(base.iterdir())
