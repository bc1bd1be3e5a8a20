"""``kvtier bench vllm`` at a tiny size, end to end with real vLLM engines: it finishes, and
so every kvtier run's outputs were token for token those of plain vLLM with the prefix in its
own cache (the bench fails otherwise), each kvtier run loaded the whole prefix, and each L2
run promoted it from disk; with --json its stdout is the JSON object alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
from benchjson import only_json

pytestmark = pytest.mark.timeout(900)


def test_bench_vllm_checks_outputs_and_reports_every_case(tmp_path):
    size = ["--prefix-tokens", "512", "--reps", "2", "--batch", "2", "--max-tokens", "8"]
    command = ["bench", "vllm", "--json", *size, "--l2-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *command],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = only_json(proc.stdout)  # the figures alone; the report went to stderr
    assert "TTFT speedup over plain vLLM" in proc.stderr
    assert result["outputs_identical"] is True
    assert result["prefix_tokens"] == 512 and result["reps"] == 2
    assert result["load_mode"] == "auto"
    for case in ("kvtier_l1", "kvtier_l2", "vllm_cached"):
        assert result["ttft_speedup"][case] > 0 and result["throughput_ratio"][case] > 0
        assert len(result["runs"]["ttft_s"][case]) == 2
    assert list(tmp_path.iterdir()) == []  # the L2 folder it made is gone
