from __future__ import annotations

from kvtier.daemon.latency import Histograms
from kvtier.daemon.stats import Counters


def test_a_resolved_key_counts_the_same_counter_as_inc():
    c = Counters()
    key = c.key("hits", tier="L1")
    c.add(key, 3)
    c.add(key, 0)  # counting nothing creates nothing
    c.inc("hits", 2, tier="L1")
    c.add(c.key("misses", reason="absent", tier="L1"))
    c.add(c.key("empty"), 0)
    assert c.get("hits", tier="L1") == 5
    assert c.flat() == {'hits{tier="L1"}': 5, 'misses{reason="absent",tier="L1"}': 1}
    # Labels given in another order name the same counter.
    c.inc("misses", 1, tier="L1", reason="absent")
    assert c.get("misses") == 2


def test_histogram_series_are_the_same_whatever_the_label_order():
    h = Histograms(bounds=(0.001, 0.01))
    h.observe("rpc_seconds", 0.0005, method="Get", code="OK")
    h.observe("rpc_seconds", 0.005, code="OK", method="Get")
    h.observe("rpc_seconds", 0.5, method="Get", code="OK")
    h.observe("rpc_seconds", 0.0005, method="Put", code="OK")
    samples = {s.labels: s for s in h.samples()}
    get = samples[(("code", "OK"), ("method", "Get"))]
    assert get.cumulative == (1, 2, 3) and abs(get.sum_s - 0.5055) < 1e-12
    assert samples[(("code", "OK"), ("method", "Put"))].cumulative == (1, 1, 1)
    assert len(samples) == 2
