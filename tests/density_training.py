"""Training for the hit-density policy in tests: statistics a test can reason about, taught
with accesses of ids the test's store never uses (``note_miss``: no block becomes resident)."""

from __future__ import annotations

from kvtier.daemon.policy.density import DensityPolicy


def roots_come_back(p: DensityPolicy, ids: int, now: float, chains: int = 100) -> None:
    """Teach ``p``, with accesses of ids from ``ids`` on, all before ``now``, that a chain's
    root comes back a second after it was stored and blocks deeper in the chain never do.
    At least one density table is built from it."""
    t = now - 2.0 * chains
    for c in range(chains):
        root = ids + 7 * c
        p.note_miss(root, -1, t)
        for bid in range(root + 1, root + 7):
            p.note_miss(bid, bid - 1, t)
        p.note_miss(root, -1, t + 1.0)
        t += 2.0
    assert p.stats().tables > 0
