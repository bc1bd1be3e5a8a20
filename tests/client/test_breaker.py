"""The integrations' circuit breaker: which failures pause kvtier, and from when."""

from __future__ import annotations

import time

from kvtier.client.errors import NotFoundError, UnavailableError
from kvtier.client.integrations.breaker import Breaker


def test_a_daemon_that_is_down_pauses_kvtier_for_the_retry_period():
    breaker = Breaker(60.0, "transfer")
    assert breaker.ok()
    breaker.trip(UnavailableError("connection refused"))
    assert not breaker.ok() and breaker.trips == 1


def test_a_daemon_that_lost_our_session_answers_so_nothing_pauses():
    """NOT_FOUND comes from a live daemon (it restarted): the next call opens a session."""
    breaker = Breaker(60.0, "transfer")
    breaker.trip(NotFoundError("session 1234 is not open (it ended or never existed)"))
    assert breaker.ok() and breaker.trips == 0


def test_a_second_not_found_within_the_period_pauses():
    """Something that stays missing (a shared-memory object the daemon cannot see) must not
    cost a registration at every engine step."""
    breaker = Breaker(60.0, "transfer")
    breaker.trip(NotFoundError("session 1234 is not open (it ended or never existed)"))
    breaker.trip(NotFoundError("shared-memory object 'kvtier-x' does not exist"))
    assert not breaker.ok() and breaker.trips == 1


def test_a_failure_seen_late_pauses_from_when_it_happened():
    breaker = Breaker(5.0, "transfer")
    now = time.monotonic()
    breaker.trip(UnavailableError("a save cut by a restart"), at=now - 10.0)
    assert breaker.ok() and breaker.trips == 1
    breaker.trip(UnavailableError("a save cut a moment ago"), at=now - 1.0)
    assert not breaker.ok()
    # An older failure reaped after it does not shorten the pause.
    breaker.trip(UnavailableError("an older one"), at=now - 4.9)
    assert not breaker.ok() and breaker._closed_until >= now + 4.0
