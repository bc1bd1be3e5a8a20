"""Memory ownership through peer credentials (issue 9, item 2; item 3's "every RPC but health
needs a session").

The daemon learns who a client is from SO_PEERCRED on its credential socket, binds each
session to it, and maps memory only if it is a regular, memory-backed file owned by the
session's uid (or shared with it by config), or a memfd the client handed over itself.
Tests act as uid 65534 through a forked child (tests/peers.py).
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import time
from collections.abc import Iterator

import grpc
import pytest
from harness import DaemonFactory, DaemonProcess, tenant_token, wait_no_pools
from peers import NOBODY, NOGROUP, require_root, run_as

from kvtier.client import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    PoolLayout,
    SharedMemoryPool,
    UnauthenticatedError,
    UnavailableError,
)
from kvtier.client import credentials as cred
from kvtier.client.types import layout_to_pb
from kvtier.daemon.credentials import MAX_CONNECTIONS
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

LAYOUT = PoolLayout.staging(num_layers=1, num_pages=4, block_tokens=1, chunk_bytes=4096)
C = grpc.StatusCode


@pytest.fixture(scope="module")
def shared_group_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon whose sockets admit group nogroup, in a folder others may traverse; one for
    the module (its tests register pools and open sessions, and check only their own)."""
    require_root()
    factory = DaemonFactory(tmp_path_factory.mktemp("group-daemon"))
    os.chmod(factory._sockdir, 0o711)
    yield factory(f"server.socket_group={NOGROUP}")
    factory.close()


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's daemon of the default config, shared by the tests of tickets and memory
    checks, each starting with no pool of another test registered (one checks the count)."""
    wait_no_pools(shared_daemon)
    return shared_daemon


def _path(d) -> str:
    return cred.cred_socket_path(d.address)


def _nobody_session_ticket(d) -> bytes:
    out = run_as(NOBODY, NOGROUP, lambda: cred.session_ticket(_path(d)).hex())
    assert isinstance(out, str), out
    return bytes.fromhex(out)


class Raw:
    """A raw stub and the sessions it opened (closed at the end)."""

    def __init__(self, d) -> None:
        self.channel = grpc.insecure_channel(d.address)
        self.stub = pb_grpc.KVTierStub(self.channel)
        self.calls: list = []

    def open(self, ticket: bytes) -> pb.SessionEvent:
        call = self.stub.OpenSession(
            pb.OpenSessionRequest(client_name="t", credential_ticket=ticket)
        )
        self.calls.append(call)
        return next(call)

    def register(self, session: str, **region) -> pb.RegisterPoolResponse:
        return self.stub.RegisterPool(
            pb.RegisterPoolRequest(session_id=session, layout=layout_to_pb(LAYOUT), **region)
        )

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self.channel.close()


@pytest.fixture
def raw_factory():
    made: list[Raw] = []

    def make(d) -> Raw:
        made.append(Raw(d))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _code(fn, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value.code(), info.value.details()


def test_a_session_is_bound_to_the_credentials_of_its_ticket(daemon_factory, raw_factory):
    require_root()
    os.chmod(daemon_factory._sockdir, 0o711)
    d = daemon_factory(
        f"server.socket_group={NOGROUP}",
        f"tenants=[{{name: alice, uids: [0]}}, {{name: bob, uids: [{NOBODY}]}}]",
    )
    raw = raw_factory(d)
    first = raw.open(cred.session_ticket(_path(d)))
    assert (first.tenant, first.admin) == ("alice", True)  # root is an admin
    first = raw.open(_nobody_session_ticket(d))
    assert (first.tenant, first.admin) == ("bob", False)


def test_without_tenants_every_local_peer_is_the_default_tenant(shared_group_daemon, raw_factory):
    d = shared_group_daemon
    raw = raw_factory(d)
    assert raw.open(cred.session_ticket(_path(d))).tenant == "default"
    assert raw.open(_nobody_session_ticket(d)).tenant == "default"


def test_a_session_on_the_unix_socket_needs_a_valid_unused_ticket(daemon, raw_factory):
    raw = raw_factory(daemon)
    code, details = _code(raw.open, b"")
    assert code == C.UNAUTHENTICATED and ".cred" in details
    ticket = cred.session_ticket(_path(daemon))
    raw.open(ticket)
    assert _code(raw.open, ticket)[0] == C.UNAUTHENTICATED  # good once
    assert _code(raw.open, os.urandom(32))[0] == C.UNAUTHENTICATED
    assert _code(raw.open, b"x" * 5000)[0] == C.UNAUTHENTICATED


def test_every_rpc_but_health_needs_a_session(daemon, raw_factory):
    stub = raw_factory(daemon).stub
    key = [bytes(32)]
    for method, request in [
        (stub.Lookup, pb.LookupRequest(keys=key)),
        (stub.Prefetch, pb.PrefetchRequest(keys=key)),
        (stub.Delete, pb.DeleteRequest(keys=key)),
        (stub.Stats, pb.StatsRequest()),
        (stub.Release, pb.ReleaseRequest(lease_id=1)),
        (stub.Put, pb.PutRequest(pool_id=1, keys=key, pages=[0])),
        (stub.Get, pb.GetRequest(pool_id=1, keys=key, pages=[0])),
        (stub.RegisterPool, pb.RegisterPoolRequest(shm=pb.ShmRegion(name="x", size_bytes=1))),
        (stub.UnregisterPool, pb.UnregisterPoolRequest(pool_id=1)),
    ]:
        code, details = _code(method, request)
        assert code == C.NOT_FOUND and "needs a session" in details, (method, details)
    with daemon.client() as client:
        assert client.health()


def _make_shm(name: str, mode: int, fill: int) -> str:
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    os.ftruncate(fd, LAYOUT.extent_bytes)
    os.pwrite(fd, bytes([fill]) * LAYOUT.extent_bytes, 0)
    os.close(fd)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o666])
def test_another_users_shared_memory_is_refused(shared_group_daemon, raw_factory, mode):
    """The issue's report: uid 65534 registered root's private object by name."""
    d = shared_group_daemon
    raw = raw_factory(d)
    name = f"kvtier-test-root-{os.getpid()}-{mode:o}"
    path = _make_shm(name, mode, 0x5A)
    try:
        session = raw.open(_nobody_session_ticket(d)).session_id
        code, details = _code(
            raw.register, session, shm=pb.ShmRegion(name=name, size_bytes=LAYOUT.extent_bytes)
        )
        assert code == C.PERMISSION_DENIED and "belongs to uid 0" in details
        # Its owner may.
        own = raw.open(cred.session_ticket(_path(d))).session_id
        raw.register(own, shm=pb.ShmRegion(name=name, size_bytes=LAYOUT.extent_bytes))
    finally:
        os.unlink(path)


def test_a_users_own_shared_memory_registers_and_works(shared_group_daemon, raw_factory):
    d = shared_group_daemon
    raw = raw_factory(d)
    name = f"kvtier-test-nobody-{os.getpid()}"
    path = os.path.join("/dev/shm", name)
    made = run_as(NOBODY, NOGROUP, lambda: _make_shm(name, 0o600, 0x33))
    assert made == path, made
    try:
        session = raw.open(_nobody_session_ticket(d)).session_id
        pool = raw.register(session, shm=pb.ShmRegion(name=name, size_bytes=LAYOUT.extent_bytes))
        key = [bytes(range(32))]
        raw.stub.Put(pb.PutRequest(session_id=session, pool_id=pool.pool_id, keys=key, pages=[0]))
        got = raw.stub.Get(
            pb.GetRequest(session_id=session, pool_id=pool.pool_id, keys=key, pages=[1])
        )
        assert got.prefix_len == 1
    finally:
        os.unlink(path)


def test_server_shm_share_grants_an_owners_objects(daemon_factory, raw_factory):
    require_root()
    os.chmod(daemon_factory._sockdir, 0o711)
    d = daemon_factory(f"server.socket_group={NOGROUP}", f"server.shm_share={NOBODY}=0")
    raw = raw_factory(d)
    name = f"kvtier-test-shared-{os.getpid()}"
    path = _make_shm(name, 0o600, 1)
    try:
        session = raw.open(_nobody_session_ticket(d)).session_id
        raw.register(session, shm=pb.ShmRegion(name=name, size_bytes=LAYOUT.extent_bytes))
    finally:
        os.unlink(path)


def test_links_fifos_and_folders_are_refused(daemon, raw_factory):
    raw = raw_factory(daemon)
    session = raw.open(cred.session_ticket(_path(daemon))).session_id
    tag = f"kvtier-test-{os.getpid()}"
    target = _make_shm(f"{tag}-target", 0o600, 0)
    link, fifo, folder = (f"/dev/shm/{tag}-{x}" for x in ("link", "fifo", "dir"))
    os.symlink(target, link)
    os.mkfifo(fifo, 0o600)
    os.mkdir(folder)
    try:
        for path in (link, fifo, folder):
            started = time.monotonic()
            code, details = _code(
                raw.register,
                session,
                shm=pb.ShmRegion(name=os.path.basename(path), size_bytes=LAYOUT.extent_bytes),
            )
            assert code == C.INVALID_ARGUMENT, (path, details)
            assert time.monotonic() - started < 5  # a FIFO never blocks the daemon
    finally:
        for path in (link, fifo, target):
            os.unlink(path)
        os.rmdir(folder)


def test_memory_handed_over_by_another_uid_is_refused_to_this_session(
    shared_group_daemon, raw_factory
):
    d = shared_group_daemon
    raw = raw_factory(d)

    def hand_over() -> str:
        fd = os.memfd_create("kvtier-nobody", os.MFD_CLOEXEC)
        os.posix_fallocate(fd, 0, LAYOUT.extent_bytes)
        return cred.pool_ticket(_path(d), fd).hex()

    tickets = [bytes.fromhex(run_as(NOBODY, NOGROUP, hand_over)) for _ in range(2)]
    root_session = raw.open(cred.session_ticket(_path(d))).session_id
    region = pb.FdRegion(ticket=tickets[0], size_bytes=LAYOUT.extent_bytes)
    code, details = _code(raw.register, root_session, fd=region)
    assert code == C.PERMISSION_DENIED and "uid" in details
    # Its own uid's session may use it; the child that made it is gone by now.
    nobody_session = raw.open(_nobody_session_ticket(d)).session_id
    region = pb.FdRegion(ticket=tickets[1], size_bytes=LAYOUT.extent_bytes)
    pool = raw.register(nobody_session, fd=region)
    assert pool.pool_id and not pool.sealed


def test_tickets_are_for_one_kind_only(daemon, raw_factory):
    raw = raw_factory(daemon)
    path = _path(daemon)
    session = raw.open(cred.session_ticket(path)).session_id
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool_ticket = cred.pool_ticket(path, shm.fd)
        assert _code(raw.open, pool_ticket)[0] == C.UNAUTHENTICATED
        region = pb.FdRegion(ticket=cred.session_ticket(path), size_bytes=LAYOUT.extent_bytes)
        assert _code(raw.register, session, fd=region)[0] == C.UNAUTHENTICATED


def test_only_writable_memory_files_are_taken(daemon):
    path = _path(daemon)
    r, w = os.pipe()
    a, b = socket.socketpair()
    memfd = os.memfd_create("kvtier-ro")
    os.ftruncate(memfd, 4096)
    readonly = os.open(f"/proc/self/fd/{memfd}", os.O_RDONLY)
    try:
        for fd, words in [(r, "not memory"), (a.fileno(), "not memory"), (readonly, "writing")]:
            with pytest.raises(InvalidArgumentError, match=words):
                cred.pool_ticket(path, fd)
    finally:
        for fd in (r, w, memfd, readonly):
            os.close(fd)
        a.close()
        b.close()


# F_SEAL_FUTURE_WRITE (Linux 5.1), which Python's fcntl does not name.
F_SEAL_FUTURE_WRITE = 0x10


@pytest.mark.parametrize("seal", [fcntl.F_SEAL_WRITE, F_SEAL_FUTURE_WRITE])
def test_regression_a_memfd_sealed_against_writing_was_refused_as_operation_not_permitted(
    daemon, seal
):
    """A memfd sealed against writing cannot be mapped for the daemon's writes: it got a
    ticket, and its RegisterPool failed on the mapping with "cannot map the memory file:
    [Errno 1] Operation not permitted". Refused on the credential socket now, saying why;
    a seal added after the ticket is refused, saying so, before anything is mapped."""
    path = _path(daemon)
    memfd = os.memfd_create("kvtier-sealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(memfd, LAYOUT.extent_bytes)
        os.posix_fallocate(memfd, 0, LAYOUT.extent_bytes)
        ticket = cred.pool_ticket(path, memfd)  # writable still: a ticket
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, seal)
        with pytest.raises(InvalidArgumentError, match="sealed against writing"):
            cred.pool_ticket(path, memfd)
        with daemon.client() as client:
            request = pb.RegisterPoolRequest(
                session_id=client.session_id,
                fd=pb.FdRegion(ticket=ticket, size_bytes=LAYOUT.extent_bytes),
                layout=layout_to_pb(LAYOUT),
            )
            code, details = _code(client.stub.RegisterPool, request, timeout=10)
            assert code == C.INVALID_ARGUMENT and "sealed against writing" in details, details
            check = client.check()
            assert check.problems == [] and check.pools == 0
    finally:
        os.close(memfd)


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


@pytest.mark.slow  # waits out silent clients, ~2 s: `make test-slow`
def test_the_credential_socket_survives_silent_and_hostile_clients(daemon_factory):
    daemon = daemon_factory()  # its own: the count of tickets taken and unused is its own
    path = _path(daemon)
    silent = [_connect(path) for _ in range(20)]
    started = time.monotonic()
    assert len(cred.session_ticket(path)) == 32  # not stuck behind the silent ones
    assert time.monotonic() - started < 1.5

    def ask(payload: bytes, fds: list[int] | None = None) -> bytes:
        with _connect(path) as s:
            if fds:
                s.sendmsg(
                    [payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
            else:
                s.sendall(payload)
            return s.recv(1024)

    assert ask(b"GET / HTTP/1.0\n").startswith(b"ERR INVALID_ARGUMENT")
    assert ask(b"KVTIER-CRED/1 " + b"A" * 500).startswith(b"ERR INVALID_ARGUMENT")
    assert ask(b"KVTIER-CRED/1 SESSION\n", [0]).startswith(b"ERR INVALID_ARGUMENT")
    many = [os.memfd_create("m") for _ in range(8)]
    assert ask(b"KVTIER-CRED/1 POOL\n", many).startswith(b"ERR INVALID_ARGUMENT")
    for fd in many:
        os.close(fd)
    # A connection that says nothing is closed after the I/O timeout.
    assert silent[0].recv(16) == b""
    for s in silent:
        s.close()
    with daemon.client() as client:
        assert client.health()
        assert client.stats().gauges["credential_tickets"] == 1  # taken above, never used


def test_a_session_over_tcp_needs_a_token_and_registers_no_memory(daemon_factory, tmp_path):
    token, tenants = tenant_token(tmp_path, "remote")
    d = daemon_factory("server.tcp_address=127.0.0.1:0", tenants)
    tcp = d.tcp_address()
    from kvtier.client import Client

    with Client(tcp) as client, pytest.raises(UnauthenticatedError, match="token"):
        client.stats()
    with (
        Client(tcp, token="a-wrong-secret-of-some-length") as client,
        pytest.raises(UnauthenticatedError, match="not any tenant's"),
    ):
        client.stats()
    with (
        Client(tcp, token_file=str(token)) as client,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
    ):
        assert client.tenant == "remote"
        # Its own tenant's sessions (the daemon's gauges are an admin's).
        assert [(t.tenant, t.sessions) for t in client.stats().tenants] == [("remote", 1)]
        with pytest.raises(FailedPreconditionError, match="Unix socket"):
            client.register_pool(shm, LAYOUT)
    named = SharedMemoryPool.for_layout(LAYOUT, backing="shm")
    try:
        with (
            Client(tcp, token_file=str(token)) as client,
            pytest.raises(PermissionDeniedError),
        ):
            client.register_pool(named, LAYOUT)
    finally:
        named.close()
    with d.client() as client:
        assert client.health()


def test_credential_socket_answers_become_typed_errors():
    with pytest.raises(UnauthenticatedError, match="unknown"):
        cred._parse(b"ERR UNAUTHENTICATED the credential ticket is unknown\n", "x")
    with pytest.raises(UnavailableError):
        cred._parse(b"HTTP/1.1 400 Bad Request\n", "x")
    assert cred._parse(b"OK " + b"ab" * 32 + b"\n", "x") == bytes.fromhex("ab" * 32)


def test_regression_one_uid_holding_the_credential_socket_kept_every_other_uid_out(
    shared_group_daemon,
):
    """The credential socket stopped accepting while it held 64 connections, whoever held
    them: uid 65534 connecting in a loop and sending nothing (each connection held 2 s) left
    every other client's ticket request to fail on the full backlog (0 tickets of 100 for
    root). Now a connection beyond the limit ends the oldest of the uid that holds the most,
    with an answer saying so, and a burst of one uid's requests is still served whole."""
    path = _path(shared_group_daemon)
    silent = [_connect(path) for _ in range(MAX_CONNECTIONS)]
    try:
        assert len(_nobody_session_ticket(shared_group_daemon)) == 32
        assert silent[0].recv(200).startswith(b"ERR RESOURCE_EXHAUSTED the credential socket")
    finally:
        for s in silent:
            s.close()
    burst = [_connect(path) for _ in range(2 * MAX_CONNECTIONS // 3)]
    for s in burst:
        s.sendall(b"KVTIER-CRED/1 SESSION\n")
    assert all(s.recv(200).startswith(b"OK ") for s in burst)
    for s in burst:
        s.close()


def test_a_full_credential_backlog_is_waited_on_until_the_timeout(tmp_path):
    """A connect that finds the daemon's backlog full (EAGAIN on a Unix socket) is tried
    again until the request's timeout, as a blocking connect would wait; it failed at once."""
    path = str(tmp_path / "c.sock.cred")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(0)  # never accepts: the backlog fills
        queued = []
        try:
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                queued.append(s)
                s.connect(path)
        except BlockingIOError:
            pass
        with pytest.raises(DeadlineExceededError, match=r"within 0\.3s"):
            cred.session_ticket(path, timeout_s=0.3)
        for s in queued:
            s.close()


def test_a_user_the_socket_refuses_is_told_so_not_that_the_daemon_did_not_answer(daemon_factory):
    """connect() refused for want of permission was UnavailableError '... did not answer:
    Permission denied', which the CLI topped with 'Is the daemon running?'."""
    require_root()
    d = daemon_factory()  # server.socket_mode: owner and group only
    os.chmod(daemon_factory._sockdir, 0o711)
    got = run_as(NOBODY, NOGROUP, lambda: cred.session_ticket(_path(d)).hex())
    assert got["error"].startswith("PermissionDeniedError: "), got
    assert "refused this user: Permission denied" in got["error"]
    assert "server.socket_mode" in got["error"]


def test_a_tcp_address_of_port_0_announces_the_port_it_took(daemon_factory, tmp_path):
    """Port 0 takes a free port; the daemon announced '127.0.0.1:0', which no client can use.
    The start line is read by ``tcp_address`` (which reads a socket path with a space whole),
    and the daemon's Stats name the same address."""
    token, tenants = tenant_token(tmp_path, "remote")
    d = daemon_factory("server.tcp_address=127.0.0.1:0", tenants)
    tcp = d.tcp_address()
    host, port = tcp.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, tcp
    from kvtier.client import Client

    with Client(tcp, token_file=str(token)) as client:
        assert client.tenant == "remote"
        assert tcp in client.stats().addresses
