from __future__ import annotations

import array
import asyncio
import fcntl
import os
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator

import pytest

from kvtier.daemon.credentials import (
    MAX_FDS_PER_REQUEST,
    CredentialServer,
    FdCloser,
    TicketBook,
    TicketKind,
    is_memory_backed,
)
from kvtier.daemon.errors import ResourceExhausted, Unauthenticated
from kvtier.daemon.sessions import PeerCred
from kvtier.daemon.unixsock import SocketAccess

ALICE = PeerCred(pid=10, uid=1000, gid=1000)
BOB = PeerCred(pid=20, uid=1001, gid=1001)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def test_a_ticket_is_good_once_for_its_kind_and_carries_its_peer():
    book = TicketBook(FdCloser())
    secret = book.issue(TicketKind.SESSION, ALICE)
    assert len(secret) == 32 and len(book) == 1
    assert book.redeem(secret, TicketKind.SESSION).peer == ALICE
    with pytest.raises(Unauthenticated, match="already used"):
        book.redeem(secret, TicketKind.SESSION)
    other = book.issue(TicketKind.SESSION, ALICE)
    with pytest.raises(Unauthenticated, match="cannot be used"):
        book.redeem(other, TicketKind.POOL)
    with pytest.raises(Unauthenticated):  # spent by the wrong use
        book.redeem(other, TicketKind.SESSION)
    for guess in (b"", b"x", os.urandom(32), secret[:31]):
        with pytest.raises(Unauthenticated):
            book.redeem(guess, TicketKind.SESSION)
    assert len(book) == 0


def test_tickets_expire_and_expiry_closes_their_memory():
    clock = Clock()
    book = TicketBook(FdCloser(), ttl_s=10.0, clock=clock)
    fd = os.memfd_create("t")
    secret = book.issue(TicketKind.POOL, ALICE, fd)
    clock.now = 9.9
    assert book.expire() == 0 and _open(fd)
    clock.now = 10.0
    assert book.expire() == 1 and not _open(fd)
    with pytest.raises(Unauthenticated):
        book.redeem(secret, TicketKind.POOL)


def test_a_redeemed_pool_ticket_hands_its_fd_to_the_caller():
    book = TicketBook(FdCloser())
    fd = os.memfd_create("t")
    ticket = book.redeem(book.issue(TicketKind.POOL, ALICE, fd), TicketKind.POOL)
    assert ticket.fd == fd and _open(fd)
    book.close()
    assert _open(fd)
    os.close(fd)


def test_a_pool_ticket_given_back_is_good_once_more_until_it_expires_with_its_fd():
    """``give_back`` (a registration whose session a reload ended, see service.py): the
    ticket redeems again, once, and the book owns its fd again: expiry or the book's close
    closes it, and only once."""
    clock = Clock()
    book = TicketBook(FdCloser(), ttl_s=10.0, clock=clock)
    fd = os.memfd_create("t")
    secret = book.issue(TicketKind.POOL, ALICE, fd)
    book.give_back(secret, book.redeem(secret, TicketKind.POOL))
    assert len(book) == 1 and _open(fd)
    again = book.redeem(secret, TicketKind.POOL)
    assert again.fd == fd and again.peer == ALICE
    with pytest.raises(Unauthenticated, match="already used"):
        book.redeem(secret, TicketKind.POOL)

    book.give_back(secret, again)
    clock.now = 9.9
    assert book.expire() == 0 and _open(fd)
    clock.now = 10.0  # its first expiry still holds
    assert book.expire() == 1 and not _open(fd)
    with pytest.raises(Unauthenticated):
        book.redeem(secret, TicketKind.POOL)

    # Given back at or after its expiry, or to a closed book: its fd is closed at once.
    for late in (True, False):
        fd = os.memfd_create("t")
        secret = book.issue(TicketKind.POOL, ALICE, fd)
        ticket = book.redeem(secret, TicketKind.POOL)
        if late:
            clock.now += 10.0
        else:
            book.close()
        book.give_back(secret, ticket)
        assert len(book) == 0 and not _open(fd) and ticket.fd == -1


def test_a_given_back_ticket_counts_to_its_uid_again():
    book = TicketBook(FdCloser(), max_per_uid=1)
    secret = book.issue(TicketKind.SESSION, ALICE)
    book.give_back(secret, book.redeem(secret, TicketKind.SESSION))
    with pytest.raises(ResourceExhausted):
        book.issue(TicketKind.SESSION, ALICE)
    book.redeem(secret, TicketKind.SESSION)
    book.issue(TicketKind.SESSION, ALICE)


def test_a_pool_ticket_spent_on_a_session_closes_its_fd():
    book = TicketBook(FdCloser())
    fd = os.memfd_create("t")
    with pytest.raises(Unauthenticated):
        book.redeem(book.issue(TicketKind.POOL, ALICE, fd), TicketKind.SESSION)
    assert not _open(fd)


def test_each_uid_holds_a_bounded_number_of_tickets():
    book = TicketBook(FdCloser(), max_per_uid=3)
    secrets = [book.issue(TicketKind.SESSION, ALICE) for _ in range(3)]
    with pytest.raises(ResourceExhausted):
        book.issue(TicketKind.SESSION, ALICE)
    book.issue(TicketKind.SESSION, BOB)  # another uid is not affected
    book.redeem(secrets[0], TicketKind.SESSION)
    book.issue(TicketKind.SESSION, ALICE)


def test_closing_the_book_closes_every_held_fd():
    book = TicketBook(FdCloser())
    fds = [os.memfd_create("t") for _ in range(3)]
    for fd in fds:
        book.issue(TicketKind.POOL, ALICE, fd)
    book.close()
    assert not any(_open(fd) for fd in fds) and len(book) == 0


def test_only_memory_files_count_as_memory():
    memfd = os.memfd_create("t")
    r, w = os.pipe()
    try:
        assert is_memory_backed(memfd)
        assert not is_memory_backed(r)
    finally:
        for fd in (memfd, r, w):
            os.close(fd)


def test_the_closer_closes_other_fds_on_its_thread():
    closer = FdCloser()
    r, w = os.pipe()
    closer.close(r)
    closer.close(w)
    for _ in range(200):
        if closer.pending == 0:
            break
        time.sleep(0.01)
    assert closer.pending == 0 and not _open(r) and not _open(w)


@pytest.fixture
async def cred_server() -> AsyncIterator[CredentialServer]:
    folder = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # short, as Unix socket paths must be
    closer = FdCloser()
    server = CredentialServer(
        os.path.join(folder, "d.sock.cred"), TicketBook(closer), closer, lambda e: "REFUSED"
    )
    server.start(SocketAccess(0o600, None))
    yield server
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


async def test_fds_sent_over_several_messages_of_one_request_are_refused_at_once(cred_server):
    """The fd limit is per request: a client that sends a few fds with each byte of an
    unfinished request line is refused as soon as it has sent more than the limit, its fds
    closed, instead of the daemon holding hundreds of them per connection until the I/O
    timeout."""
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.setblocking(False)
    memfds = [os.memfd_create("m") for _ in range(MAX_FDS_PER_REQUEST)]
    try:
        await loop.sock_connect(client, cred_server.path)
        for byte in b"KVT":
            client.sendmsg(
                [bytes([byte])],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", memfds))],
            )
        answer = await loop.sock_recv(client, 1024)
        assert answer.startswith(b"ERR REFUSED"), answer
        assert f"at most {MAX_FDS_PER_REQUEST} fds per request".encode() in answer
        assert cred_server.counters["credential_refused"] == 1
    finally:
        client.close()
        for fd in memfds:
            os.close(fd)
