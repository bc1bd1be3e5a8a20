"""One vLLM engine serving ``kvtier bench vllm``: ``python -m kvtier.bench.vllm_engine SPEC FD``.

SPEC (JSON) names the model and the connector options (null: plain vLLM). The engine
reads one JSON command a line on stdin and answers one JSON line on file descriptor FD (its
stdout carries vLLM's log):

- ``{"op": "run", "prompts": [[ids...]], "max_tokens": n, "reset": true}``: empty vLLM's
  own prefix cache (so that only kvtier, if anything, can supply a prefix; ``reset`` false
  keeps it), generate greedily, answer the wall time, the outputs and each request's
  cached-token count;
- ``{"op": "quit"}``.

The ``__main__`` guard is required: vLLM starts its engine core with ``spawn``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> int:
    spec = json.loads(sys.argv[1])
    out = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.llm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.client.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        # Finished requests may hold blocks for one more step (saves): retry briefly.
        deadline = time.monotonic() + 10
        while cmd.get("reset", True) and not llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's prefix cache did not empty within 10 s")
            time.sleep(0.01)
        params = SamplingParams(temperature=0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        out.write(
            json.dumps(
                {
                    "elapsed_s": elapsed,
                    "outputs": [list(o.outputs[0].token_ids) for o in outs],
                    "cached": [o.num_cached_tokens for o in outs],
                }
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
