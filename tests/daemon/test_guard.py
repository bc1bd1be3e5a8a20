from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.policy.guard import EvictionGuard


def test_protection_period() -> None:
    guard = EvictionGuard(protect_s=2.0)
    last = np.array([10.0, 8.5, 7.0, -np.inf])
    zeros = np.zeros(4, dtype=np.int32)
    assert guard.evictable(10.0, last, zeros, zeros).tolist() == [False, False, True, True]
    assert guard.evictable(12.0, last, zeros, zeros).tolist() == [True, True, True, True]


def test_pins_and_copies_in_flight_block_eviction() -> None:
    guard = EvictionGuard(protect_s=0.0)
    last = np.zeros(3)
    pins = np.array([0, 2, 0])
    inflight = np.array([0, 0, 1])
    assert guard.evictable(5.0, last, pins, inflight).tolist() == [True, False, False]


def test_evictable_fn_reads_by_block_id() -> None:
    guard = EvictionGuard(protect_s=1.0)
    last = np.array([0.0, 9.5, 0.0, 0.0])
    pins = np.array([0, 0, 1, 0])
    inflight = np.zeros(4, dtype=np.int16)
    fn = guard.evictable_fn(10.0, last, pins, inflight)
    assert fn(np.array([3, 2, 1, 0])).tolist() == [True, False, False, True]


def test_watermarks() -> None:
    guard = EvictionGuard(high_watermark=0.9, low_watermark=0.7)
    # At or below high: nothing to do, unless it would not fit at all.
    assert guard.to_free(used=90, capacity=100, now=100.0, started_at=0.0) == 0
    # Above high: down to low.
    assert guard.to_free(used=91, capacity=100, now=100.0, started_at=0.0) == 21
    assert guard.to_free(used=85, capacity=100, now=100.0, started_at=0.0, incoming=10) == 25
    assert guard.to_free(used=100, capacity=100, now=100.0, started_at=0.0, incoming=50) == 80


def test_warmup_evicts_only_at_the_hard_limit() -> None:
    guard = EvictionGuard(warmup_s=60.0, high_watermark=0.9, low_watermark=0.7)
    assert guard.in_warmup(now=30.0, started_at=0.0)
    assert guard.to_free(used=99, capacity=100, now=30.0, started_at=0.0) == 0
    assert guard.to_free(used=99, capacity=100, now=30.0, started_at=0.0, incoming=3) == 2
    # After warm-up the watermarks apply again.
    assert not guard.in_warmup(now=60.0, started_at=0.0)
    assert guard.to_free(used=99, capacity=100, now=60.0, started_at=0.0) == 29


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        EvictionGuard(high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValueError):
        EvictionGuard(protect_s=-1)
