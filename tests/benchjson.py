"""Helpers of the benchmark tests (tests/bench): run one in process, check its ratios."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.bench import run_bench

RunJson = Callable[..., dict[str, Any]]


def make_run_json(capsys: pytest.CaptureFixture[str]) -> RunJson:
    def run(name: str, *args: str) -> dict[str, Any]:
        assert run_bench(name, list(args), as_json=True) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) > 1, "figures are printed before the JSON line"
        figures = json.loads(lines[-1])
        assert isinstance(figures, dict)
        return figures

    return run


def assert_ratio(figures: dict[str, Any], name: str, value: float, baseline: float) -> None:
    """``figures[name]`` is ``value / baseline`` (both as reported, to their rounding)."""
    assert value > 0 and baseline > 0, name
    assert figures[name] == pytest.approx(value / baseline, rel=2e-3, abs=1e-3), name
