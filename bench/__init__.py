"""Benchmarks, run as ``kvtier bench NAME [--json]``. Each prints its figures next to a
baseline measured in the same run; with ``--json`` the last line is one JSON object."""

from __future__ import annotations

import importlib

# Modules are imported only when their benchmark runs.
BENCHMARKS = {
    "gpu": "kvtier.bench.gpu_check",
    "l1": "kvtier.bench.l1",
    "l2": "kvtier.bench.l2",
    "l3": "kvtier.bench.l3",
    "restart": "kvtier.bench.restart",
    "rpc": "kvtier.bench.rpc",
    "ttft": "kvtier.bench.ttft",
    "vllm": "kvtier.bench.vllm",
}


def run_bench(name: str, argv: list[str], *, as_json: bool) -> int:
    module = importlib.import_module(BENCHMARKS[name])
    return int(module.main(list(argv), as_json=as_json))
