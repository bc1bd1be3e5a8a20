"""Tiny randomly initialised transformers models for integration tests (no downloads).

Also run as a script by tests that need a second process:
``python hf_models.py ADDRESS BLOCK_TOKENS TOKEN,TOKEN,...`` prefills the tokens through kvtier
with the default tiny Llama and prints one JSON line with what it reused and stored.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per KV head
    "max_position_embeddings": 1024,
    # No end-of-sequence token: greedy decoding always runs max_new_tokens steps.
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def tiny_llama(
    seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> LlamaForCausalLM:
    """A random-init Llama (float32, GQA); equal arguments give bit-identical weights."""
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def _main(argv: list[str]) -> int:
    from kvtier.client import Client
    from kvtier.client.integrations.transformers import KVTierPrefixCache

    address, block_tokens, tokens = argv[0], int(argv[1]), [int(t) for t in argv[2].split(",")]
    model = tiny_llama()
    with (
        Client(address) as client,
        KVTierPrefixCache(
            model, client, block_tokens=block_tokens, staging_tokens=4 * block_tokens
        ) as kv,
    ):
        result = kv.prefill(tokens)
        print(json.dumps({"reused": result.reused_tokens, **kv.stats()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
