from __future__ import annotations

import pytest

from kvtier.daemon.policy.admission import (
    AdmissionDecision,
    FrequencySketch,
    admission_names,
    make_admission,
)


def test_registry() -> None:
    assert {"always", "second_hit", "tinylfu", "belady"} <= set(admission_names())
    with pytest.raises(ValueError, match="unknown admission"):
        make_admission("nope")
    # Unknown parameters are ignored, so one parameter set serves every rule.
    make_admission("always", capacity_blocks=10, colour="red")


def test_always() -> None:
    adm = make_admission("always")
    assert adm.decide(1, 2, 0.0) == AdmissionDecision(True, "always")


def test_second_hit_admits_from_the_second_access_on() -> None:
    adm = make_admission("second_hit", capacity_blocks=64)
    adm.record(7, 0.0)
    first = adm.decide(7, None, 0.0)
    assert first == AdmissionDecision(False, "first_seen")
    # Deciding records nothing: asking again gives the same answer.
    assert adm.decide(7, None, 0.0) == first
    adm.record(7, 1.0)
    assert adm.decide(7, 3, 1.0) == AdmissionDecision(True, "seen_twice")


def test_tinylfu_prefers_the_more_frequent() -> None:
    adm = make_admission("tinylfu", capacity_blocks=64)
    assert adm.decide(1, None, 0.0).reason == "room"
    for _ in range(3):
        adm.record(1, 0.0)
    adm.record(2, 0.0)
    assert adm.decide(1, 2, 0.0) == AdmissionDecision(True, "more_frequent")
    assert adm.decide(2, 1, 0.0) == AdmissionDecision(False, "less_frequent")
    # Ties go to the victim.
    adm.record(3, 0.0)
    assert not adm.decide(3, 2, 0.0).admit


def test_sketch_never_underestimates_and_ages() -> None:
    sketch = FrequencySketch(capacity_blocks=256, sample_factor=10)
    truth: dict[int, int] = {}
    for i in range(1000):
        key = (i * 7919) % 300
        sketch.increment(key)
        truth[key] = truth.get(key, 0) + 1
    assert all(sketch.estimate(k) >= min(v, 15) for k, v in truth.items())


def test_sketch_halves_its_counters_every_sample() -> None:
    sketch = FrequencySketch(capacity_blocks=16, sample_factor=1)
    assert sketch.sample_size == 16
    for _ in range(15):
        sketch.increment(0)
    assert sketch.estimate(0) == 15
    sketch.increment(0)  # the 16th record: counters saturate at 15, then all halve
    assert sketch.estimate(0) == 7


def test_belady_bypasses_blocks_needed_later() -> None:
    future = {1: 5.0, 2: 9.0}
    adm = make_admission("belady", next_use=future.__getitem__)
    assert adm.decide(1, 2, 0.0).admit and not adm.decide(2, 1, 0.0).admit
    with pytest.raises(ValueError):
        make_admission("belady")
