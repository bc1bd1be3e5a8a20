"""``HeatPolicy.replace`` (a full tier's miss in one call, written out for the replayer)
against the steps it stands for, on generated conversation traffic.

Two policies serve the same trace as the replayer's one-tier loop does: hits are touched,
misses of a full tier go through ``replace`` on one and through ``victim``, ``remove`` and
``insert`` on the other. Every answer must match and, at every request boundary sampled and
at the end, so must the whole state (``heat_state``). The traffic (shared prompts, chains,
conversations that come back, agents' long chains, documents) at several sizes moves ARC's target both
ways, returns blocks from both shadows, runs protection out and evicts parents waiting for
their children, which the coverage counters check.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from heat_state import assert_same_state

from kvtier.daemon.policy.base import NO_VICTIM
from kvtier.daemon.policy.heat import _PROBATION, HeatPolicy
from kvtier.sim.trace import Trace, trace_from_requests
from kvtier.sim.tracegen import scenario


@pytest.mark.parametrize("mix", ["chat", "agent", "rag"])
def test_replace_equals_its_steps_on_generated_traffic(mix: str) -> None:
    trace = trace_from_requests(scenario(mix, seed=3, duration_s=240.0), mix).cacheable()
    seen: Counter[str] = Counter()
    for percent in (1, 5, 20):
        _replay_both(trace, max(8, trace.unique_blocks * percent // 100), seen)
    assert all(seen[k] for k in ("probation", "protected", "returning", "exception")), seen


def _replay_both(trace: Trace, capacity: int, seen: Counter[str]) -> None:
    fast, steps = HeatPolicy(capacity_blocks=capacity), HeatPolicy(capacity_blocks=capacity)
    pick = steps._pick

    def counted_pick(n1: int, p: float, from_protected: bool, head: Any) -> tuple[int, int]:
        # ARC's rule chose one segment, heat's exceptions the other (protection ran out,
        # or a parent waits for its child in probation).
        rule = _PROBATION if n1 >= 1 and (n1 > p or (from_protected and n1 == p)) else 2
        got = pick(n1, p, from_protected, head)
        seen["exception"] += got[0] != rule
        return got

    steps._pick = counted_pick  # type: ignore[method-assign]
    blocks, offsets = trace.blocks.tolist(), trace.offsets.tolist()
    resident: set[int] = set()
    for r, now in enumerate(trace.timestamps_s.tolist()):
        req = blocks[offsets[r] : offsets[r + 1]]
        for i, b in enumerate(req):
            if b in resident:
                fast.touch(b, now)
                steps.touch(b, now)
                continue
            parent = req[i - 1] if i else -1
            if len(resident) < capacity:
                fast.insert(b, now, parent)
                steps.insert(b, now, parent)
                resident.add(b)
                continue
            if b < steps._size and steps._returning_from(b):
                seen["returning"] += 1
            out = steps.victim(now, b)
            assert out >= 0
            seen["probation" if steps._seg_v[out] == _PROBATION else "protected"] += 1
            steps.remove(out)
            steps.insert(b, now, parent)
            assert fast.replace(b, parent, now) == out, (r, i)
            resident.discard(out)
            resident.add(b)
        if r % 97 == 0:
            assert_same_state(fast, steps)
    assert_same_state(fast, steps)


def test_replace_without_a_victim_inserts_nothing() -> None:
    """Every resident block hinted: ``NO_VICTIM``, the block is not inserted, and the
    policy is as ``victim`` alone leaves it."""
    fast, steps = HeatPolicy(capacity_blocks=4), HeatPolicy(capacity_blocks=4)
    for p in (fast, steps):
        for b in range(4):
            p.insert(b, float(b), b - 1)
        p.hint(np.arange(4, dtype=np.int64), 100.0, 4.0)
    assert steps.victim(5.0, 9) == -1
    assert fast.replace(9, -1, 5.0) == NO_VICTIM
    assert 9 not in fast and len(fast) == 4
    assert_same_state(fast, steps)
