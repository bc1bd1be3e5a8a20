"""A client in a child its process forked, against a real daemon.

gRPC's channels do not cross fork(). A child that used the parent's Client hung past every
timeout (gRPC's fork support off, as in this suite: conftest.py), or, with it on, failed
once and then acted in the parent's session, with the parent's leases and pools. The child's
calls are now refused with FailedPreconditionError before they touch gRPC, its close() and
unregister_pool_nowait() leave the parent's session and pool alone, and the parent goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Coroutine

from kvtier.client import (
    AsyncClient,
    Namespace,
    PoolLayout,
    SharedMemoryPool,
)
from kvtier.proto import kvtier_pb2 as pb

NS = Namespace(model="fork", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=4, block_tokens=4, chunk_bytes=64)
TOKENS = list(range(8))
CHILD_LIMIT_S = 30.0


def in_child(body: Callable[[], dict[str, str]]) -> dict[str, str]:
    """Run ``body`` in a forked child; what it returns, or a failure if it does not end."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, then out without Python's exit
        try:
            os.close(read)
            try:
                out = body()
            except BaseException as e:
                out = {"body": f"{type(e).__name__}: {e}"}
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + CHILD_LIMIT_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            raise AssertionError(f"the child hung past {CHILD_LIMIT_S}s")
        time.sleep(0.01)
    with os.fdopen(read, "rb") as f:
        return json.loads(f.read() or b"{}")  # type: ignore[no-any-return]


def outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except BaseException as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


async def outcome_of(call: Coroutine[object, None, object]) -> str:
    try:
        await call
    except BaseException as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_a_forked_child_is_refused_the_parents_client_and_the_parent_goes_on(daemon):
    with daemon.client(timeout_s=5) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        pool_id, session = pool.pool_id, client.session_id

        def child() -> dict[str, str]:
            return {
                "load": outcome(lambda: pool.load(TOKENS, [2, 3])),
                "lookup": outcome(lambda: client.lookup(pool.keys(TOKENS))),
                "health": outcome(client.health),
                "session": outcome(lambda: client.session_id),
                "fence": outcome(lambda: client.fence_pool(pool.binding)),
                "nowait": outcome(lambda: client.unregister_pool_nowait(pool.binding)),
                "close": outcome(client.close),
            }

        seen = in_child(child)
        refused = f"FailedPreconditionError: this Client was made in process {os.getpid()}"
        for call in ("load", "lookup", "health", "session", "fence"):
            assert seen[call].startswith(refused), (call, seen)
            assert "a client does not cross fork()" in seen[call]
        assert seen["nowait"] == "ok" and seen["close"] == "ok", seen
        # The parent's session and pool are as they were: nothing re-registered, nothing
        # unregistered, nothing closed.
        assert client.session_id == session
        assert pool.load(TOKENS, [2, 3]) == 8
        assert pool.pool_id == pool_id
        assert client.lookup(pool.keys(TOKENS)).prefix_len == 2


def test_regression_a_child_forked_before_an_interrupts_replacement_builds_no_channel(daemon):
    """A child forked after an interrupt marked the channel suspect and before the client
    replaced it (``Client.interrupted``) is refused ``call`` and ``health`` before the
    replacement. Before, each built a new channel in the child first (and handed the
    parent's to a closing thread that the child does not have), then refused."""
    with daemon.client(timeout_s=5) as client:
        session = client.session_id

        def child() -> dict[str, str]:
            client._held["suspect"] = True  # the mark, as the fork left it
            channel = client._channel
            return {
                "call": outcome(lambda: client.call("Stats", pb.StatsRequest(), 5)),
                "health": outcome(client.health),
                "replaced": str(client._channel is not channel),
            }

        seen = in_child(child)
        refused = f"FailedPreconditionError: this Client was made in process {os.getpid()}"
        assert seen["call"].startswith(refused), seen
        assert seen["health"].startswith(refused), seen
        assert seen["replaced"] == "False", seen
        assert client.session_id == session
        assert client.health()


def test_a_forked_child_is_refused_the_parents_async_client(daemon):
    async def main() -> None:
        async with AsyncClient(daemon.address, timeout_s=5) as client:
            with SharedMemoryPool.for_layout(LAYOUT) as shm:
                pool = await client.register_pool(shm, LAYOUT, NS)
                assert await pool.store(TOKENS, [0, 1]) == 8

                def child() -> dict[str, str]:
                    async def calls() -> dict[str, str]:
                        return {
                            "load": await outcome_of(pool.load(TOKENS, [2, 3])),
                            "health": await outcome_of(client.health()),
                            "close": await outcome_of(client.close()),
                        }

                    # A loop of the child's own: the parent's does not run in the child.
                    loop = asyncio.new_event_loop()
                    try:
                        return loop.run_until_complete(calls())
                    finally:
                        loop.close()

                seen = in_child(child)
                refused = (
                    f"FailedPreconditionError: this AsyncClient was made in process {os.getpid()}"
                )
                assert seen["load"].startswith(refused), seen
                assert seen["health"].startswith(refused), seen
                assert seen["close"] == "ok", seen
                assert await pool.load(TOKENS, [2, 3]) == 8

    asyncio.run(main())


def test_a_forked_child_closing_a_named_pool_leaves_the_parent_its_name(daemon):
    with daemon.client(timeout_s=5) as client:
        with SharedMemoryPool.for_layout(LAYOUT, backing="shm") as shm:
            assert shm.path is not None and os.path.exists(shm.path)

            def child() -> dict[str, str]:
                shm.close()  # as a with block the child leaves, or its exit's finalizers
                shm.unlink()
                return {"closed": str(shm.closed)}

            assert in_child(child) == {"closed": "True"}
            # The name is still there: the parent registers the pool by it.
            assert os.path.exists(shm.path)
            pool = client.register_pool(shm, LAYOUT, NS)
            assert pool.store(TOKENS, [0, 1]) == 8
        assert not os.path.exists(shm.path)  # the parent's close removes it
