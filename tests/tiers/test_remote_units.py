"""The L3 tier's pure parts: key naming, the value header, reachability with backoff, the
write budget, option checks, how the tier's connections pack, send and read. No server
needed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from harness import held_port
from peers import require_root
from redis._parsers import _AsyncHiredisParser
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis_servers import wait_for

from kvtier.tiers.remote.codec import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    KeyNamer,
    Verdict,
    checksum,
    header,
    verify,
)
from kvtier.tiers.remote.options import RemoteOptions, RemoteOptionsError, read_password
from kvtier.tiers.remote.state import Availability, Reach, TokenBucket
from kvtier.tiers.remote.wire import (
    READER_KEEP_BYTES,
    STREAM_LIMIT_BYTES,
    Framed,
    NodeFaults,
    TierConnectionUnavailable,
    _tier_class,
    _TierConnection,
    noting_node_faults,
    use_tier_connections,
)


def _value(payload: bytes, key: bytes) -> bytes:
    return header(len(payload), checksum(payload), key) + payload


def test_header_layout_is_the_documented_one() -> None:
    v = _value(b"abc", b"k")
    assert HEADER_BYTES == 32
    assert v[:4] == MAGIC and v[4] == FORMAT_VERSION and v[5:8] == bytes(3)
    assert int.from_bytes(v[8:16], "little") == 3
    assert int.from_bytes(v[16:24], "little") == checksum(b"abc")
    assert int.from_bytes(v[24:32], "little") == checksum(b"k")
    assert v[32:] == b"abc"


def test_verify_names_every_defect() -> None:
    key = b"p:1:aa"
    good = _value(b"x" * 100, key)
    assert verify(good, 100, key) is Verdict.OK
    assert verify(None, 100, key) is Verdict.ABSENT
    assert verify(good[:20], 100, key) is Verdict.BAD_HEADER
    assert verify(b"XXXX" + good[4:], 100, key) is Verdict.BAD_HEADER
    assert verify(good[:4] + bytes([FORMAT_VERSION + 1]) + good[5:], 100, key) is Verdict.BAD_HEADER
    assert verify(good, 99, key) is Verdict.BAD_LENGTH
    assert verify(good[:-1], 100, key) is Verdict.BAD_LENGTH
    assert verify(good + b"!", 100, key) is Verdict.BAD_LENGTH
    assert verify(good, 100, b"p:2:aa") is Verdict.BAD_KEY
    assert verify(good[:-1] + b"y", 100, key) is Verdict.BAD_CHECKSUM


def test_key_names_are_injective_and_carry_no_hash_tag() -> None:
    namer = KeyNamer("kv:")
    assert namer.key(1, b"\x7b\x7d") == b"kv:1:7b7d"  # braces in the key come out as hex
    assert namer.key(12, b"\x03") != namer.key(1, b"\x23")
    tokens = KeyNamer("kv:", {1: "acme", 2: "acme.eu"}.__getitem__)
    assert tokens.key(1, b"\x01") == b"kv:acme:01"
    assert tokens.key(2, b"\x01") == b"kv:acme.eu:01"
    for bad in ("a:b", "{t}", "", "a b", "x" * 129, "acme\n"):
        with pytest.raises(ValueError, match="namespace token"):
            KeyNamer("kv:", lambda ns, bad=bad: bad).key(1, b"\x01")


def test_backoff_grows_with_jitter_up_to_the_cap() -> None:
    a = Availability(0.5, 4.0, random.Random(7))
    t = a.failed(100.0, "refused")
    assert t is not None and t.after is Reach.DOWN and 0.25 <= t.retry_in_s <= 0.5
    assert not a.serves(100.0) and not a.takes_writes(100.0)
    assert a.failed(100.1, "again") is None  # one transition, however many failures
    delays = [a.retry_failed(101.0, "refused") for _ in range(8)]
    for i, d in enumerate(delays):
        cap = min(4.0, 0.5 * 2 ** (i + 1))
        assert cap / 2 <= d <= cap
    assert len(set(delays)) == len(delays)  # jittered
    t = a.recovered(120.0)
    assert t is not None and t.before is Reach.DOWN and a.serves(120.0)
    assert a.recovered(121.0) is None
    t = a.failed(130.0, "timeout")
    assert t is not None and t.retry_in_s <= 0.5  # the backoff starts over after a recovery


def test_no_space_pauses_writes_only_until_its_retry_time() -> None:
    a = Availability(1.0, 8.0, random.Random(1))
    t = a.no_space(10.0, "OOM")
    assert t is not None and t.after is Reach.NOSPACE
    assert a.serves(10.0) and not a.takes_writes(10.0)
    assert a.takes_writes(a.retry_at)
    assert a.no_space(a.retry_at, "OOM") is None  # still refused: longer pause, no new log
    assert a.retry_at - 10.0 > 1.0
    assert a.recovered(50.0) is not None and a.takes_writes(50.0)


def test_token_bucket_spends_refills_and_caps() -> None:
    b = TokenBucket(1000, 1500, now=0.0)
    assert b.take(1500, 0.0) and not b.take(1, 0.0)
    assert b.take(500, 0.5) and not b.take(1, 0.5)
    assert b.take(1500, 100.0) and not b.take(1, 100.0)  # capped at the burst
    assert not b.take(2000, 200.0)  # more than the burst never passes, and costs nothing
    assert b.take(1500, 200.0)
    unlimited = TokenBucket(0, 10, now=0.0)
    assert all(unlimited.take(1 << 30, 0.0) for _ in range(10))


def test_token_bucket_takes_a_new_rate_keeping_its_tokens_within_the_new_burst() -> None:
    b = TokenBucket(1000, 1500, now=0.0)
    assert b.take(1000, 0.0)  # 500 left
    b.set_rate(4000, 1500)  # a reload: burst 4000 now, the 500 saved stay
    assert b.take(500, 0.0) and not b.take(1, 0.0)
    assert b.take(4000, 10.0)  # refills to the new burst at the new rate
    b.set_rate(100, 200)  # smaller: refills at the new rate, up to the new burst
    assert not b.take(1, 10.0)
    assert b.take(200, 100.0) and not b.take(1, 100.0)
    b.set_rate(0, 0)  # unlimited
    assert b.take(1 << 30, 10.0)


@pytest.mark.parametrize(
    "opts, match",
    [
        (RemoteOptions(urls=()), "no URL"),
        (RemoteOptions(urls=("tcp://h:1",)), "scheme"),
        (RemoteOptions(urls=("redis://:pw@h:1",)), "credentials"),
        (RemoteOptions(urls=("redis://h:1/3",)), "database 0"),
        (RemoteOptions(urls=("redis://h:1?timeout=3",)), "config"),
        (RemoteOptions(urls=("redis://h:99999",)), "port"),
        (RemoteOptions(urls=("redis://h:1", "rediss://h:2"), mode="cluster"), "mixing"),
        (RemoteOptions(urls=("redis://h:1", "redis://h:2")), "exactly one"),
        (RemoteOptions(mode="sentinel"), "mode"),
        (RemoteOptions(key_prefix="a{b}"), "hash tag"),
        (RemoteOptions(tls_cert_file="c.pem"), "together"),
        (RemoteOptions(backoff_initial_s=5, backoff_max_s=1), "backoff"),
        (RemoteOptions(pool_size=1), "pool_size"),
    ],
)
def test_bad_options_name_the_problem(opts: RemoteOptions, match: str) -> None:
    with pytest.raises(RemoteOptionsError, match=match):
        opts.check()


def test_a_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(RemoteOptionsError, match="credentials") as refused:
        RemoteOptions(urls=("redis://ops:s3cr3t-pw@cache.example:6380",)).check()
    assert "s3cr3t-pw" not in str(refused.value) and "ops" not in str(refused.value)
    assert "redis://cache.example:6380" in str(refused.value)


def test_rediss_urls_turn_tls_on() -> None:
    opts = RemoteOptions(urls=("rediss://cache.example:6380",))
    opts.check()
    (e,) = opts.endpoints()
    assert (e.host, e.port, e.tls) == ("cache.example", 6380, True)


# ------------------------------------------------------------------------- wire


def test_a_framed_value_goes_out_as_the_bytes_of_one_joined_value() -> None:
    body = bytes(range(256)) * 40  # over redis-py's 6,000-byte chunking cutoff
    hdr = header(len(body), checksum(body), b"k")
    joined = Connection().pack_commands([("SET", b"k", hdr + body, "EX", 600), ("GET", b"k")])
    framed_conn = _tier_class(Connection)()
    chunks = framed_conn.pack_commands(
        [("SET", b"k", Framed(hdr, memoryview(body)), "EX", 600), ("GET", b"k")]
    )
    assert b"".join(chunks) == b"".join(joined)
    # The block's bytes are passed on as they are, not copied into a joined chunk.
    assert any(isinstance(c, memoryview) and c.obj is body for c in chunks)
    # Commands without a Framed argument are redis-py's own packing.
    assert framed_conn.pack_command("GET", b"k") == Connection().pack_command("GET", b"k")


def test_tier_connections_reach_every_connection_a_client_opens() -> None:
    single = aioredis.Redis(host="127.0.0.1", port=1)
    use_tier_connections(single)
    assert issubclass(single.connection_pool.connection_class, Connection)
    assert single.connection_pool.connection_class.__name__ == "TierConnection"
    tls = aioredis.Redis(host="127.0.0.1", port=1, ssl=True)
    use_tier_connections(tls)
    assert issubclass(tls.connection_pool.connection_class, SSLConnection)
    use_tier_connections(tls)  # idempotent: not wrapped twice
    assert tls.connection_pool.connection_class.__mro__.count(_TierConnection) == 1
    cluster = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", 1)])
    use_tier_connections(cluster)
    manager = cluster.nodes_manager
    # Nodes discovered later are built from these kwargs; the startup nodes already exist.
    assert issubclass(manager.connection_kwargs["connection_class"], _TierConnection)
    assert all(
        issubclass(n.connection_class, _TierConnection) for n in manager.startup_nodes.values()
    )
    with pytest.raises(TierConnectionUnavailable):
        use_tier_connections(object())


class _Transport:
    def __init__(self, closing_after: int = -1) -> None:
        self.closing_after = closing_after
        self.writes = 0

    def is_closing(self) -> bool:
        return self.writes == self.closing_after


class _Reader:
    """A connection's open stream, from the reading side."""

    def at_eof(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return None


class _Writer:
    """Records what a connection hands its stream: chunk by chunk, or joined."""

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport
        self.chunks: list[Any] = []
        self.drained = 0

    def write(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        self.transport.writes += 1

    def writelines(self, chunks: Any) -> None:
        self.write(b"".join(chunks))

    async def drain(self) -> None:
        self.drained += 1


def test_a_pipeline_goes_to_the_stream_chunk_by_chunk_never_joined() -> None:
    body = bytes(range(256)) * 40
    conn = _tier_class(Connection)(socket_timeout=5.0)
    command = conn.pack_commands(
        [("SET", b"k", Framed(b"h" * 32, memoryview(body)), "EX", 600), ("GET", b"k")]
    )
    conn._reader, conn._writer = _Reader(), (writer := _Writer(_Transport()))
    asyncio.run(conn.send_packed_command(command, check_health=False))
    # Each chunk as it was packed (the block's bytes still the caller's), then one drain.
    assert writer.chunks == command and writer.drained == 1
    assert any(isinstance(c, memoryview) and c.obj is body for c in writer.chunks)
    # A transport lost meanwhile takes no more chunks (drain reports the loss).
    conn._writer = writer = _Writer(_Transport(closing_after=1))
    asyncio.run(conn._send_packed_command(command))
    assert len(writer.chunks) == 1 and writer.drained == 1


async def _raised_by_reads(
    conn: Connection, fault: type[BaseException], count: int
) -> list[BaseException]:
    """What each of ``count`` reads of ``conn`` raises: a ``fault`` each."""
    raised = []
    for _ in range(count):
        with pytest.raises(fault) as e:
            await conn.read_response()
        raised.append(e.value)
    return raised


@contextlib.asynccontextmanager
async def _resp_server(
    hush: Callable[[list[bytes]], bool] = lambda args: False,
) -> AsyncIterator[int]:
    """A server on a port of its own (yielded) that answers every command, ECHO with its
    argument, any other +OK, until ``hush`` is true of one: nothing more on that connection."""
    served: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(writer)
        silent = False
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while line := await reader.readline():
                args = []
                for _ in range(int(line[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                silent = silent or hush(args)
                if silent:
                    continue
                if args[0].upper() == b"ECHO":
                    writer.write(b"$%d\r\n%s\r\n" % (len(args[1]), args[1]))
                else:
                    writer.write(b"+OK\r\n")
                await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in served:
            writer.close()
        server.close()
        await server.wait_closed()


def test_a_refused_connection_answers_the_reads_of_its_send_where_faults_are_noted() -> None:
    """Within ``noting_node_faults`` a connection's fault of a send (here a refused connect)
    is raised by each read that follows it, not by the send, so that a cluster pipeline
    takes it as that node's commands' replies, and is noted with the node; the next send
    starts afresh. Without, the send raises it, as redis-py's own connection does."""

    async def run(port: int) -> None:
        conn = _tier_class(Connection)(
            host="127.0.0.1", port=port, socket_timeout=5.0, retry=Retry(NoBackoff(), 0)
        )
        with pytest.raises(RedisConnectionError):
            await conn.send_packed_command(conn.pack_command("GET", b"k"))
        faults = NodeFaults()
        with noting_node_faults(faults):
            await conn.send_packed_command(conn.pack_commands([("GET", b"a"), ("GET", b"b")]))
            raised = await _raised_by_reads(conn, RedisConnectionError, 2)
        assert [faults.node_of(e) for e in raised] == [f"127.0.0.1:{port}"] * 2
        assert faults.node_of(RedisConnectionError("another")) is None
        with pytest.raises(RedisConnectionError) as e:
            await conn.send_packed_command(conn.pack_command("GET", b"k"))
        assert e.value is not raised[0]

    # A port bound here and never listened on: each connect to it is refused, and no other
    # process may take it meanwhile (one found free and let go may be a server's by then).
    with held_port(shared=False) as port:
        asyncio.run(run(port))


def test_regression_a_reset_in_the_handshake_was_answered_and_left_its_replies_askew() -> None:
    """A fault of redis-py's own handshake within a send (here the connection reset as the
    first ``CLIENT SETINFO`` went out) is raised to the handshake, which fails the connect:
    the send that connects answers it, and the connection serves the next call in step.
    Answered within the handshake, its next send connected again and the handshake read
    the reply of that send as the first one's, then waited for one that never came: the
    call failed as a timeout (the tier DOWN, not the node lost)."""

    async def run() -> None:
        async with _resp_server() as port:
            await reset_in_handshake(port)

    async def reset_in_handshake(port: int) -> None:
        conn = _tier_class(Connection)(
            host="127.0.0.1", port=port, socket_timeout=2.0, retry=Retry(NoBackoff(), 0)
        )
        send = conn._send_packed_command
        resets = []

        async def reset_at_first_setinfo(command: Any) -> None:
            if not resets and any(b"SETINFO" in bytes(c) for c in command):
                resets.append(conn._writer.transport)
                conn._writer.transport.abort()
                raise ConnectionResetError(104, "Connection reset by peer")
            await send(command)

        conn._send_packed_command = reset_at_first_setinfo
        faults = NodeFaults()
        try:
            with noting_node_faults(faults):
                await conn.send_packed_command(conn.pack_command("ECHO", b"first"))
                with pytest.raises(RedisConnectionError) as e:
                    await conn.read_response()
                assert resets and faults.node_of(e.value) == f"127.0.0.1:{port}"
                await conn.send_packed_command(conn.pack_command("ECHO", b"second"))
                assert await conn.read_response() == b"second"
        finally:
            await conn.disconnect()

    asyncio.run(run())


def test_a_silent_node_times_out_at_the_deadline_and_answers_the_reads_of_its_send() -> None:
    """Within ``noting_node_faults`` with a deadline, every wait of a connection ends at it:
    a node that answers nothing (here from its handshake on) or stops answering (here at
    HANG) times out, raised by each read of that send, not by the send, and noted with the
    node, so that a cluster pipeline takes it as that node's replies; the connection is
    closed, and the next send connects afresh. Only the deadline ends a wait here: the
    connection has no timeout of its own (with one of 30 s, the test passed without the
    deadline, each wait ended by that timeout instead)."""
    silent_from_start = [True]

    def hush(args: list[bytes]) -> bool:
        return silent_from_start[0] or args[0].upper() == b"HANG"

    async def run() -> None:
        async with _resp_server(hush) as port:
            await time_out(port)

    async def time_out(port: int) -> None:
        conn = _tier_class(Connection)(
            host="127.0.0.1", port=port, socket_timeout=None, retry=Retry(NoBackoff(), 0)
        )
        loop = asyncio.get_running_loop()
        try:
            for silent in (True, False):
                silent_from_start[0] = silent
                faults = NodeFaults(loop.time() + 0.2)
                with noting_node_faults(faults):
                    await conn.send_packed_command(conn.pack_commands([("HANG",), ("ECHO", b"b")]))
                    raised = await _raised_by_reads(conn, RedisTimeoutError, 2)
                assert [faults.node_of(e) for e in raised] == [f"127.0.0.1:{port}"] * 2
                assert not conn.is_connected
            await conn.send_packed_command(conn.pack_command("ECHO", b"after"))
            assert await conn.read_response() == b"after"
        finally:
            await conn.disconnect()

    asyncio.run(run())


def test_a_send_begun_past_the_deadline_sends_nothing_and_times_out() -> None:
    """A send that begins once the deadline has passed (a redirection followed after a
    node's part took the whole op timeout) is given no time: 0 s, which redis-py takes for
    no timeout at all on a send, and a hung node's drain would wait for ever (the whole
    call then ends at its own bound, L3 down). It sends nothing; its reads time out, noted
    with the node."""
    heard: list[bytes] = []

    def hush(args: list[bytes]) -> bool:
        heard.append(args[0].upper())
        return False

    async def run() -> None:
        async with _resp_server(hush) as port:
            conn = _tier_class(Connection)(
                host="127.0.0.1", port=port, socket_timeout=30.0, retry=Retry(NoBackoff(), 0)
            )
            try:
                await conn.send_packed_command(conn.pack_command("ECHO", b"before"))
                assert await conn.read_response() == b"before"
                faults = NodeFaults(asyncio.get_running_loop().time() - 1.0)
                with noting_node_faults(faults):
                    await conn.send_packed_command(conn.pack_command("SET", b"k", b"late"))
                    raised = await _raised_by_reads(conn, RedisTimeoutError, 1)
                assert faults.node_of(raised[0]) == f"127.0.0.1:{port}"
                await conn.send_packed_command(conn.pack_command("ECHO", b"after"))
                assert await conn.read_response() == b"after"
                assert b"SET" not in heard, heard
            finally:
                await conn.disconnect()

    asyncio.run(run())


def test_a_read_timed_out_sends_nothing_more_of_what_its_transport_held() -> None:
    """A node that stops reading and answering once it has a command (HANG here): a drain
    may end with the last bytes of a body still held by the transport (uvloop's by
    reference, the caller's buffer), and the read that times out then closed the connection
    gracefully, which sent them once the node read again, the caller's buffer rewritten by
    then. The read's timeout aborts the connection: the node gets what the socket had taken,
    never what the transport held."""
    written = 0
    heard: list[int] = []  # the bytes the node read after HANG, until the connection ended

    async def run() -> None:
        nonlocal written
        resume = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                args = []
                for _ in range(int(line[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                if args[0].upper() == b"HANG":
                    await resume.wait()
                    total = 0
                    with contextlib.suppress(ConnectionError):
                        while chunk := await reader.read(1 << 20):
                            total += len(chunk)
                    heard.append(total)
                    break
                writer.write(b"+OK\r\n")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = _tier_class(Connection)(
            host="127.0.0.1", port=port, socket_timeout=30.0, retry=Retry(NoBackoff(), 0)
        )
        try:
            await conn.connect()
            faults = NodeFaults(asyncio.get_running_loop().time() + 0.3)
            with noting_node_faults(faults):
                await conn.send_packed_command(conn.pack_command("HANG"))
                transport = conn._writer.transport  # type: ignore[union-attr]
                while transport.get_write_buffer_size() == 0:  # the socket's buffers full
                    transport.write(bytes(1 << 20))
                    written += 1 << 20
                    await asyncio.sleep(0)
                await _raised_by_reads(conn, RedisTimeoutError, 1)
            resume.set()
            await wait_for("the node to read to the end", lambda: bool(heard))
        finally:
            resume.set()
            await conn.disconnect()
            server.close()
            await server.wait_closed()

    asyncio.run(run())
    assert heard[0] < written, (heard, written)


def test_tier_connections_read_with_a_larger_stream_buffer_and_a_kept_hiredis_buffer() -> None:
    for base in (Connection, SSLConnection):
        assert _tier_class(base)(port=1)._connection_arguments()["limit"] == STREAM_LIMIT_BYTES
    conn = _tier_class(Connection)()
    if not isinstance(conn._parser, _AsyncHiredisParser):
        pytest.skip("hiredis is not installed: redis-py's own parser keeps no buffer")
    conn._reader = object()
    conn._parser.on_connect(conn)
    assert conn._parser._reader.getmaxbuf() == READER_KEEP_BYTES
    # Without the tier's connection, hiredis frees its buffer past its own small default.
    plain = Connection()
    plain._reader = object()
    plain._parser.on_connect(plain)
    assert plain._parser._reader.getmaxbuf() < READER_KEEP_BYTES


def test_regression_a_password_file_of_no_text_ended_the_start_with_a_traceback(tmp_path):
    """The tier read the file whole as UTF-8: bytes that are not UTF-8 raised
    UnicodeDecodeError through the daemon's start (a traceback, after --check-config said
    'config ok'), and /dev/zero was read until the memory ran out. Each is refused naming
    the file; a good one gives the password and whether everyone may read it."""
    from kvtier.tiers.base import TierUnavailable
    from kvtier.tiers.remote.tier import RemoteTier

    good = tmp_path / "good"
    good.write_text("s3cret\n")
    good.chmod(0o600)
    assert read_password(str(good)) == ("s3cret", False)
    assert read_password("") is None
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfepw\n")
    long = tmp_path / "long"
    long.write_bytes(b"x" * (1 << 20))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, says in [
        (binary, "is not UTF-8 text"),
        (long, "on one line"),
        (fifo, "is not a regular file"),  # not waited on for a writer
        ("/dev/zero", "is not a regular file"),
        (tmp_path / "absent", "No such file"),
    ]:
        with pytest.raises(RemoteOptionsError, match=says):
            read_password(str(path))
        with pytest.raises(TierUnavailable, match=f"L3 password_file .*{says}"):
            RemoteTier(RemoteOptions(password_file=str(path)))


def test_a_password_file_through_another_user_s_link_is_refused(tmp_path):
    """The token files' rule for links (``paths.link_problem``): root's and the daemon's own
    are followed (a Secret volume's), another user's is refused, naming it: that user could
    point the file at any file."""
    require_root()  # a link of another user
    good = tmp_path / "good"
    good.write_text("s3cret\n")
    good.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(good)
    assert read_password(str(link)) == ("s3cret", False)
    os.lchown(link, 4321, 4321)
    with pytest.raises(RemoteOptionsError, match=f"{link}, a link of uid 4321"):
        read_password(str(link))
