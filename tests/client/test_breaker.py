"""The integrations' circuit breaker: which failures pause kvtier, and from when."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable

import pytest

from kvtier.client.errors import (
    DeadlineExceededError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvtier.client.integrations.breaker import Breaker, daemon_answers


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


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_daemon_that_did_not_answer_is_asked_again_by_a_probe_not_the_engine():
    """Before, the pause ended after retry_after_s whatever the daemon's state, and the
    engine's own next call paid the timeout again: a vLLM worker waited 5 s for a staging
    pool's registration every 10 s while the daemon was hung (SIGSTOP), and made a new
    512 MiB pool before each try while it was down. The breaker now stays open until a
    probe, on a thread of its own, finds the daemon serving."""
    answers = [False, False, True]
    threads: list[int] = []

    def probe() -> bool:
        threads.append(threading.get_ident())
        return answers[len(threads) - 1]

    breaker = Breaker(0.01, "transfer", probe=probe)
    breaker.trip(DeadlineExceededError("Deadline Exceeded"))
    assert not breaker.ok() and breaker.probing
    assert _wait_until(breaker.ok)
    # Open while the probe said no, twice past the pause it would have had before.
    assert len(threads) == 3 and breaker.probes == 2 and not breaker.probing
    assert threading.get_ident() not in threads
    breaker.close()


def test_a_call_unanswered_long_ago_is_probed_before_the_engine_asks_again(caplog):
    """A failure that says the daemon did not answer, noticed after its pause would have
    ended (a background save reaped late) or while a shorter pause of another cause runs,
    started no probe: the breaker stayed or went back open to the engine, whose next call
    was the one to find out whether the daemon still hung. Both are now probed first."""
    answers: list[bool] = []
    release = threading.Event()

    def probe() -> bool:
        release.wait(20)
        answers.append(True)
        return True

    late = Breaker(1.0, "save", probe=probe)
    with caplog.at_level(logging.WARNING, logger="kvtier.client.integrations.breaker"):
        late.trip(DeadlineExceededError("a save reaped late"), at=time.monotonic() - 10.0)
    assert late.probing and not late.ok()
    # Said as the old failure it is, not as an outage starting now.
    assert re.search(r"kvtier save failed 1\d\.\ds ago \(DeadlineExceededError", caplog.text)
    release.set()
    assert _wait_until(late.ok) and answers == [True]
    late.close()

    release.clear()
    answers.clear()
    paused = Breaker(0.05, "save", probe=probe)
    paused.trip(NotFoundError("session 1234 is not open"))  # forgiven: no pause
    paused.trip(NotFoundError("shared-memory object 'kvtier-x' does not exist"))  # a pause
    paused.trip(UnavailableError("a save cut by a hang"), at=time.monotonic() - 0.04)
    assert paused.probing
    time.sleep(0.1)  # past both pauses: still closed until the probe answers
    assert not paused.ok() and answers == []
    release.set()
    assert _wait_until(paused.ok) and answers == [True]
    paused.close()


def test_failures_older_than_the_probes_answer_do_not_hold_kvtier_off_again():
    """Regression: the save jobs a hang timed out are reaped together at a later step; the
    first one's trip started a probe, and the others, counted as failures that came in while
    it ran, set its answer aside: the daemon answered, yet kvtier stayed off for another
    retry_after_s and a second probe. A failure that happened before the daemon was asked is
    older than its answer: that answer ends the pause."""
    asked = threading.Event()
    release = threading.Event()
    calls: list[int] = []

    def probe() -> bool:
        calls.append(1)
        asked.set()
        release.wait(20)
        return True

    breaker = Breaker(0.05, "transfer", probe=probe)
    timed_out = time.monotonic() - 10.0  # when the hang timed the jobs out
    breaker.trip(DeadlineExceededError("a save reaped late"), at=timed_out)
    assert asked.wait(20)
    for i in range(1, 4):  # the same hang's other jobs, reaped while the probe asks
        breaker.trip(DeadlineExceededError("another save reaped late"), at=timed_out + i / 1000)
    release.set()
    assert _wait_until(lambda: not breaker.probing)
    assert breaker.ok() and calls == [1]
    breaker.close()


def test_failures_older_than_the_probes_answer_reaped_after_it_start_no_probe():
    """Regression: of the save jobs a hang timed out, reaped together at a later step, the
    first one's trip started a probe that could answer (the daemon served) before the
    worker tripped the breaker with the next one; that failure found no probe running and
    started another, and so did the third: three probes and three warnings for one hang
    the daemon had answered since (seen under load in
    test_saves_a_hang_timed_out_reaped_together_later_cost_one_probe). A failure that
    happened before the daemon was asked is older than its answer, however late it is
    noticed: it neither pauses kvtier nor starts a probe."""
    calls: list[int] = []

    def probe() -> bool:
        calls.append(1)
        return True

    breaker = Breaker(1.0, "transfer", probe=probe)
    timed_out = time.monotonic() - 1.0  # when the hang timed the jobs out
    breaker.trip(DeadlineExceededError("a save reaped late"), at=timed_out)
    assert _wait_until(breaker.ok) and calls == [1]
    for i in range(1, 3):  # the same hang's other jobs, reaped once the probe answered
        breaker.trip(DeadlineExceededError("another save reaped late"), at=timed_out + i / 1000)
    # A probe they started ends before ok() says so (probing is set as they trip).
    assert _wait_until(breaker.ok) and calls == [1]
    # A failure after the answer is probed again.
    breaker.trip(DeadlineExceededError("a new hang"))
    assert not breaker.ok()
    assert _wait_until(breaker.ok) and calls == [1, 1]
    breaker.close()


def test_refusals_that_come_from_a_serving_daemon_are_not_probed():
    """A daemon that answered (here: a limit) is up: the pause ends with retry_after_s."""
    calls: list[int] = []
    breaker = Breaker(0.01, "lookup", probe=lambda: bool(calls.append(1)))
    breaker.trip(ResourceExhaustedError("tenant pool bytes"))
    assert not breaker.probing
    assert _wait_until(breaker.ok) and calls == []


def test_a_closed_breaker_stops_probing():
    breaker = Breaker(0.01, "transfer", probe=lambda: False)
    breaker.trip(UnavailableError("connection refused"))
    assert _wait_until(lambda: breaker.probes >= 1)
    breaker.close()
    probes = breaker.probes
    time.sleep(0.1)
    assert breaker.probes <= probes + 1 and not breaker.ok()


def test_regression_a_breaker_dropped_unclosed_stopped_probing_only_at_exit():
    """An integration dropped without ``close()`` (a ``KVTierPrefixCache`` is the caller's
    to close) while the daemon was down left its breaker's probing thread asking that daemon
    every ``retry_after_s`` for as long as the process lived, holding the breaker, its probe
    and so the client: one thread more for each such integration, and for good once the
    client was closed (its probe fails at once). The thread holds the breaker weakly now."""
    calls: list[int] = []
    breaker = Breaker(0.01, "dropped", probe=lambda: bool(calls.append(1)))
    breaker.trip(UnavailableError("connection refused"))
    assert _wait_until(lambda: len(calls) >= 2)
    dropped = weakref.ref(breaker)
    del breaker
    gc.collect()
    assert _wait_until(lambda: dropped() is None)
    assert _wait_until(
        lambda: not any(t.name == "kvtier-dropped-probe" for t in threading.enumerate())
    )


def test_a_hung_daemon_keeps_the_breaker_open_until_it_continues(daemon):
    """The real health check against a real daemon stopped with SIGSTOP, then continued."""
    assert daemon.proc is not None
    with daemon.client(timeout_s=0.2) as client:
        assert client.health()
        breaker = Breaker(0.05, "transfer", probe=daemon_answers(client))
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            breaker.trip(DeadlineExceededError("Deadline Exceeded"))
            # Probes time out while it is stopped: kvtier stays off for the engine.
            assert _wait_until(lambda: breaker.probes >= 2)
            assert not breaker.ok()
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert _wait_until(breaker.ok)
        assert client.health()
        breaker.close()


def test_probes_of_a_daemon_that_is_down_make_no_grpc_connection_attempt(daemon):
    """Probes of a daemon that is down fail in the credential exchange, so gRPC's channel
    makes no connection attempt meanwhile and does not back off: with a health check alone
    it tried at every probe, backed off longer after each failure, and an engine saw its
    restarted daemon 14 s late (up to gRPC's longest back-off, 2 minutes, after a long
    outage). A listener of our own on the daemon's socket counts the attempts."""
    assert daemon.proc is not None
    with daemon.client(timeout_s=0.5) as client:
        probe = daemon_answers(client)
        assert probe()
        daemon.kill()
        # The client takes its session as ended once gRPC has seen the connection drop (at
        # once here, later on a loaded machine); until then a probe would take the old
        # session as open and ask for health, one connection attempt. An engine's probes
        # come retry_after_s apart, long after.
        call = client._session_call
        assert _wait_until(lambda: call is None or not call.is_active())
        os.unlink(daemon.socket)  # the credential socket stays, and nothing listens there
        attempts = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(daemon.socket)
            listener.listen(16)
            listener.settimeout(0.05)
            for _ in range(5):
                with pytest.raises(UnavailableError):
                    probe()
                with contextlib.suppress(TimeoutError):
                    conn, _ = listener.accept()
                    attempts.append(conn)
                    conn.close()
        assert attempts == []


def test_a_call_unanswered_while_the_probe_ran_is_probed_again_not_sent_by_the_engine():
    """Regression: a call that failed unanswered (a save's timeout, on the worker's own
    thread) while the probe ran saw the breaker already probing and started none; the probe
    then said the daemon served and opened the breaker, and after that failure's pause the
    engine's own next call asked the daemon again (a hung daemon: another timeout). Now the
    probe asks once more when such a failure came in meanwhile."""
    calls: list[int] = []
    breaker: Breaker

    def probe() -> bool:
        calls.append(1)
        if len(calls) == 1:
            breaker.trip(DeadlineExceededError("a save's answer did not come"))
        return True

    breaker = Breaker(0.01, "transfer", probe=probe)
    breaker.trip(DeadlineExceededError("Deadline Exceeded"))
    assert _wait_until(breaker.ok)
    assert len(calls) == 2 and not breaker.probing
    breaker.close()
