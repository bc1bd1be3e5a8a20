"""Benchmarks, run as ``kvtier bench NAME [--json]``. Each prints its figures next to a
baseline measured in the same run; with ``--json`` the last line is one JSON object."""

from __future__ import annotations

import importlib
import json
import sys

# Modules are imported only when their benchmark runs.
BENCHMARKS = {
    "gpu": "kvtier.bench.gpu_check",
    "l1": "kvtier.bench.l1",
    "l2": "kvtier.bench.l2",
    "l3": "kvtier.bench.l3",
    "policy_memory": "kvtier.bench.policy_memory",
    "restart": "kvtier.bench.restart",
    "rpc": "kvtier.bench.rpc",
    "ttft": "kvtier.bench.ttft",
    "vllm": "kvtier.bench.vllm",
}

# The optional packages some benchmarks import (ttft: torch and transformers; l3: redis-py),
# by the extra of kvtier that installs each. `make run`'s venv has the runtime dependencies
# only: there such a benchmark says what to install (exit status 2) rather than ending in an
# ImportError traceback.
EXTRAS = {"torch": "torch", "transformers": "transformers", "redis": "redis"}


def run_bench(name: str, argv: list[str], *, as_json: bool) -> int:
    try:
        module = importlib.import_module(BENCHMARKS[name])
        return int(module.main(list(argv), as_json=as_json))
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        msg = (
            f"kvtier bench {name} needs {missing}, which this Python lacks: "
            f"pip install 'kvtier[{EXTRAS[missing]}]'"
        )
        print(msg, file=sys.stderr)
        if as_json:
            print(json.dumps({"ok": False, "error": msg}))
        return 2
