"""ParseTurns: large requests parsed one at a time, round robin over their senders."""

from __future__ import annotations

import asyncio
from collections import Counter

from kvtier.daemon.parseturns import ParseTurns, session_id_of
from kvtier.proto import kvtier_pb2 as pb


def _sender(data: bytes) -> str:
    return data[:1].decode()


def test_turns_go_round_robin_over_the_senders() -> None:
    """A sender with many requests waiting gets one turn in each round: another sender's
    request waits behind one of them, not all."""

    async def run() -> None:
        counters: Counter[str] = Counter()
        turns = ParseTurns(_sender, counters)
        order: list[bytes] = []

        def parse(data: bytes) -> bytes:
            order.append(data)
            return data

        requests = [b"a1", b"a2", b"a3", b"a4", b"b1", b"c1"]
        parsed = await asyncio.gather(*(turns.parse(r, parse) for r in requests))
        assert parsed == requests  # each call gets its own request back
        assert order == [b"a1", b"a2", b"b1", b"c1", b"a3", b"a4"]
        assert counters["requests_parse_waited"] == 5  # all but the first

    asyncio.run(run())


def test_a_request_whose_client_left_while_it_waited_gives_its_turn_away() -> None:
    async def run() -> None:
        turns = ParseTurns(_sender, Counter())
        order: list[bytes] = []
        first = asyncio.ensure_future(turns.parse(b"a1", order.append))
        gone = asyncio.ensure_future(turns.parse(b"b1", order.append))
        last = asyncio.ensure_future(turns.parse(b"c1", order.append))
        await first
        gone.cancel()
        await last
        assert order == [b"a1", b"c1"]
        # The turn is free again once the pause after the last parse has passed.
        await asyncio.sleep(0.01)
        await asyncio.wait_for(turns.parse(b"d1", order.append), 1)
        assert order[-1] == b"d1"

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
