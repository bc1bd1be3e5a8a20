"""Benchmarks behind ``kvtier bench NAME``: each reports figures next to a limit measured in
the same run. Each entry takes the benchmark's own arguments and whether to end with one JSON
line, and returns an exit status."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.bench import l2

BENCHMARKS: dict[str, Callable[[list[str], bool], int]] = {
    "l2": l2.main,
}


def run_bench(what: str, argv: list[str], as_json: bool = False) -> int:
    return BENCHMARKS[what](list(argv), as_json)
