"""One real vLLM engine run, as a subprocess of the tests: ``python engine_run.py SPEC OUT``.

SPEC (JSON) names the model, the connector options (null: no connector), optionally the
connector's class (``connector_class``: [module, name]; kvtier's by default) and phases; each
phase generates greedily from token-id prompts. OUT (JSON) gets, per phase, the outputs,
each request's cached-token count, vLLM's prefix-cache counters and the connector's
(``vllm:kvtier_*``), and (with a connector) the kvtier daemon's counters after the phase;
vLLM's stats line is logged at the end of each phase. A phase may SIGKILL a process (the
daemon) a given time after it starts, to test an engine whose daemon dies mid-run.

The ``__main__`` guard is required: vLLM starts its engine core with ``spawn``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any


def _metrics(llm: Any) -> dict[str, float]:
    """vLLM's prefix-cache counters and the kvtier connector's (``vllm:kvtier_*``)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_") or m.name in (
            "vllm:prefix_cache_hits",
            "vllm:prefix_cache_queries",
            "vllm:external_prefix_cache_hits",
            "vllm:external_prefix_cache_queries",
        ):
            out[m.name] = float(getattr(m, "value", 0))
    return out


def _kvtier_counters(address: str) -> dict[str, int] | None:
    from kvtier.client import Client, KvtierError

    try:
        with Client(address, timeout_s=2.0) as client:
            stats = client.stats()
    except KvtierError:
        return None
    return {
        **stats.counters,
        "get_blocks_loaded": stats.counter("get_blocks", result="loaded"),
        "lookup_keys": stats.counter("lookup_keys"),
        "blocks": int(stats.gauges.get("blocks", 0)),
    }


def _kill(pid: int, killed_at: list[float], t0: float) -> None:
    os.kill(pid, signal.SIGKILL)
    killed_at.append(time.monotonic() - t0)


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.llm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {}
    connector = spec.get("connector")
    if connector is not None:
        module, name = spec.get(
            "connector_class", ["kvtier.client.integrations.vllm", "KVTierConnector"]
        )
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=connector,
        )
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=spec.get("max_model_len", 2048),
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    result: dict[str, Any] = {"init_s": time.monotonic() - started, "phases": {}}
    address = (connector or {}).get("address", "")
    for phase in spec["phases"]:
        params = SamplingParams(temperature=0, max_tokens=phase["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        killed_at: list[float] = []
        t0 = time.monotonic()
        if phase.get("kill_pid"):
            threading.Timer(
                phase["kill_after_s"], _kill, (phase["kill_pid"], killed_at, t0)
            ).start()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.monotonic() - t0
        # vLLM's periodic stats line, now rather than at its next interval (10 s).
        llm.llm_engine.do_log_stats()
        while phase.get("kill_pid") and not killed_at:
            time.sleep(0.01)
        result["phases"][phase["name"]] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "cached_tokens": [o.num_cached_tokens for o in outs],
            "elapsed_s": elapsed,
            "killed_at_s": killed_at[0] if killed_at else None,
            "metrics": _metrics(llm),
            "kvtier": _kvtier_counters(address) if address else None,
        }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
