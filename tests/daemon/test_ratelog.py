from __future__ import annotations

import logging

from kvtier.daemon.ratelog import BurstGate, BurstLog, LostAnswerFilter, RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_then_a_count_of_the_rest(caplog):
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("kvtier.test.ratelog"), 10.0, clock)
    with caplog.at_level(logging.WARNING, logger="kvtier.test.ratelog"):
        for _ in range(1000):
            rl.warning("malformed Put", "bad %s", "Put")
        rl.warning("malformed Get", "bad %s", "Get")
        assert [r.getMessage() for r in caplog.records] == ["bad Put", "bad Get"]
        assert rl.suppressed == 999
        clock.now += 10.0
        assert rl.warning("malformed Put", "bad %s", "Put")
        assert caplog.records[-1].getMessage() == "bad Put (and 999 more like it in the last 10s)"
        assert rl.suppressed == 0


def test_an_interval_of_zero_logs_every_line(caplog):
    """server.bad_request_log_interval_s=0, as its doc says: no rate limit."""
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("kvtier.test.ratelog0"), 0.0, clock)
    with caplog.at_level(logging.WARNING, logger="kvtier.test.ratelog0"):
        for _ in range(5):
            assert rl.warning("malformed Put", "bad %s", "Put")
    assert [r.getMessage() for r in caplog.records] == ["bad Put"] * 5 and rl.suppressed == 0


def test_exceptions_carry_their_traceback_once_per_interval(caplog):
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("kvtier.test.ratelog2"), 5.0, clock)
    with caplog.at_level(logging.ERROR, logger="kvtier.test.ratelog2"):
        for _ in range(3):
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                rl.exception("internal Put", "Put failed")
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is not None


def test_regression_grpc_logged_a_traceback_for_each_answer_a_client_deadline_cut_off(caplog):
    """grpc's server core logs an ERROR with a traceback when an answer cannot be sent
    because the call's deadline passed as it went out: one client with deadlines near the
    answer time made the daemon log 76 tracebacks in 10 s. The daemon's filter on grpc's
    logger makes that one WARNING line per interval without a traceback, then a count."""
    clock = Clock()
    grpc_core = logging.getLogger("kvtier.test.grpc_core")
    lost = LostAnswerFilter(10.0, clock)
    grpc_core.addFilter(lost)

    def answer_lost() -> None:
        try:
            raise RuntimeError('Failed "execute_batch"')
        except RuntimeError:
            # As grpc's Cython layer logs it: the method already in the text.
            grpc_core.exception(
                "ExecuteBatchError raised in core by servicer method [/kvtier.v1.KVTier/Get]"
            )

    try:
        with caplog.at_level(logging.INFO, logger="kvtier.test.grpc_core"):
            for _ in range(100):
                answer_lost()
            grpc_core.error("another failure in %s", "core")
            clock.now += 10.0
            answer_lost()
    finally:
        grpc_core.removeFilter(lost)
    lines = [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records]
    assert lines == [
        (
            "WARNING",
            "/kvtier.v1.KVTier/Get: an answer was not sent, its call had ended (the client's "
            "deadline)",
            None,
        ),
        ("ERROR", "another failure in core", None),
        (
            "WARNING",
            "/kvtier.v1.KVTier/Get: an answer was not sent, its call had ended (the client's "
            "deadline) (and 99 more like it in the last 10s)",
            None,
        ),
    ]


def test_a_burst_gate_passes_a_burst_then_its_rate_and_counts_the_rest():
    now = [0.0]
    gate = BurstGate(burst=3, rate_s=2.0, clock=lambda: now[0])
    assert [gate.passes("uid:1") for _ in range(5)] == [0, 0, 0, None, None]
    assert gate.passes("uid:2") == 0  # each key has its own bucket
    assert gate.suppressed == 2
    now[0] = 0.4  # 0.8 of a pass earned: still short
    assert gate.passes("uid:1") is None
    now[0] = 0.6  # one more pass, which reports the three left out
    assert gate.passes("uid:1") == 3
    assert gate.passes("uid:1") is None
    now[0] = 100.0  # refilled to the burst, no more
    assert [gate.passes("uid:1") for _ in range(4)] == [1, 0, 0, None]


def test_a_burst_gate_keeps_at_most_max_keys_and_forgets_full_buckets_first():
    now = [0.0]
    gate = BurstGate(burst=2, rate_s=1.0, clock=lambda: now[0], max_keys=3)
    for key in ("a", "b"):
        gate.passes(key)
    assert [gate.passes("c") for _ in range(3)] == [0, 0, None]
    now[0] = 5.0  # a and b are full again; c is still owed its count
    assert gate.passes("d") == 0
    assert sorted(gate._buckets) == ["c", "d"]
    assert gate.passes("c") == 1


def test_a_burst_log_logs_within_its_keys_budget_and_counts_the_rest(caplog):
    now = [0.0]
    lines = BurstLog(
        logging.getLogger("kvtier.test.burst"),
        BurstGate(burst=1, rate_s=1.0, clock=lambda: now[0]),
        " ({count} more of {key} left out)",
    )
    with caplog.at_level(logging.INFO, logger="kvtier.test.burst"):
        assert lines.info("uid:7", "opened %d%%", 1)
        assert not lines.info("uid:7", "opened %d%%", 2)
        assert lines.info("uid:8", "opened %d%%", 3)  # its own budget
        now[0] = 1.0
        assert lines.info("uid:7", "opened %d%%", 4)
    assert [r.getMessage() for r in caplog.records] == [
        "opened 1%",
        "opened 3%",
        "opened 4% (1 more of uid:7 left out)",
    ]
