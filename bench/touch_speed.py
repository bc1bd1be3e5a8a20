"""Cost of the heat policy's touches for one Lookup: ``touch_many`` against the loop of
``touch`` it replaces, in microseconds per block, on a resident chain (root first).

    python -m kvtier.bench.touch_speed [--blocks 1024] [--rounds 200] [--json]

Cases, each timed on the state a Lookup would meet (the median of ``rounds``):

- ``protected``: the chain was read before, so every block is protected and all share one
  history; each round is one more Lookup of the whole chain, a little later.
- ``mixed``: the chain's last quarter is new (the conversation's last turn, in probation)
  and leaves probation in this Lookup; the rest is protected.
- ``grown``: the chain grew one block per turn, each turn a Lookup of the chain so far and
  a write of one block: every block has a heat of its own, the worst case for
  ``touch_many``'s heat update (see ``HeatTable.record_distinct``).
- ``decoded``: the chain was stored one block at a time (as an engine does during decode),
  each a little later than its parent, so every child ranks above its ancestors and each
  touch raises them all: the chain rule's worst case (O(n^2) before owed raises).

Each timing includes paying the raises the Lookup left owed to ancestors (``victims`` or
``effective_key`` would). Both policies see the same calls and must end in the same state;
the script checks it.

Then ``--deep`` (200,000; 0 skips it): a chain that deep stored by Puts of 16, each a
little later, and one touch of its leaf alone, which protects every ancestor: the longest
single call (the touch, or one of the ``work`` calls that make the moves it owed) against
all of them together, and the ancestors the touch itself walked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvtier.daemon.policy.heat import HeatPolicy

Setup = Callable[[HeatPolicy], float]


def _protected(n: int) -> Setup:
    def setup(policy: HeatPolicy) -> float:
        for bid in range(n):
            policy.insert(bid, 0.0, bid - 1)
        policy.touch_many(np.arange(n), 1.0)
        return 2.0

    return setup


def _mixed(n: int) -> Setup:
    old = n - n // 4

    def setup(policy: HeatPolicy) -> float:
        for bid in range(old):
            policy.insert(bid, 0.0, bid - 1)
        policy.touch_many(np.arange(old), 1.0)
        for bid in range(old, n):
            policy.insert(bid, 1.5, bid - 1)
        return 2.0

    return setup


def _grown(n: int) -> Setup:
    def setup(policy: HeatPolicy) -> float:
        for bid in range(n):
            policy.touch_many(np.arange(bid), bid * 0.01)
            policy.insert(bid, bid * 0.01, bid - 1)
        return n * 0.01

    return setup


def _decoded(n: int) -> Setup:
    def setup(policy: HeatPolicy) -> float:
        for bid in range(n):
            policy.insert(bid, bid * 0.001, bid - 1)
        return n * 0.001 + 1.0

    return setup


def _time_case(setup: Setup, n: int, rounds: int, repeat_on_one: bool) -> tuple[float, float]:
    """Median seconds of ``touch_many`` and of the loop for one Lookup of ``n`` blocks.
    ``repeat_on_one``: every round is another Lookup on the same policies (the state stays
    alike); otherwise each round starts from a fresh ``setup``."""
    bids = np.arange(n, dtype=np.int64)
    vec_s, loop_s = [], []
    vec = loop = None
    now = 0.0
    for _ in range(rounds):
        if vec is None or loop is None or not repeat_on_one:
            vec, loop = HeatPolicy(), HeatPolicy()
            now = setup(vec)
            setup(loop)
        t = time.perf_counter()
        vec.touch_many(bids, now)
        vec.effective_key(0)  # pays what the touches owe
        vec_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for bid in bids.tolist():
            loop.touch(bid, now)
        loop.effective_key(0)
        loop_s.append(time.perf_counter() - t)
        now += 0.25
        if not (np.array_equal(vec._eff, loop._eff) and np.array_equal(vec._seg, loop._seg)):
            raise AssertionError("touch_many and the loop of touch disagree")
    return statistics.median(vec_s), statistics.median(loop_s)


def _leaf_touch(n: int) -> dict[str, float]:
    """The first touch of the leaf of an ``n``-block chain stored by Puts (see ``--deep``)."""
    policy = HeatPolicy()
    ids = np.arange(n, dtype=np.int64)
    now = 0.0
    for lo in range(0, n, 16):
        now += 0.001
        policy.insert_many(ids[lo : lo + 16], now, ids[lo : lo + 16] - 1)
    steps = policy.chain_steps
    t = time.perf_counter()
    policy.touch(n - 1, now + 1.0)
    calls = [time.perf_counter() - t]
    walked = [policy.chain_steps - steps]
    more = policy.owes_work
    while more:
        steps = policy.chain_steps
        t = time.perf_counter()
        more = policy.work()
        calls.append(time.perf_counter() - t)
        walked.append(policy.chain_steps - steps)
    if policy.stats().protected != n:
        raise AssertionError("the leaf's touch left ancestors in probation")
    return {
        "deep_blocks": n,
        "deep_touch_walked": walked[0],
        "deep_most_walked": max(walked),
        "deep_calls": len(calls),
        "deep_median_ms": round(statistics.median(calls) * 1e3, 3),
        "deep_longest_ms": round(max(calls) * 1e3, 3),
        "deep_all_ms": round(sum(calls) * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--deep", type=int, default=200_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    n = args.blocks
    cases = {
        "protected": (_protected(n), True),
        "mixed": (_mixed(n), False),
        "grown": (_grown(n), False),
        "decoded": (_decoded(n), False),
    }
    figures: dict[str, float] = {"blocks": n}
    print(f"heat policy, one Lookup of a {n}-block resident chain (median of {args.rounds})")
    print(f"  {'case':<10} {'touch_many':>18} {'loop of touch':>18} {'speed-up':>9}")
    for name, (setup, repeat) in cases.items():
        rounds = args.rounds if repeat else max(args.rounds // 10, 5)
        vec, loop = _time_case(setup, n, rounds, repeat)
        figures[f"{name}_touch_many_us_per_block"] = round(vec / n * 1e6, 3)
        figures[f"{name}_loop_us_per_block"] = round(loop / n * 1e6, 3)
        figures[f"{name}_touch_many_us"] = round(vec * 1e6, 1)
        print(
            f"  {name:<10} {vec / n * 1e6:6.3f} us/block {loop / n * 1e6:6.3f} us/block "
            f"{loop / vec:8.1f}x   ({vec * 1e6:.0f} us vs {loop * 1e6:.0f} us in all)"
        )
    if args.deep > 0:
        deep = _leaf_touch(args.deep)
        figures.update(deep)
        print(
            f"first touch of a {args.deep}-block chain's leaf: the touch walked "
            f"{deep['deep_touch_walked']:.0f} ancestors, {deep['deep_calls']:.0f} calls (the "
            f"touch, then work) at most {deep['deep_most_walked']:.0f} each; "
            f"{deep['deep_all_ms']:.1f} ms together, a call's median "
            f"{deep['deep_median_ms']:.2f} ms, the longest {deep['deep_longest_ms']:.2f} ms"
        )
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
