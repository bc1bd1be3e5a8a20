"""A pinning Lookup whose answer reaches the client after the caller's time ran out releases
its lease.

The daemon pins as it answers, and the lease id is only in the answer. It releases the lease
of a Lookup whose deadline passed before its step ran, but an answer that leaves in time can
still come after the client's deadline: on its way, or waiting for a busy client's thread.
gRPC then dropped it, and the blocks stayed pinned until the lease expired. Seen by a hostile
client's pinning Lookups of 5-50 ms timeouts on two busy cores: 11 leases of one blocking
client and 54 of one AsyncClient held all 4,096 blocks for their 600 s lease. The tests here
put the delay on the wire: a proxy holds the daemon's bytes until the caller's wait has ended
(no timed wait decides the outcome: the answer cannot come before the gate opens).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from races import wait_for

from kvtier.client import AsyncClient, Client, DeadlineExceededError, PoolLayout, SharedMemoryPool
from kvtier.client import aio as client_aio
from kvtier.client import sync as client_sync
from kvtier.daemon.credentials import CRED_SUFFIX

LOOKUP_TIMEOUT_S = 0.1
LEASE_MS = 600_000


class LateProxy:
    """A Unix socket that passes each connection on to ``target``: the client's bytes at
    once, the daemon's while ``gate`` is open (held in order while it is shut). Its
    credential socket is the daemon's."""

    def __init__(self, target: str, path: Path) -> None:
        self.path = path
        self.gate = threading.Event()
        self.gate.set()
        self._target = target
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(16)
        os.symlink(target + CRED_SUFFIX, str(path) + CRED_SUFFIX)
        self._socks: list[socket.socket] = [self._listener]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:  # closed
                return
            far = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            far.connect(self._target)
            self._socks += [near, far]
            threading.Thread(target=self._pipe, args=(near, far, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(far, near, self.gate), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, gate: threading.Event | None) -> None:
        try:
            while data := src.recv(1 << 16):
                while gate is not None and not gate.wait(0.05) and not self._closed.is_set():
                    pass
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        # A close alone leaves ``_accept``'s thread in accept() for good (Linux); a shutdown
        # of the listener wakes it (EINVAL).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        for s in self._socks:
            s.close()


# How long past the caller's time a pinning Lookup's call runs on in these tests. The
# client's ``ANSWER_GRACE_S`` (2 s) held the outcome to a timing: where the test took longer
# than that from the Lookup's send to the gate's opening (its polls each open a session, on
# a busy machine), gRPC's deadline passed first, the answer was dropped and its blocks stayed
# pinned (so a late answer never arrived, and the tests failed).
LONG_GRACE_S = 60.0


@pytest.fixture
def late(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[LateProxy]:
    """A ``LateProxy`` in front of ``daemon``; pinning Lookups run ``LONG_GRACE_S`` past
    their caller's time, so the gate opens before their gRPC deadline however long the test
    takes to open it."""
    monkeypatch.setattr(client_sync, "ANSWER_GRACE_S", LONG_GRACE_S)
    monkeypatch.setattr(client_aio, "ANSWER_GRACE_S", LONG_GRACE_S)
    folder = Path(daemon.socket).parent
    proxy = LateProxy(daemon.socket, folder / "late.sock")
    try:
        yield proxy
    finally:
        proxy.close()


def _stored(daemon: Any) -> list[bytes]:
    keys = [bytes([i]) * 32 for i in range(4)]
    with daemon.client() as client:
        layout = PoolLayout.staging(num_layers=1, num_pages=4, block_tokens=4, chunk_bytes=64)
        with SharedMemoryPool.for_layout(layout) as shm:
            pool = client.register_pool(shm, layout)
            assert client.put(pool.pool_id, keys, [0, 1, 2, 3]).stored == 4
    return keys


def _pins(daemon: Any) -> float:
    with daemon.client() as admin:
        return admin.stats().gauges["blocks_pinned"]  # type: ignore[no-any-return]


def test_regression_a_pinning_lookup_answered_after_its_deadline_kept_its_pins(daemon, late):
    keys = _stored(daemon)
    with Client(f"unix:{late.path}", timeout_s=10) as client:
        assert client.lookup(keys[:1]).prefix_len == 1  # the session, opened in time
        late.gate.clear()
        # The caller's wait ends at its time, with its answer held back.
        with pytest.raises(DeadlineExceededError):
            client.lookup(keys, pin=True, lease_ms=LEASE_MS, timeout_s=LOOKUP_TIMEOUT_S)
        # The call runs on in its slot of max_calls_open, until its answer comes.
        assert client.call_slots.held == 1
        wait_for(lambda: _pins(daemon) == 4)  # the daemon answered, pinning
        late.gate.set()
        wait_for(lambda: _pins(daemon) == 0)
        wait_for(lambda: client.call_slots.held == 0)


class _AsyncioTimeoutError(Exception):
    """asyncio.TimeoutError as Python 3.10 has it: not the builtin TimeoutError."""


def _as_on_python_3_10(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``asyncio.wait_for``'s timeout ``_AsyncioTimeoutError``, as Python 3.10's is."""
    wait_for_builtin = asyncio.wait_for

    async def wait_for_3_10(aw: Any, timeout: float | None) -> Any:
        try:
            return await wait_for_builtin(aw, timeout)
        except TimeoutError:
            raise _AsyncioTimeoutError from None

    monkeypatch.setattr(asyncio, "TimeoutError", _AsyncioTimeoutError)
    monkeypatch.setattr(asyncio, "wait_for", wait_for_3_10)


@pytest.mark.parametrize("python", ["3.11+", "3.10"])
def test_regression_an_async_pinning_lookup_answered_after_its_deadline_kept_its_pins(
    daemon, late, monkeypatch, python
):
    """On Python 3.10 the caller's time running out raised asyncio's own TimeoutError, which
    the client, catching the builtin one, let out untyped, the answer's lease not released."""
    keys = _stored(daemon)
    if python == "3.10":
        _as_on_python_3_10(monkeypatch)

    async def pins_reach(n: int) -> None:
        await asyncio.to_thread(wait_for, lambda: _pins(daemon) == n)

    async def main() -> None:
        async with AsyncClient(f"unix:{late.path}", timeout_s=10) as client:
            assert (await client.lookup(keys[:1])).prefix_len == 1
            late.gate.clear()
            with pytest.raises(DeadlineExceededError):
                await client.lookup(keys, pin=True, lease_ms=LEASE_MS, timeout_s=LOOKUP_TIMEOUT_S)
            await pins_reach(4)
            late.gate.set()
            await pins_reach(0)

    asyncio.run(main())


def test_regression_an_async_pinning_lookup_counted_the_session_opening_in_its_time(
    daemon, monkeypatch
):
    """README: a call's ``timeout_s`` bounds that call; opening a session first still takes up
    to the client's. An AsyncClient's pinning lookup counted the opening in its own time: one
    whose session took longer than it failed with DeadlineExceededError, its Lookup sent on
    regardless, though the blocking client's, and its own lookup without a pin, succeeded."""
    keys = _stored(daemon)
    open_session = AsyncClient._open_session
    lookup_timeout_s = 1.0  # the daemon answers well within it

    async def slow_open_session(self: AsyncClient) -> None:
        await asyncio.sleep(1.5 * lookup_timeout_s)  # past the lookup's time
        await open_session(self)

    monkeypatch.setattr(AsyncClient, "_open_session", slow_open_session)

    async def main() -> None:
        async with AsyncClient(daemon.address, timeout_s=10) as client:
            answer = await client.lookup(keys, pin=True, timeout_s=lookup_timeout_s)
            assert answer.prefix_len == 4 and answer.lease_id
            await client.release(answer.lease_id)

    asyncio.run(main())
