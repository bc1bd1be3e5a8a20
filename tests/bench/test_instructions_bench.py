"""``kvtier bench instructions`` counts the daemon's instructions per call under callgrind at a
tiny size; a host without valgrind is told what to install (exit status 2), not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchjson import assert_ratio, only_json, run_json


@pytest.mark.slow  # two daemons and ping servers under callgrind, ~60 s: `make test-slow`
def test_instructions_bench_counts_each_call_against_health_and_the_ping() -> None:
    f = run_json(
        "instructions", "--calls", "10", "--warmup", "2", "--repeats", "2", "--idle-s", "0.2",
        report="daemon instructions per single-block call",
    )  # fmt: skip
    assert (f["calls"], f["repeats"], f["block_bytes"]) == (10, 2, 4096)
    per_call = f["instructions_per_call"]
    assert set(per_call) == {"ping", "health", "put", "get", "lookup"}
    # Any gRPC call runs well over 10k instructions in a Python server; a count of the client's
    # side or of nothing would not.
    assert all(n > 10_000 for n in per_call.values()), per_call
    # A Put parses a request, stores a block and copies its page: more than a health Check.
    assert per_call["put"] > per_call["health"], per_call
    for op in ("ping", "put", "get", "lookup"):
        assert_ratio(f["ratios"], f"{op}_vs_health", per_call[op], per_call["health"])
    for op in ("health", "put", "get", "lookup"):
        assert_ratio(f["ratios"], f"{op}_vs_ping", per_call[op], per_call["ping"])
    # Per daemon process: each repeat's count less that process's health count.
    each = f["per_repeat"]
    for op in ("put", "get", "lookup"):
        diffs = [a - h for a, h in zip(each[op], each["health"], strict=True)]
        # Each figure is rounded to 4 digits: a difference of two is off by up to 100.
        assert min(diffs) - 100 <= f["above_health"][op] <= max(diffs) + 100, op
    assert all(v >= 0 for v in f["spread"].values()) and f["idle_instructions_per_s"] >= 0
    assert all(v > 0 for v in f["ms_per_call"].values())


@pytest.mark.parametrize("as_json", [False, True])
def test_instructions_bench_without_valgrind_says_what_to_install(
    tmp_path: Path, as_json: bool
) -> None:
    """valgrind is hidden by a PATH that holds nothing."""
    args = ["bench", *(["--json"] if as_json else []), "instructions"]
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    message = "kvtier bench instructions needs valgrind"
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "apt-get install valgrind" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    if as_json:
        error = only_json(r.stdout)
        assert error["ok"] is False and message in error["error"]
    else:
        assert r.stdout == ""
