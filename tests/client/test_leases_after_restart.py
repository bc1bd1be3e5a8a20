"""A Release once the lease's session has ended opens no session to send it.

A lease lives in the session that took it, and the daemon drops it with that session (a
restart, a reload of the tenants). A Release sent after that (the vLLM connector's scheduler
side releases a hit's lease once its workers report the load done) opened a new session for
the Release, and sent it again there, to be answered NotFound: a credential ticket, an
OpenSession and the Release, each bounded by the client's timeout, on the releasing thread.
"""

from __future__ import annotations

import asyncio

import pytest

from kvtier.client import AsyncClient, Namespace, NotFoundError, PoolLayout, SharedMemoryPool

NS = Namespace(model="leases-after-restart", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=4, block_tokens=4, chunk_bytes=64)
TOKENS = list(range(8))


def test_regression_a_release_after_a_restart_opened_a_session_to_send_it(daemon):
    with daemon.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        lease = client.lookup(pool.binding.keys(TOKENS), pin=True).lease_id
        assert lease
        daemon.kill()
        daemon.start()
        with pytest.raises(NotFoundError, match="session"):
            client.release(lease)
        with daemon.client() as watcher:
            assert watcher.stats().gauges["sessions"] == 1  # the watcher's own
        # The next call opens a session as before.
        assert client.lookup(pool.binding.keys(TOKENS)).prefix_len == 0


def test_regression_an_async_release_after_a_restart_opened_a_session_to_send_it(daemon):
    async def main() -> None:
        async with AsyncClient(daemon.address) as client:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                pool = await client.register_pool(shm, LAYOUT, NS)
                assert await pool.store(TOKENS, [0, 1]) == 8
                keys = pool.binding.keys(TOKENS)
                lease = (await client.lookup(keys, pin=True)).lease_id
                assert lease
                await asyncio.to_thread(daemon.kill)
                await asyncio.to_thread(daemon.start)
                with pytest.raises(NotFoundError, match="session"):
                    await client.release(lease)
                async with AsyncClient(daemon.address) as watcher:
                    assert (await watcher.stats()).gauges["sessions"] == 1
                assert (await client.lookup(keys)).prefix_len == 0

    asyncio.run(main())
