"""Who may connect: socket mode and group, their folder, and the systemd unit (issue 9,
item 6)."""

from __future__ import annotations

import asyncio
import configparser
import errno
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import DaemonProcess, held_port, tenant_token
from peers import NOBODY, NOGROUP, require_root, run_as

from kvtier.client import (
    Client,
    PermissionDeniedError,
    PoolLayout,
    SharedMemoryPool,
    UntrustedSocketError,
    wait_until_serving,
)
from kvtier.client import credentials as cred
from kvtier.daemon import preflight
from kvtier.daemon.config import load_config
from kvtier.daemon.unixsock import (
    BIND_SUFFIX,
    SocketAccess,
    SocketLock,
    bind_unix,
    lock_path,
    move_bound,
    prepare_socket_path,
    private_umask,
    remove_socket,
)

REPO = Path(__file__).resolve().parent.parent
USERS_GID = 100  # a group that is not the sockets' group


def _both(d) -> list[str]:
    return [d.socket, cred.cred_socket_path(d.address)]


def test_sockets_get_mode_and_group_even_under_umask_000(daemon_factory):
    old = os.umask(0)
    try:
        d = daemon_factory()
    finally:
        os.umask(old)
    for path in _both(d):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660, path
        assert st.st_gid == os.getegid()


def test_configured_mode_and_group_are_applied(daemon_factory):
    require_root()
    d = daemon_factory("server.socket_mode=0600", f"server.socket_group={NOGROUP}")
    for path in _both(d):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == NOGROUP
    # The lock beside them: their group, but private whatever their mode (a process that
    # may open it may flock it, and keep every daemon from starting there).
    st = os.stat(d.socket + ".lock")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == NOGROUP


def _connect(path: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
    return "connected"


def test_members_of_the_socket_group_connect_and_no_one_else(daemon_factory):
    """The systemd unit's arrangement: the folder is the daemon's group's, 0750; both
    sockets 0660 of that group (here nogroup stands in for kvtier)."""
    require_root()
    folder = daemon_factory._sockdir
    os.chown(folder, 0, NOGROUP)
    os.chmod(folder, 0o750)
    d = daemon_factory(f"server.socket_group={NOGROUP}")
    path = cred.cred_socket_path(d.address)

    assert run_as(NOBODY, NOGROUP, lambda: len(cred.session_ticket(path))) == 32
    assert run_as(NOBODY, USERS_GID, lambda: _connect(d.socket), groups=[NOGROUP]) == "connected"
    outsider = run_as(NOBODY, USERS_GID, lambda: _connect(d.socket))
    assert "PermissionError" in outsider["error"]
    # Even where the folder lets everyone through, the sockets themselves do not.
    os.chmod(folder, 0o751)
    for p in _both(d):
        assert "PermissionError" in run_as(NOBODY, USERS_GID, lambda p=p: _connect(p))["error"]


def _start(socket_path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.daemon",
            "--set",
            f"server.socket={socket_path}",
            "--set",
            "tiers.l1.capacity_bytes=64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_socket_folder_that_others_may_write_is_refused():
    folder = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    try:
        os.chmod(folder, 0o777)
        proc = _start(os.path.join(folder, "d.sock"))
        assert proc.returncode == 1
        assert "writable by other users" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert os.listdir(folder) == []
    finally:
        shutil.rmtree(folder)


def test_regression_a_socket_folder_of_another_user_was_taken(tmp_path):
    """Only the mode was checked, not the owner: in a folder that another user had made (say
    /tmp/kvtier, made before the daemon first started), the daemon bound its sockets, and
    that user could remove them and listen there himself, receiving the clients' requests
    and the memory files they hand the credential socket. The daemon now refuses it."""
    require_root()
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    os.chown(folder, NOBODY, NOGROUP)
    config = load_config(None, [f"server.socket={folder}/d.sock"])
    # The checks (kvtierd --check-config, and before a start) and the bind itself.
    problems = preflight.check(config, preflight.HostFacts(8 << 30, 16 << 30, None))
    assert [p.key for p in problems] == ["server.socket"]
    assert f"belongs to uid {NOBODY}" in str(problems[0])
    with pytest.raises(OSError, match=f"belongs to uid {NOBODY}"):
        prepare_socket_path(str(folder / "d.sock"), SocketAccess.from_config(config.server))
    assert os.listdir(folder) == []


# Listens on each path given, as whoever runs it, and answers every request as the daemon's
# credential socket would (a ticket of random bytes); on stdin's end it prints what it was
# sent, as JSON. It stops by itself after 60 s without a connection.
_LISTENER = r"""
import json, os, selectors, socket, sys
selector = selectors.DefaultSelector()
for path in sys.argv[1:]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    selector.register(listener, selectors.EVENT_READ)
selector.register(sys.stdin, selectors.EVENT_READ)
print("ready", flush=True)
seen = {"requests": 0, "fds": 0}
while events := selector.select(timeout=60):
    for key, _ in events:
        if key.fileobj is sys.stdin:
            print(json.dumps(seen), flush=True)
            sys.exit(0)
        conn, _ = key.fileobj.accept()
        try:
            conn.settimeout(5)
            data, ancillary, _, _ = conn.recvmsg(128, socket.CMSG_SPACE(16))
            seen["requests"] += bool(data)
            seen["fds"] += sum(len(payload) // 4 for _, _, payload in ancillary)
            conn.sendall(b"OK " + os.urandom(32).hex().encode() + b"\n")
        except OSError:
            pass
        finally:
            conn.close()
"""


class _Listener:
    """``_LISTENER`` run as uid/gid nobody on ``paths``."""

    def __init__(self, *paths: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LISTENER, *paths],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            user=NOBODY,
            group=NOGROUP,
            extra_groups=[],
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def seen(self) -> dict[str, int]:
        """What it was sent; it stops."""
        out, _ = self.proc.communicate(timeout=30)
        return json.loads(out)

    def __enter__(self) -> _Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def nobodys_folder():
    """A folder of uid nobody's (as one another user made under /tmp), reachable by all."""
    require_root()
    top = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    os.chmod(top, 0o755)
    folder = os.path.join(top, "theirs")
    os.mkdir(folder, 0o755)
    os.chown(folder, NOBODY, NOGROUP)
    yield folder
    shutil.rmtree(top)


def _refuses(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
    return False


# Runs kvtierd with every disk write run held while the file ``gate`` exists.
_ENTRY_HOLDING_L2_WRITES = """
import os, sys, time
from kvtier.daemon.entry import main
from kvtier.tiers.disk.io import BatchIO

gate = sys.argv.pop(1)
write_run = BatchIO._write_set_run

def held_write_run(self, ws, run):
    while os.path.exists(gate):
        time.sleep(0.002)
    return write_run(self, ws, run)

BatchIO._write_set_run = held_write_run
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_regression_a_daemon_still_stopping_removed_its_successors_socket(daemon_factory, tmp_path):
    """A daemon stops listening as it drains, then flushes L1 to L2 and only then exits. A
    daemon started in that time finds the path not listening and binds its own socket there;
    the old one's exit removed it, and the new daemon was unreachable. The old daemon's disk
    writes wait here until the new one serves: a flush slowed by L2's write rate (8 s) ended
    before a loaded machine had started the new daemon, and there was no overlap."""
    gate = tmp_path / "gate"
    old = daemon_factory(
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path / 'l2'}",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.file_bytes=64MiB",
        "tiers.l2.segment_bytes=4MiB",
        "tiers.l2.flush_timeout_s=60",
        entry=("-c", _ENTRY_HOLDING_L2_WRITES, str(gate)),
    )
    layout = PoolLayout.staging(
        num_layers=4, num_pages=8, block_tokens=16, chunk_bytes=(1 << 20) // 8, dtype="uint8"
    )
    with old.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout)
        assert client.put(pool.pool_id, [os.urandom(32) for _ in range(8)], range(8)).stored == 8
    assert old.proc is not None
    gate.touch()  # the flush at stop waits for it
    old.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not _refuses(old.socket):
        assert time.monotonic() < deadline, "the stopping daemon kept listening"
        time.sleep(0.01)
    new = DaemonProcess(tmp_path, old.socket, ["--set", "tiers.l1.capacity_bytes=64MiB"])
    try:
        new.start()
        assert old.running(), "the old daemon ended before the new one bound: no overlap"
        gate.unlink()
        assert old.proc.wait(60) == 0
        for path in _both(new):
            assert stat.S_ISSOCK(os.lstat(path).st_mode), path
        with new.client() as client:
            assert client.health()
    finally:
        gate.unlink(missing_ok=True)
        new.stop()


def test_regression_a_daemon_whose_socket_a_cleaner_removed_removed_its_successors_at_stop(
    daemon_factory, tmp_path
):
    """gRPC's server unlinks the Unix socket it bound, by the name it was given, when it
    stops. Where a cleaner of old files (or an operator) had removed a running daemon's
    sockets and lock file, and another daemon had started at the path, the first one's stop
    removed the second's live socket through that name, leaving it serving no one."""
    old = daemon_factory()
    for path in [*_both(old), lock_path(old.socket)]:
        os.unlink(path)
    new = DaemonProcess(tmp_path, old.socket, ["--set", "tiers.l1.capacity_bytes=64MiB"])
    try:
        new.start()
        assert old.stop() == 0
        for path in _both(new):
            assert stat.S_ISSOCK(os.lstat(path).st_mode), path
        with new.client() as client:
            assert client.health()
        assert "may hold another process's socket" in old.log()
        assert sorted(os.listdir(os.path.dirname(old.socket))) == sorted(
            os.path.basename(p) for p in [*_both(new), lock_path(new.socket)]
        )
    finally:
        new.stop()


def test_grpcs_stop_leaves_the_socket_path_to_whoever_holds_it(tmp_path):
    """gRPC unlinks the Unix socket it bound, by the name it bound, as its server stops
    (on a thread of its own, during the stop's grace). The daemon's socket is bound under a
    name of its own and then renamed to the path (``move_bound``), so the stop never removes
    what the path holds: here a successor's socket, bound at the path after the first's and
    its lock file were removed (on ext4 it often gets the inode number the removed one
    freed), stays there through the stop and after it, and no other name is left."""
    access = SocketAccess(mode=0o600, gid=None)
    path = str(tmp_path / "d.sock")
    old_lock = SocketLock.take(path, access)
    seen: list[bool] = []

    async def run() -> None:
        server = grpc.aio.server()
        with private_umask():
            server.add_insecure_port(f"unix:{path}{BIND_SUFFIX}")
        move_bound(path + BIND_SUFFIX, path)
        await server.start()
        for removed in (path, old_lock.path):  # a cleaner of old files
            os.unlink(removed)
        new_lock = SocketLock.take(path, access)
        new, successor = bind_unix(path, access)
        stopping = asyncio.ensure_future(server.stop(1.0))
        while not stopping.done():
            seen.append(_identity(path) == successor)
            await asyncio.sleep(0.002)
        await stopping
        seen.append(_identity(path) == successor)
        new.close()
        new_lock.release()

    asyncio.run(run())
    assert seen and all(seen)
    old_lock.release()
    assert os.listdir(tmp_path) == ["d.sock"]


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def test_regression_a_successors_socket_with_the_old_ones_inode_number_was_removed(tmp_path):
    """A stopping daemon removes its socket only while the path holds the one it bound, known
    by (device, inode). The successor removes the stale socket and binds its own, and a disk
    filesystem gives the new one the inode number just freed (ext4: 20 times in 20), so the
    old daemon's exit removed the new daemon's socket after all. A socket someone listens on
    is not removed now, whatever its identity (the second part holds on any filesystem)."""
    access = SocketAccess(mode=0o600, gid=None)
    path = str(tmp_path / "d.sock")
    old, identity = bind_unix(path, access)
    old.close()  # the old daemon stopped listening; it flushes before it exits
    prepare_socket_path(path, access)  # the new daemon removes the stale socket
    new, _ = bind_unix(path, access)
    try:
        remove_socket(path, identity)  # the old daemon exits
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        st = os.lstat(path)
        remove_socket(path, (st.st_dev, st.st_ino))  # the same identity, still listening
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        new.close()
    remove_socket(path, (st.st_dev, st.st_ino))  # stale and its own: removed
    assert not os.path.lexists(path)


def test_regression_a_stopping_daemon_removed_the_lock_file_of_another(tmp_path):
    """A daemon lets go of the socket lock by removing ``<socket>.lock`` by its name, then
    closing it. Where its file had been removed meanwhile (an operator or a cleaner of old
    files: a running daemon's lock file is as old as its start) and another daemon had taken
    a new one there, the stop removed that daemon's file, and a third start locked a new
    file beside the live holder. A stop removes the file only while it is the one it locked."""
    access = SocketAccess(mode=0o600, gid=None)
    path = str(tmp_path / "d.sock")
    old = SocketLock.take(path, access)
    os.unlink(old.path)
    new = SocketLock.take(path, access)  # the old daemon no longer listens: another starts
    try:
        old.release()
        assert os.path.exists(new.path)
        with pytest.raises(OSError) as refused:
            SocketLock.take(path, access)
        assert refused.value.errno == errno.EADDRINUSE
        assert f"(pid {os.getpid()}) serves {path}" in str(refused.value)
    finally:
        new.release()
    assert not os.path.lexists(new.path)


def test_regression_a_bind_that_found_the_path_taken_removed_the_others_socket(tmp_path):
    """The start checks the credential socket's path (``prepare_socket_path``), then binds
    it: a daemon started meanwhile at the same path binds first, and the bind's failure
    (EADDRINUSE) was cleaned up by removing the path, which was that daemon's listening
    socket. Only a socket this bind made is removed now."""
    access = SocketAccess(mode=0o600, gid=None)
    path = str(tmp_path / "d.sock.cred")
    prepare_socket_path(path, access)  # free when checked
    other, _ = bind_unix(path, access)  # the other daemon's, bound since
    try:
        with pytest.raises(OSError) as refused:
            bind_unix(path, access)
        assert refused.value.errno == errno.EADDRINUSE
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)  # still the other daemon's, listening
    finally:
        other.close()


def test_regression_the_untraversable_folder_warning_names_each_socket(daemon_factory):
    """Sockets that admit their group in a folder that group cannot traverse: the daemon
    warned twice in the same words, once for the gRPC socket and once for its credential
    socket, without saying which. Each line now names its socket."""
    d = daemon_factory()  # its folder is 0700: the default mode 0660 admits the group
    lines = [line for line in d.log().splitlines() if "does not let that group" in line]
    assert len(lines) == 2, d.log()
    for path, line in zip(_both(d), lines, strict=True):
        assert f"the socket {path} admits group" in line, line


def test_a_daemon_removes_both_its_sockets_when_it_stops(daemon_factory):
    """What remove_socket's checks must still allow: the daemon's own sockets, which it no
    longer listens on when it removes them."""
    d = daemon_factory()
    with d.client() as client:
        assert client.health()
    assert d.stop() == 0
    assert [p for p in _both(d) if os.path.lexists(p)] == []


def test_regression_a_credential_socket_held_by_another_user_got_the_clients_requests(
    nobodys_folder,
):
    """The client proved who it was to whoever listened on the credential socket, and
    handed a pool's memfd to him, without asking who that was: in a folder another user
    could write (made before the daemon checked folders, or never checked by one), he could
    remove the daemon's credential socket and listen in its place. The client now checks
    that the listener runs as the owner of the daemon's gRPC socket, and sends nothing
    otherwise. Here root's "daemon" socket sits in nobody's folder, nobody holds the
    credential socket, and root's client asks for a session and hands over memory."""
    address = f"unix:{nobodys_folder}/d.sock"
    path = cred.cred_socket_path(address)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as daemons:
        daemons.bind(f"{nobodys_folder}/d.sock")  # root's, as a root daemon would bind it
        with _Listener(path) as impostor:
            with pytest.raises(UntrustedSocketError, match=f"held by uid {NOBODY}, but") as info:
                cred.session_ticket(path, timeout_s=5)
            assert isinstance(info.value, PermissionDeniedError)
            memfd = os.memfd_create("kvtier-test")
            try:
                with pytest.raises(UntrustedSocketError, match="nothing was sent to it"):
                    cred.pool_ticket(path, memfd, timeout_s=5)
            finally:
                os.close(memfd)
            with Client(address, timeout_s=5) as client, pytest.raises(UntrustedSocketError):
                client.session_id  # noqa: B018 - opens the session
            assert impostor.seen() == {"requests": 0, "fds": 0}


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o775])
def test_regression_another_user_holding_both_sockets_in_a_folder_others_may_write_got_them(
    mode,
):
    """The check above compares the credential socket's listener with the gRPC socket's
    owner, and whoever may write the folder can hold both: in a folder like /tmp (sticky:
    names anyone's to take while the daemon is stopped) or one writable by a group or by
    all (the old sockets removed), another user bound both and root's client handed him its
    requests and memory. The client now also refuses sockets in a folder that users other
    than root and the socket's owner may write, as the daemon refuses to bind there."""
    require_root()
    top = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    try:
        os.chown(top, 0, NOGROUP)  # root's, as /tmp is; the group is nobody's
        os.chmod(top, mode)
        address = f"unix:{top}/d.sock"
        path = cred.cred_socket_path(address)
        with _Listener(f"{top}/d.sock", path) as impostor:
            with pytest.raises(UntrustedSocketError, match=f"{top} .*may write") as info:
                cred.session_ticket(path, timeout_s=5)
            assert "nothing was sent to it" in str(info.value)
            memfd = os.memfd_create("kvtier-test")
            try:
                with pytest.raises(UntrustedSocketError):
                    cred.pool_ticket(path, memfd, timeout_s=5)
            finally:
                os.close(memfd)
            assert impostor.seen() == {"requests": 0, "fds": 0}
    finally:
        shutil.rmtree(top)


def test_a_root_client_takes_tickets_from_a_daemon_of_another_user(nobodys_folder):
    """The check is against the socket's owner, not the client's own uid: a root client of
    a daemon that runs as another user (nobody here, holding both sockets) gets its ticket.
    The users' clients of a daemon run as root pass too
    (test_members_of_the_socket_group_connect_and_no_one_else)."""
    address = f"unix:{nobodys_folder}/d.sock"
    path = cred.cred_socket_path(address)
    with _Listener(f"{nobodys_folder}/d.sock", path) as daemon:
        assert len(cred.session_ticket(path, timeout_s=5)) == 32
        assert daemon.seen() == {"requests": 1, "fds": 0}


def test_regression_a_link_made_as_the_daemon_made_its_folder_had_it_chmod_the_target(
    tmp_path, monkeypatch
):
    """The daemon makes a missing socket folder, then sets its mode and group by its path.
    In a folder others may write (/tmp, where a user's daemon goes without $XDG_RUNTIME_DIR)
    another user could make a link there once the daemon had found no folder: the folder
    was 'made' (it exists) and the mode, 0700 here, went to the folder the link named. The
    start is refused now, the link's target untouched. The link is made here as that user
    would, between the daemon's look and its mkdir."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    victim.chmod(0o755)
    folder = tmp_path / "run"
    makedirs = os.makedirs

    def made_a_link_first(name, mode=0o777, exist_ok=False):
        if name == str(folder):
            folder.symlink_to(victim)
        makedirs(name, mode, exist_ok)

    monkeypatch.setattr(os, "makedirs", made_a_link_first)
    with pytest.raises(OSError) as refused:
        prepare_socket_path(f"{folder}/d.sock", SocketAccess(mode=0o600, gid=None))
    assert f"the socket's folder {folder} became a symbolic link" in str(refused.value)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755


def test_a_missing_folder_is_created_traversable_by_the_socket_group_only():
    require_root()
    top = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    folder = os.path.join(top, "run")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.daemon",
            "--set",
            f"server.socket={folder}/d.sock",
            "--set",
            f"server.socket_group={NOGROUP}",
            "--set",
            "tiers.l1.capacity_bytes=64MiB",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_serving(f"unix:{folder}/d.sock", 60)
        st = os.stat(folder)
        assert stat.S_IMODE(st.st_mode) == 0o710 and st.st_gid == NOGROUP
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(top)


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(REPO / "deploy" / "kvtierd.service")
    return unit


def test_the_systemd_unit_sets_up_a_client_group_that_works():
    service = _unit()["Service"]
    assert service["User"] == "kvtier" and service["Group"] == "kvtier"
    runtime_mode = int(service["RuntimeDirectoryMode"], 8)
    # The group may traverse the runtime folder (and nobody else may): x for the group.
    assert runtime_mode & 0o010 and not runtime_mode & 0o007
    assert service["RuntimeDirectory"] == "kvtier"
    # Files the daemon makes are its own; group membership grants the sockets only.
    assert int(service["UMask"], 8) == 0o077
    # The sockets admit the daemon's group by default.
    server = load_config().server
    assert server.socket_group == "" and server.socket_mode_bits() & 0o060 == 0o060
    assert not server.socket_mode_bits() & 0o007

    sysusers = (REPO / "deploy" / "kvtier.sysusers").read_text().splitlines()
    entries = [line.split() for line in sysusers if line.strip() and not line.startswith("#")]
    assert ["g", "kvtier", "-"] in entries
    assert any(e[:3] == ["u", "kvtier", "-:kvtier"] for e in entries)


def test_the_systemd_files_pass_systemds_own_checks(tmp_path):
    """systemd-analyze and systemd-sysusers, where the host has them (Debian does)."""
    analyze, sysusers = shutil.which("systemd-analyze"), shutil.which("systemd-sysusers")
    if analyze is None or sysusers is None:
        pytest.skip("systemd's tools are not installed")
    unit = tmp_path / "kvtierd.service"
    kvtierd = shutil.which("kvtierd", path=os.path.dirname(sys.executable)) or "/bin/true"
    unit.write_text(
        (REPO / "deploy" / "kvtierd.service")
        .read_text()
        .replace("/opt/kvtier/.venv/bin/kvtierd", kvtierd)
    )
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    out = subprocess.run(
        [sysusers, f"--root={root}", str(REPO / "deploy" / "kvtier.sysusers")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    group = (root / "etc" / "group").read_text()
    passwd = (root / "etc" / "passwd").read_text()
    gid = next(line.split(":")[2] for line in group.splitlines() if line.startswith("kvtier:"))
    user = next(line.split(":") for line in passwd.splitlines() if line.startswith("kvtier:"))
    assert user[3] == gid and user[5] == "/var/lib/kvtier"


def _kvtierd(path: str, *overrides: str) -> subprocess.Popen[str]:
    args = [f"server.socket={path}", "tiers.l1.capacity_bytes=64MiB", *overrides]
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.daemon", *(a for o in args for a in ("--set", o))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kvtier_health(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "--address", f"unix:{path}", "health"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _alive(proc: subprocess.Popen[str]) -> None:
    """``wait_until_serving``'s check: give up once ``proc`` has exited."""
    if proc.poll() is not None:
        out = proc.communicate()[0] if proc.stdout is not None else ""
        raise RuntimeError(f"kvtierd {proc.pid} exited with {proc.returncode}:\n{out}")


def _first_to_exit(procs: list[subprocess.Popen[str]]) -> int:
    deadline = time.monotonic() + 120
    while (ended := [i for i, p in enumerate(procs) if p.poll() is not None]) == []:
        assert time.monotonic() < deadline, "neither daemon exited"
        time.sleep(0.02)
    return ended[0]


RACE_ROUNDS = 8


def _l2_in(folder: Path) -> list[str]:
    return [
        "tiers.l2.enabled=true",
        f"tiers.l2.path={folder}",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.file_bytes=64MiB",
        "tiers.l2.segment_bytes=4MiB",
    ]


@pytest.mark.slow
def test_regression_two_daemons_started_at_once_on_one_socket_path_left_it_to_neither(tmp_path):
    """The start checked the socket path (nobody listening), then gRPC's bind removed
    whatever was there: of two daemons started together, the second bound over the first's
    live socket, and its failure a moment later (the credential socket or the TCP port,
    taken by the first) removed it, leaving the first serving nobody; one that did not fail
    took every client. The first to lock ``<socket>.lock`` now starts, the other stops
    before it binds anything, naming the path and the holder, and exits 1."""
    _, tenants = tenant_token(tmp_path, "t")
    for n in range(RACE_ROUNDS):
        folder = tmp_path / f"r{n}"
        folder.mkdir(mode=0o700)
        path = str(folder / "d.sock")
        # One port for both, known before either starts: held by this process meanwhile.
        with held_port() as port:
            tcp = f"server.tcp_address=127.0.0.1:{port}"
            procs = [_kvtierd(path, tenants, tcp, *_l2_in(folder / f"l2-{i}")) for i in (0, 1)]
            try:
                loser = procs[_first_to_exit(procs)]
                survivor = procs[1 - procs.index(loser)]
                out, _ = loser.communicate()
                assert loser.returncode == 1, out
                assert f"another kvtierd (pid {survivor.pid}) serves {path}" in out, out
                assert "Traceback" not in out, out
                # The loser stops at the lock, maybe before the survivor has bound its socket.
                wait_until_serving(f"unix:{path}", 60, check=lambda s=survivor: _alive(s))
                # Stopped before it opened its L2 folder (it had filled L1 and preallocated L2).
                assert not (folder / f"l2-{procs.index(loser)}").exists()
                health = _kvtier_health(path)
                assert health.returncode == 0, health.stdout + health.stderr
                survivor.send_signal(signal.SIGTERM)
                out, _ = survivor.communicate(timeout=60)
                assert survivor.returncode == 0, out
                # Both sockets and the lock removed at the stop.
                assert os.listdir(folder) == [f"l2-{procs.index(survivor)}"], os.listdir(folder)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.communicate()


# Runs kvtierd held, once it has checked both socket paths, until the file ``gate`` is gone.
_ENTRY_HOLDING_THE_BIND = """
import os, sys, time
from kvtier.daemon import server
from kvtier.daemon.entry import main

gate = sys.argv.pop(1)
check = server.prepare_socket_path

def checked_then_held(path, access):
    check(path, access)
    if path.endswith(".cred"):
        open(gate + ".reached", "w").close()
        while os.path.exists(gate):
            time.sleep(0.01)

server.prepare_socket_path = checked_then_held
sys.exit(main())
"""


def test_regression_a_daemon_that_bound_over_a_live_ones_socket_left_it_serving_nobody(
    tmp_path,
):
    """The race above, made certain: one daemon has checked the path (nobody listening) when
    another starts there. The second one served; the first then bound over its socket, failed
    on the credential socket (the second one's) and removed what it had bound, so the
    daemon left serving could be reached by no one. Now whichever locked the path first
    serves, and the other names it and exits."""
    path = str(tmp_path / "d.sock")
    gate = tmp_path / "gate"
    gate.touch()
    l1 = ["--set", "tiers.l1.capacity_bytes=64MiB"]
    held = DaemonProcess(tmp_path, path, l1, entry=("-c", _ENTRY_HOLDING_THE_BIND, str(gate)))
    held.start(wait=False)
    other: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{gate}.reached"):
            assert held.running() and time.monotonic() < deadline, held.log()
            time.sleep(0.01)
        other = _kvtierd(path)
        while other.poll() is None and _refuses(path):
            assert time.monotonic() < deadline + 60, "the second daemon neither served nor exited"
            time.sleep(0.01)
        gate.unlink()
        assert held.proc is not None
        procs = [held.proc, other]
        first_out = _first_to_exit(procs)  # type: ignore[arg-type]
        exited, survivor = procs[first_out], procs[1 - first_out]
        # Refused at the lock, the second exits before the first has bound its socket; the
        # first, bound over, exited after removing the second's (before the lock).
        wait_until_serving(f"unix:{path}", 30, check=lambda: _alive(survivor))
        health = _kvtier_health(path)
        assert health.returncode == 0, health.stdout + health.stderr
        assert exited.returncode == 1
        out = held.log() if exited is held.proc else other.communicate()[0]
        assert f"another kvtierd (pid {survivor.pid}) serves {path}" in out, out
    finally:
        gate.unlink(missing_ok=True)
        held.kill()
        if other is not None and other.poll() is None:
            other.kill()
            other.communicate()


def test_a_daemon_started_beside_a_live_one_names_it_and_leaves_it_untouched(tmp_path):
    """What the host checks see when the first daemon serves already: the lock, its holder
    named; the first one's socket, TCP port and metrics port stay its own."""
    _, tenants = tenant_token(tmp_path, "t")
    path = str(tmp_path / "d.sock")
    # The ports the first one took (ports chosen before its start may be taken by then).
    overrides = [
        "tiers.l1.capacity_bytes=64MiB",
        tenants,
        "server.tcp_address=127.0.0.1:0",
        "metrics.address=0",
    ]
    first = DaemonProcess(tmp_path, path, [a for o in overrides for a in ("--set", o)]).start()
    try:
        metrics = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", first.log())
        assert metrics, first.log()
        ports = [f"server.tcp_address={first.tcp_address()}", f"metrics.address={metrics[1]}"]
        before = os.lstat(path)
        second = _kvtierd(path, tenants, *ports)
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 1, out
        assert f"another kvtierd (pid {first.proc.pid}) serves {path}" in out, out
        assert (os.lstat(path).st_ino, os.lstat(path).st_dev) == (before.st_ino, before.st_dev)
        assert _kvtier_health(path).returncode == 0
        with open(path + ".lock") as f:
            assert f.read() == f"{first.proc.pid}\n"
    finally:
        assert first.stop() == 0
    assert not os.path.lexists(path + ".lock")


def test_a_daemon_starts_at_once_where_one_was_sigkilled(tmp_path):
    """The kernel lets go of a killed holder's lock; the file it left refuses nothing, nor
    does a stale socket at the bind name."""
    path = str(tmp_path / "d.sock")
    old = DaemonProcess(tmp_path, path, ["--set", "tiers.l1.capacity_bytes=64MiB"]).start()
    old.kill()
    assert os.path.exists(path + ".lock")  # left behind, naming the dead daemon
    # And the socket a start killed between gRPC's bind and its rename leaves (move_bound).
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path + BIND_SUFFIX)
    stale.close()
    new = DaemonProcess(tmp_path, path, ["--set", "tiers.l1.capacity_bytes=64MiB"]).start()
    try:
        assert _kvtier_health(path).returncode == 0
        with open(path + ".lock") as f:
            assert f.read() == f"{new.proc.pid}\n"
        assert not os.path.lexists(path + BIND_SUFFIX)
    finally:
        assert new.stop() == 0


# kvtierd without its host checks, as if they had passed: what the start itself does when
# what they check changed after them (or they missed it).
_ENTRY_WITHOUT_HOST_CHECKS = """
import sys
from kvtier.daemon import preflight
from kvtier.daemon.entry import main

preflight.check = lambda config, host=None: []
sys.exit(main())
"""


def _start_without_host_checks(
    overrides: list[str], **run: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            _ENTRY_WITHOUT_HOST_CHECKS,
            *(a for o in overrides for a in ("--set", o)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        **run,
    )


def test_regression_a_socket_whose_group_could_not_be_set_stayed_bound(nobodys_folder):
    """gRPC binds the socket, then the daemon gives it its group and mode: where that failed
    (a group the daemon is no member of, here root's for a daemon of nobody's, the socket's
    lock file already of that group), the start failed with the socket left bound, for
    engines to find and the next start to refuse. The start now removes what it bound."""
    path = f"{nobodys_folder}/d.sock"
    with open(path + ".lock", "w"):
        pass
    os.chown(path + ".lock", NOBODY, 0)
    proc = _start_without_host_checks(
        [f"server.socket={path}", "server.socket_group=0", "tiers.l1.capacity_bytes=64MiB"],
        user=NOBODY,
        group=NOGROUP,
        extra_groups=[],
    )
    assert proc.returncode == 1, proc.stderr
    assert f"cannot give {path} the group 0 (server.socket_group)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(nobodys_folder) == []


def test_regression_what_stood_at_the_sockets_bind_name_failed_the_start_in_a_traceback(
    tmp_path,
):
    """gRPC binds the socket at its path plus ``.new`` (``move_bound``) and fails on anything
    but a socket there, a directory here: the start, past the host checks (as if it appeared
    after them), ended in gRPC's traceback ("Failed to bind to address"). It is refused as
    at the path, named, and left as it was."""
    path = str(tmp_path / "d.sock")
    os.mkdir(path + BIND_SUFFIX)
    proc = _start_without_host_checks([f"server.socket={path}", "tiers.l1.capacity_bytes=64MiB"])
    assert proc.returncode == 1, proc.stderr
    assert f"{path}{BIND_SUFFIX} exists and is not a socket" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == ["d.sock.new"] and os.path.isdir(path + BIND_SUFFIX)


def test_regression_a_socket_path_holding_a_percent_sign_was_bound_as_another_file(tmp_path):
    """The daemon gave gRPC its socket path as "unix:PATH", which gRPC reads as a URI: it
    decoded the %41 of ".../a%41.sock" and bound ".../aA.sock.new", so the start failed
    ("No such file or directory" for the name it meant to move into place) and left that
    file behind; a "?" or "#" in the path made the address it logged one that clients read
    as another path. The path is written as an address gRPC reads back as that path."""
    from kvtier.paths import unix_address

    folder = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    path = os.path.join(folder, "a%41?#.sock")
    d = DaemonProcess(tmp_path, path, ["--set", "tiers.l1.capacity_bytes=64MiB"])
    try:
        d.start()
        names = os.listdir(folder)
        assert {"a%41?#.sock", "a%41?#.sock.cred"} <= set(names), names
        assert all(n.startswith("a%41?#.sock") for n in names), names
        with Client(unix_address(path)) as client:
            assert client.stats().tiers
        assert f"kvtierd listening on {unix_address(path)}" in d.log()
    finally:
        d.kill()
        shutil.rmtree(folder)


def test_regression_a_bench_daemon_at_a_socket_path_holding_a_percent_sign_was_not_reached():
    """The bench launcher addressed its daemon as "unix:PATH", which gRPC reads with its %XX
    escapes decoded: since the daemon binds the path itself (a33539a), a socket path (or
    TMPDIR) holding "%41" had the launcher wait for, and its clients dial, ".../aA.sock",
    and the start ran out of time. The launcher writes the address as gRPC reads it back."""
    from kvtier.bench.launcher import bench_daemon
    from kvtier.client.types import unix_socket_path

    folder = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    path = os.path.join(folder, "a%41.sock")
    try:
        with bench_daemon(
            "tiers.l1.capacity_bytes=64MiB",
            socket_path=path,
            start_timeout_s=30,
            wait_recovered=False,
        ) as daemon:
            assert unix_socket_path(daemon.address) == path
            with Client(daemon.address) as client:
                assert client.stats().tiers
    finally:
        shutil.rmtree(folder)
