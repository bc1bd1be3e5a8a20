from __future__ import annotations

from kvtier.daemon.policy.prefetch import PrefetchLedger, PrefetchStats


def check(stats: PrefetchStats) -> None:
    assert stats.issued == stats.used + stats.late + stats.wasted + stats.outstanding


def test_each_prefetch_ends_in_one_outcome() -> None:
    ledger = PrefetchLedger()
    for key in range(5):
        assert ledger.issue(key, 0.0)
    assert not ledger.issue(0, 0.1)  # already outstanding
    ledger.complete(0, 1.0)
    ledger.demand(0, 2.0)  # used
    ledger.demand(1, 0.5)  # late: still in flight
    ledger.complete(1, 1.0)  # arrives after the demand read: settled already
    ledger.complete(2, 1.0)
    ledger.evict(2, 5.0)  # wasted
    ledger.evict(3, 5.0)  # cancelled in flight: wasted
    ledger.demand(9, 1.0)  # never prefetched: ignored
    stats = ledger.stats()
    check(stats)
    assert (stats.used, stats.late, stats.wasted, stats.outstanding) == (1, 1, 2, 1)
    assert stats.duplicates == 1 and stats.late_wait_s == 0.5
    assert stats.used_ratio == 0.25


def test_a_key_can_be_prefetched_again_once_settled() -> None:
    ledger = PrefetchLedger()
    ledger.issue(1, 0.0)
    ledger.complete(1, 1.0)
    ledger.demand(1, 2.0)
    assert ledger.issue(1, 3.0)
    ledger.evict(1, 4.0)
    stats = ledger.stats()
    check(stats)
    assert (stats.issued, stats.used, stats.wasted) == (2, 1, 1)
