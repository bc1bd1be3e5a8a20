"""Synthetic traces in the Mooncake format, for tests and for tuning policies on more than the
one public trace (``kvtier trace gen``).

The model, seeded and deterministic (``generate(config, seed)``):

- **Conversations** arrive as a Poisson process (``session_rate`` a second, optionally
  swinging over the trace, see ``rate_swing``). A conversation may start with a shared
  system prompt drawn from a Zipf-popular set of ``prompts`` (each 1 to ``prompt_blocks``
  full blocks). Each turn's request is the prompt plus the whole history so far, counted in
  tokens: the first user message, then per turn the previous answer and a new message. Only
  the history's full blocks keep their ids from turn to turn; the partial block at its end is
  new in every request (it fills up with the next turn's tokens), so ``input_length`` is
  rarely a multiple of the block size, as in real traces.
- A conversation continues after turn ``k`` (1-based) with probability
  ``continue_later - (continue_later - continue_first) * continue_ramp ** (k - 1)``: from
  ``continue_first`` after the first turn towards ``continue_later`` (a step when the ramp is
  0). Think times between turns are log-normal around ``think_median_s``.
- **One-off requests** (documents, batch jobs) arrive as a second Poisson process: a shared
  prompt or not, then tokens used once.

``SCENARIOS`` names mixes (``SCENARIO_DOCS`` says what each stands for); ``chat`` is the
default. Every parameter of ``SyntheticTraceConfig`` can be overridden per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from kvtier.sim.trace import DEFAULT_BLOCK_TOKENS

MAX_MEAN_TOKENS = 1 << 24
"""Bound of a mean message, answer or one-off request, and of a shared prompt, in tokens
(16.7M, past any model's context): a request's blocks are drawn around the mean and built as
one list, and a larger mean overflowed (infinity, or past a list's size) or exhausted memory."""

MAX_PROMPTS_BLOCKS = 1 << 24
"""Bound of the blocks of every shared prompt together (prompts x prompt_blocks, at most):
they are built before the first request."""

MAX_ARRIVALS = 1 << 20
"""Bound of the expected conversations and one-off requests of a trace (at the peak rate):
the generator holds every request until the trace is written, so more did not finish."""


@dataclass(frozen=True, slots=True)
class SyntheticTraceConfig:
    duration_s: float = 900.0
    session_rate: float = 2.0
    oneoff_rate: float = 1.0
    prompts: int = 50
    prompt_blocks: int = 8
    prompt_zipf: float = 1.1
    prompt_share: float = 0.7
    continue_first: float = 0.3
    continue_later: float = 0.8
    continue_ramp: float = 0.8
    think_median_s: float = 30.0
    think_sigma: float = 1.0
    first_turn_blocks: float = 8.0
    later_turn_blocks: float = 2.0
    answer_tokens: float = 400.0
    oneoff_blocks: float = 20.0
    rate_swing: float = 0.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value}")
            # Every count below, past this, fails a bound of its product anyway; checked
            # first because one past a float's range cannot meet a float (OverflowError).
            if isinstance(value, int) and value > MAX_MEAN_TOKENS:
                raise ValueError(f"{f.name} must be at most {MAX_MEAN_TOKENS}, got {value}")
        for name in ("prompt_share", "continue_first", "continue_later", "continue_ramp"):
            if getattr(self, name) > 1:
                raise ValueError(f"{name} is a probability or fraction, got {getattr(self, name)}")
        if self.rate_swing >= 1:
            raise ValueError(f"rate_swing must be below 1, got {self.rate_swing}")
        if self.prompts < 1 or self.prompt_blocks < 1 or self.block_tokens < 1:
            raise ValueError("prompts, prompt_blocks and block_tokens must be at least 1")
        sizes = {
            f"{name} x block_tokens": getattr(self, name) * self.block_tokens
            for name in ("first_turn_blocks", "later_turn_blocks", "oneoff_blocks", "prompt_blocks")
        }
        sizes["answer_tokens"] = self.answer_tokens
        for name, tokens in sizes.items():
            if tokens > MAX_MEAN_TOKENS:
                raise ValueError(f"{name} is {tokens:.4g} tokens; at most {MAX_MEAN_TOKENS}")
        if self.prompts * self.prompt_blocks > MAX_PROMPTS_BLOCKS:
            raise ValueError(
                f"prompts x prompt_blocks is {self.prompts * self.prompt_blocks} blocks; "
                f"at most {MAX_PROMPTS_BLOCKS}"
            )
        arrivals = self.duration_s * (self.session_rate + self.oneoff_rate) * (1 + self.rate_swing)
        if arrivals > MAX_ARRIVALS:
            raise ValueError(
                f"duration_s x (session_rate + oneoff_rate) x (1 + rate_swing) is "
                f"{arrivals:.4g} conversations and requests; at most {MAX_ARRIVALS}"
            )


PARAMETER_DOCS: dict[str, str] = {
    "duration_s": "length of the trace in seconds",
    "session_rate": "new conversations per second (mean)",
    "oneoff_rate": "one-off requests per second (mean)",
    "prompts": "number of shared system prompts",
    "prompt_blocks": "longest shared prompt, in full blocks",
    "prompt_zipf": "Zipf exponent of the prompts' popularity",
    "prompt_share": "fraction of requests that start with a shared prompt",
    "continue_first": "probability that a conversation continues after its first turn",
    "continue_later": "probability, reached after many turns, that it continues",
    "continue_ramp": "how slowly the first reaches the later (0: at once, after turn 1)",
    "think_median_s": "median seconds between a conversation's turns",
    "think_sigma": "log-normal sigma of the think time",
    "first_turn_blocks": "mean blocks of a conversation's first message",
    "later_turn_blocks": "mean blocks of each later message",
    "answer_tokens": "mean tokens of an answer (part of the next turn's history)",
    "oneoff_blocks": "mean blocks of a one-off request",
    "rate_swing": "arrival rates swing by this fraction over the trace (a slow wave, 0: none)",
    "block_tokens": "tokens per block (the hash ids' granularity)",
}

SCENARIOS: dict[str, SyntheticTraceConfig] = {
    "chat": SyntheticTraceConfig(),
    # Conversations that mostly have exactly one quick follow-up: recency is everything.
    "followup": SyntheticTraceConfig(
        continue_first=0.9,
        continue_later=0.0,
        continue_ramp=0.0,
        think_median_s=3.0,
        oneoff_rate=0.5,
    ),
    # Few long prompts shared by many short one-off requests.
    "prompts": SyntheticTraceConfig(
        prompts=20,
        prompt_share=1.0,
        oneoff_rate=3.0,
        prompt_zipf=1.3,
        continue_first=0.1,
        continue_later=0.1,
        oneoff_blocks=6.0,
        prompt_blocks=16,
    ),
    # Long conversations with long pauses.
    "longchat": SyntheticTraceConfig(
        continue_first=0.5,
        continue_later=0.9,
        continue_ramp=0.7,
        think_median_s=60.0,
        session_rate=1.0,
    ),
    # Tool-using agents: long shared tool prompts, many quick turns with bulky tool output.
    "agent": SyntheticTraceConfig(
        session_rate=0.5,
        oneoff_rate=0.2,
        prompts=8,
        prompt_blocks=24,
        prompt_share=0.95,
        continue_first=0.85,
        continue_later=0.95,
        think_median_s=4.0,
        think_sigma=0.7,
        first_turn_blocks=3.0,
        later_turn_blocks=1.5,
        answer_tokens=150.0,
    ),
    # Documents read once: a cache can only keep the prompts and a few conversations.
    "docs": SyntheticTraceConfig(
        oneoff_rate=3.0, oneoff_blocks=40.0, session_rate=1.0, prompt_share=0.5
    ),
    # Questions over a large library of long documents, each re-read minutes apart.
    "rag": SyntheticTraceConfig(
        prompts=2000,
        prompt_blocks=60,
        prompt_zipf=0.8,
        prompt_share=0.9,
        oneoff_rate=3.0,
        oneoff_blocks=1.0,
        session_rate=0.3,
    ),
    # Chat whose load swings slowly, so what is worth keeping drifts over the trace.
    "drift": SyntheticTraceConfig(
        rate_swing=0.8, session_rate=2.5, think_median_s=20.0, think_sigma=1.3
    ),
}

SCENARIO_DOCS: dict[str, str] = {
    "chat": "conversations (continuing more often the longer they run) and one-off requests",
    "followup": "conversations with one quick follow-up",
    "prompts": "short one-off requests behind a few popular long prompts",
    "longchat": "long conversations with long pauses",
    "agent": "tool-using agents: long tool prompts, many quick turns",
    "docs": "long one-off documents crowding out conversations",
    "rag": "questions over a large library of long documents, re-read minutes apart",
    "drift": "chat whose arrival rate swings over the trace",
}


def generate(config: SyntheticTraceConfig | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Requests sorted by timestamp, as the trace file's objects."""
    cfg = config or SyntheticTraceConfig()
    rng = np.random.default_rng(seed)
    bt = cfg.block_tokens
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    def tokens(mean_blocks: float) -> int:
        return 1 + int(rng.exponential(max(mean_blocks * bt - 1, 0.0)))

    prompts = [fresh(int(n)) for n in rng.integers(1, cfg.prompt_blocks + 1, size=cfg.prompts)]
    weights = 1.0 / np.arange(1, cfg.prompts + 1) ** cfg.prompt_zipf
    weights /= weights.sum()

    def prompt() -> list[int]:
        if rng.random() >= cfg.prompt_share:
            return []
        return list(prompts[int(rng.choice(cfg.prompts, p=weights))])

    def arrivals(rate: float) -> list[float]:
        """A Poisson process of mean ``rate`` whose rate swings by ``rate_swing`` in one slow
        wave over the trace (thinning)."""
        out: list[float] = []
        peak = rate * (1 + cfg.rate_swing)
        t = 0.0
        while rate > 0:
            t += rng.exponential(1.0 / peak)
            if t > cfg.duration_s:
                return out
            now_rate = rate * (1 + cfg.rate_swing * math.sin(2 * math.pi * t / cfg.duration_s))
            if rng.random() * peak <= now_rate:
                out.append(t)
        return out

    def answer() -> int:
        return 1 + int(rng.exponential(cfg.answer_tokens))

    # (arrival s, hash ids, input tokens, output tokens)
    events: list[tuple[float, list[int], int, int]] = []
    for start in arrivals(cfg.session_rate):
        head = prompt()
        history: list[int] = []  # full blocks of the conversation, stable across turns
        length = tokens(cfg.first_turn_blocks)
        at, turn = start, 1
        while at <= cfg.duration_s:
            history += fresh(length // bt - len(history))
            tail = fresh(1) if length % bt else []
            out = answer()
            events.append((at, head + history + tail, len(head) * bt + length, out))
            p = cfg.continue_later - (cfg.continue_later - cfg.continue_first) * (
                cfg.continue_ramp ** (turn - 1)
            )
            if rng.random() >= p:
                break
            at += rng.lognormal(np.log(max(cfg.think_median_s, 1e-3)), cfg.think_sigma)
            length += out + tokens(cfg.later_turn_blocks)
            turn += 1
    for at in arrivals(cfg.oneoff_rate):
        head = prompt()
        length = tokens(cfg.oneoff_blocks)
        events.append((at, head + fresh(-(-length // bt)), len(head) * bt + length, answer()))
    events.sort(key=lambda e: e[0])
    return [
        {
            "timestamp": int(at * 1000),
            "input_length": n_in,
            "output_length": n_out,
            "hash_ids": ids,
        }
        for at, ids, n_in, n_out in events
    ]


def scenario(name: str, seed: int = 0, **overrides: Any) -> list[dict[str, Any]]:
    try:
        config = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}") from None
    unknown = set(overrides) - {f.name for f in fields(SyntheticTraceConfig)}
    if unknown:
        raise ValueError(f"unknown trace parameter {sorted(unknown)[0]!r}")
    return generate(replace(config, **overrides), seed)
