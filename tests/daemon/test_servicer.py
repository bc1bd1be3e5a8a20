"""The servicer's one place for statuses: malformed requests and unexpected failures."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvtier.daemon.errors import InvalidArgument
from kvtier.daemon.health import HealthService
from kvtier.daemon.server import (
    MAX_HEALTH_SERVICE_CHARS,
    MAX_OPEN_SESSION_BYTES,
    KVTierServicer,
    Malformed,
    RequestReceiver,
    WatchLimits,
    _health_handlers,
    _lenient,
    layout_from_pb,
    watch_peer,
)
from kvtier.kernels.layout import MAX_LAYERS
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.wire import ANSWERED_KEY


class FakeContext:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()

    async def abort(
        self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()
    ) -> None:
        self.status = (code, details)
        self.trailing_metadata = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def peer(self) -> str:
        return "unix:"


class BrokenService:
    """Every rule fails in a way the daemon did not foresee."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def lookup(self, *args: object) -> None:
        raise RuntimeError("a bug")


def _call(servicer: KVTierServicer, method: str, request: object) -> tuple[grpc.StatusCode, str]:
    context = FakeContext()

    async def run() -> None:
        with pytest.raises(grpc.aio.AbortError):
            await getattr(servicer, method)(request, context)

    asyncio.run(run())
    assert context.status is not None
    # Only an UNAVAILABLE is marked as the daemon's own (clients tell it from gRPC's).
    answered = (ANSWERED_KEY, "1") in context.trailing_metadata
    assert answered == (context.status[0] == grpc.StatusCode.UNAVAILABLE)
    return context.status


def test_an_unexpected_failure_is_internal_with_one_traceback_per_interval(caplog):
    service = BrokenService()
    servicer = KVTierServicer(service, 10, log_interval_s=60.0)  # type: ignore[arg-type]
    request = pb.LookupRequest(session_id="0" * 32, keys=[bytes(32)])
    with caplog.at_level(logging.ERROR, logger="kvtier.daemon.server"):
        for _ in range(50):
            code, details = _call(servicer, "Lookup", request)
            assert code == grpc.StatusCode.INTERNAL and "see its log" in details
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "Lookup failed" in tracebacks[0].getMessage()
    assert service.counters["requests_internal_error"] == 50


def test_a_malformed_request_is_invalid_argument_with_one_warning_per_interval(caplog):
    service = BrokenService()
    servicer = KVTierServicer(service, 10, log_interval_s=60.0)  # type: ignore[arg-type]
    parse = _lenient(pb.PutRequest)
    bad = parse(b"\x0a\xff\xff\xff\x7f")
    assert bad == Malformed("PutRequest", 5)
    with caplog.at_level(logging.WARNING, logger="kvtier.daemon.server"):
        for _ in range(50):
            code, details = _call(servicer, "Put", bad)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert details == "the request is not a valid PutRequest message"
    assert len(caplog.records) == 1 and not caplog.records[0].exc_info
    assert service.counters["requests_malformed"] == 50


def test_the_lenient_parser_returns_valid_messages_unchanged():
    request = pb.PutRequest(session_id="s", pool_id=3, keys=[b"k"], pages=[1])
    assert _lenient(pb.PutRequest)(request.SerializeToString()) == request


def test_regression_a_layout_of_millions_of_layers_was_built_before_its_count_was_checked():
    """A RegisterPool of 2.5 million layers (30 MB, under the message limit) held the event
    loop for 8 s, stalling every client, while each layer became an object; only then did
    the layout's validation refuse the count. The count is now refused first."""

    def layout(n: int) -> pb.PoolLayout:
        layer = pb.LayerLayout(offset=0, kv_count=1, page_stride=1, chunk_bytes=1)
        return pb.PoolLayout(layers=[layer] * n, num_pages=1, block_tokens=1, dtype=pb.DTYPE_UINT8)

    assert len(layout_from_pb(layout(MAX_LAYERS)).layers) == MAX_LAYERS
    with pytest.raises(InvalidArgument, match=f"{MAX_LAYERS + 1} layers; at most {MAX_LAYERS}"):
        layout_from_pb(layout(MAX_LAYERS + 1))


def test_regression_streams_kept_requests_of_the_message_limit_for_their_whole_life():
    """An OpenSession request and a health Watch (which needs no session) are held for as
    long as their streams stay open: eight sessions named with 60 MB each kept 1.1 GB of the
    daemon, eight watches of a 60 MB service name 2 GB. Both are now refused above a size
    far below the message limit, before anything is held."""
    servicer = KVTierServicer(BrokenService(), 10)  # type: ignore[arg-type]
    watch = _health_handlers(HealthService(), servicer, WatchLimits(256, 32))["Watch"].unary_stream

    def status(call: Any) -> tuple[grpc.StatusCode, str]:
        context = FakeContext()

        async def run() -> None:
            with pytest.raises(grpc.aio.AbortError):
                await call(context)

        asyncio.run(run())
        assert context.status is not None
        return context.status

    session = pb.OpenSessionRequest(client_name="x" * MAX_OPEN_SESSION_BYTES)
    code, details = status(lambda c: servicer.OpenSession(session, c).__anext__())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "OpenSession request of" in details
    name = health_pb2.HealthCheckRequest(service="x" * (MAX_HEALTH_SERVICE_CHARS + 1))
    code, details = status(lambda c: watch(name, c))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "service name of" in details


def test_regression_health_watches_were_unbounded():
    """A health watch needs no session (over TCP no token either) and holds a few kilobytes
    while it stays open: 20,000 of them grew a daemon by 130 MB. Beyond the bound
    (server.max_health_watches) open at once a watch is RESOURCE_EXHAUSTED; one that ends
    makes room."""
    servicer = KVTierServicer(BrokenService(), 10)  # type: ignore[arg-type]
    watch = _health_handlers(HealthService(), servicer, WatchLimits(2, 2))["Watch"].unary_stream
    request = health_pb2.HealthCheckRequest(service="")

    class WatchContext(FakeContext):
        async def write(self, message: object) -> None:
            pass

    async def run() -> None:
        open_ = [asyncio.ensure_future(watch(request, WatchContext())) for _ in range(2)]
        await asyncio.sleep(0)  # both are watching
        refused = WatchContext()
        with pytest.raises(grpc.aio.AbortError):
            await watch(request, refused)
        assert refused.status is not None
        code, details = refused.status
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 2" in details
        open_[0].cancel()  # a watcher goes away
        await asyncio.gather(open_[0], return_exceptions=True)
        again = asyncio.ensure_future(watch(request, WatchContext()))
        await asyncio.sleep(0)
        assert not again.done()  # watching, not refused
        for task in (open_[1], again):
            task.cancel()
        await asyncio.gather(open_[1], again, return_exceptions=True)

    asyncio.run(run())


def test_one_tcp_host_gets_its_share_of_watches_and_unix_peers_the_total():
    """Per TCP client host at most server.max_health_watches_per_peer watches, each host
    counted apart; Unix socket peers, which gRPC does not name, only count toward the
    total. Refusals are counted (health_watches_refused) and name the bound met."""
    service = BrokenService()
    servicer = KVTierServicer(service, 10)  # type: ignore[arg-type]
    limits = WatchLimits(5, 2)
    watch = _health_handlers(HealthService(), servicer, limits)["Watch"].unary_stream
    request = health_pb2.HealthCheckRequest(service="")

    class WatchContext(FakeContext):
        def __init__(self, peer: str) -> None:
            super().__init__()
            self._peer = peer

        def peer(self) -> str:
            return self._peer

        async def write(self, message: object) -> None:
            pass

    async def attempt(peer: str, tasks: list[asyncio.Future[None]]) -> str | None:
        """Opens a watch from ``peer``; the refusal's details, or None if it is watching."""
        context = WatchContext(peer)
        task = asyncio.ensure_future(watch(request, context))
        await asyncio.sleep(0)
        if task.done():
            with pytest.raises(grpc.aio.AbortError):
                task.result()
            assert context.status is not None
            assert context.status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            return context.status[1]
        tasks.append(task)
        return None

    async def run() -> None:
        tasks: list[asyncio.Future[None]] = []
        assert await attempt("ipv4:10.0.0.5:40001", tasks) is None
        assert await attempt("ipv4:10.0.0.5:40002", tasks) is None  # another connection
        refused = await attempt("ipv4:10.0.0.5:40003", tasks)
        assert refused == (
            "2 health watches are open from ipv4:10.0.0.5; at most 2 per client host "
            "(server.max_health_watches_per_peer)"
        )
        assert await attempt("ipv6:[::1]:40004", tasks) is None  # another host
        assert await attempt("unix:", tasks) is None
        assert await attempt("unix:", tasks) is None  # five open: the total
        refused = await attempt("ipv4:10.0.0.6:40005", tasks)
        assert refused == "5 health watches are open; at most 5 (server.max_health_watches)"
        assert service.counters["health_watches_refused"] == 2
        tasks[0].cancel()  # one of 10.0.0.5's ends: that host may open one again
        await asyncio.gather(tasks.pop(0), return_exceptions=True)
        assert await attempt("ipv4:10.0.0.5:40006", tasks) is None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert limits.open == 0 and limits.refusal("ipv4:10.0.0.5") is None

    asyncio.run(run())


@pytest.mark.parametrize(
    "peer, host",
    [
        ("ipv4:127.0.0.1:53434", "ipv4:127.0.0.1"),
        ("ipv6:[::1]:8080", "ipv6:[::1]"),
        ("ipv6:%5B::1%5D:8080", "ipv6:%5B::1%5D"),
        ("unix:", None),
        ("unix:/run/kvtier/kvtierd.sock", None),
        ("", None),
    ],
)
def test_a_watch_counts_against_its_tcp_host_only(peer, host):
    assert watch_peer(peer) == host


def test_regression_requests_after_sigterm_were_told_their_session_was_not_found():
    """Once the daemon stops, sessions end; a request arriving then was NOT_FOUND ('session
    ... is not open'), which reads as a lost session, not a daemon going away."""
    servicer = KVTierServicer(BrokenService(), 10)  # type: ignore[arg-type]
    servicer.closing.set()
    code, details = _call(servicer, "Lookup", pb.LookupRequest(session_id="gone"))
    assert code == grpc.StatusCode.UNAVAILABLE and "stopping" in details


def test_past_its_limit_the_receiver_ends_the_call_that_has_waited_longest():
    """Calls waiting for their request are bounded: one more ends the oldest waiter with
    RESOURCE_EXHAUSTED, the others keep waiting (the daemon-level test in
    tests/test_slow_requests.py cannot tell which: gRPC starts handlers out of the order the
    calls were opened in)."""
    from collections import Counter

    class Waiting(FakeContext):
        async def read(self) -> object:
            await asyncio.Event().wait()  # the rest of the request never comes

    async def run() -> None:
        counters: Counter[str] = Counter()
        receiver = RequestReceiver(3, 100.0, counters)
        contexts = [Waiting() for _ in range(4)]
        tasks = []
        for ctx in contexts:
            tasks.append(asyncio.ensure_future(receiver.receive(ctx, bytes)))
            await asyncio.sleep(0)  # each begins to wait before the next arrives
        await asyncio.sleep(0.01)
        assert contexts[0].status is not None
        assert contexts[0].status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [c.status for c in contexts[1:]] == [None, None, None]
        assert counters["requests_unreceived"] == 1
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


@pytest.mark.parametrize("nkeys", [600, 2000])  # handler turns only; parse turns as well
def test_regression_a_request_naming_its_session_last_took_the_turns_of_requests_naming_none(
    nkeys,
):
    """A large request's handler turn went to the sender that ``session_id_of`` read from its
    first bytes: a client whose protobuf library wrote the session id after the keys took
    the turns of the requests naming no session (\"\"), while served as its tenant, and one
    writing both orders had two turns per round. The handler's turn now goes by the parsed
    request's session, wherever it was written."""
    from kvtier.daemon.parseturns import LARGE_REQUEST_BYTES
    from kvtier.daemon.stepturns import STEP_TURN_BYTES

    session_id = "ab" * 16
    late = (
        pb.LookupRequest(keys=[i.to_bytes(32, "big") for i in range(nkeys)]).SerializeToString()
        + pb.LookupRequest(session_id=session_id).SerializeToString()
    )
    assert len(late) >= STEP_TURN_BYTES and (len(late) >= LARGE_REQUEST_BYTES) == (nkeys > 600)

    class Sent(FakeContext):
        async def read(self) -> bytes:
            return late

    async def run() -> tuple[Any, str | None]:
        receiver = RequestReceiver(
            8, 100.0, Counter(), lambda sid: "tenant-a" if sid == session_id else ""
        )
        return await receiver._receive(Sent(), pb.LookupRequest.FromString)

    request, sender = asyncio.run(run())
    assert request.session_id == session_id and len(request.keys) == nkeys
    assert sender == "tenant-a"
