"""RegisterPool maps the client's memory on a worker thread, not on the event loop, and
unregistering a pool (or ending its session) unmaps it on one too.

Each test runs a real gRPC server in this process and holds the daemon's mapping step
(``pools._map``, where populating faults in every page: seconds for a pool of several GiB),
or the close of a pool's mapping (the last step of unmapping it, as slow when it does it
all), on a ``threading.Event``, so "a registration is being mapped" or "a pool is being
unmapped" is a state the test controls, not a race it times. Clients run on a thread of
their own, as an engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvtier.client import (
    AsyncClient,
    Client,
    FailedPreconditionError,
    NotFoundError,
    PoolLayout,
    ResourceExhaustedError,
    SharedMemoryPool,
    UnauthenticatedError,
    credentials,
)
from kvtier.client.flows import PoolBinding
from kvtier.daemon import pools as pools_module
from kvtier.daemon.config import load_config
from kvtier.daemon.credentials import TICKET_TTL_S
from kvtier.daemon.errors import FailedPrecondition, NotFound
from kvtier.daemon.reload import Reloader
from kvtier.daemon.server import Daemon
from kvtier.daemon.sessions import PeerCred
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

LAYOUT = PoolLayout.staging(
    num_layers=2, num_pages=64, block_tokens=4, chunk_bytes=8192, kv_count=1, dtype="uint8"
)
# Generous: only a daemon that does not answer (a blocked event loop) ever waits this long.
WAIT_S = 20.0


class HeldMaps:
    """Stands in for the daemon's mapping step: each call counts itself, waits until the test
    lets the mappings go, then maps as the daemon would, keeping the mapping to look at."""

    def __init__(self, real: Callable[..., mmap.mmap]) -> None:
        self.real = real
        self.release = threading.Event()
        self.buffers: list[mmap.mmap] = []
        self._entered = 0
        self._cv = threading.Condition()

    def __call__(self, *args: Any) -> mmap.mmap:
        with self._cv:
            self._entered += 1
            self._cv.notify_all()
        if not self.release.wait(2 * WAIT_S):
            raise TimeoutError("the test never let the mapping go")
        buffer = self.real(*args)
        self.buffers.append(buffer)
        return buffer

    def wait_entered(self, n: int = 1) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self._entered >= n, WAIT_S), "no mapping began"


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> HeldMaps:
    maps = HeldMaps(pools_module._map)
    monkeypatch.setattr(pools_module, "_map", maps)
    return maps


class HeldMapping(mmap.mmap):
    """A pool's mapping whose close waits until the test lets it go."""

    held: HeldCloses

    def close(self) -> None:
        self.held.closing()
        super().close()


class HeldCloses:
    """Stands in for the daemon's mapping step, mapping each pool as a ``HeldMapping``: the
    close of its mapping, wherever the daemon runs it, counts itself and waits until the
    test lets the closes go."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._entered = 0
        self._cv = threading.Condition()

    def __call__(self, fd: int, size_bytes: int, what: str) -> mmap.mmap:
        buffer = HeldMapping(fd, size_bytes, flags=mmap.MAP_SHARED)
        buffer.held = self
        pools_module._populate(buffer)
        return buffer

    def closing(self) -> None:
        with self._cv:
            self._entered += 1
            self._cv.notify_all()
        if not self.release.wait(2 * WAIT_S):
            raise TimeoutError("the test never let the close go")

    def wait_entered(self, n: int = 1) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self._entered >= n, WAIT_S), "no close began"

    @property
    def entered(self) -> int:
        with self._cv:
            return self._entered


@pytest.fixture
def held_closes(monkeypatch: pytest.MonkeyPatch) -> HeldCloses:
    closes = HeldCloses()
    monkeypatch.setattr(pools_module, "_map", closes)
    return closes


@contextlib.asynccontextmanager
async def running_daemon(held: HeldMaps | HeldCloses, *overrides: str) -> AsyncIterator[Daemon]:
    sockdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    config = load_config(
        None,
        [
            f"server.socket={sockdir}/d.sock",
            "tiers.l1.capacity_bytes=8MiB",
            "tiers.l1.segment_bytes=1MiB",
            *overrides,
        ],
        environ={},
    )
    daemon = Daemon(config)
    await daemon.start()
    try:
        yield daemon
    finally:
        held.release.set()
        if not daemon.servicer.closing.is_set():
            await daemon.stop()
        shutil.rmtree(sockdir, ignore_errors=True)


def tenant_tokens(folder: Path, *names: str) -> tuple[dict[str, str], str]:
    """(each tenant's token file, the ``tenants`` list of a config naming them) of tenants
    ``names``, each bound by a token written in ``folder``."""
    tokens = {}
    for name in names:
        path = folder / f"{name}.token"
        path.write_text(f"{name}-secret-0123456789")
        path.chmod(0o600)
        tokens[name] = str(path)
    return tokens, ", ".join(f"{{name: {n}, token_file: {p}}}" for n, p in tokens.items())


def fd_request(client: Client, shm: SharedMemoryPool) -> pb.RegisterPoolRequest:
    """A RegisterPool of ``shm``'s memfd for ``client``'s session, as the client builds it."""
    cred = credentials.cred_socket_path(client.address)
    assert cred is not None
    request = PoolBinding(shm, LAYOUT, None).register_request(
        credentials.pool_ticket(cred, shm.fd, 30.0)
    )
    request.session_id = client.session_id
    return request


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def mapped_in_this_process(name: str) -> list[str]:
    """Mappings of the memfd ``name`` in this process (the client's and the daemon's)."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if f"/memfd:{name} " in line]


def left_in_this_process(name: str) -> list[str]:
    """Mappings and descriptors of the memfd ``name`` this process (the daemon in it) holds."""
    found = mapped_in_this_process(name)
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} "):
                found.append(f"fd {fd}")
    return found


async def test_regression_registering_a_pool_held_every_other_client_until_it_was_mapped(held):
    """The daemon mapped (and populated) a pool on its event loop: while a pool of several
    GiB was faulted in, seconds, no other client got an answer, not even a health check.
    Here another client's Lookup and health check are answered while the mapping is held."""

    def clients(address: str) -> None:
        with (
            Client(address) as engine,
            Client(address, timeout_s=WAIT_S) as other,
            SharedMemoryPool.for_layout(LAYOUT) as shm,
            ThreadPoolExecutor(1) as engine_thread,
        ):
            registering = engine_thread.submit(engine.register_pool, shm, LAYOUT)
            try:
                held.wait_entered()
                assert other.lookup([bytes(32)]).prefix_len == 0
                assert other.health()
                assert not registering.done()
            finally:
                held.release.set()
            pool = registering.result(WAIT_S)
            check = engine.check()
            assert check.problems == [] and check.pools == 1
            engine.unregister_pool(pool.pool_id)

    async with running_daemon(held) as daemon:
        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_a_session_that_ends_while_its_pool_is_mapped_gets_no_pool(held):
    """The session ends while its registration is being mapped: the pool is not registered
    (to a session that no longer exists), and its mapping and descriptor are closed. The
    call runs on a connection of its own, so it outlives the session's."""

    async with running_daemon(held) as daemon:

        def clients(address: str) -> None:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                name = shm.name
                engine = Client(address)
                request = fd_request(engine, shm)
                with grpc.insecure_channel(address) as channel:
                    stub = pb_grpc.KVTierStub(channel)
                    call = stub.RegisterPool.future(request, timeout=WAIT_S)
                    try:
                        held.wait_entered()
                        engine.close()
                        wait_until(lambda: daemon.sessions.session_count == 0, "session closed")
                    finally:
                        held.release.set()
                    with pytest.raises(grpc.RpcError) as refused:
                        call.result()
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
                assert "ended while its pool was being mapped" in str(refused.value.details())
                assert len(held.buffers) == 1 and held.buffers[0].closed
            assert left_in_this_process(name) == []

        await asyncio.to_thread(clients, daemon.addresses[0])
        assert len(daemon.pools) == 0 and daemon.pools.per_session_counts() == {}


def _end_by_reload(daemon: Daemon, loop: asyncio.AbstractEventLoop, session_id: str) -> None:
    """What ``Reloader`` calls for a session its new tenants no longer bind."""
    loop.call_soon_threadsafe(daemon.servicer.end_session, session_id, "the tenants changed")


def _end_as_given_up(daemon: Daemon, loop: asyncio.AbstractEventLoop, session_id: str) -> None:
    """An OpenSession of the same process naming the session (``given_up_sessions``), as a
    blocking client's does for one whose channel an interrupt left locked."""
    with Client(daemon.addresses[0]) as successor:
        successor._given_up.append(session_id)
        assert successor.session_id


@pytest.mark.parametrize("end", [_end_by_reload, _end_as_given_up], ids=["reload", "given-up"])
async def test_regression_a_register_pool_whose_session_the_daemon_ended_while_mapped_was_refused(
    held, end
):
    """The daemon ends the session (a reload, ``KVTierServicer.end_session``; or an
    OpenSession naming it given up, ``KVService.end_given_up``) while its memfd pool is being
    mapped. The daemon had spent the pool's credential ticket, so the client's retry in a new
    session, which sends the same ticket, was refused UNAUTHENTICATED ("the credential ticket
    is unknown, already used or expired"; by reloads, 92-141 of ~9,000 registrations in 20 s
    of reloads every 0.1 s). The ticket is given back with its memfd: the retry registers the
    pool, and nothing of the memfd is left once it is unregistered."""
    loop = asyncio.get_running_loop()

    async with running_daemon(held) as daemon:

        def clients(address: str) -> None:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                name = shm.name
                with Client(address) as engine, ThreadPoolExecutor(1) as engine_thread:
                    first = engine.session_id
                    registering = engine_thread.submit(engine.register_pool, shm, LAYOUT)
                    try:
                        held.wait_entered()
                        end(daemon, loop, first)
                        wait_until(lambda: daemon.sessions.session_count == 0, "session ended")
                    finally:
                        held.release.set()
                    pool = registering.result(WAIT_S)
                    assert engine.session_id != first
                    check = engine.check()
                    assert check.problems == [] and check.pools == 1
                    engine.unregister_pool(pool.pool_id)
                assert len(held.buffers) == 2 and all(b.closed for b in held.buffers)
            assert left_in_this_process(name) == []

        await asyncio.to_thread(clients, daemon.addresses[0])
        assert len(daemon.pools) == 0 and len(daemon.tickets) == 0


async def test_regression_an_async_register_pool_whose_session_its_client_gave_up_was_refused(
    held,
):
    """AsyncClient gives its session up (``_give_up_session``, after an interrupt ended a
    pinning Lookup's call) by cancelling the session's stream while its memfd pool is being
    mapped. The daemon ends the session as its client's (``SessionGone``, the ticket spent
    and its fd closed, as for a client that closed), and the client sent the registration
    again in its new session with the same ticket: refused UNAUTHENTICATED ("the credential
    ticket is unknown, already used or expired"; a 1 GiB pool registered while the session
    was given up failed so). It is now sent again with a new ticket."""

    async with running_daemon(held) as daemon:

        async def engine_side(address: str) -> None:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                name = shm.name
                async with AsyncClient(address) as engine:
                    first = await engine.session()
                    registering = asyncio.create_task(engine.register_pool(shm, LAYOUT))
                    try:
                        await asyncio.to_thread(held.wait_entered)
                        engine._give_up_session(first)
                        ended = lambda: daemon.sessions.session_count == 0  # noqa: E731
                        await asyncio.to_thread(wait_until, ended, "session ended")
                    finally:
                        held.release.set()
                    pool = await registering
                    assert await engine.session() != first
                    check = await engine.check()
                    assert check.problems == [] and check.pools == 1
                    await engine.unregister_pool(pool.pool_id)
                assert len(held.buffers) == 2 and all(b.closed for b in held.buffers)
            assert left_in_this_process(name) == []

        await asyncio.to_thread(lambda: asyncio.run(engine_side(daemon.addresses[0])))
        assert len(daemon.pools) == 0 and len(daemon.tickets) == 0


async def test_regression_an_async_register_pool_with_a_wrong_token_left_two_tickets(held):
    """AsyncClient sent a memfd pool's registration again with a new ticket on any
    UNAUTHENTICATED, a session refused for a wrong (or revoked) token included: each of the two
    tries fetched a pool ticket before the session that refused it, and the daemon held both
    memfds until the tickets expired, toward the uid's ``MAX_TICKETS_PER_UID``. It now opens
    the session before it fetches a ticket, and sends the registration again only where its
    first try was sent again in a new session (the daemon spent that try's ticket)."""

    async with running_daemon(held) as daemon:

        async def engine_side(address: str) -> None:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                async with AsyncClient(address, token="a-wrong-secret-of-some-length") as engine:
                    with pytest.raises(UnauthenticatedError, match="token"):
                        await engine.register_pool(shm, LAYOUT)

        await asyncio.to_thread(lambda: asyncio.run(engine_side(daemon.addresses[0])))
        assert daemon.store.counters.get("sessions_refused", reason="tenant") == 1
        assert len(daemon.tickets) == 0 and len(daemon.pools) == 0


async def test_regression_a_register_pool_with_a_wrong_token_left_a_ticket(held):
    """The blocking client fetched a memfd pool's ticket before it opened the session that
    would send it: with a wrong (or revoked) token the session was refused and the daemon held
    the memfd until the ticket expired, one of the uid's ``MAX_TICKETS_PER_UID`` unused
    tickets for each such call. It now opens the session first."""

    async with running_daemon(held) as daemon:

        def engine_side(address: str) -> None:
            with (
                SharedMemoryPool.for_layout(LAYOUT) as shm,
                Client(address, token="a-wrong-secret-of-some-length") as engine,
                pytest.raises(UnauthenticatedError, match="token"),
            ):
                engine.register_pool(shm, LAYOUT)

        await asyncio.to_thread(engine_side, daemon.addresses[0])
        assert daemon.store.counters.get("sessions_refused", reason="tenant") == 1
        assert len(daemon.tickets) == 0 and len(daemon.pools) == 0


async def test_a_register_pool_cancelled_while_mapped_leaves_no_pool(held):
    """A client that cancels its RegisterPool while the memory is mapped never learns the
    pool's id: the registration is undone once the mapping ends (it used to stay, counted
    toward the session's pools, until the session ended), so the memory registers again
    under a limit of one pool."""

    async with running_daemon(held, "server.max_pools_per_session=1") as daemon:

        def clients(address: str) -> None:
            with Client(address) as engine, SharedMemoryPool.for_layout(LAYOUT) as shm:
                call = engine.stub.RegisterPool.future(fd_request(engine, shm))
                try:
                    held.wait_entered()
                    call.cancel()
                    wait_until(
                        lambda: daemon.service.counters["requests_detached"] >= 1,
                        "the daemon saw the cancel",
                    )
                finally:
                    held.release.set()
                wait_until(lambda: bool(held.buffers) and held.buffers[0].closed, "unmapped")
                pool = engine.register_pool(shm, LAYOUT)
                check = engine.check()
                assert check.problems == [] and check.pools == 1
                engine.unregister_pool(pool.pool_id)

        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_a_session_that_ends_with_two_registrations_in_flight_one_cancelled_gets_no_pool(
    held,
):
    """Two registrations of one session are being mapped; the client cancels one, then the
    session ends: both register nothing, and nothing of either memfd stays mapped or open
    in the process; the session's count (those in flight included) is back to none, no
    request failed inside the daemon, and the invariants hold."""

    async with running_daemon(held) as daemon:

        def clients(address: str) -> None:
            with (
                Client(address) as other,
                SharedMemoryPool.for_layout(LAYOUT) as a,
                SharedMemoryPool.for_layout(LAYOUT) as b,
            ):
                names = (a.name, b.name)
                assert other.lookup([bytes(32)]).prefix_len == 0  # its session is open
                engine = Client(address)
                session_id = engine.session_id
                requests = [fd_request(engine, s) for s in (a, b)]
                with grpc.insecure_channel(address) as channel:
                    stub = pb_grpc.KVTierStub(channel)
                    cancelled, voided = (
                        stub.RegisterPool.future(r, timeout=WAIT_S) for r in requests
                    )
                    try:
                        held.wait_entered(2)
                        cancelled.cancel()
                        wait_until(
                            lambda: daemon.service.counters["requests_detached"] >= 1,
                            "the daemon saw the cancel",
                        )
                        engine.close()
                        wait_until(lambda: daemon.sessions.session_count == 1, "session closed")
                    finally:
                        held.release.set()
                    with pytest.raises(grpc.RpcError) as refused:
                        voided.result()
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
                wait_until(lambda: not daemon.servicer.detached, "the cancelled call ended")
                check = other.check()
                assert check.problems == [] and check.pools == 0
            for name in names:
                assert left_in_this_process(name) == []
            assert daemon.pools.session_pools(session_id) == 0
            assert daemon.service.counters["requests_internal_error"] == 0

        await asyncio.to_thread(clients, daemon.addresses[0])
        assert len(daemon.pools) == 0 and daemon.pools.per_session_counts() == {}


async def test_registrations_in_flight_together_count_toward_the_pool_limit(held):
    """Two registrations of one session are mapped at once under a limit of two pools: a
    third, sent meanwhile, is refused at once (it would pass the limit if only registered
    pools counted); the two in flight end with pools of distinct ids."""

    async with running_daemon(held, "server.max_pools_per_session=2") as daemon:

        def clients(address: str) -> None:
            with (
                Client(address) as engine,
                SharedMemoryPool.for_layout(LAYOUT) as a,
                SharedMemoryPool.for_layout(LAYOUT) as b,
                SharedMemoryPool.for_layout(LAYOUT) as c,
            ):
                calls = [engine.stub.RegisterPool.future(fd_request(engine, s)) for s in (a, b)]
                try:
                    held.wait_entered(2)  # both passed their checks and are being mapped
                    with pytest.raises(grpc.RpcError) as refused:
                        engine.stub.RegisterPool(fd_request(engine, c), timeout=WAIT_S)
                    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "server.max_pools_per_session" in str(refused.value.details())
                finally:
                    held.release.set()
                ids = {call.result(WAIT_S).pool_id for call in calls}
                assert len(ids) == 2
                check = engine.check()
                assert check.problems == [] and check.pools == 2
                for pool_id in ids:
                    engine.unregister_pool(pool_id)

        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_a_daemon_that_stops_while_a_pool_is_mapped_registers_nothing(held):
    """Shutdown while a registration is being mapped: the session ends with the daemon's
    streams, the registration registers nothing and its mapping is closed; shutdown waits
    for the call to end (it is a request in flight)."""

    async with running_daemon(held) as daemon:

        def register(address: str) -> tuple[Client, SharedMemoryPool, Any]:
            engine = Client(address)
            shm = SharedMemoryPool.for_layout(LAYOUT)
            call = engine.stub.RegisterPool.future(fd_request(engine, shm))
            held.wait_entered()
            return engine, shm, call

        engine, shm, call = await asyncio.to_thread(register, daemon.addresses[0])
        try:
            stopping = asyncio.create_task(daemon.stop())
            while daemon.sessions.session_count:
                await asyncio.sleep(0.005)
            held.release.set()
            await asyncio.wait_for(stopping, WAIT_S)
            with pytest.raises(grpc.RpcError) as refused:
                await asyncio.to_thread(call.result, WAIT_S)
            assert refused.value.code() in (
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.UNAVAILABLE,
            )
            assert len(held.buffers) == 1 and held.buffers[0].closed
            assert len(daemon.pools) == 0
        finally:
            held.release.set()
            await asyncio.to_thread(engine.close)
            shm.close()


async def test_regression_a_daemon_stop_returned_while_a_registration_was_still_being_mapped(held):
    """The daemon's stop closed the registry (voiding the registration being mapped) and
    ended its worker threads without waiting for that mapping: stop returned with the
    registration still to be mapped, and its mapping was then made and unmapped after the
    daemon had stopped, on worker threads started again for it and never ended. With no
    time to drain (the call is cancelled at once), stop now waits for the registration:
    when it returns the mapping is made, unmapped, and gone from the process."""

    async with running_daemon(held, "server.drain_timeout_s=0") as daemon:

        def register(address: str) -> tuple[Client, SharedMemoryPool, Any]:
            engine = Client(address)
            shm = SharedMemoryPool.for_layout(LAYOUT)
            call = engine.stub.RegisterPool.future(fd_request(engine, shm))
            held.wait_entered()
            return engine, shm, call

        engine, shm, call = await asyncio.to_thread(register, daemon.addresses[0])
        closed = threading.Event()
        close = daemon.pools.close

        def closing() -> None:
            close()
            closed.set()

        daemon.pools.close = closing  # type: ignore[method-assign]
        try:
            stopping = asyncio.create_task(daemon.stop())
            while not closed.is_set():
                await asyncio.sleep(0.005)
            held.release.set()  # the registration is voided: its mapping may end now
            await asyncio.wait_for(stopping, WAIT_S)
            assert len(held.buffers) == 1 and held.buffers[0].closed
            assert len(mapped_in_this_process(shm.name)) == 1  # the client's own
            assert len(daemon.pools) == 0
            with pytest.raises(grpc.RpcError):
                await asyncio.to_thread(call.result, WAIT_S)
        finally:
            held.release.set()
            await asyncio.to_thread(engine.close)
            shm.close()


def _resident_bytes(buffer: mmap.mmap) -> int:
    """Rss of the mapping ``buffer``, as /proc/self/smaps counts it."""
    view = np.frombuffer(buffer, dtype=np.uint8)
    start = f"{int(view.ctypes.data):x}-"
    del view
    with open("/proc/self/smaps") as f:
        lines = iter(f)
        for line in lines:
            if line.startswith(start):
                for field in lines:
                    if field.startswith("Rss:"):
                        return int(field.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


def test_a_pool_is_populated_when_it_is_mapped():
    """The mapping step faults in every page of the (fully allocated) object: once with
    MAP_POPULATE, now with a madvise that lets the GIL go, so that the event loop's thread
    runs meanwhile."""
    size = 8 << 20
    fd = os.memfd_create("kvtier-test")
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        populated = pools_module._map(fd, size, "the memory file")
        try:
            assert _resident_bytes(populated) == size
        finally:
            populated.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("object_pages", "allocated", "said"),
    [
        # A sparse object allocated in part.
        (1, (0, 1 / 2), "has {half} of its {size} bytes allocated"),
        # Regression: the check counted the whole object's allocated bytes (st_blocks)
        # against the declared size, so an object twice as large allocated only past the
        # declared size passed, and populating its mapping then allocated the registered
        # range in the daemon's memory. The whole object must be allocated.
        (2, (1, 1), None),
    ],
    ids=["in part", "only past the declared size"],
)
def test_a_pool_not_allocated_in_full_is_refused_and_nothing_is_mapped_or_counted(
    object_pages: int, allocated: tuple[float, float], said: str | None
):
    """A sparse object (a memfd or a /dev/shm object not allocated in full) is refused with
    FAILED_PRECONDITION before anything is mapped: the daemon's writes into its holes would
    allocate pages charged to the daemon. The refusal says what to do; the tenant's mapped
    bytes and mappings stay as they were. Allocated, the same objects register."""
    peer = PeerCred(os.getpid(), os.getuid(), os.getgid())
    tenant = "t"
    size = LAYOUT.extent_bytes
    start, length = (int(f * size) for f in allocated)

    async def run() -> None:
        registry = pools_module.PoolRegistry("/dev/shm")
        memfd = os.memfd_create("kvtier-sparse")
        name = f"kvtier-sparse-{os.getpid()}"
        shm = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            for fd in (memfd, shm):
                os.ftruncate(fd, object_pages * size)
                os.posix_fallocate(fd, start, length)
            with pytest.raises(FailedPrecondition, match="posix_fallocate") as refused:
                await registry.register_fd("s", memfd, size, LAYOUT, tenant=tenant)
            if said is not None:
                assert said.format(half=size // 2, size=size) in str(refused.value)
            with pytest.raises(FailedPrecondition, match="posix_fallocate"):
                await registry.register_shm("s", peer, name, size, LAYOUT, tenant=tenant)
            assert len(registry) == 0 and registry.check() == []
            assert registry.tenant_bytes(tenant) == 0 and registry.tenant_mappings(tenant) == 0
            assert mapped_in_this_process("kvtier-sparse") == []
            for fd in (memfd, shm):
                os.posix_fallocate(fd, 0, object_pages * size)
            await registry.register_fd("s", memfd, size, LAYOUT, tenant=tenant)
            await registry.register_shm("s", peer, name, size, LAYOUT, tenant=tenant)
            assert len(registry) == 2 and registry.tenant_bytes(tenant) == 2 * size
        finally:
            os.close(memfd)
            os.close(shm)
            os.unlink(f"/dev/shm/{name}")
            await registry.stop()

    asyncio.run(run())


async def test_regression_unregistering_a_pool_held_every_other_client_until_it_was_unmapped(
    held_closes,
):
    """UnregisterPool closed the pool's mapping on the event loop: the munmap of a
    populated pool of 4 GiB took 0.25-0.7 s, during which no other client got an answer.
    Here another client's Lookup and health check are answered while the unmapping is held;
    the pool's id is gone at once, and the UnregisterPool answers once the daemon's mapping
    is gone from the process (the engine may then free or reuse the memory)."""

    def clients(address: str) -> None:
        with (
            Client(address) as engine,
            Client(address, timeout_s=WAIT_S) as other,
            SharedMemoryPool.for_layout(LAYOUT) as shm,
            ThreadPoolExecutor(1) as engine_thread,
        ):
            pool = engine.register_pool(shm, LAYOUT)
            assert len(mapped_in_this_process(shm.name)) == 2  # the client's and the daemon's
            unregistering = engine_thread.submit(engine.unregister_pool, pool.pool_id)
            try:
                held_closes.wait_entered()
                assert other.lookup([bytes(32)]).prefix_len == 0
                assert other.health()
                with pytest.raises(NotFoundError):
                    engine.unregister_pool(pool.pool_id)
                assert not unregistering.done()
            finally:
                held_closes.release.set()
            unregistering.result(WAIT_S)
            assert len(mapped_in_this_process(shm.name)) == 1  # the client's own
            assert engine.check().pools == 0

    async with running_daemon(held_closes) as daemon:
        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_regression_a_pool_whose_copy_faulted_stayed_mapped_after_unregister_pool(
    held_closes, caplog
):
    """A copy that faults in a pool's memory (its owner truncated it) fails its request,
    whose traceback, kept in a reference cycle until the collector runs, holds a view of the
    pool's mapping. Unregistering the pool then found the view: the close was refused ("still
    has views at unmap"), UnregisterPool answered anyway, and the daemon kept the mapping
    (and the memory behind it) until a collection came by. The unmapping now collects that
    garbage and closes the mapping before UnregisterPool answers."""
    held_closes.release.set()

    def clients(address: str) -> None:
        with (
            Client(address) as engine,
            SharedMemoryPool.for_layout(LAYOUT, seal=False) as shm,
        ):
            pool = engine.register_pool(shm, LAYOUT)
            keys = [os.urandom(32) for _ in range(2)]
            engine.put(pool.pool_id, keys, range(2))
            os.ftruncate(shm.fd, 0)
            with pytest.raises(FailedPreconditionError, match="is broken"):
                engine.get(pool.pool_id, keys, range(2))
            engine.unregister_pool(pool.pool_id)
            assert len(mapped_in_this_process(shm.name)) == 1  # the client's own
            assert "still has views" not in caplog.text

    async with running_daemon(held_closes) as daemon:
        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_regression_ending_a_session_held_other_clients_until_its_pools_were_unmapped(
    held_closes,
):
    """The end of a session unmapped its pools on the event loop, as UnregisterPool did.
    Here the engine's session ends with a pool registered: another client is answered while
    the unmapping is held, the pool is gone from the registry at once, and the daemon's
    mapping leaves the process when the unmapping is let go."""

    def clients(address: str) -> None:
        with (
            Client(address, timeout_s=WAIT_S) as other,
            SharedMemoryPool.for_layout(LAYOUT) as shm,
        ):
            engine = Client(address)
            engine.register_pool(shm, LAYOUT)
            assert len(mapped_in_this_process(shm.name)) == 2
            try:
                engine.close()
                held_closes.wait_entered()
                assert other.lookup([bytes(32)]).prefix_len == 0
                assert other.health()
                assert len(daemon.pools) == 0 and daemon.pools.per_session_counts() == {}
                assert len(mapped_in_this_process(shm.name)) == 2
            finally:
                held_closes.release.set()
            wait_until(lambda: len(mapped_in_this_process(shm.name)) == 1, "the pool unmapped")

    async with running_daemon(held_closes) as daemon:
        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_regression_a_registration_voided_while_mapped_was_unmapped_on_the_event_loop(
    monkeypatch,
):
    """A registration whose session ended while it was mapped closed its mapping on the
    event loop when the mapping ended. Here the mapping, then its close, are held: another
    client is answered while the close is, and the registration answers NOT_FOUND once the
    mapping is gone."""
    closes = HeldCloses()
    maps = HeldMaps(closes)
    monkeypatch.setattr(pools_module, "_map", maps)

    async with running_daemon(maps) as daemon:

        def clients(address: str) -> None:
            with (
                Client(address, timeout_s=WAIT_S) as other,
                SharedMemoryPool.for_layout(LAYOUT) as shm,
            ):
                assert other.session_id  # open: only the engine's session ends
                engine = Client(address)
                request = fd_request(engine, shm)
                with grpc.insecure_channel(address) as channel:
                    call = pb_grpc.KVTierStub(channel).RegisterPool.future(request, timeout=WAIT_S)
                    try:
                        maps.wait_entered()
                        engine.close()
                        wait_until(lambda: daemon.sessions.session_count == 1, "session closed")
                        maps.release.set()
                        closes.wait_entered()
                        assert other.lookup([bytes(32)]).prefix_len == 0
                        assert other.health()
                        assert not call.done()
                    finally:
                        maps.release.set()
                        closes.release.set()
                    with pytest.raises(grpc.RpcError) as refused:
                        call.result()
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
                assert len(mapped_in_this_process(shm.name)) == 1

        await asyncio.to_thread(clients, daemon.addresses[0])
        assert len(daemon.pools) == 0


async def test_a_stopped_daemon_has_unmapped_every_pool(held_closes):
    """The daemon's stop unmaps every registered pool (on worker threads) and returns only
    once they are gone."""
    held_closes.release.set()
    async with running_daemon(held_closes) as daemon:
        engine = Client(daemon.addresses[0])
        shm = SharedMemoryPool.for_layout(LAYOUT)
        try:
            for _ in range(2):
                await asyncio.to_thread(engine.register_pool, shm, LAYOUT)
            assert len(mapped_in_this_process(shm.name)) == 3
            await daemon.stop()
            assert held_closes.entered == 2
            assert len(mapped_in_this_process(shm.name)) == 1
        finally:
            await asyncio.to_thread(engine.close)
            shm.close()


def test_a_pool_is_unmapped_only_after_its_last_copy(held_closes):
    """Unregistering a pool a copy is using takes its id away at once and refuses new
    copies, but the unmapping begins only when that copy ends; ``released()`` answers once
    the mapping is gone."""
    held_closes.release.set()

    async def run() -> None:
        registry = pools_module.PoolRegistry("/dev/shm")
        fd = os.memfd_create("kvtier-test")
        try:
            os.ftruncate(fd, LAYOUT.extent_bytes)
            os.posix_fallocate(fd, 0, LAYOUT.extent_bytes)
            pool = await registry.register_fd("s", fd, LAYOUT.extent_bytes, LAYOUT)
        finally:
            os.close(fd)
        with pool.use() as memory:
            registry.unregister("s", pool.pool_id)
            with pytest.raises(NotFound):
                registry.get("s", pool.pool_id)
            with pytest.raises(NotFound), pool.use():
                pass
            for _ in range(20):
                await asyncio.sleep(0)
            assert held_closes.entered == 0 and not pool.buffer.closed
            memory[:] = 7  # the copy still writes into the mapping
            del memory
        await asyncio.wait_for(pool.released(), WAIT_S)
        assert held_closes.entered == 1 and pool.buffer.closed
        assert mapped_in_this_process("kvtier-test") == []
        await registry.stop()

    asyncio.run(run())


def test_regression_a_pool_in_use_when_the_registry_stopped_started_its_threads_again(
    held_closes,
):
    """A pool a copy still used when the registry stopped (a request that outlasted the
    daemon's drain) was unmapped, once the copy ended, through a pool of worker threads
    started again after the stop and never ended. Now the registry, once stopped, unmaps on
    the caller's thread, as it does without an event loop: no thread of it is left."""
    held_closes.release.set()

    def map_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kvtier-map")}

    async def run() -> None:
        registry = pools_module.PoolRegistry("/dev/shm")
        fd = os.memfd_create("kvtier-test")
        try:
            os.ftruncate(fd, LAYOUT.extent_bytes)
            os.posix_fallocate(fd, 0, LAYOUT.extent_bytes)
            pool = await registry.register_fd("s", fd, LAYOUT.extent_bytes, LAYOUT)
        finally:
            os.close(fd)
        started = map_threads()
        with pool.use():
            await registry.stop()  # returns: the copy keeps the pool mapped
            assert not pool.buffer.closed
        await asyncio.wait_for(pool.released(), WAIT_S)
        assert held_closes.entered == 1 and pool.buffer.closed
        assert mapped_in_this_process("kvtier-test") == []
        assert map_threads() <= started

    asyncio.run(run())


def test_unmapping_keeps_the_data_of_the_memory():
    """``_unmap`` empties the daemon's mapping (madvise MADV_DONTNEED) before it closes it:
    on a shared mapping that drops only the daemon's view of the pages, and what was written
    through it stays in the object for its owner."""
    size = 4 << 20
    fd = os.memfd_create("kvtier-test")
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        owner = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        daemon = pools_module._map(fd, size, "the memory file")
    finally:
        os.close(fd)
    try:
        pattern = np.arange(size, dtype=np.uint64).view(np.uint8)[:size]
        np.frombuffer(daemon, dtype=np.uint8)[:] = pattern
        pools_module._unmap(daemon, "a test pool")
        assert daemon.closed
        assert len(mapped_in_this_process("kvtier-test")) == 1
        assert np.array_equal(np.frombuffer(owner, dtype=np.uint8), pattern)
    finally:
        owner.close()


def test_a_mapping_with_a_view_left_is_not_closed_and_keeps_its_data(caplog):
    """A view of a pool's memory still alive at unmap (none should be) refuses the close:
    the mapping stays, logged, until the view goes, and reads what it held."""
    size = 1 << 20
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
    view = np.frombuffer(buffer, dtype=np.uint8)
    view[:] = 3
    pools_module._unmap(buffer, "a test pool")
    assert not buffer.closed
    assert "a test pool still has views at unmap" in caplog.text
    assert (view == 3).all()
    del view
    buffer.close()


# ------------------------------------------------- mapped bytes per tenant, fair mapping

MIB = 1 << 20
assert LAYOUT.extent_bytes == MIB


def _refused_for_bytes(call: Callable[[], Any]) -> str:
    """The message of ``call``'s RESOURCE_EXHAUSTED, which must name the bytes limit."""
    with pytest.raises(ResourceExhaustedError) as refused:
        call()
    assert "server.max_pool_bytes_per_tenant" in str(refused.value)
    return str(refused.value)


async def test_regression_registering_one_memfd_many_times_mapped_it_each_time_without_limit(
    held,
):
    """Every RegisterPool maps its memory, repeats of the same memfd included: 32
    registrations of one 256 MiB memfd took the daemon's page tables (VmPTE) from 0.6 to
    17 MB, and with 64 pools per session and 256 sessions per tenant nothing bounded what one
    tenant could make the daemon hold. Now a tenant's mapped bytes are capped
    (server.max_pool_bytes_per_tenant), each registration counted in full: under a cap of
    three pools, the same memfd registers three times and a fourth is RESOURCE_EXHAUSTED
    naming the limit and what is mapped, from this session or another of the tenant. An
    unregistered pool, and the pools of a session that ended, count no more once unmapped."""
    held.release.set()

    async with running_daemon(held, f"server.max_pool_bytes_per_tenant={3 * MIB}") as daemon:

        def clients(address: str) -> None:
            with (
                Client(address) as engine,
                Client(address) as sibling,
                SharedMemoryPool.for_layout(LAYOUT) as shm,
            ):
                pools = [engine.register_pool(shm, LAYOUT) for _ in range(3)]
                message = _refused_for_bytes(lambda: engine.register_pool(shm, LAYOUT))
                assert f"has {3 * MIB} bytes of pools mapped" in message
                assert f"pass the {3 * MIB}" in message
                _refused_for_bytes(lambda: sibling.register_pool(shm, LAYOUT))
                engine.unregister_pool(pools[0].pool_id)
                pools[0] = sibling.register_pool(shm, LAYOUT)
                check = engine.check()
                assert check.problems == [] and check.pools == 3
                engine.close()  # its two pools go with its session, once unmapped
                wait_until(
                    lambda: daemon.pools.tenant_bytes(tenant) == MIB, "the session's pools unmapped"
                )
                more = [sibling.register_pool(shm, LAYOUT) for _ in range(2)]
                _refused_for_bytes(lambda: sibling.register_pool(shm, LAYOUT))
                for pool in [pools[0], *more]:
                    sibling.unregister_pool(pool.pool_id)
                assert sibling.check().problems == []

        tenant = f"uid:{os.getuid()}"
        await asyncio.to_thread(clients, daemon.addresses[0])
        assert daemon.pools.tenant_bytes(tenant) == 0 and daemon.pools.check() == []


async def test_registrations_racing_for_a_tenants_mapped_bytes_are_counted_once(held):
    """Twelve registrations from three sessions of one tenant are in flight together under
    a cap of four pools while their mappings are held: exactly four pass (each counted from
    its checks on, before it is mapped), the others are refused at once; then one session
    ends with its registrations still being mapped. Once everything is let go and
    unregistered, the tenant's mapped bytes are back to none and the invariants hold:
    nothing was counted twice, nothing leaked."""

    async with running_daemon(held, f"server.max_pool_bytes_per_tenant={4 * MIB}") as daemon:
        tenant = f"uid:{os.getuid()}"

        def clients(address: str) -> None:
            engines = [Client(address) for _ in range(3)]
            shms = [SharedMemoryPool.for_layout(LAYOUT) for _ in range(3)]
            by_session = {e.session_id: e for e in engines}
            try:
                requests = [
                    fd_request(e, s) for _ in range(4) for e, s in zip(engines, shms, strict=True)
                ]
                with grpc.insecure_channel(address) as channel:
                    stub = pb_grpc.KVTierStub(channel)
                    calls = [stub.RegisterPool.future(r, timeout=WAIT_S) for r in requests]
                    wait_until(lambda: sum(c.done() for c in calls) == 8, "the refusals")
                    for call in calls:
                        if call.done():
                            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                            assert "server.max_pool_bytes_per_tenant" in call.details()
                    assert daemon.pools.tenant_bytes(tenant) == 4 * MIB
                    in_flight = [
                        (c, r) for c, r in zip(calls, requests, strict=True) if not c.done()
                    ]
                    ending = engines[0].session_id
                    engines[0].close()
                    wait_until(lambda: daemon.sessions.session_count == 2, "session closed")
                    held.release.set()
                    registered = []
                    for call, request in in_flight:
                        if request.session_id == ending:
                            assert call.exception(WAIT_S).code() == grpc.StatusCode.NOT_FOUND
                        else:
                            pool_id = call.result(WAIT_S).pool_id
                            registered.append((by_session[request.session_id], pool_id))
                check = engines[1].check()
                assert check.problems == [] and check.pools == len(registered)
                for engine, pool_id in registered:
                    engine.unregister_pool(pool_id)
                assert engines[1].check().problems == []
            finally:
                held.release.set()
                for e in engines:
                    e.close()
                for s in shms:
                    s.close()

        await asyncio.to_thread(clients, daemon.addresses[0])
        wait_until(lambda: daemon.pools.tenant_bytes(tenant) == 0, "every mapping gone")
        assert daemon.pools.check() == []


class HeldLargeMaps(HeldMaps):
    """Holds only the mappings of pools of ``LAYOUT``'s size (the flood's); others map at
    once."""

    def __call__(self, fd: int, size_bytes: int, what: str) -> mmap.mmap:
        if size_bytes != LAYOUT.extent_bytes:
            return self.real(fd, size_bytes, what)
        return super().__call__(fd, size_bytes, what)


async def test_regression_a_tenants_flood_of_registrations_held_every_other_tenants_pools(
    monkeypatch, tmp_path
):
    """The registry's four mapping threads took jobs first come, first served: a client
    registering 1 GiB 32 times held another tenant's 4 KiB RegisterPool 3.4 s, and its
    UnregisterPool 3.6 s, behind its queue. Now one tenant's jobs take at most
    MAP_THREADS_PER_TENANT threads and the others take turns: with eight of a flooding
    tenant's registrations in flight and their mappings held, another tenant registers,
    uses and unregisters a pool."""
    held = HeldLargeMaps(pools_module._map)
    monkeypatch.setattr(pools_module, "_map", held)
    tokens, tenants = tenant_tokens(tmp_path, "flood", "other")
    small = PoolLayout.staging(
        num_layers=1, num_pages=1, block_tokens=1, chunk_bytes=4096, kv_count=1, dtype="uint8"
    )

    async with running_daemon(held, f"tenants=[{tenants}]") as daemon:

        def clients(address: str) -> None:
            with (
                Client(address, token_file=tokens["flood"]) as flood,
                Client(address, token_file=tokens["other"], timeout_s=WAIT_S) as other,
                SharedMemoryPool.for_layout(LAYOUT) as big,
                SharedMemoryPool.for_layout(small) as mine,
            ):
                calls = [flood.stub.RegisterPool.future(fd_request(flood, big)) for _ in range(8)]
                try:
                    held.wait_entered(pools_module.MAP_THREADS_PER_TENANT)
                    pool = other.register_pool(mine, small)
                    key = os.urandom(32)
                    assert pool.store_keys([key], [0]) == 1
                    assert pool.load_keys([key], [0]) == 1
                    other.unregister_pool(pool.pool_id)
                    assert not any(call.done() for call in calls)
                    assert daemon.pools._worker_pool().running("flood") == (
                        pools_module.MAP_THREADS_PER_TENANT
                    )
                finally:
                    held.release.set()
                for call in calls:
                    flood.unregister_pool(call.result(WAIT_S).pool_id)
                assert flood.check().problems == []

        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_the_daemon_holds_at_most_server_max_pools_mappings_of_all_tenants_together(held):
    """Each host pool is a memory mapping of the daemon's, and the kernel allows a process
    vm.max_map_count of them (65,530 by default): the per-session and per-tenant limits let a
    few tenants (or uids) with many small pools pass it, and then every mmap the daemon itself
    makes fails (its large allocations, arrays, threads). So the registry holds at most
    ``server.max_pools`` host mappings, every tenant's together (registrations being mapped
    and pools not yet unmapped included): past it a registration is RESOURCE_EXHAUSTED naming
    the limit, and room comes back once a pool is unmapped."""
    held.release.set()

    async with running_daemon(held, "server.max_pools=3") as daemon:

        def clients(address: str) -> None:
            with (
                Client(address) as one,
                Client(address) as two,
                SharedMemoryPool.for_layout(LAYOUT) as shm,
            ):
                pools = [one.register_pool(shm, LAYOUT), two.register_pool(shm, LAYOUT)]
                pools.append(two.register_pool(shm, LAYOUT))
                for client in (one, two):
                    with pytest.raises(ResourceExhaustedError, match=r"server\.max_pools\b"):
                        client.register_pool(shm, LAYOUT)
                one.unregister_pool(pools[0].pool_id)
                wait_until(lambda: daemon.pools.mappings == 2, "the pool unmapped")
                pools[0] = one.register_pool(shm, LAYOUT)
                check = one.check()
                assert check.problems == [] and check.pools == 3

        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_regression_one_tenant_could_take_every_pool_mapping_and_refuse_all_others(
    held, tmp_path
):
    """``server.max_pools`` bounds the mappings of every tenant together, and one tenant
    could take all of them: 256 sessions of 64 pools each are exactly the default 16,384,
    tiny pools pass any bytes cap, and every other tenant's RegisterPool was then
    RESOURCE_EXHAUSTED. A tenant holds at most ``server.max_pools_per_tenant`` mappings:
    past its own it is refused naming that key, and another tenant still registers."""
    held.release.set()
    tokens, tenants = tenant_tokens(tmp_path, "flood", "other")
    limits = ("server.max_pools=4", "server.max_pools_per_tenant=3")

    async with running_daemon(held, f"tenants=[{tenants}]", *limits) as daemon:

        def clients(address: str) -> None:
            with (
                Client(address, token_file=tokens["flood"]) as flood,
                Client(address, token_file=tokens["flood"]) as sibling,
                Client(address, token_file=tokens["other"]) as other,
                SharedMemoryPool.for_layout(LAYOUT) as shm,
            ):
                pools = [flood.register_pool(shm, LAYOUT) for _ in range(2)]
                pools.append(sibling.register_pool(shm, LAYOUT))
                for client in (flood, sibling):
                    with pytest.raises(
                        ResourceExhaustedError, match=r"server\.max_pools_per_tenant"
                    ):
                        client.register_pool(shm, LAYOUT)
                mine = other.register_pool(shm, LAYOUT)
                assert daemon.pools.mappings == 4
                other.unregister_pool(mine.pool_id)
                flood.unregister_pool(pools[0].pool_id)
                wait_until(lambda: daemon.pools.mappings == 2, "the pools unmapped")
                pools[0] = flood.register_pool(shm, LAYOUT)
                assert flood.check().problems == []

        await asyncio.to_thread(clients, daemon.addresses[0])


async def test_regression_a_tenant_registering_pools_in_a_loop_hid_other_tenants_pool_lines(
    caplog,
):
    """The lines of pools registered and unregistered had one budget for all sessions: a
    client registering and dropping pools in a loop kept it spent, and the pools another
    tenant's engines registered meanwhile went unlogged. Each tenant (a session's limit key)
    has a budget of its own."""
    now = [0.0]
    registry = pools_module.PoolRegistry("/dev/shm", clock=lambda: now[0])
    small = PoolLayout.staging(
        num_layers=1, num_pages=1, block_tokens=1, chunk_bytes=4096, kv_count=1, dtype="uint8"
    )
    size = small.extent_bytes
    fd = os.memfd_create("kvtier-test-pool", os.MFD_CLOEXEC)
    caplog.set_level(logging.INFO, logger=pools_module.__name__)
    try:
        os.posix_fallocate(fd, 0, size)
        for _ in range(pools_module.POOL_LOG_BURST // 2):  # two lines each: the burst
            pool = await registry.register_fd("flood", fd, size, small, tenant="uid:1001")
            registry.unregister("flood", pool.pool_id)
        caplog.clear()
        flooding = await registry.register_fd("flood", fd, size, small, tenant="uid:1001")
        assert f"pool {flooding.pool_id} registered" not in caplog.text  # its budget is spent
        other = await registry.register_fd("engine", fd, size, small, tenant="uid:1002")
        assert f"pool {other.pool_id} registered" in caplog.text
    finally:
        os.close(fd)
        await registry.stop()


def _age_tickets(daemon: Daemon) -> Callable[[], None]:
    """A call that ages every pool ticket the daemon issued so far past its life."""
    shift = [0.0]
    daemon.tickets._clock = lambda: time.monotonic() + shift[0]

    def age() -> None:
        shift[0] += 2 * TICKET_TTL_S

    return age


async def test_regression_an_async_register_pool_whose_ticket_expired_waiting_for_a_slot_failed(
    held,
):
    """AsyncClient fetched a memfd pool's ticket before its RegisterPool waited for a call
    slot (``max_calls_open``): a wait past the ticket's life (``TICKET_TTL_S``, 10 s, under a
    timeout of 30 s) sent an expired ticket, refused UNAUTHENTICATED, and since 8889de9 no new
    ticket was tried (the registration was sent in its first session). The refused request is
    made again with a new ticket, as before 8889de9 (the session, opened first, was not the
    refusal)."""
    held.release.set()
    async with running_daemon(held) as daemon:
        age = _age_tickets(daemon)

        async def engine_side(address: str) -> None:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                async with AsyncClient(address, max_calls_open=1) as engine:
                    await engine.session()
                    slots = engine._slots
                    assert slots.take()
                    registering = asyncio.create_task(engine.register_pool(shm, LAYOUT))
                    try:
                        async with asyncio.timeout(WAIT_S):
                            while slots.waiting == 0:
                                await asyncio.sleep(0.005)
                        age()
                    finally:
                        slots.release()
                    pool = await asyncio.wait_for(registering, WAIT_S)
                    await engine.unregister_pool(pool.pool_id)

        await asyncio.to_thread(lambda: asyncio.run(engine_side(daemon.addresses[0])))
        assert len(daemon.tickets) == 0 and len(daemon.pools) == 0


async def test_regression_a_register_pool_whose_ticket_expired_waiting_for_a_slot_failed(held):
    """The blocking client fetched a memfd pool's ticket before its RegisterPool waited for a
    call slot (``max_calls_open``): a wait past the ticket's life (``TICKET_TTL_S``, 10 s,
    under a timeout of 30 s) sent an expired ticket, refused UNAUTHENTICATED, and
    register_pool failed. As AsyncClient's (5531a57), the registration is made again with a
    new ticket where the daemon refused the ticket."""
    held.release.set()
    async with running_daemon(held) as daemon:
        age = _age_tickets(daemon)

        def engine_side(address: str) -> None:
            with (
                SharedMemoryPool.for_layout(LAYOUT) as shm,
                Client(address, max_calls_open=1) as engine,
                ThreadPoolExecutor(1) as pool,
            ):
                assert engine.session_id
                slots = engine.call_slots
                assert slots.acquire(0)
                try:
                    registering = pool.submit(engine.register_pool, shm, LAYOUT)
                    deadline = time.monotonic() + WAIT_S
                    while slots.waiting == 0:
                        assert time.monotonic() < deadline, "the registration never queued"
                        time.sleep(0.005)
                    age()
                finally:
                    slots.release()
                engine.unregister_pool(registering.result(WAIT_S).pool_id)

        await asyncio.to_thread(engine_side, daemon.addresses[0])
        assert len(daemon.tickets) == 0 and len(daemon.pools) == 0


async def test_regression_an_async_register_pool_whose_token_was_revoked_opened_two_sessions(
    held, tmp_path
):
    """AsyncClient made a memfd pool's registration again, with a new ticket, on any
    UNAUTHENTICATED: where a reload revoked the token (removed its tenant) after the ticket
    was fetched, the registration sent again in a new session (``_invoke``) was refused as
    that session's opening, and the retry opened another, refused too: one more
    OpenSession and credential ticket for an answer known already. The daemon marks a
    ticket it refuses (``TICKET_REFUSED_KEY``), and only that registration is made again."""
    held.release.set()
    tokens, tenants = tenant_tokens(tmp_path, "bob", "other")
    async with running_daemon(held, f"tenants=[{tenants}]") as daemon:
        kept = tuple(t for t in daemon.config.tenants if t.name != "bob")
        reloader = Reloader(daemon, lambda: dataclasses.replace(daemon.config, tenants=kept))
        loop = asyncio.get_running_loop()

        async def revoke() -> None:
            assert reloader.reload().applied == ["tenants: removed bob"]

        async def engine_side(address: str) -> None:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                async with AsyncClient(address, token_file=tokens["bob"]) as engine:
                    await engine.session()
                    send = engine._send_registration

                    async def revoked_first(request: Any) -> Any:
                        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(revoke(), loop))
                        return await send(request)

                    engine._send_registration = revoked_first  # type: ignore[method-assign]
                    with pytest.raises(UnauthenticatedError, match="token"):
                        await engine.register_pool(shm, LAYOUT)

        await asyncio.to_thread(lambda: asyncio.run(engine_side(daemon.addresses[0])))
        assert daemon.store.counters.get("sessions_refused", reason="tenant") == 1
        assert len(daemon.pools) == 0


@pytest.mark.parametrize("refusal", ["pools-per-session", "dtype", "size"])
async def test_regression_a_refused_fd_registration_kept_its_ticket_until_it_expired(held, refusal):
    """A memfd pool's RegisterPool refused before its ticket was redeemed (RESOURCE_EXHAUSTED
    for a limit, INVALID_ARGUMENT for a layout or size the daemon cannot use) left the
    ticket, and the memfd handed over with it, in the daemon until the ticket expired
    (``TICKET_TTL_S``): one of the uid's ``MAX_TICKETS_PER_UID`` unused tickets for each
    such call, though no client sends that request again. The ticket is spent, its memfd
    closed, with the refusal."""
    held.release.set()  # no mapping is held
    async with running_daemon(held, "server.max_pools_per_session=1") as daemon:

        def engine_side(address: str) -> None:
            with (
                SharedMemoryPool.for_layout(LAYOUT) as first,
                SharedMemoryPool.for_layout(LAYOUT) as shm,
                Client(address) as engine,
            ):
                if refusal == "pools-per-session":
                    engine.register_pool(first, LAYOUT)
                    with pytest.raises(ResourceExhaustedError, match="max_pools_per_session"):
                        engine.register_pool(shm, LAYOUT)
                    return
                request = fd_request(engine, shm)
                if refusal == "dtype":  # refused by the servicer
                    request.layout.dtype = 0
                else:  # by the service, the layout past the memory
                    request.fd.size_bytes = 1
                with pytest.raises(grpc.RpcError) as caught:
                    engine.stub.RegisterPool(request, timeout=WAIT_S)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        await asyncio.to_thread(engine_side, daemon.addresses[0])
        assert len(daemon.tickets) == 0


def test_regression_a_pool_under_a_mib_was_logged_as_0_mib(daemon):
    """The daemon's line for a registered pool gave its size in whole MiB, shifted down: a
    pool under 1 MiB (this one, 16 pages) read "memfd, 0 MiB", as if it held nothing, and a
    1.5 MiB one "1 MiB". It is spelled as the tier lines spell sizes."""
    from kvtier.tiers.sizes import format_size

    small = dataclasses.replace(LAYOUT, num_pages=16)
    with Client(daemon.address) as client, SharedMemoryPool.for_layout(small) as shm:
        pool = client.register_pool(shm, small)
        size = format_size(len(shm.buffer))
        assert len(shm.buffer) < 1 << 20
        client.unregister_pool(pool.pool_id)
    lines = [x for x in daemon.log().splitlines() if f"pool {pool.pool_id} registered:" in x]
    assert lines and f"registered: memfd, {size} (sealed), 16 pages of" in lines[0], lines
