"""A pinning Lookup whose answer reaches the client after the caller's time ran out releases
its lease.

The daemon pins as it answers, and the lease id is only in the answer. It releases the lease
of a Lookup whose deadline passed before its step ran, but an answer that leaves in time can
still come after the client's deadline: on its way, or waiting for a busy client's thread.
gRPC then dropped it, and the blocks stayed pinned until the lease expired. Seen by a hostile
client's pinning Lookups of 5-50 ms timeouts on two busy cores: 11 leases of one blocking
client and 54 of one AsyncClient held all 4,096 blocks for their 600 s lease. The tests here
put the delay on the wire: a proxy hands the daemon's bytes on late.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client import AsyncClient, Client, DeadlineExceededError, PoolLayout, SharedMemoryPool
from kvtier.daemon.credentials import CRED_SUFFIX

# How late the daemon's bytes reach the client, and the Lookup's time: less than the delay,
# so that every answer comes after it.
DELAY_S = 0.3
LOOKUP_TIMEOUT_S = 0.1
LEASE_MS = 600_000


class LateProxy:
    """A Unix socket that passes each connection on to ``target``: the client's bytes at
    once, the daemon's ``DELAY_S`` late (in order). Its credential socket is the daemon's."""

    def __init__(self, target: str, path: Path) -> None:
        self.path = path
        self._target = target
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(16)
        os.symlink(target + CRED_SUFFIX, str(path) + CRED_SUFFIX)
        self._socks: list[socket.socket] = [self._listener]
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
            threading.Thread(target=self._pipe, args=(near, far, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(far, near, DELAY_S), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(1 << 16):
                due = time.monotonic() + delay_s
                while (left := due - time.monotonic()) > 0:
                    time.sleep(left)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for s in self._socks:
            s.close()


@pytest.fixture
def late(daemon: Any) -> Iterator[str]:
    """The address of a ``LateProxy`` in front of ``daemon``."""
    folder = Path(daemon.socket).parent
    proxy = LateProxy(daemon.socket, folder / "late.sock")
    try:
        yield f"unix:{proxy.path}"
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


def _settled_pins(daemon: Any) -> float:
    """The daemon's pinned blocks once the answer has come late and its Release arrived."""
    with daemon.client() as admin:
        deadline = time.monotonic() + 10 * DELAY_S + 5
        while (pinned := admin.stats().gauges["blocks_pinned"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return pinned  # type: ignore[no-any-return]


def test_regression_a_pinning_lookup_answered_after_its_deadline_kept_its_pins(daemon, late):
    keys = _stored(daemon)
    with Client(late, timeout_s=10) as client:
        assert client.lookup(keys[:1]).prefix_len == 1  # the session, opened in time
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.lookup(keys, pin=True, lease_ms=LEASE_MS, timeout_s=LOOKUP_TIMEOUT_S)
        assert time.monotonic() - started < DELAY_S  # the caller's time, not the answer's
        # The call runs on in its slot of max_calls_open, until its answer comes.
        assert client.call_slots.held == 1
        assert _settled_pins(daemon) == 0
        assert client.call_slots.held == 0


def test_regression_an_async_pinning_lookup_answered_after_its_deadline_kept_its_pins(daemon, late):
    keys = _stored(daemon)

    async def main() -> None:
        async with AsyncClient(late, timeout_s=10) as client:
            assert (await client.lookup(keys[:1])).prefix_len == 1
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                await client.lookup(keys, pin=True, lease_ms=LEASE_MS, timeout_s=LOOKUP_TIMEOUT_S)
            assert time.monotonic() - started < DELAY_S
            assert await asyncio.to_thread(_settled_pins, daemon) == 0

    asyncio.run(main())
