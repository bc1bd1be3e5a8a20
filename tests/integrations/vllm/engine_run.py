"""One real vLLM engine run, as a subprocess of the tests: ``python engine_run.py SPEC OUT``.

SPEC (JSON) names the model, the connector options (null: no connector), optionally the
connector's class (``connector_class``: [module, name]; kvtier's by default), more engine
arguments (``engine_args``: a small KV cache, a token budget, a dtype), environment variables
to set before vLLM is imported (``env``) and phases; each
phase generates greedily from token-id prompts. OUT (JSON) gets, per phase, the outputs,
each request's cached-token count (and top logprobs, if the phase asks for ``logprobs``),
vLLM's prefix-cache and preemption counters and the connector's (``vllm:kvtier_*``), (with a
connector) the kvtier daemon's counters and leases after the phase, and the resident bytes
and open fds of the engine's processes; vLLM's stats line is logged at the end of each
phase. A phase may SIGKILL a process (the daemon) a given time after it starts, to test an
engine whose daemon dies mid-run, or abort some of its requests after a number of engine
steps (``abort``: their indices, ``abort_after_steps``): their outputs are null.

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
            "vllm:num_preemptions",
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
        "leases": int(stats.gauges.get("leases", 0)),
        "blocks_pinned": int(stats.gauges.get("blocks_pinned", 0)),
    }


def _top_logprobs(out: Any) -> list[dict[str, float]] | None:
    """Each generated token's top logprobs (token id: logprob), if the phase asked for them."""
    if out is None or not out.outputs[0].logprobs:
        return None
    return [{str(t): x.logprob for t, x in step.items()} for step in out.outputs[0].logprobs]


def _processes() -> dict[str, list[int]]:
    """Resident bytes and open fds of this process and its descendants (the engine core)."""
    import psutil

    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    return {str(p.pid): [p.memory_info().rss, p.num_fds()] for p in procs}


def _kill(pid: int, killed_at: list[float], t0: float) -> None:
    os.kill(pid, signal.SIGKILL)
    killed_at.append(time.monotonic() - t0)


def _generate_aborting(
    llm: Any, prompts: list[Any], params: Any, phase: dict[str, Any]
) -> list[Any]:
    """Run ``prompts`` step by step through the engine, aborting the requests at the indices
    ``phase["abort"]`` after ``phase["abort_after_steps"]`` steps; returns the outputs of the
    others, in prompt order, and None for each aborted one."""
    engine = llm.llm_engine
    ids = [f"p{i}" for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        engine.add_request(ids[i], prompt, params)
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == phase["abort_after_steps"]:
            engine.abort_request([ids[i] for i in phase["abort"]])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    return [None if i in phase["abort"] else done[r] for i, r in enumerate(ids)]


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.update(spec.get("env", {}))
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
    engine_args = dict(spec.get("engine_args", {}))
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=engine_args.pop("dtype", "bfloat16"),
        max_model_len=spec.get("max_model_len", 2048),
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        **engine_args,
        **kwargs,
    )
    result: dict[str, Any] = {"init_s": time.monotonic() - started, "phases": {}}
    address = (connector or {}).get("address", "")
    for phase in spec["phases"]:
        params = SamplingParams(
            temperature=0,
            max_tokens=phase["max_tokens"],
            ignore_eos=True,
            logprobs=phase.get("logprobs"),
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        killed_at: list[float] = []
        t0 = time.monotonic()
        if phase.get("kill_pid"):
            threading.Timer(
                phase["kill_after_s"], _kill, (phase["kill_pid"], killed_at, t0)
            ).start()
        if "abort" in phase:
            outs = _generate_aborting(llm, prompts, params, phase)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.monotonic() - t0
        # vLLM's periodic stats line, now rather than at its next interval (10 s).
        llm.llm_engine.do_log_stats()
        while phase.get("kill_pid") and not killed_at:
            time.sleep(0.01)
        result["phases"][phase["name"]] = {
            "outputs": [list(o.outputs[0].token_ids) if o else None for o in outs],
            "cached_tokens": [o.num_cached_tokens if o else None for o in outs],
            "elapsed_s": elapsed,
            "logprobs": [_top_logprobs(o) for o in outs],
            "killed_at_s": killed_at[0] if killed_at else None,
            "metrics": _metrics(llm),
            "kvtier": _kvtier_counters(address) if address else None,
            "processes": _processes(),
        }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
