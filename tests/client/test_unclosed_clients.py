"""A Client dropped without close() ends its session when it is collected.

Its session's watcher thread held the client (its bound method), so a client that a program
dropped unclosed (``Client().lookup(keys)`` in a helper) lived on with its session open in
the daemon, two threads and a connection: one more of ``server.max_sessions_per_tenant``
each time, which without tenants counts per uid, until the daemon turned every process of
that user away. Collecting such a client now ends its session.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from typing import Any

import pytest
from harness import entry_setting

from kvtier.client import AsyncClient, Client, Namespace, PoolLayout, SharedMemoryPool
from kvtier.client import sync as sync_module

DROPPED = 5
NS = Namespace(model="unclosed", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=4, block_tokens=4, chunk_bytes=64)


def open_sessions(observer: Client) -> float:
    """The daemon's open sessions once the dropped clients' have ended (or 30 s passed)."""
    deadline = time.monotonic() + 30
    while (sessions := observer.stats().gauges["sessions"]) > 1 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return sessions  # type: ignore[no-any-return]


def test_clients_dropped_unclosed_end_their_sessions(daemon):
    with daemon.client() as observer:
        assert observer.stats().gauges["sessions"] == 1
        for _ in range(DROPPED):
            assert Client(daemon.address).lookup([bytes(32)]).prefix_len == 0
        assert open_sessions(observer) == 1
        # Nothing of theirs is left for the daemon's check to find, and a new client works.
        assert observer.check().problems == []
        with daemon.client() as again:
            assert again.lookup([bytes(32)]).prefix_len == 0


def test_a_client_kept_referenced_keeps_its_session(daemon):
    with daemon.client() as observer:
        kept = Client(daemon.address)
        session = kept.session_id
        gc.collect()
        assert observer.stats().gauges["sessions"] == 2
        assert kept.session_id == session
        kept.close()
        assert open_sessions(observer) == 1


def session_watchers() -> int:
    return sum(thread.name == "kvtier-session" for thread in threading.enumerate())


def watchers_left(before: int) -> int:
    """The session watchers past ``before`` once the dropped clients' have ended (or 30 s)."""
    deadline = time.monotonic() + 30
    while session_watchers() > before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return session_watchers() - before


def test_a_client_collected_on_its_channels_thread_ends_its_threads(daemon):
    # unregister_pool_nowait's answer comes on the channel's gRPC thread, whose callback held
    # the client: dropped before the answer, the client is collected there, and closing the
    # channel on its own thread waited for that thread forever, the session's watcher too.
    with daemon.client() as observer, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert observer.session_id
        before = session_watchers()
        for _ in range(DROPPED):
            client = Client(daemon.address)
            pool = client.register_pool(shm, LAYOUT, NS)
            client.unregister_pool_nowait(pool.binding)
            del client, pool
        assert open_sessions(observer) == 1
        assert watchers_left(before) == 0
        with daemon.client() as again:
            assert again.lookup([bytes(32)]).prefix_len == 0


@pytest.mark.parametrize("suspect", [False, True], ids=["plain", "given-up"])
def test_regression_a_closed_client_collected_hands_over_its_channel_no_more(
    daemon, monkeypatch, suspect
):
    """A client that close() closed is not closed again when collected. Before, its
    finalizer still ran: it cancelled the session's call again and had the closer thread
    close the channel again, and a client closed with its channel marked by an interrupt
    (``Client.interrupted``) handed that channel to a second closing thread, which parks for
    good where the interrupt left gRPC's lock held."""
    handed: list[str] = []
    discard, close_later = sync_module._closer.discard, sync_module._closer.close_later

    def discarded(channel: Any, session_call: Any) -> None:
        handed.append("discard")
        discard(channel, session_call)

    def closed_later(channel: Any) -> None:
        handed.append("close_later")
        close_later(channel)

    monkeypatch.setattr(sync_module._closer, "discard", discarded)
    monkeypatch.setattr(sync_module._closer, "close_later", closed_later)
    client = Client(daemon.address)
    assert client.lookup([bytes(32)]).prefix_len == 0
    if suspect:
        client._held["suspect"] = True  # an interrupt's mark, not yet acted on
    client.close()
    expected = ["discard"] if suspect else []
    assert handed == expected
    del client
    gc.collect()
    assert handed == expected


ASYNC_DROPPED = 20
# The daemon counts its connections at this period here (every 5 s by default).
CONNECTIONS_CHECK_S = 0.1


async def sessions_and_connections(observer: Client, want: tuple[int, int]) -> tuple[int, int]:
    """The daemon's open sessions and connections once they are ``want`` (or 30 s passed),
    collecting meanwhile; the loop runs between checks, to close what collected clients
    leave it to close."""
    deadline = time.monotonic() + 30
    while True:
        gauges = observer.stats().gauges
        if (got := (gauges["sessions"], gauges["connections"])) == want:
            return want
        if time.monotonic() > deadline:
            return got
        gc.collect()
        await asyncio.sleep(0.02)


def test_regression_async_clients_dropped_unclosed_end_their_sessions_and_connections(
    daemon_factory,
):
    """An AsyncClient dropped unclosed while its loop runs is collected, and its session and
    connection end, as a ``Client``'s do. Its session's watcher task held the client (its
    bound method), so each such client lived on until the loop ended: its session open in
    the daemon, and its connection (each client holds one of its own)."""
    checks = {"kvtier.daemon.connections.CHECK_INTERVAL_S": CONNECTIONS_CHECK_S}
    daemon = daemon_factory(entry=entry_setting(checks))
    dropped = ASYNC_DROPPED + 1, ASYNC_DROPPED + 1  # with the observer's

    async def main(observer: Client) -> tuple[tuple[int, int], ...]:
        clients = [AsyncClient(daemon.address) for _ in range(ASYNC_DROPPED)]
        for client in clients:
            assert (await client.lookup([bytes(32)])).prefix_len == 0
        held = await sessions_and_connections(observer, dropped)
        del clients, client
        left = await sessions_and_connections(observer, (1, 1))
        async with AsyncClient(daemon.address) as again:
            assert (await again.lookup([bytes(32)])).prefix_len == 0
        return held, left

    with daemon.client() as observer:
        assert asyncio.run(main(observer)) == (dropped, (1, 1))


def test_an_async_client_held_over_a_restart_opens_a_session_again_and_ends_it_dropped(
    daemon_factory, caplog
):
    """Its session's watcher holds the client weakly: a client still held is told that the
    restart ended its session (it forgets it, and says so), its next call opens another,
    and dropped, the client ends that one (its finalizer holds the new session's call, not
    the ended one's) and closes its connection."""
    caplog.set_level(logging.WARNING, logger="kvtier.client")
    checks = {"kvtier.daemon.connections.CHECK_INTERVAL_S": CONNECTIONS_CHECK_S}
    daemon = daemon_factory(entry=entry_setting(checks))

    async def main() -> tuple[tuple[int, int], tuple[int, int]]:
        client = AsyncClient(daemon.address)
        first = await client.session()
        await asyncio.to_thread(daemon.restart)
        ended = f"session {first[:8]} ended"
        deadline = time.monotonic() + 30
        while ended not in caplog.text and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert ended in caplog.text
        assert (await client.lookup([bytes(32)])).prefix_len == 0
        assert (second := await client.session()) != first
        with daemon.client() as observer:
            held = await sessions_and_connections(observer, (2, 2))
            del client
            left = await sessions_and_connections(observer, (1, 1))
        assert f"session {second[:8]} ended" not in caplog.text  # collected: nothing to tell
        return held, left

    assert asyncio.run(main()) == ((2, 2), (1, 1))
