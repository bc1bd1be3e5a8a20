"""An AsyncClient and the event loops that use it, against a real daemon.

grpc.aio binds a channel to the event loop it is made on. The client made its channel at
construction, so one made outside any loop (at module level, before ``asyncio.run``: the
usual way to hand it to ``main``) failed every call with a RuntimeError about a future
attached to another loop, and one used from a second loop failed so too, or hung. It now
makes its channel on the loop of its first call, and refuses a call from any other loop
with FailedPreconditionError before touching gRPC; its own loop goes on serving.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtier.client import (
    AsyncClient,
    FailedPreconditionError,
    Namespace,
    PoolLayout,
    SharedMemoryPool,
    UnavailableError,
)
from kvtier.client.flows import PoolBinding

NS = Namespace(model="async-loops", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=4, block_tokens=4, chunk_bytes=64)
TOKENS = list(range(8))


def test_a_client_made_outside_any_loop_serves_the_loop_that_first_uses_it(daemon):
    client = AsyncClient(daemon.address)  # no loop runs here

    async def main() -> tuple[int, int, bool, int]:
        with SharedMemoryPool.for_layout(LAYOUT) as shm:
            pool = await client.register_pool(shm, LAYOUT, NS)
            shm.array()[:] = 7
            stored = await pool.store(TOKENS, [0, 1])
            loaded = await pool.load(TOKENS, [2, 3])
            healthy = await client.health()
            found = (await client.lookup(pool.keys(TOKENS))).prefix_len
            await client.close()
        return stored, loaded, healthy, found

    assert asyncio.run(main()) == (8, 8, True, 2)


def test_a_call_from_another_loop_is_refused_and_the_clients_loop_keeps_serving(daemon):
    own = asyncio.new_event_loop()
    try:
        client = own.run_until_complete(_made_and_used(daemon.address))
        key = NS.seed()

        async def elsewhere(shm: SharedMemoryPool) -> None:
            with pytest.raises(FailedPreconditionError, match="event loop") as caught:
                await client.lookup([key])
            assert "one client per event loop" in str(caught.value)
            with pytest.raises(FailedPreconditionError, match="event loop"):
                await client.health()
            with pytest.raises(FailedPreconditionError, match="event loop"):
                client.unregister_pool_nowait(PoolBinding(shm, LAYOUT, NS))

        with SharedMemoryPool.for_layout(LAYOUT) as shm:
            asyncio.run(elsewhere(shm))
        # From a thread's own loop too, while the client's loop is idle.
        errors: list[BaseException] = []

        def in_thread() -> None:
            try:
                asyncio.run(client.lookup([key]))
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join(30)
        assert len(errors) == 1 and isinstance(errors[0], FailedPreconditionError)
        # The client's own loop still has its session and its pool.
        assert own.run_until_complete(client.lookup([key])).prefix_len == 0
        assert own.run_until_complete(client.health()) is True
        own.run_until_complete(client.close())
    finally:
        own.close()


def test_a_client_whose_loop_has_closed_refuses_calls_and_closes_from_another(daemon):
    client = asyncio.run(_made_and_used(daemon.address))  # that loop is closed now

    async def after() -> None:
        with pytest.raises(FailedPreconditionError, match="event loop"):
            await client.stats()
        await client.close()  # no error: the client is closed, its loop gone
        await client.close()
        with pytest.raises(UnavailableError, match="the client was closed"):
            await client.lookup([NS.seed()])

    asyncio.run(after())


def test_close_from_another_loop_closes_the_client_on_its_own_running_loop(daemon):
    own = asyncio.new_event_loop()
    thread = threading.Thread(target=own.run_forever)
    thread.start()
    try:
        client = asyncio.run_coroutine_threadsafe(_made_and_used(daemon.address), own).result(30)
        asyncio.run(client.close())  # from this thread's loop: done on the client's
        with pytest.raises(UnavailableError, match="the client was closed"):
            asyncio.run_coroutine_threadsafe(client.health(), own).result(30)
    finally:
        own.call_soon_threadsafe(own.stop)
        thread.join(30)
        own.close()


async def _made_and_used(address: str) -> AsyncClient:
    client = AsyncClient(address)
    await client.lookup([NS.seed()])  # opens the session on this loop
    return client
