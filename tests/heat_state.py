"""Whole-state equality of two ``HeatPolicy`` objects, for tests that drive a policy's fast
path and the steps it stands for side by side (``touch_many``, ``replace``)."""

from __future__ import annotations

import numpy as np

from kvtier.daemon.policy.heat import HeatPolicy

SCALARS = ("_p", "_accesses", "_inserts", "_high_water", "_rebuilds", "_size")
LISTS = ("_count", "_evictions")


def assert_same_state(vec: HeatPolicy, ref: HeatPolicy) -> None:
    for name in SCALARS + LISTS:
        assert getattr(vec, name) == getattr(ref, name), name
    for name, a, b in zip(
        ("_eff", "_seg", "_ghost", "_depth", "_parent", "_ins", "_seen", "_gseq", "_kids"),
        vec._arrays(),
        ref._arrays(),
        strict=True,
    ):
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    # Bit for bit: the heat keys go through C library functions that numpy's SIMD code
    # would round differently.
    assert vec.heat.heat.tobytes() == ref.heat.heat.tobytes()
    assert vec.heat.last_access.tobytes() == ref.heat.last_access.tobytes()
    assert vec._eff.tobytes() == ref._eff.tobytes()
    for a, b in zip(vec._bufs, ref._bufs, strict=True):
        assert (a.cur, a.bound, a.complete) == (b.cur, b.bound, b.complete)
        assert a.entries == b.entries
    assert vec._owed_new == ref._owed_new
    assert vec._owed == ref._owed
