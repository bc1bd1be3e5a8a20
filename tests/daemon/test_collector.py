"""The daemon's tuning of Python's cyclic garbage collector (``daemon/main.py``)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvtier.daemon import main


@pytest.fixture
def collector() -> Iterator[None]:
    """Give the test process its collector back as it found it."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_loaded_objects_are_frozen_and_later_cycles_still_collected(collector):
    before = _cycle()  # garbage already: collected by the tuning, not frozen
    kept = _Node()  # alive when the collector is tuned: frozen
    main._tune_collector()

    assert before() is None
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen objects are not walked
    assert gc.get_threshold()[0] == main.GC_FIRST_THRESHOLD
    after = _cycle()
    assert after() is not None
    gc.collect()
    assert after() is None


def test_the_first_threshold_bounds_how_long_cyclic_garbage_waits(collector):
    main._tune_collector()
    gc.collect()
    garbage = _cycle()
    survivors = []
    # Allocations of tracked objects that stay alive: a collection of the youngest
    # generation must come within the threshold and free the cycle.
    for _ in range(main.GC_FIRST_THRESHOLD + 100):
        survivors.append([])
        if garbage() is None:
            break
    assert garbage() is None
