"""ParseTurns: large requests parsed one at a time, round robin over their senders."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from collections.abc import Callable

import pytest
import uvloop

from kvtier.daemon.parseturns import ParseTurns, TurnRefused, session_id_of
from kvtier.proto import kvtier_pb2 as pb


def _sender(data: bytes) -> str:
    return data[:1].decode()


def _ten_ms_parses() -> Callable[[], float]:
    """A clock by which every parse takes 10 ms: its pauses (10 and 30 ms) outlast the
    set-up of a test, so that its requests wait."""
    return itertools.count(step=0.01).__next__


def test_turns_go_round_robin_over_the_senders() -> None:
    """A sender with many requests waiting gets one turn in each round: another sender's
    request waits behind one of them, not all; and not for the pause after the first
    sender's parse, but one parse time (b1 and c1 came before a2: a sender's three parse
    times of pause held every sender)."""

    async def run() -> None:
        counters: Counter[str] = Counter()
        turns = ParseTurns(_sender, counters, 1 << 20, _ten_ms_parses())
        order: list[bytes] = []

        def parse(data: bytes) -> bytes:
            order.append(data)
            return data

        requests = [b"a1", b"a2", b"a3", b"a4", b"b1", b"c1"]
        parsed = await asyncio.gather(*(turns.parse([r], parse) for r in requests))
        assert parsed == requests  # each call gets its own request back
        assert order == [b"a1", b"b1", b"c1", b"a2", b"a3", b"a4"]
        assert counters["requests_parse_waited"] == 5  # all but the first

    asyncio.run(run())


def test_a_request_whose_client_left_while_it_waited_gives_its_turn_away() -> None:
    async def run() -> None:
        turns = ParseTurns(_sender, Counter(), 1 << 20, _ten_ms_parses())
        order: list[bytes] = []
        first = asyncio.ensure_future(turns.parse([b"a1"], order.append))
        gone = asyncio.ensure_future(turns.parse([b"b1"], order.append))
        last = asyncio.ensure_future(turns.parse([b"c1"], order.append))
        await first
        gone.cancel()
        await last
        assert order == [b"a1", b"c1"]
        # The turn is free again once the pause after the last parse has passed.
        await asyncio.sleep(0.01)
        await asyncio.wait_for(turns.parse([b"d1"], order.append), 1)
        assert order[-1] == b"d1"

    asyncio.run(run())


def test_past_the_bound_the_sender_with_the_most_waiting_has_its_newest_refused() -> None:
    """Requests waiting for their turn hold their bytes: at most ``max_waiting_bytes`` (here
    four requests' worth). Past it the newest requests of the sender with the most bytes
    waiting (the one come, where it is its sender's) lose their bytes at once and end
    TurnRefused in their turns; another sender's requests keep theirs."""

    async def run() -> None:
        counters: Counter[str] = Counter()
        turns = ParseTurns(_sender, counters, 8, _ten_ms_parses())
        order: list[bytes] = []

        def parse(data: bytes) -> bytes:
            order.append(data)
            return data

        first = asyncio.ensure_future(turns.parse([b"a0"], parse))
        await asyncio.sleep(0)  # a0 holds the turn; the rest wait
        held = {r: [r] for r in (b"a1", b"a2", b"a3", b"b1", b"a4", b"b2")}
        waiting = [asyncio.ensure_future(turns.parse(held[r], parse)) for r in held]
        # b1: 8 bytes waiting, full; a4: a would hold 8 of 10, itself; b2: a3, a's newest.
        await asyncio.sleep(0)
        # The refused requests' bytes are gone at once; they end in their turns.
        assert held[b"a3"] == held[b"a4"] == []
        assert not any(w.done() for w in waiting)
        done = await asyncio.gather(first, *waiting, return_exceptions=True)
        refused = [
            r
            for r, d in zip([b"a0", b"a1", b"a2", b"a3", b"b1", b"a4", b"b2"], done, strict=True)
            if isinstance(d, TurnRefused)
        ]
        assert refused == [b"a3", b"a4"]
        assert order == [b"a0", b"b1", b"a1", b"b2", b"a2"]
        assert counters["requests_parse_refused"] == 2

    asyncio.run(run())


def test_a_request_whose_client_left_gives_its_place_back() -> None:
    """A waiting request whose call ended leaves the queue then, not when its turn comes:
    the bound counts only the requests still waiting."""

    async def run() -> None:
        turns = ParseTurns(_sender, Counter(), 4, _ten_ms_parses())
        order: list[bytes] = []
        first = asyncio.ensure_future(turns.parse([b"a0"], order.append))
        await asyncio.sleep(0)
        gone = [asyncio.ensure_future(turns.parse([r], order.append)) for r in (b"b1", b"c1")]
        await asyncio.sleep(0)
        for g in gone:
            g.cancel()
        await asyncio.sleep(0)
        kept = [asyncio.ensure_future(turns.parse([r], order.append)) for r in (b"d1", b"e1")]
        await asyncio.gather(first, *kept)
        assert order == [b"a0", b"d1", b"e1"]

    asyncio.run(run())


def test_the_sender_is_the_session_a_request_names_first() -> None:
    sid = "0123456789abcdef" * 2
    put = pb.PutRequest(session_id=sid, pool_id=1, keys=[b"k" * 32], pages=[1])
    assert session_id_of(put.SerializeToString()) == sid
    assert session_id_of(pb.LookupRequest(session_id=sid).SerializeToString()) == sid
    # No session, or one not written first: the requests naming none share their turn.
    assert session_id_of(pb.PutRequest(pool_id=1).SerializeToString()) == ""
    assert session_id_of(pb.LookupRequest(session_id="short").SerializeToString()) == ""
    assert session_id_of(b"\x10\x01" + put.SerializeToString()) == ""
    assert session_id_of(b"") == ""


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
@pytest.mark.parametrize("seed", range(3))
def test_every_call_ends_under_arrivals_cancellations_and_refusals(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], seed: int
) -> None:
    """Requests of three senders arriving at random, some of their calls ended while they
    wait, and a bound that refuses most: every call ends (parsed, refused or cancelled) and
    nothing stays queued. On uvloop, whose call_at of a time already passed returns a Handle
    without ``when``, arming the timer again raised AttributeError and the turns stopped."""
    rnd = random.Random(seed)

    async def run() -> None:
        turns = ParseTurns(_sender, Counter(), 40, itertools.count(step=0.0005).__next__)
        calls: list[asyncio.Future[bytes]] = []
        for _ in range(300):
            request = [rnd.choice(b"abc").to_bytes() + b"x" * rnd.randint(1, 12)]
            calls.append(asyncio.ensure_future(turns.parse(request, bytes)))
            if rnd.random() < 0.3:
                await asyncio.sleep(rnd.random() * 0.002)
            if rnd.random() < 0.2:
                rnd.choice(calls).cancel()
        # A bound on a hang, not on the time taken: the turns of 300 requests take ~1 s.
        ends = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
        kinds = {type(e) for e in ends if isinstance(e, BaseException)}
        assert kinds <= {TurnRefused, asyncio.CancelledError}
        assert not turns._waiting and turns._bytes == 0

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())
