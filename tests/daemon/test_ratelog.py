from __future__ import annotations

import logging

from kvtier.daemon.ratelog import RateLimitedLog


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
