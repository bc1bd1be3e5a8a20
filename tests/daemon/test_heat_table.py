from __future__ import annotations

import math

import numpy as np

from kvtier.daemon.heat import HeatTable


def test_log_key_orders_as_decayed_heat_at_any_time() -> None:
    rng = np.random.default_rng(1)
    table = HeatTable(half_life_s=10.0, initial_capacity=64)
    for t in np.sort(rng.uniform(0, 100, size=400)):
        table.record(int(rng.integers(0, 64)), float(t))
    ids = np.arange(64)
    keys = table.log_key(ids)
    for now in (100.0, 150.0, 1000.0):
        heat = table.heat_at(ids, now).astype(np.float64)
        live = heat > 0
        # Same order, and the key is log2 of the heat up to the common shift now/half-life.
        assert np.allclose(np.log2(heat[live]) + now / 10.0, keys[live], rtol=0, atol=1e-4)
    assert np.all(np.isneginf(keys[~(table.heat[ids] > 0)]))


def test_record_one_equals_record() -> None:
    a, b = HeatTable(5.0, 8), HeatTable(5.0, 8)
    for t, bid in [(0.0, 1), (1.0, 1), (4.0, 2), (9.5, 1), (9.5, 2)]:
        a.record(bid, t)
        key = b.record_one(bid, t)
        assert math.isclose(key, float(b.log_key(bid)), abs_tol=1e-6)
    assert np.allclose(a.heat, b.heat) and np.array_equal(a.last_access, b.last_access)


def test_a_clock_stepping_back_does_not_age_a_block() -> None:
    table = HeatTable(5.0, 4)
    table.record_one(0, 10.0)
    table.record_one(0, 8.0)
    assert table.last_access[0] == 10.0 and math.isclose(table.heat[0], 2.0)


def test_ensure_grows_and_keeps_history() -> None:
    table = HeatTable(5.0, 2)
    table.record_one(1, 3.0)
    table.ensure(100)
    assert len(table) >= 100 and table.last_access[1] == 3.0
    table.record_one(99, 4.0)
    assert table.heat[99] == 1.0 and table.bytes_per_block == 12


def test_record_distinct_is_record_one_bit_for_bit() -> None:
    """Per id, the same heat, last access and key as ``record_one``, clock stepping back
    included; numpy's own ``power``/``log2`` would miss the last bit now and then."""
    rng = np.random.default_rng(11)
    vec, ref = HeatTable(7.3, 64), HeatTable(7.3, 64)
    now = 0.0
    for _ in range(300):
        now += float(rng.choice([0.0, rng.exponential(10.0), -rng.uniform(0, 3)]))
        ids = rng.permutation(64)[: rng.integers(0, 65)]
        keys = vec.record_distinct(ids, now)
        expect = [ref.record_one(int(b), now) for b in ids.tolist()]
        assert keys.dtype == np.float64 and keys.tobytes() == np.array(expect).tobytes()
        assert vec.heat.tobytes() == ref.heat.tobytes()
        assert vec.last_access.tobytes() == ref.last_access.tobytes()


def test_record_distinct_with_shared_histories() -> None:
    """Runs of blocks with one history (a chain written and read together) share each
    transcendental call; the results are still per block."""
    vec, ref = HeatTable(30.0, 128), HeatTable(30.0, 128)
    for table in (vec, ref):
        for lo, t in ((0, 1.0), (32, 2.0), (40, 2.5), (100, 3.0)):
            table.record_distinct(np.arange(lo, lo + 20), t)
    for now in (5.0, 5.0, 4.0, 60.0):
        ids = np.concatenate([np.arange(120), [127, 126]])
        keys = vec.record_distinct(ids, now)
        expect = [ref.record_one(int(b), now) for b in ids.tolist()]
        assert keys.tobytes() == np.array(expect).tobytes()
        assert vec.heat.tobytes() == ref.heat.tobytes()
        assert vec.last_access.tobytes() == ref.last_access.tobytes()
