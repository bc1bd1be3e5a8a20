"""The heat policy under hints: a victim scan parks the entries of hinted blocks (an engine's
waiting queue) until their deadline instead of walking them on every eviction, wherever they
sit in the order, and decides exactly as a scan that walks them. Costs are counted in
``HeatPolicy.scan_steps``, not timed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.daemon.policy.base import EvictableFn
from kvtier.daemon.policy.heat import _MIN_BUFFER, HeatPolicy


class WalkingHeat(HeatPolicy):
    """The same policy with the plain scan: every entry from the buffer's head, one by one,
    hints and the caller's mask checked per block."""

    def _candidates(
        self, seg: int, evictable: EvictableFn | None, now: float | None, first: int
    ) -> Iterator[list[int]]:
        buf = self._bufs[seg]
        if self._coldest(seg) < 0:
            return
        yielded: set[int] = set()
        i = buf.cur
        while True:
            if i >= len(buf.entries):
                if buf.complete:
                    return
                self._rebuild(seg, 4 * max(len(buf.entries) - buf.cur, _MIN_BUFFER))
                i = buf.cur
                continue
            entry = buf.entries[i]
            i += 1
            self.scan_steps += 1
            bid = entry[3]
            if bid in yielded or not self._valid(seg, entry):
                continue
            if now is not None and self._hints.until(bid) >= now:
                continue
            if evictable is not None and not evictable(np.array([bid]))[0]:
                continue
            yielded.add(bid)
            yield [bid]

    def _coldest_unhinted(self, seg: int, now: float) -> int:
        # The one-victim path's head, by the same plain scan.
        return next(iter(self._candidates(seg, None, now, 1)), [-1])[0]


def hinted_pair(blocks: int, hinted: np.ndarray) -> tuple[HeatPolicy, WalkingHeat]:
    """Both scans over ``blocks`` blocks inserted coldest first, ``hinted`` of them under a
    hint until far ahead; scan costs counted from here."""
    fast, walk = HeatPolicy(), WalkingHeat()
    for p in (fast, walk):
        for b in range(blocks):
            p.insert(b, b * 1e-3)
        p.hint(hinted, 1e9, 10.0)
        p.scan_steps = 0
    return fast, walk


def mask_for(salt: int) -> EvictableFn:
    return lambda bids: (np.asarray(bids) * 2654435761 + salt) % 5 != 0


@pytest.mark.parametrize(
    "seed, caps, steps",
    [(s, (40, 200), 1500) for s in range(5)] + [(s, (150, 400), 2500) for s in range(6, 8)],
)
def test_skipping_hinted_blocks_decides_as_walking_them(
    seed: int, caps: tuple[int, int], steps: int
) -> None:
    """Random inserts, touches, hints (deadlines passing all the time) and victims with and
    without masks; the larger caches have buffers smaller than a segment, so rebuilds park
    and deadlines bring entries back."""
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(*caps))
    fast, walk = HeatPolicy(capacity_blocks=cap), WalkingHeat(capacity_blocks=cap)
    resident: list[int] = []
    next_id, now, asked = 0, 0.0, 0
    for step in range(steps):
        now += float(rng.exponential(0.05))
        op = rng.random()
        if op < 0.45 or not resident:
            parent = resident[-1] if resident and rng.random() < 0.5 else -1
            bid = next_id if rng.random() < 0.8 or next_id < 10 else int(rng.integers(next_id))
            next_id = max(next_id, bid + 1)
            for p in (fast, walk):
                p.insert(bid, now, parent)
            if bid not in resident:
                resident.append(bid)
        elif op < 0.65:
            bid = resident[int(rng.integers(len(resident)))]
            for p in (fast, walk):
                p.touch(bid, now)
        elif op < 0.8:
            # A waiting queue: mostly the coldest resident blocks, some not resident yet.
            k = int(rng.integers(1, max(2, len(resident) // 2)))
            bids = np.array([*resident[:k], next_id + int(rng.integers(5))], dtype=np.int64)
            until = now + float(rng.uniform(0, 3))
            for p in (fast, walk):
                p.hint(bids, until, now)
        else:
            n = int(rng.integers(1, 4))
            mask = None if rng.random() < 0.5 else mask_for(step)
            got, want = fast.victims(n, now, mask), walk.victims(n, now, mask)
            asked += 1
            assert (got is None) == (want is None), step
            if got is None or want is None:
                continue
            assert got.tolist() == want.tolist(), step
            for bid in got.tolist():
                for p in (fast, walk):
                    p.remove(bid)
                resident.remove(bid)
        while len(resident) > cap:
            got = fast.victims(1, now, None)
            want = walk.victims(1, now, None)
            if got is None or want is None:
                assert got is None and want is None
                break
            assert got.tolist() == want.tolist(), step
            bid = int(got[0])
            for p in (fast, walk):
                p.remove(bid)
            resident.remove(bid)
    assert asked > 100
    assert fast.order().tolist() == walk.order().tolist()


def test_a_waiting_queue_at_the_cold_end_is_walked_once_not_on_every_eviction() -> None:
    """5,000 cold blocks hinted until a later deadline, then 300 evictions of fresh blocks:
    the scans walk the hinted run about once; the plain scan walks it every time."""
    hinted, rounds = 5000, 300
    fast, walk = hinted_pair(hinted + 100, np.arange(hinted))
    for k in range(rounds):
        now = 11.0 + k * 1e-3
        got, want = fast.victims(1, now, None), walk.victims(1, now, None)
        assert got is not None and want is not None
        assert got.tolist() == want.tolist()
        assert int(got[0]) >= hinted  # never a hinted block
        for p in (fast, walk):
            p.remove(int(got[0]))
            p.insert(hinted + 100 + k, now)
    assert walk.scan_steps >= rounds * hinted
    assert fast.scan_steps < 2 * hinted + rounds * 4 * _MIN_BUFFER, fast.scan_steps
    # Past the deadline the run is walked again and its blocks go first (they are coldest).
    got = fast.victims(3, 2e9, None)
    assert got is not None and got.tolist() == walk.victims(3, 2e9, None).tolist()
    assert max(got.tolist()) < hinted


def test_hinted_blocks_spread_through_the_order_are_parked_not_walked() -> None:
    """Every other cold block hinted (a waiting queue does not sit in one run): 300
    evictions look at each hinted entry about once, and decide as the plain scan."""
    blocks, rounds = 4000, 300
    fast, walk = hinted_pair(blocks, np.arange(0, blocks, 2))
    for k in range(rounds):
        now = 11.0 + k * 1e-3
        got, want = fast.victims(1, now, None), walk.victims(1, now, None)
        assert got is not None and want is not None
        assert got.tolist() == want.tolist()
        assert int(got[0]) % 2 == 1  # never a hinted block
        for p in (fast, walk):
            p.remove(int(got[0]))
            p.insert(blocks + k, now)
    assert walk.scan_steps >= rounds * rounds // 2  # the plain scan re-walks the hinted ones
    assert fast.scan_steps < 4 * rounds, fast.scan_steps
    # Past the deadline the parked blocks come back at their place: the coldest go first.
    got = fast.victims(4, 2e9, None)
    assert got is not None and got.tolist() == walk.victims(4, 2e9, None).tolist()
    assert got.tolist() == [0, 2, 4, 6]
