"""UnregisterPools left unanswered are sent again before the next registration.

A call whose deadline passes while the daemon is stopped (SIGSTOP) is never run once it
resumes. So a ``fence_pool`` (or ``unregister_pool_nowait``) that timed out left the pool
registered, its memory mapped, until the session's end, while the next store registered the
memory again: one more of ``server.max_pools_per_session`` each time, until every
registration, and with it every store and load of the pool, failed with
ResourceExhaustedError for the rest of the client's life. The client now sends such an
UnregisterPool again before it registers a pool, so the daemon holds one registration.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.client import AsyncClient, Namespace, PoolLayout, SharedMemoryPool

NS = Namespace(model="unanswered-unregistrations", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=4, block_tokens=4, chunk_bytes=64)
TOKENS = list(range(8))
ROUNDS = 4  # more than the daemon's pools per session below
PER_SESSION = "server.max_pools_per_session=2"


@contextmanager
def stopped(daemon) -> Iterator[None]:
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


def test_a_fence_that_timed_out_does_not_leave_its_pool_registered(daemon_factory):
    daemon = daemon_factory(PER_SESSION)
    with daemon.client(timeout_s=10) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        for _ in range(ROUNDS):
            with stopped(daemon):
                assert client.fence_pool(pool.binding, timeout_s=0.2) is False
            # Registers the memory again, after the fence's UnregisterPool.
            assert pool.load(TOKENS, [2, 3]) == 8
            assert client.stats().gauges["pools"] == 1
        assert client.check().problems == []


def test_an_unanswered_async_unregistration_does_not_leave_its_pool_registered(daemon_factory):
    daemon = daemon_factory(PER_SESSION)

    async def main() -> None:
        async with AsyncClient(daemon.address, timeout_s=10) as client:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                pool = await client.register_pool(shm, LAYOUT, NS)
                assert await pool.store(TOKENS, [0, 1]) == 8
                for _ in range(ROUNDS):
                    client.timeout_s = 0.2  # the UnregisterPool's deadline, past in the stop
                    with stopped(daemon):
                        client.unregister_pool_nowait(pool.binding)
                        while client._unanswered:  # its UnregisterPool timing out
                            await asyncio.sleep(0.01)
                    client.timeout_s = 10
                    assert await pool.load(TOKENS, [2, 3]) == 8
                    assert (await client.stats()).gauges["pools"] == 1

    asyncio.run(main())
