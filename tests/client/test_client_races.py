"""Races of the clients' calls and jobs with ``close()``, and of a client's threads (or an
AsyncClient's coroutines) registering a pool again.

Each test holds one side of the race at a fixed point, so the interleaving that once went
wrong happens on every run."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from harness import DaemonFactory, DaemonProcess, NamespacedDaemon
from races import ContendedLock

from kvtier.client import AsyncClient, JobState, SaveSegment, SharedMemoryPool, block_keys
from kvtier.client.errors import UnavailableError
from kvtier.client.keys import Namespace
from kvtier.kernels.layout import PoolLayout

LAYOUT = PoolLayout.vllm(
    num_layers=2, num_pages=8, block_tokens=4, num_kv_heads=2, head_dim=8, dtype="float16"
)


@pytest.fixture
def daemon(namespaced_daemon: NamespacedDaemon) -> NamespacedDaemon:
    """The module's tests share one daemon, each in a namespace of its own and starting with
    no pool registered (the pool counts they check are their own); the tests that restart or
    pause their daemon take ``own_daemon``."""
    return namespaced_daemon


@pytest.fixture
def own_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory()


def keys_for(n: int, tag: str) -> list[bytes]:
    ns = Namespace(model=f"races-{tag}", kv_dtype="float16", block_tokens=4)
    return block_keys(ns, list(range(n * 4)))


def test_a_job_submitted_while_the_client_closes_fails_with_a_typed_error(daemon):
    """``close()`` on another thread lands after ``submit_save`` set up the session and the
    pool but before the job sent its RPCs: the job ends FAILED with UnavailableError (it
    raised ValueError from the closed channel and stayed RUNNING, its parts never ended)."""
    client = daemon.client()
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        pool_id_of = client.pool_id_of
        calls = []

        def closing_pool_id_of(binding):
            pool_id = pool_id_of(binding)
            calls.append(pool_id)
            if len(calls) == 2:  # the job's own look-up, just before it sends
                client.close()
            return pool_id

        client.pool_id_of = closing_pool_id_of  # type: ignore[method-assign]
        job = client.submit_save(pool, [SaveSegment(keys_for(2, "close"), [0, 1])])
        status = job.wait(10)
        assert status.state is JobState.FAILED
        assert isinstance(status.error, UnavailableError)
        assert not status.done.any()


def test_calls_on_a_closed_client_raise_a_typed_error(daemon):
    """A thread still using the client after another closed it gets UnavailableError, as
    for a daemon that went away, not the channel's ValueError."""
    client = daemon.client()
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        client.close()
        with pytest.raises(UnavailableError):
            client.lookup(keys_for(1, "closed"))
        with pytest.raises(UnavailableError):
            pool.store_keys(keys_for(1, "closed"), [0])
        with pytest.raises(UnavailableError):
            client.submit_save(pool, [SaveSegment(keys_for(1, "closed"), [0])])
        with pytest.raises(UnavailableError):
            client.health()


def test_two_threads_registering_a_pool_again_after_a_restart_register_it_once(own_daemon):
    """Regression: after a daemon restart, two threads each found the pool unregistered in
    the new session and each registered it; the pool kept the last id and the daemon the
    other registration (its memory mapped) until the session ended. The first thread's
    RegisterPool is held until the second has registered too or waits for the first: the
    pool is registered once and both threads get its id."""
    daemon = own_daemon
    client = daemon.client()
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        daemon.restart()
        deadline = time.monotonic() + 10
        while client.live_ids(pool.binding) is not None:  # the client saw its session end
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held, moved, release = threading.Event(), threading.Event(), threading.Event()
        registrations = []
        invoke = client._invoke

        def holding_invoke(method, request, *args, **kwargs):
            if method == "RegisterPool":
                registrations.append(request)
                if len(registrations) == 1:
                    held.set()
                    assert release.wait(10)
            return invoke(method, request, *args, **kwargs)

        def second_thread() -> int:
            pool_id = client.pool_id_of(pool.binding)
            moved.set()
            return pool_id

        client._invoke = holding_invoke  # type: ignore[method-assign]
        client._register_lock = ContendedLock(moved)  # type: ignore[assignment]
        with ThreadPoolExecutor(2) as threads:
            first = threads.submit(client.pool_id_of, pool.binding)
            assert held.wait(10)
            second = threads.submit(second_thread)
            assert moved.wait(10)
            release.set()
            ids = {first.result(), second.result()}
        assert len(registrations) == 1
        assert ids == {pool.binding.pool_id}
        assert client.check().pools == 1
        client.close()


class _HeldPut:
    """A client's stub whose first Put waits for ``release`` before it is sent."""

    def __init__(self, stub: Any, sent: threading.Event, release: threading.Event) -> None:
        self._stub, self._sent, self._release = stub, sent, release

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Put(self, request: Any, **kwargs: Any) -> Any:
        if not self._sent.is_set():
            self._sent.set()
            assert self._release.wait(10)
        return self._stub.Put(request, **kwargs)


def test_a_late_not_found_keeps_the_pool_id_another_thread_registered(daemon):
    """Regression: a Put sent with the pool's old id (fenced meanwhile by another thread,
    which then registered the pool again) came back NotFound and zeroed the new id; the
    retry registered the pool a third time and the daemon kept the second registration
    until the session ended. The retry now uses the new id."""
    client = daemon.client()
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        sent, release = threading.Event(), threading.Event()
        client._stub = _HeldPut(client._stub, sent, release)  # type: ignore[assignment]
        with ThreadPoolExecutor(1) as threads:
            stored = threads.submit(pool.store_keys, keys_for(2, "late"), [0, 1])
            assert sent.wait(10)
            assert client.fence_pool(pool.binding)
            new_id = client.pool_id_of(pool.binding)
            release.set()
            assert stored.result() == 2
        assert pool.binding.pool_id == new_id
        assert client.check().pools == 1
        client.close()


def test_a_job_answer_does_not_wait_for_a_registration_under_way(daemon):
    """Regression: a job's part answered NotFound dropped the pool id under the lock that a
    registration holds across its RegisterPool call, on gRPC's callback thread, which
    delivers every answer of the client's channel: while another thread registered a pool,
    no job of the client ended, and a registration that had to open a session waited for
    that very thread until its timeout. Another pool's RegisterPool is held here until the
    job has ended: the job ends (FAILED, its pool gone) while the registration waits."""
    client = daemon.client()
    with SharedMemoryPool.for_layout(LAYOUT) as shm, SharedMemoryPool.for_layout(LAYOUT) as shm2:
        pool = client.register_pool(shm, LAYOUT)
        other = client.register_pool(shm2, LAYOUT)
        client.unregister_pool(pool.binding.pool_id)  # the binding keeps the id: NotFound
        assert client.fence_pool(other.binding)  # its next use registers it again
        held, release = threading.Event(), threading.Event()
        invoke = client._invoke

        def holding_invoke(method, request, *args, **kwargs):
            if method == "RegisterPool":
                held.set()
                assert release.wait(30)
            return invoke(method, request, *args, **kwargs)

        client._invoke = holding_invoke  # type: ignore[method-assign]
        with ThreadPoolExecutor(1) as threads:
            registering = threads.submit(client.pool_id_of, other.binding)
            assert held.wait(10)
            job = client.submit_save(pool, [SaveSegment(keys_for(2, "held-register"), [0, 1])])
            status = job.wait(10)
            release.set()
            assert status.state is JobState.FAILED
            assert not status.done.any()
            assert registering.result() == other.binding.pool_id
        assert pool.binding.pool_id == 0  # registered again on its next use
        client.close()


def test_regression_a_job_answer_waited_for_a_session_being_opened(own_daemon):
    """A job's answer is handled on gRPC's callback thread, which delivers every answer of
    the client's channel; its next batch asked for the open session (``live_ids``) under the
    lock that opening a session held until the daemon's first answer. While one thread
    opened a session (the daemon had ended the last), an answer to a job of the client made
    that thread wait for the very thread that was to deliver the session's answer: both
    waited for good (the session call's cancel at its timeout is delivered by that thread
    too), and the client with them. Here the daemon is paused while a save of two batches is
    sent and another thread starts opening a session, then resumed: the session opens."""
    daemon = own_daemon
    assert daemon.proc is not None
    client = daemon.client(timeout_s=5.0, max_batch_blocks=1)
    started = threading.Event()
    open_session = client._open_session

    def signalled_open_session(*args: Any) -> Any:
        started.set()
        return open_session(*args)

    client._open_session = signalled_open_session  # type: ignore[method-assign]
    opened: list[str] = []
    # A daemon thread: before, it waited for good (and the client with it).
    opening = threading.Thread(target=lambda: opened.append(client.session_id), daemon=True)
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        ended = client.session_id
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            job = client.submit_save(pool, [SaveSegment(keys_for(2, "opening"), [0, 1])])
            client.forget_session(ended)  # as when the daemon ends it (a reload, a restart)
            opening.start()
            assert started.wait(10)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        opening.join(30)
        assert opened and opened[0] != ended
        assert job.wait(10).done[0]  # its first batch was stored
        assert client.lookup(keys_for(2, "opening")).prefix_len >= 1  # the client works on
    client.close()


async def test_async_stores_that_find_their_pool_gone_register_it_again_once(daemon):
    """Regression, the AsyncClient's twin of the two above: two stores whose Puts came back
    NotFound (the daemon had dropped the pool) each registered it again, or the later one
    zeroed the id the earlier had just registered and registered a third time; either way
    the daemon kept an extra registration until the session ended."""
    async with AsyncClient(daemon.address, namespace=daemon.namespace) as client:
        with SharedMemoryPool.for_layout(LAYOUT) as shm:
            pool = await client.register_pool(shm, LAYOUT)
            await client.unregister_pool(pool.pool_id)  # the binding keeps the old id
            registrations = []
            invoke = client._invoke

            async def counting_invoke(method, request, *args, **kwargs):
                if method == "RegisterPool":
                    registrations.append(request)
                return await invoke(method, request, *args, **kwargs)

            client._invoke = counting_invoke  # type: ignore[method-assign]
            held = await asyncio.gather(
                pool.store_keys(keys_for(2, "async-a"), [0, 1]),
                pool.store_keys(keys_for(2, "async-b"), [2, 3]),
            )
            assert held == [2, 2]
            assert len(registrations) == 1
            assert (await client.check()).pools == 1


async def test_calls_on_a_closed_async_client_raise_a_typed_error(daemon):
    """The AsyncClient's twin of the blocking client's: a coroutine still using the client
    after another closed it gets UnavailableError."""
    client = AsyncClient(daemon.address, namespace=daemon.namespace)
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = await client.register_pool(shm, LAYOUT)
        await client.close()
        with pytest.raises(UnavailableError):
            await client.lookup(keys_for(1, "async-closed"))
        with pytest.raises(UnavailableError):
            await pool.store_keys(keys_for(1, "async-closed"), [0])
        with pytest.raises(UnavailableError):
            await client.submit_save(pool, [SaveSegment(keys_for(1, "async-closed"), [0])])
        with pytest.raises(UnavailableError):
            await client.health()


async def test_an_async_job_submitted_while_the_client_closes_fails_with_a_typed_error(daemon):
    """The AsyncClient's twin of the blocking client's: ``close()`` lands after
    ``submit_save`` set up the session and the pool but before the job sent its RPCs; the job
    ends FAILED with UnavailableError (its RPC tasks died of the closed channel's UsageError
    and the job stayed RUNNING)."""
    client = AsyncClient(daemon.address, namespace=daemon.namespace)
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = await client.register_pool(shm, LAYOUT)
        pool_id_of = client.pool_id_of
        calls = []

        async def closing_pool_id_of(binding):
            pool_id = await pool_id_of(binding)
            calls.append(pool_id)
            if len(calls) == 2:  # the job's own look-up, just before it sends
                await client.close()
            return pool_id

        client.pool_id_of = closing_pool_id_of  # type: ignore[method-assign]
        job = await client.submit_save(pool, [SaveSegment(keys_for(2, "async-close"), [0, 1])])
        status = await job.wait(10)
        assert status.state is JobState.FAILED
        assert isinstance(status.error, UnavailableError)
        assert not status.done.any()


async def test_an_async_call_or_job_in_flight_when_the_client_closes_gets_a_typed_error(
    own_daemon,
):
    """Regression: ``close()`` while an AsyncClient call was in flight gave the caller a bare
    ``asyncio.CancelledError`` (grpc.aio cancels the calls on a closed channel), and a job's
    RPC task died of it, leaving its part unended. Both get the closed client's
    UnavailableError now, as the blocking client's calls do. Each RPC is sent, then held
    until the close is done, then awaited; the daemon is paused meanwhile, so that no answer
    can come before the close (on uvloop one did, now and then, and the job was DONE)."""
    daemon = own_daemon
    client = AsyncClient(daemon.address)
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = await client.register_pool(shm, LAYOUT)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            await _close_with_calls_in_flight(client, pool)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)


async def _close_with_calls_in_flight(client: AsyncClient, pool: Any) -> None:
    sent, closed = asyncio.Event(), asyncio.Event()
    stub = client._stub

    class HeldStub:
        def __getattr__(self, method: str) -> Any:
            rpc = getattr(stub, method)

            async def held(request: Any, **kwargs: Any) -> Any:
                call = rpc(request, **kwargs)
                sent.set()
                await closed.wait()
                return await call

            return held

    client._stub = HeldStub()  # type: ignore[assignment]
    job = await client.submit_save(pool, [SaveSegment(keys_for(2, "inflight"), [0, 1])])
    lookup = asyncio.ensure_future(client.lookup(keys_for(1, "inflight")))
    await sent.wait()
    await client.close()
    closed.set()
    with pytest.raises(UnavailableError, match=r"^the client was closed$"):
        await lookup
    status = await job.wait(10)
    assert status.state is JobState.FAILED
    assert isinstance(status.error, UnavailableError)
    assert str(status.error) == "the client was closed"


async def test_an_async_call_opening_its_session_when_the_client_closes_gets_a_typed_error(
    daemon, monkeypatch
):
    """Regression: a call whose session was being opened when ``close()`` ran (the credential
    ticket is fetched off the loop first, on every Unix socket) sent OpenSession on the closed
    channel and gave the caller grpc.aio's bare ``UsageError('Channel is closed.')``, not the
    closed client's UnavailableError. The close lands while the ticket is being fetched."""
    from kvtier.client import aio

    fetching, go_on = threading.Event(), threading.Event()
    session_ticket = aio.credentials.session_ticket

    def held_ticket(path: str, timeout_s: float = 10.0) -> bytes:
        ticket = session_ticket(path, timeout_s)
        fetching.set()
        assert go_on.wait(10)
        return ticket

    monkeypatch.setattr(aio.credentials, "session_ticket", held_ticket)
    client = AsyncClient(daemon.address, namespace=daemon.namespace)
    lookup = asyncio.ensure_future(client.lookup(keys_for(1, "opening")))
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, fetching.wait, 10)
    await client.close()
    go_on.set()
    with pytest.raises(UnavailableError, match=r"^the client was closed$"):
        await lookup
