"""The synthetic trace generator (``kvtier trace gen``): deterministic, well formed, the
conversation model it documents, and the shipped trace it regenerates."""

from __future__ import annotations

import itertools
import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli.main import main
from kvtier.sim import tracegen
from kvtier.sim.engine import replay, sweep_capacities
from kvtier.sim.trace import load_trace, trace_from_requests

SHIPPED = Path(__file__).resolve().parents[2] / "sim" / "traces" / "chat.jsonl"
# The command that made the shipped trace (README).
SHIPPED_ARGS = ["trace", "gen", "--scenario", "chat", "--seed", "0", "--duration-s", "300"]


def test_generation_is_deterministic_per_seed() -> None:
    a = tracegen.scenario("chat", seed=5, duration_s=60.0)
    assert a == tracegen.scenario("chat", seed=5, duration_s=60.0)
    assert a != tracegen.scenario("chat", seed=6, duration_s=60.0)
    stamps = [r["timestamp"] for r in a]
    assert stamps == sorted(stamps)


@pytest.mark.parametrize("name", sorted(tracegen.SCENARIOS))
def test_every_scenario_is_well_formed_and_documented(name: str) -> None:
    reqs = tracegen.scenario(name, seed=1, duration_s=120.0)
    assert reqs and name in tracegen.SCENARIO_DOCS
    for r in reqs:
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / 512)
        assert r["output_length"] >= 1 and 0 <= r["timestamp"] <= 120_000
    trace = trace_from_requests(reqs)  # the loader's own consistency check
    assert trace.partial.mean() > 0.9  # token counts rarely fill the last block exactly


def test_every_parameter_is_documented() -> None:
    assert set(tracegen.PARAMETER_DOCS) == {f.name for f in fields(tracegen.SyntheticTraceConfig)}


@pytest.mark.slow  # generates and replays a long synthetic trace, ~3 s: `make test-slow`
def test_conversations_keep_their_full_blocks_and_renew_the_partial_one() -> None:
    cfg = tracegen.SyntheticTraceConfig(
        duration_s=3600.0,
        session_rate=0.01,
        oneoff_rate=0.0,
        prompt_share=0.0,
        continue_first=1.0,
        continue_later=1.0,
        think_median_s=1.0,
    )
    reqs = tracegen.generate(cfg, seed=2)
    first = next(r for r in reqs if r["input_length"] >= 1024)  # a first turn with full blocks
    turns = [r for r in reqs if r["hash_ids"][0] == first["hash_ids"][0]]
    assert len(turns) >= 3
    for prev, nxt in itertools.pairwise(turns):
        full = prev["input_length"] // 512
        assert nxt["hash_ids"][:full] == prev["hash_ids"][:full]
        if prev["input_length"] % 512:
            assert prev["hash_ids"][-1] not in nxt["hash_ids"]
        # The next prompt holds the previous prompt, its answer and a new message.
        assert nxt["input_length"] > prev["input_length"] + prev["output_length"]


def test_continuation_rises_with_the_turn() -> None:
    cfg = tracegen.SyntheticTraceConfig(
        duration_s=20000.0,
        session_rate=0.5,
        oneoff_rate=0.0,
        prompt_share=0.0,
        think_median_s=0.5,
        think_sigma=0.1,
        continue_first=0.3,
        continue_later=0.9,
        continue_ramp=0.5,
    )
    reqs = tracegen.generate(cfg, seed=3)
    # A conversation is identified by its first block; count its turns.
    turns: dict[int, int] = {}
    for r in reqs:
        turns[r["hash_ids"][0]] = turns.get(r["hash_ids"][0], 0) + 1
    lengths = np.array(list(turns.values()))
    after_first = np.mean(lengths >= 2)
    after_fifth = np.mean(lengths[lengths >= 5] >= 6)
    assert abs(after_first - 0.3) < 0.03
    assert abs(after_fifth - (0.9 - 0.6 * 0.5**4)) < 0.05


def test_shared_prompts_are_shared() -> None:
    reqs = tracegen.scenario("prompts", seed=0, duration_s=60.0)
    firsts = [r["hash_ids"][0] for r in reqs if r["hash_ids"]]
    assert len(set(firsts)) <= tracegen.SCENARIOS["prompts"].prompts


def test_rate_swing_moves_the_arrivals() -> None:
    cfg = tracegen.SyntheticTraceConfig(duration_s=2000.0, rate_swing=0.9, session_rate=2.0)
    stamps = np.array([r["timestamp"] for r in tracegen.generate(cfg, seed=4)]) / 1000
    # sin > 0 over the first half: many more arrivals there than in the second.
    assert np.sum(stamps < 1000) > 2 * np.sum(stamps >= 1000)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"continue_first": 1.5}, "probability"),
        ({"duration_s": -1.0}, ">= 0"),
        ({"rate_swing": 1.0}, "below 1"),
        ({"prompts": 0}, "at least 1"),
        ({"colour": 1}, "unknown trace parameter"),
    ],
)
def test_bad_parameters_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tracegen.scenario("chat", **overrides)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown scenario"):
        tracegen.scenario("nope")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # Each raised OverflowError out of the generator: a mean past a float's range
        # (infinity), one past a list's size, a count past a float's range.
        (["--first-turn-blocks", "1e308"], "first_turn_blocks x block_tokens is inf tokens"),
        (["--oneoff-blocks", "1e20"], "oneoff_blocks x block_tokens is 5.12e+22 tokens"),
        (["--prompts", "1" + "0" * 400], "prompts must be at most 16777216"),
        # Never finished: arrivals were drawn (and held) without end.
        (
            ["--duration-s", "1e308"],
            "duration_s x (session_rate + oneoff_rate) x (1 + rate_swing) is inf",
        ),
    ],
    ids=["infinite-mean", "mean-past-a-list", "huge-count", "endless"],
)
def test_regression_a_trace_too_large_to_build_ended_in_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(["trace", "gen", *args, "-o", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "t.jsonl").exists()


def test_the_shipped_trace_is_what_its_command_makes(tmp_path: Path) -> None:
    out = tmp_path / "chat.jsonl"
    assert main([*SHIPPED_ARGS, "-o", str(out)]) == 0
    assert out.read_bytes() == SHIPPED.read_bytes()
    assert SHIPPED.stat().st_size < 400_000


def test_trace_gen_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    rc = main(
        [
            "trace",
            "gen",
            "--scenario",
            "agent",
            "--seed",
            "3",
            "--duration-s",
            "30",
            "--think-median-s",
            "2",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    trace = load_trace(out)
    assert trace.requests > 0
    assert f"{trace.requests} requests" in capsys.readouterr().err
    assert main(["trace", "gen", "--duration-s", "5", "-o", "-"]) == 0
    assert capsys.readouterr().out.count("\n") >= 1
    assert main(["trace", "gen", "--continue-first", "2", "-o", str(out)]) == 2
    assert "probability" in capsys.readouterr().err
    assert main(["trace", "gen", "-o", str(tmp_path / "missing" / "t.jsonl")]) == 2
    assert "error" in capsys.readouterr().err


def test_conversations_reuse_their_history() -> None:
    trace = trace_from_requests(tracegen.scenario("chat", seed=0, duration_s=300.0))
    infinite = replay(trace, "lru", trace.cacheable().unique_blocks)
    assert 0.2 < infinite.hit_ratio < 0.8


@pytest.mark.slow  # a sweep of two policies over a generated trace, ~3 s: `make test-slow`
def test_heat_is_not_worse_than_lru_on_synthetic_chat() -> None:
    trace = trace_from_requests(tracegen.scenario("chat", seed=0))
    for cap in sweep_capacities(trace.cacheable().unique_blocks, (1, 2, 5, 10, 20)):
        heat = replay(trace, "heat", cap).hit_ratio
        lru = replay(trace, "lru", cap).hit_ratio
        assert heat >= lru, cap
