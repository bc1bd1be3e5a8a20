"""Synthetic traces in the Mooncake format, for tests and for checking that policy defaults
are not fitted to the one public trace.

The model, seeded and deterministic:
- Sessions arrive as a Poisson process. A session may start with a shared system prompt,
  drawn from a Zipf-popular set of prompts (1-8 blocks each).
- A session is a conversation: each turn's request is the prompt plus the whole history so
  far. The history's last block changes between turns (the partial block at the end of the
  previous turn fills up), and each turn appends new blocks. A session continues after its
  first turn with ``continue_first`` and after later turns with ``continue_later``; think
  times between turns are log-normal around ``think_median_s``.
- One-off requests (documents, batch jobs) arrive as a second Poisson process: a prompt, or
  not, followed by blocks used only once.

``SCENARIOS`` names a few mixes; ``"chat"`` is the default one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SyntheticTraceConfig:
    duration_s: float = 900.0
    session_rate: float = 2.0  # new conversations per second
    oneoff_rate: float = 1.0  # one-off requests per second
    prompts: int = 50
    prompt_zipf: float = 1.1
    prompt_share: float = 0.7  # fraction of requests that start with a shared prompt
    continue_first: float = 0.3
    continue_later: float = 0.7
    think_median_s: float = 30.0
    think_sigma: float = 1.0
    first_turn_blocks: float = 8.0  # mean new blocks of a first turn
    later_turn_blocks: float = 3.0  # mean new blocks of a later turn
    oneoff_blocks: float = 20.0


SCENARIOS: dict[str, SyntheticTraceConfig] = {
    "chat": SyntheticTraceConfig(),
    # Conversations that mostly have exactly one quick follow-up: recency is everything.
    "followup": SyntheticTraceConfig(
        continue_first=0.9, continue_later=0.0, think_median_s=3.0, oneoff_rate=0.5
    ),
    # Few long prompts shared by many short one-off requests.
    "prompts": SyntheticTraceConfig(
        prompts=20, prompt_share=1.0, oneoff_rate=3.0, prompt_zipf=1.3, continue_first=0.1
    ),
    # Long conversations with long pauses.
    "longchat": SyntheticTraceConfig(continue_first=0.5, continue_later=0.9, think_median_s=60.0),
}


def generate(config: SyntheticTraceConfig | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Requests sorted by timestamp, as the trace file's objects."""
    cfg = config or SyntheticTraceConfig()
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    def blocks(mean: float) -> int:
        return int(rng.geometric(1.0 / max(mean, 1.0)))

    prompts = [fresh(int(n)) for n in rng.integers(1, 9, size=cfg.prompts)]
    weights = 1.0 / np.arange(1, cfg.prompts + 1) ** cfg.prompt_zipf
    weights /= weights.sum()

    def prompt() -> list[int]:
        if rng.random() >= cfg.prompt_share:
            return []
        return list(prompts[int(rng.choice(cfg.prompts, p=weights))])

    events: list[tuple[float, list[int]]] = []
    t = 0.0
    while True:
        t += rng.exponential(1.0 / cfg.session_rate)
        if t > cfg.duration_s:
            break
        head, history, at, turn = prompt(), fresh(blocks(cfg.first_turn_blocks)), t, 1
        while at <= cfg.duration_s:
            events.append((at, head + history))
            p = cfg.continue_first if turn == 1 else cfg.continue_later
            if rng.random() >= p:
                break
            at += rng.lognormal(np.log(cfg.think_median_s), cfg.think_sigma)
            history = history[:-1] + fresh(blocks(cfg.later_turn_blocks) + 1)
            turn += 1
    t = 0.0
    while cfg.oneoff_rate > 0:
        t += rng.exponential(1.0 / cfg.oneoff_rate)
        if t > cfg.duration_s:
            break
        events.append((t, prompt() + fresh(blocks(cfg.oneoff_blocks))))
    events.sort(key=lambda e: e[0])
    return [
        {
            "timestamp": int(at * 1000),
            "input_length": BLOCK_TOKENS * len(ids),
            "output_length": 1,
            "hash_ids": ids,
        }
        for at, ids in events
    ]


def scenario(name: str, seed: int = 0, **overrides: Any) -> list[dict[str, Any]]:
    try:
        config = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}") from None
    return generate(replace(config, **overrides), seed)


def write_jsonl(path: str | Path, requests: Iterable[Mapping[str, Any]]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(dict(r)) + "\n")
