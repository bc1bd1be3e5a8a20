"""Helpers for deterministic race tests: locks that tell a test when a thread had to wait,
and a wait for what a background thread does."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ContendedLock:
    """A lock that sets ``waited`` when a thread finds it held and has to wait
    (``reentrant``: by another thread, as ``threading.RLock``)."""

    def __init__(self, waited: threading.Event, *, reentrant: bool = False) -> None:
        self._lock: threading.Lock | threading.RLock = (
            threading.RLock() if reentrant else threading.Lock()
        )
        self._waited = waited

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waited.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; AssertionError once ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)
