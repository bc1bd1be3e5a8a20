"""How failed calls become typed exceptions."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time

import grpc
import pytest

from kvtier.client import AsyncClient, Client, PoolLayout, SharedMemoryPool
from kvtier.client.errors import (
    InvalidArgumentError,
    KvtierError,
    UnavailableError,
    from_rpc_error,
    unclean,
)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_regression_a_call_the_stopping_daemon_cancelled_was_a_bare_kvtier_error():
    """At SIGTERM the server's gRPC ends the calls it holds unanswered with CANCELLED; clients
    got KvtierError('CANCELLED'), which says nothing of why nor that a retry later may work."""
    err = from_rpc_error(_Failed(grpc.StatusCode.CANCELLED, "CANCELLED"))
    assert isinstance(err, UnavailableError) and "stopping" in str(err)
    assert err.code == grpc.StatusCode.CANCELLED
    assert unclean(err)  # unanswered: the daemon may still have been copying


def test_other_codes_keep_their_types():
    err = from_rpc_error(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert isinstance(err, InvalidArgumentError) and str(err) == "bad"
    assert type(from_rpc_error(_Failed(grpc.StatusCode.UNKNOWN, "?"))) is KvtierError


# A health service whose Check never answers, in a process of its own: a gRPC server left in
# the test process (its threads outlive stop()) made a later fork() in the same process hang
# in gRPC's fork handler (tests/peers.py forks).
_SILENT_SERVER = """
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import grpc

def check(request, context):
    print("arrived", flush=True)
    time.sleep(60)
    return b""

server = grpc.server(ThreadPoolExecutor(2))
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
    "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}),))
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


def test_regression_a_call_the_client_s_own_close_ended_read_as_the_daemon_stopping():
    """``close()`` on another thread ends the calls in flight on the channel with CANCELLED,
    which the client now reads as the daemon's server ending them: a blocked call got
    UnavailableError 'the daemon is stopping', blaming the daemon for the caller's own close.
    It is the closed client's error, as for a call made after the close."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SILENT_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = Client(f"127.0.0.1:{port}", timeout_s=10)
        errors: list[BaseException] = []

        def probe() -> None:
            try:
                client.health()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=probe)
        thread.start()
        assert server.stdout.readline().strip() == "arrived"
        client.close()
        thread.join(10)
    finally:
        server.kill()
        server.wait()
    assert len(errors) == 1 and isinstance(errors[0], UnavailableError)
    assert str(errors[0]) == "the client was closed"


async def test_regression_an_async_call_its_client_s_close_ended_was_a_bare_cancellation():
    """The AsyncClient's twin of the blocking client's: ``close()`` while a call was in
    flight gave the caller a bare ``asyncio.CancelledError`` (grpc.aio cancels the calls on
    a closed channel), which reads as its own task being cancelled. It is the closed client's
    UnavailableError; a cancel of the caller's own task stays a CancelledError."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SILENT_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        loop = asyncio.get_running_loop()

        async def arrived() -> None:
            line = await loop.run_in_executor(None, server.stdout.readline)
            assert line.strip() == "arrived"

        client = AsyncClient(f"127.0.0.1:{port}", timeout_s=10)
        call = asyncio.ensure_future(client.health())
        await arrived()
        await client.close()
        with pytest.raises(UnavailableError, match=r"^the client was closed$"):
            await call

        client = AsyncClient(f"127.0.0.1:{port}", timeout_s=10)
        try:
            call = asyncio.ensure_future(client.health())
            await arrived()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        finally:
            await client.close()
    finally:
        server.kill()
        server.wait()


async def test_regression_the_clients_logged_their_whole_session_id_when_it_ended(daemon, caplog):
    """The session id is the session's secret: any request naming it acts as that session,
    from any process that may open the socket, of any uid (it can look up, delete and evict
    the tenant's blocks). The daemon logs only its first 8 characters, but both clients logged
    all of it when the session ended, so whoever read an engine's log could take its
    session. They log the same first 8 characters as the daemon."""
    caplog.set_level(logging.WARNING, logger="kvtier.client")
    client, aclient = daemon.client(), AsyncClient(daemon.address)
    try:
        ids = [client.session_id, await aclient.session()]
        daemon.kill()
        deadline = time.monotonic() + 10
        while sum("ended" in r.getMessage() for r in caplog.records) < 2:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.02)
    finally:
        client.close()
        await aclient.close()
    for sid in ids:
        assert sid not in caplog.text and f"session {sid[:8]} ended" in caplog.text


def test_regression_a_pool_binding_s_repr_showed_its_session_s_whole_id(daemon):
    """``pool.binding`` (what ``fence_pool`` takes) is a dataclass whose repr held the session
    id, so an engine that logged it, or an error reporter that records locals, wrote the
    session's secret down."""
    layout = PoolLayout.staging(num_layers=1, num_pages=2, block_tokens=4, chunk_bytes=4096)
    with daemon.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        assert pool.binding.session_id == client.session_id
        assert client.session_id not in repr(pool.binding)
