"""The daemon's tuning of Python's cyclic garbage collector (``daemon/main.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PRELUDE = """
import gc, weakref
from kvtier.daemon import main

class _Node:
    def __init__(self):
        self.other = None

def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)
"""


def _run_fresh(body: str) -> None:
    """Run ``body`` after ``_PRELUDE`` in an interpreter of its own: a test process's
    collector is shared with every test before it, and one whose collection never ends
    (a gRPC channel collected on a thread whose close waits for good, as the sync client's
    interrupted channels may leave) makes every later ``gc.collect()`` return at once, so
    these tests failed after others that passed (seen in make test's scheduling)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_loaded_objects_are_frozen_and_later_cycles_still_collected():
    _run_fresh(
        """
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
        """
    )


def test_the_first_threshold_bounds_how_long_cyclic_garbage_waits():
    _run_fresh(
        """
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
        """
    )
