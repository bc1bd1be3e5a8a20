"""The synthetic trace generator, and the check that heat's defaults are not fitted to the
one public trace."""

from __future__ import annotations

import pytest

from kvtier.daemon import tracegen
from kvtier.daemon.replay import replay, sweep_capacities, trace_from_requests


def test_generation_is_deterministic_per_seed() -> None:
    a = tracegen.scenario("chat", seed=5, duration_s=60.0)
    assert a == tracegen.scenario("chat", seed=5, duration_s=60.0)
    assert a != tracegen.scenario("chat", seed=6, duration_s=60.0)
    stamps = [r["timestamp"] for r in a]
    assert stamps == sorted(stamps)
    assert all(r["input_length"] == 512 * len(r["hash_ids"]) for r in a)
    with pytest.raises(ValueError):
        tracegen.scenario("nope")


def test_conversations_reuse_their_history() -> None:
    trace = trace_from_requests(tracegen.scenario("chat", seed=0, duration_s=300.0))
    infinite = replay(trace, "lru", trace.unique_blocks)
    assert 0.2 < infinite.hit_ratio < 0.8


def test_heat_is_not_worse_than_lru_on_synthetic_chat() -> None:
    trace = trace_from_requests(tracegen.scenario("chat", seed=0))
    for cap in sweep_capacities(trace.unique_blocks):
        heat = replay(trace, "heat", cap).hit_ratio
        lru = replay(trace, "lru", cap).hit_ratio
        assert heat >= lru, cap
