"""Whole-state equality of two ``HeatPolicy`` objects, for tests that drive a policy's fast
path and the steps it stands for side by side (``touch_many``, ``replace``); and equal
decisions of a ``HeatPolicy`` and the eager reference (``heat_reference``)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
from heat_reference import EagerHeatPolicy

from kvtier.daemon.heat import HeatTable
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
    assert vec._moving == ref._moving


ARRAYS = ("_eff", "_seg", "_ghost", "_depth", "_parent", "_ins", "_seen", "_gseq", "_kids")
Policy = HeatPolicy | EagerHeatPolicy


def clone(policy: Policy) -> Policy:
    """A deep copy (the per-id arrays are read through memoryviews, which do not copy)."""
    other = object.__new__(type(policy))
    for name, value in vars(policy).items():
        if name == "heat" or name.endswith("_v"):
            continue
        setattr(other, name, copy.deepcopy(value))
    for name in ARRAYS:
        setattr(other, name + "_v", getattr(other, name).data)
    heat = object.__new__(HeatTable)
    heat.half_life_s = policy.heat.half_life_s
    heat.heat, heat.last_access = policy.heat.heat.copy(), policy.heat.last_access.copy()
    heat._views()
    other.heat = heat
    return other


def mask_fn(salt: int) -> Callable[[np.ndarray], np.ndarray]:
    """A deterministic evictable mask: about a third of the ids may not go."""
    return lambda bids: (bids * 2654435761 + salt) % 3 != 0


def assert_same_decisions(new: HeatPolicy, old: EagerHeatPolicy, now: float, salt: int) -> None:
    """``victims`` answers alike for several n, with and without a mask, asked of copies (so
    the policies' own states, owed raises included, are left as they are); and with every
    owed raise paid, the same effective keys, bit for bit, and the same segments."""
    n = len(old)
    assert len(new) == n
    a, b = clone(new), clone(old)
    for k in sorted({1, 2, 3, 7, n // 2, n - 1, n, n + 1}):
        for mask in (None, mask_fn(salt)):
            got, want = a.victims(k, now, mask), b.victims(k, now, mask)
            assert (got is None) == (want is None), (k, mask is None)
            if got is not None and want is not None:
                assert got.tolist() == want.tolist(), (k, mask is None)
    a._pay_owed()
    size = min(new._size, old._size)
    resident = np.flatnonzero(old._seg[:size] != 0)
    assert np.array_equal(a._seg[:size], old._seg[:size])
    assert a._eff[resident].tobytes() == old._eff[resident].tobytes()
    assert np.array_equal(a._kids[resident], old._kids[resident])
    assert (a._count, a._p, a._evictions) == (old._count, old._p, old._evictions)
