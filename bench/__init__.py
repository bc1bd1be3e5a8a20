"""Benchmarks, run as ``kvtier bench NAME [--json]``. Each prints its figures next to a
baseline measured in the same run; with ``--json`` the last line is one JSON object."""

from __future__ import annotations

import importlib

# Modules are imported only when their benchmark runs.
BENCHMARKS = {
    "l1": "kvtier.bench.l1",
    "l2": "kvtier.bench.l2",
    "policy_memory": "kvtier.bench.policy_memory",
    "ttft": "kvtier.bench.ttft",
}


def run_bench(name: str, argv: list[str], *, as_json: bool) -> int:
    module = importlib.import_module(BENCHMARKS[name])
    return int(module.main(list(argv), as_json=as_json))
