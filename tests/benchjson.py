"""Helpers of the benchmark tests (tests/bench): run one as `kvtier bench NAME --json`, check
its ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

RunJson = Callable[..., dict[str, Any]]


def bench_cli(name: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """``kvtier bench NAME *args --json`` in a fresh interpreter, stdout and stderr apart."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "bench", name, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def only_json(stdout: str) -> dict[str, Any]:
    """The one JSON object that is all of ``stdout`` (one line), for ``jq`` to parse."""
    assert stdout.endswith("\n") and stdout.count("\n") == 1, stdout
    parsed = json.loads(stdout)
    assert isinstance(parsed, dict), stdout
    return parsed


def run_json(name: str, *args: str, report: str) -> dict[str, Any]:
    """Run ``kvtier bench NAME *args --json``; stdout must hold its figures alone, as one
    JSON object, and stderr the text report, which must include ``report``."""
    r = bench_cli(name, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert report in r.stderr, r.stderr[-4000:]
    return only_json(r.stdout)


def assert_ratio(figures: dict[str, Any], name: str, value: float, baseline: float) -> None:
    """``figures[name]`` is ``value / baseline`` (both as reported, to their rounding)."""
    assert value > 0 and baseline > 0, name
    assert figures[name] == pytest.approx(value / baseline, rel=2e-3, abs=1e-3), name
