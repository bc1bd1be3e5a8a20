"""A SharedMemoryPool used after ``close()``: its views and its registrations (the first, and
the one a daemon restart makes the client send again) raise InvalidArgumentError naming the
pool, not the mapping's ValueError, torch's RuntimeError or the daemon's NotFoundError."""

from __future__ import annotations

import asyncio
import dis
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType

import pytest
import torch

from kvtier.client import (
    AsyncClient,
    InvalidArgumentError,
    KvtierError,
    Namespace,
    PoolLayout,
    SharedMemoryPool,
)

NS = Namespace(model="closed-pools", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=8, block_tokens=4, chunk_bytes=64)
TOKENS = list(range(8))


def _memfd() -> SharedMemoryPool:
    return SharedMemoryPool(4096, name="views", backing="memfd")


def _named() -> SharedMemoryPool:
    return SharedMemoryPool(4096, name=f"kvtier-test-views-{os.getpid()}", backing="shm")


def _adopted() -> SharedMemoryPool:
    fd = os.memfd_create("adopted", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        return SharedMemoryPool.from_fd(fd, label="views")
    finally:
        os.close(fd)


VIEWS: dict[str, Callable[[SharedMemoryPool], object]] = {
    "array": lambda shm: shm.array(),
    "tensor": lambda shm: shm.tensor(),
    "tensor-typed": lambda shm: shm.tensor(torch.float32, (2, 8)),
}


@pytest.mark.parametrize("make", [_memfd, _named, _adopted], ids=["memfd", "shm", "from_fd"])
@pytest.mark.parametrize("view", list(VIEWS.values()), ids=list(VIEWS))
def test_regression_a_closed_pools_views_raise_an_error_naming_the_pool(make, view):
    """``shm.array()`` after ``close()`` raised numpy's "mmap closed or invalid" ValueError,
    ``shm.tensor()`` torch's RuntimeError ("could not retrieve buffer from object"): neither
    said what was closed, nor was a KvtierError."""
    shm = make()
    shm.close()
    with pytest.raises(InvalidArgumentError, match=r"^shm: the pool '.*' was closed$") as caught:
        view(shm)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, KvtierError)


def test_a_pool_closed_while_a_view_holds_its_mapping_gives_no_new_view():
    """``close()`` cannot unmap memory an earlier view still holds; the pool is closed all
    the same, so a new view is refused, and the old one keeps working."""
    shm = _memfd()
    old = shm.array()
    shm.close()
    with pytest.raises(InvalidArgumentError, match=r"^shm: the pool 'views' was closed$"):
        shm.array()
    old[0] = 7
    assert old[0] == 7


def test_an_unlinked_named_pool_still_gives_views():
    """``unlink()`` removes only the name: the memory stays mapped and usable."""
    shm = _named()
    try:
        shm.unlink()
        shm.array()[:4] = 1
        assert shm.tensor()[:4].tolist() == [1, 1, 1, 1]
    finally:
        shm.close()


@pytest.mark.parametrize("backing", ["memfd", "shm"])
def test_regression_a_pool_closed_after_registering_is_refused_when_registered_again(
    daemon_factory, backing
):
    """A pool registered, then closed, then used after the daemon restarted (the client
    registers it again on its next use): a memfd pool, its descriptor gone, was sent by a
    name it never had, and a named one by its removed name, and the daemon answered
    NotFoundError ("shared-memory object ... does not exist"). The client now refuses it
    before sending, naming the closed pool."""
    d = daemon_factory()
    with d.client() as client:
        shm = SharedMemoryPool.for_layout(LAYOUT, backing=backing)
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, range(2)) == 8
        shm.close()
        d.kill()
        d.start()
        with pytest.raises(InvalidArgumentError, match=rf"^shm: the pool '{shm.name}' was closed$"):
            pool.store(TOKENS, range(2))
        with SharedMemoryPool.for_layout(LAYOUT) as other:  # the client still works
            assert client.register_pool(other, LAYOUT, NS).load(TOKENS, range(2)) == 0


async def test_regression_an_async_clients_pool_closed_after_registering_is_refused_again(
    daemon_factory,
):
    """As above, for the asyncio client."""
    d = daemon_factory()
    async with AsyncClient(d.address) as client:
        shm = SharedMemoryPool.for_layout(LAYOUT)
        pool = await client.register_pool(shm, LAYOUT, NS)
        assert await pool.store(TOKENS, range(2)) == 8
        shm.close()
        d.kill()
        d.start()
        with pytest.raises(InvalidArgumentError, match=rf"^shm: the pool '{shm.name}' was closed$"):
            await pool.store(TOKENS, range(2))


def _close_during_the_hand_over(monkeypatch, shm: SharedMemoryPool, module) -> list[object]:
    """Make ``pool_ticket`` close ``shm`` on another thread before the descriptor it was
    given goes to the daemon. Returns, for each hand-over, the file the descriptor named
    when it was sent (``os.fstat``'s inode), or the OSError that ``os.fstat`` raised."""
    pool_ticket = module.credentials.pool_ticket
    sent: list[object] = []

    def closed_meanwhile(path: str, fd: int, timeout_s: float = 10.0) -> bytes:
        closer = threading.Thread(target=shm.close)
        closer.start()
        closer.join()
        try:
            sent.append(os.fstat(fd).st_ino)
        except OSError as e:
            sent.append(e)
        return pool_ticket(path, fd, timeout_s)

    monkeypatch.setattr(module.credentials, "pool_ticket", closed_meanwhile)
    return sent


def test_regression_a_pool_closed_while_its_descriptor_is_handed_over_is_refused(
    daemon, monkeypatch
):
    """``close()`` on one thread while another registered the pool closed the descriptor
    the registration was handing to the daemon: the hand-over failed with EBADF, reported
    as UnavailableError (the daemon's credential socket "did not answer"), which callers
    read as a daemon that is down; and where another file took the descriptor's number
    meanwhile, that file went to the daemon in the pool's place. The registration hands
    over a duplicate of its own, taken under the lock ``close()`` takes: the pool's memory
    file is what is sent, and the registration then fails with the closed pool's
    InvalidArgumentError."""
    from kvtier.client import sync

    shm = SharedMemoryPool.for_layout(LAYOUT)
    inode = os.fstat(shm.fd).st_ino
    sent = _close_during_the_hand_over(monkeypatch, shm, sync)
    with daemon.client() as client:
        with pytest.raises(InvalidArgumentError, match=rf"^shm: the pool '{shm.name}' was closed$"):
            client.register_pool(shm, LAYOUT, NS)
        assert sent == [inode]
        with SharedMemoryPool.for_layout(LAYOUT) as other:  # the client still works
            assert client.register_pool(other, LAYOUT, NS).store(TOKENS, range(2)) == 8


async def test_regression_an_async_pool_closed_while_its_descriptor_is_handed_over_is_refused(
    daemon, monkeypatch
):
    """As above, for the asyncio client."""
    from kvtier.client import aio

    shm = SharedMemoryPool.for_layout(LAYOUT)
    inode = os.fstat(shm.fd).st_ino
    sent = _close_during_the_hand_over(monkeypatch, shm, aio)
    async with AsyncClient(daemon.address) as client:
        with pytest.raises(InvalidArgumentError, match=rf"^shm: the pool '{shm.name}' was closed$"):
            await client.register_pool(shm, LAYOUT, NS)
        assert sent == [inode]


async def test_regression_a_cancelled_async_registration_closed_the_descriptor_still_handed_over(
    daemon, monkeypatch
):
    """The asyncio client hands its duplicate of the pool's descriptor to the daemon on a
    worker thread, which a cancelled ``register_pool`` (``asyncio.wait_for``'s timeout)
    does not stop; the coroutine closed the duplicate as the cancellation left its ``with``
    block, so the thread sent a closed descriptor (EBADF) or, where another file took its
    number meanwhile, that file to the daemon. The thread that hands the descriptor over
    owns it and closes it after the exchange."""
    from kvtier.client import aio

    pool_ticket = aio.credentials.pool_ticket
    entered, go_on = threading.Event(), threading.Event()
    sent: list[object] = []

    def held(path: str, fd: int, timeout_s: float = 10.0) -> bytes:
        entered.set()
        assert go_on.wait(60)
        try:
            sent.append(os.fstat(fd).st_ino)
        except OSError as e:
            sent.append(e)
        return pool_ticket(path, fd, timeout_s)

    monkeypatch.setattr(aio.credentials, "pool_ticket", held)
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        inode = os.fstat(shm.fd).st_ino
        async with AsyncClient(daemon.address) as client:
            registering = asyncio.create_task(client.register_pool(shm, LAYOUT, NS))
            while not entered.is_set():
                await asyncio.sleep(0.001)
            registering.cancel()
            with pytest.raises(asyncio.CancelledError):
                await registering
            go_on.set()
            while not sent:
                await asyncio.sleep(0.001)
            assert sent == [inode]


def _memfd_descriptors(shm: SharedMemoryPool) -> list[int]:
    """This process's descriptors of ``shm``'s memory file, in the order listed."""
    inode = os.fstat(shm.fd).st_ino
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.fstat(int(name)).st_ino == inode:
                found.append(int(name))
        except OSError:  # the listing's own descriptor, closed since
            continue
    return found


def _interrupt_once_duplicated(frame: FrameType, event: str, arg: object) -> object:
    """A trace that raises a KeyboardInterrupt in ``SharedMemoryPool.descriptor`` after the
    first call that ends once its duplicate is taken (the lock's release): where a signal's
    handler raises, as a call returns (an opcode trace can raise at any instruction, a
    signal's handler only where the interpreter checks for one)."""
    if event != "call" or frame.f_code is not SharedMemoryPool.descriptor.__wrapped__.__code__:
        return None
    previous = [-1]

    def at_opcode(frame: FrameType, event: str, arg: object) -> object:
        frame.f_trace_opcodes = True
        if event != "opcode":
            return at_opcode
        if previous[0] == CALL and frame.f_locals.get("fd", -1) >= 0:
            sys.settrace(None)
            frame.f_trace_opcodes = False
            frame.f_trace = None  # once: the frame's cleanup runs untraced
            raise KeyboardInterrupt
        previous[0] = frame.f_code.co_code[frame.f_lasti]
        return at_opcode

    return at_opcode(frame, event, arg)


CALL = dis.opmap["CALL"]


def test_regression_a_descriptor_interrupted_once_duplicated_leaked_the_duplicate():
    """A KeyboardInterrupt that came after ``descriptor`` took its duplicate of the memory
    file's descriptor, before the ``try`` whose ``finally`` closes it (as the lock it was
    taken under was let go), left the duplicate open: a descriptor, and the memory with it,
    for the process's life. The duplicate is closed however the block is left."""
    with SharedMemoryPool(4096, name="interrupted", backing="memfd") as shm:
        held = _memfd_descriptors(shm)  # the pool's, and its mapping's (mmap keeps one)
        sys.settrace(_interrupt_once_duplicated)
        try:
            with pytest.raises(KeyboardInterrupt), shm.descriptor():
                pytest.fail("the interrupt comes before the block")
        finally:
            sys.settrace(None)
        assert _memfd_descriptors(shm) == held
        with shm.descriptor() as fd:  # the pool still hands its memory over
            assert sorted(_memfd_descriptors(shm)) == sorted([*held, fd])
        assert _memfd_descriptors(shm) == held
