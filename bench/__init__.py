"""Benchmarks, run as ``kvtier bench NAME [--json]``. Each prints its figures next to a
baseline measured in the same run; with ``--json`` the last line is one JSON object."""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "ttft": "kvtier.bench.ttft",
}


def run_bench(name: str, argv: list[str], *, as_json: bool) -> int:
    module = importlib.import_module(BENCHMARKS[name])
    return int(module.main(argv, as_json=as_json))
