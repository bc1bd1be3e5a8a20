"""Two chat sessions that share a long system prompt, without and with kvtier.

Start the daemon first (``make run`` in the repository root), then, in another shell, from
the repository root::

    make example                                          # or:
    .venv/bin/python examples/prefix_reuse.py             # [--address unix:/path/to.sock]

The model is a randomly initialised Llama-architecture network (no download) and the
"tokenizer" maps UTF-8 bytes to token ids, so the answers are noise; the timings are real.
Each session has two turns; a turn's prompt is the system prompt, the conversation so far and
the new user message. The four turns run in two ways: recomputing every prompt from scratch,
and through kvtier, which loads the longest stored prefix (the system prompt for a session's
first turn, the whole conversation so far for its second) and computes only the rest. Both
produce the same answers, token for token.

A fair comparison: both ways are warmed up once on the same four turns, then run
``--repeats`` times each, interleaved (without, with, with, without, ...) so that drift of a
shared machine hits both alike; the table shows the median time to first token per turn.
Every kvtier repeat starts from an empty store of its own (its own namespace revision), so
each does the same work; run the example again and those namespaces are no longer empty: the
first turns then reuse what the previous run stored.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier.client import Client, KvtierError
from kvtier.client.integrations.transformers import KVTierPrefixCache

MODEL = LlamaConfig(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

SYSTEM = (
    "You are the support assistant of Example Telecom. Answer politely and briefly. "
    "Never ask for a full password or a full card number. Opening hours of the shops are "
    "9:00 to 18:00 on weekdays and 10:00 to 14:00 on Saturdays; shops are closed on Sundays "
    "and public holidays. A lost phone is reported in the app under Account > Lost device, "
    "which blocks the SIM card at once; a new SIM card is sent within two working days. "
    "Passwords are reset from the login page with a code sent by text message. "
) * 4  # about 2,000 tokens, as a real system prompt with policies and examples would be

SESSIONS = {
    "A": ["How do I reset my password?", "And if I also lost my phone?"],
    "B": ["When are your shops open?", "Is the shop open on Easter Monday?"],
}


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def plain_generate(model: LlamaForCausalLM, ids: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding without kvtier; returns the tokens and the time to the first one."""
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    ttft = 0.0
    with torch.inference_mode():
        step = torch.tensor([ids])
        for i in range(n):
            out = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
            tokens.append(int(out.logits[0, -1].argmax()))
            if i == 0:
                ttft = time.perf_counter() - start
            step = torch.tensor([[tokens[-1]]])
    return tokens, ttft


def run(
    model: LlamaForCausalLM, kv: KVTierPrefixCache | None, new_tokens: int
) -> list[tuple[str, int, int, float, list[int]]]:
    """The four turns (A1, B1, A2, B2); per turn: name, prompt tokens, reused, TTFT, answer."""
    history = {name: encode(SYSTEM) for name in SESSIONS}
    rows = []
    for turn in range(2):
        for name, questions in SESSIONS.items():
            prompt = history[name] + encode(f"\nUser: {questions[turn]}\nAssistant:")
            if kv is None:
                answer, ttft = plain_generate(model, prompt, new_tokens)
                reused = 0
            else:
                result = kv.generate(prompt, new_tokens)
                answer, ttft, reused = result.tokens, result.ttft_s, result.reused_tokens
            rows.append((f"session {name}, turn {turn + 1}", len(prompt), reused, ttft, answer))
            history[name] = prompt + answer
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--address",
        help="kvtierd address (default: $KVTIER_ADDRESS, else the default socket the daemon "
        "listens on, as `make run` starts it)",
    )
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="measured runs of each way")
    args = p.parse_args()

    with Client(args.address, timeout_s=10.0) as client:
        try:
            client.health()
        except KvtierError as e:
            print(f"cannot reach kvtierd at {client.address}: {e.details}", file=sys.stderr)
            print("start it with `make run` (or pass --address)", file=sys.stderr)
            return 1
        torch.manual_seed(0)
        model = LlamaForCausalLM(MODEL).eval()

        def cached(tag: str) -> list[tuple[str, int, int, float, list[int]]]:
            # Each kvtier run in a namespace of its own: it starts from what that namespace
            # holds (nothing, on the first invocation), not from the previous repeat.
            with KVTierPrefixCache(
                model, client, block_tokens=args.block_tokens, revision=f"example-{tag}"
            ) as kv:
                return run(model, kv, args.new_tokens)

        print("warming up both ways on the same four turns ...", flush=True)
        run(model, None, args.new_tokens)
        cached("warmup")
        plain_runs, cached_runs = [], []
        for r in range(args.repeats):
            print(f"measuring: repeat {r + 1} of {args.repeats}", flush=True)
            # Interleaved, alternating which way goes first.
            if r % 2 == 0:
                plain_runs.append(run(model, None, args.new_tokens))
                cached_runs.append(cached(f"repeat-{r}"))
            else:
                cached_runs.append(cached(f"repeat-{r}"))
                plain_runs.append(run(model, None, args.new_tokens))

    reference = [row[4] for row in plain_runs[0]]
    same = all([row[4] for row in rows] == reference for rows in plain_runs + cached_runs)
    print()
    print(f"median of {args.repeats} interleaved runs each")
    print(
        f"{'turn':<20} {'prompt':>7} {'TTFT without':>13} {'TTFT with':>10} {'speed-up':>9} "
        f"{'reused':>7}"
    )
    total0 = total1 = 0.0
    for i, (name, n, _, _, _) in enumerate(plain_runs[0]):
        t0 = statistics.median(rows[i][3] for rows in plain_runs)
        t1 = statistics.median(rows[i][3] for rows in cached_runs)
        reused = int(statistics.median(rows[i][2] for rows in cached_runs))
        total0, total1 = total0 + t0, total1 + t1
        print(f"{name:<20} {n:>7} {t0:>12.3f}s {t1:>9.3f}s {t0 / t1:>8.2f}x {reused:>7}")
    print(f"{'total':<20} {'':>7} {total0:>12.3f}s {total1:>9.3f}s {total0 / total1:>8.2f}x")
    if not same:
        print("(answers differ between runs: kvtier changed the result!)")
    if cached_runs[0][0][2]:
        print("(session A's first turn reused blocks stored by an earlier run of this example)")
    return 0 if same else 2


if __name__ == "__main__":
    sys.exit(main())
