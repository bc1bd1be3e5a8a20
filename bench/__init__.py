"""Benchmarks, run as ``kvtier bench NAME [--json]``. Each prints its figures next to a
baseline measured in the same run.

With ``--json``, stdout holds one JSON object and nothing else: the figures, or
``{"ok": false, "error": ...}`` when the run ends without them (an extra or a GPU missing,
arguments refused, an exception). The text report and everything else the run writes to
stdout, child processes and native libraries included, go to stderr. ``run_bench`` arranges
that once for every benchmark (``jsonout.JsonStdout``): a benchmark module's
``main(argv, *, emit)`` prints its report as usual and, where ``emit`` is not None (``--json``),
hands its figures to ``emit`` once. A host that cannot run a benchmark (no GPU, no vLLM)
is ``BenchUnavailable``: its message on stderr, exit status 2.
"""

from __future__ import annotations

import importlib
import sys

from kvtier.bench.jsonout import Emit, JsonStdout

# Modules are imported only when their benchmark runs.
BENCHMARKS = {
    "fair": "kvtier.bench.fair",
    "flood": "kvtier.bench.flood",
    "gpu": "kvtier.bench.gpu_check",
    "instructions": "kvtier.bench.instructions",
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
# and per benchmark the extra of kvtier that installs all of its own: `make run`'s venv has the
# runtime dependencies only, and there such a benchmark says what to install (exit status 2)
# rather than ending in an ImportError traceback. The extra is the benchmark's, not the
# missing package's: `kvtier[torch]` alone left ttft without transformers.
OPTIONAL = frozenset({"torch", "transformers", "redis"})
EXTRAS = {"ttft": "transformers", "l3": "redis"}


class BenchUnavailable(Exception):
    """This host cannot run the benchmark (an extra, a GPU or vLLM missing); the message
    says why and what to do. Raised rather than printed so that ``--json`` reports it."""


def run_bench(name: str, argv: list[str], *, as_json: bool) -> int:
    if not as_json:
        try:
            return _call(name, argv, None)
        except BenchUnavailable as e:
            print(e, file=sys.stderr)
            return 2
    with JsonStdout() as out:
        try:
            code = _call(name, argv, out.emit)
        except BenchUnavailable as e:
            print(e, file=sys.stderr)
            out.fail(str(e))
            return 2
        except SystemExit as e:
            # Arguments refused: argparse printed why on stderr (exit status 2), or a
            # benchmark exited with its message. --help (status 0) has no figures to give.
            if e.code not in (0, None):
                out.fail(
                    e.code
                    if isinstance(e.code, str)
                    else f"kvtier bench {name}: arguments refused (exit status {e.code}; "
                    "the message is on stderr)"
                )
            raise
        except BaseException as e:
            out.fail(f"kvtier bench {name}: {type(e).__name__}: {e}")
            raise  # its traceback goes to stderr as without --json
        out.fail(f"kvtier bench {name} ended with exit status {code} and no figures")
        return code


def _call(name: str, argv: list[str], emit: Emit | None) -> int:
    try:
        module = importlib.import_module(BENCHMARKS[name])
        return int(module.main(list(argv), emit=emit))
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in OPTIONAL or name not in EXTRAS:
            raise
        raise BenchUnavailable(
            f"kvtier bench {name} needs {missing}, which this Python lacks: "
            f"pip install 'kvtier[{EXTRAS[name]}]'"
        ) from None
