"""The miss-reason ledger (daemon/misses.py): a fixed table, oldest forgotten first."""

from __future__ import annotations

import numpy as np

from kvtier.daemon.misses import ABSENT, DECLINED, EVICTED, MissLedger


def test_reasons_are_recorded_updated_and_discarded():
    ledger = MissLedger(capacity=1024)
    keys = [int(k) for k in np.random.default_rng(0).integers(0, 2**63, 100, dtype=np.int64)]
    ledger.record(keys[:40], EVICTED)
    ledger.record(keys[40:60], DECLINED)
    ledger.record(keys[:10], DECLINED)  # evicted, then declined on its way back
    assert len(ledger) == 60
    assert ledger.classify(keys) == {ABSENT: 40, EVICTED: 30, DECLINED: 30}
    ledger.discard(keys[:20] + keys[90:])
    assert len(ledger) == 40
    assert ledger.classify(keys) == {ABSENT: 60, EVICTED: 20, DECLINED: 20}
    assert ledger.classify([]) == {ABSENT: 0, EVICTED: 0, DECLINED: 0}


def test_a_few_keys_are_classified_as_a_batch_of_many_is():
    """classify takes a few keys one bucket at a time and many as arrays: the same answer."""
    # Room enough that no bucket overflows (its oldest entry forgotten): at 1,024 (256
    # buckets of 4) 150 keys overflowed one for about one random multiplier in ten.
    ledger = MissLedger(capacity=1 << 16)
    keys = [int(k) for k in np.random.default_rng(1).integers(0, 2**64, 300, dtype=np.uint64)]
    assert ledger.classify(keys[:3]) == {ABSENT: 3, EVICTED: 0, DECLINED: 0}  # empty ledger
    ledger.record(keys[:100], EVICTED)
    ledger.record(keys[100:150], DECLINED)
    one_by_one = {ABSENT: 0, EVICTED: 0, DECLINED: 0}
    for key in keys:
        for reason, n in ledger.classify([key]).items():
            one_by_one[reason] += n
    assert one_by_one == ledger.classify(keys) == {ABSENT: 150, EVICTED: 100, DECLINED: 50}
    assert ledger.classify(iter(keys[95:105])) == {ABSENT: 0, EVICTED: 5, DECLINED: 5}


def test_regression_the_ledger_grew_with_every_eviction_until_full():
    """Found by the soak: a dict of Python ints took about 125 bytes per evicted block, up to
    2**18 of them. The table is allocated once; a full bucket forgets its oldest entry."""
    ledger = MissLedger(capacity=256)
    nbytes = ledger._keys.nbytes + ledger._why.nbytes + ledger._stamp.nbytes
    assert nbytes == 256 * 13
    # Keys as the daemon's are: 64-bit hashes. (Consecutive integers, which this test
    # used, fall unevenly into the buckets for some of the ledger's random multipliers: with
    # about 3% of them fewer than 60 of the newest 100 stayed, and the test failed.)
    rng = np.random.default_rng(0)
    keys = [int(k) for k in rng.integers(0, 2**64, 100_000, dtype=np.uint64)]
    for start in range(0, 100_000, 1000):
        ledger.record(keys[start : start + 1000], EVICTED)
    assert len(ledger) <= 256
    assert ledger._keys.nbytes + ledger._why.nbytes + ledger._stamp.nbytes == nbytes
    # The newest keys are the ones remembered.
    recent = ledger.classify(keys[99_900:])
    old = ledger.classify(keys[:100])
    assert recent[EVICTED] > 60 and old[EVICTED] == 0
