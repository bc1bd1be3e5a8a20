"""Helpers for the vLLM tests: tiny random Llama checkpoints and engine runs in subprocesses.

The checkpoints are written by the tests (config plus seeded random weights, large enough
that outputs depend on the whole context; vLLM's ``load_format="dummy"`` weights are so small
that greedy output is a 2-cycle depending on the last token only). Prompts are token ids:
no tokenizer, no download.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCK_TOKENS = 128  # vLLM's CPU block size

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.1,
}


def block_bytes(dtype_bytes: int = 2) -> int:
    """One block's K and V of every layer of ``TINY_LLAMA``, ``dtype_bytes`` per value."""
    return (
        TINY_LLAMA["num_hidden_layers"]
        * 2
        * BLOCK_TOKENS
        * TINY_LLAMA["num_key_value_heads"]
        * TINY_LLAMA["head_dim"]
        * dtype_bytes
    )


BLOCK_BYTES = block_bytes()  # bf16


# Every engine of a test sees the same CPU setup. vLLM reserves one more core when a KV
# connector is configured; on a small machine that changes the worker's thread count, and
# with it the bf16 reduction order and near-tie greedy choices. Pinning the reservation keeps
# runs with and without the connector numerically comparable.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    # vLLM's stats line only when engine_run.py asks for it (at each phase's end), so that
    # each line covers one phase.
    "VLLM_LOG_STATS_INTERVAL": "3600",
}


def make_checkpoint(path: Path, **overrides: Any) -> Path:
    """A random-weight Llama checkpoint (seed 0) of ``TINY_LLAMA`` with ``overrides``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {**TINY_LLAMA, **overrides}
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompts(seed: int, prefix_tokens: int, suffixes: list[int]) -> list[list[int]]:
    """Prompts sharing one random prefix, each with its own random suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in suffixes]


def run_engine(
    workdir: Path, name: str, spec: dict[str, Any], timeout_s: float = 900
) -> dict[str, Any]:
    """Run ``engine_run.py`` with ``spec``; returns its result (raises with its log)."""
    spec_path = workdir / f"{name}.json"
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **ENGINE_ENV}
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "engine_run.py"), str(spec_path), str(out_path)],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"engine {name} exited with {proc.returncode}:\n{text[-20000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["log"] = text
    return result
