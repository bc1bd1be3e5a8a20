"""Host checks before anything is allocated (``kvtierd --check-config`` and every start), and
the default socket rule shared by daemon and client."""

from __future__ import annotations

import errno
import fcntl
import grp
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from peers import NOBODY, NOGROUP, require_root, run_as

from kvtier import paths
from kvtier.daemon import preflight, stack
from kvtier.daemon.config import load_config
from kvtier.daemon.preflight import HostFacts
from kvtier.tiers.remote.journal import RemovalFile, RemovalFileError


def _kvtierd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


HOST = HostFacts(mem_available_bytes=8 << 30, mem_limit_bytes=16 << 30, memlock_limit_bytes=None)


def _keys(problems):
    return [p.key for p in problems]


def test_an_l1_larger_than_memory_is_refused(tmp_path):
    config = load_config(
        None, [f"server.socket={tmp_path}/s.sock", "tiers.l1.capacity_bytes=64GiB"]
    )
    problems = preflight.check(config, HOST)
    assert _keys(problems) == ["tiers.l1.capacity_bytes"]
    assert "memory limit" in str(problems[0])
    config = load_config(
        None, [f"server.socket={tmp_path}/s.sock", "tiers.l1.capacity_bytes=12GiB"]
    )
    assert "available" in str(preflight.check(config, HOST)[0])
    config = load_config(None, [f"server.socket={tmp_path}/s.sock", "tiers.l1.capacity_bytes=4Gi"])
    assert preflight.check(config, HOST) == []


def test_regression_a_shm_dir_on_a_disk_was_refused_only_when_a_pool_registered(tmp_path):
    """A ``server.shm_dir`` that is a folder but not a tmpfs passed the checks; the daemon
    started and refused every pool named there ("not in memory"). The folder is made in the
    checkout, on a disk (a test's tmp_path may be a tmpfs)."""
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as disk:
        config = load_config(None, [f"server.socket={tmp_path}/s.sock", f"server.shm_dir={disk}"])
        problems = preflight.check(config, HOST)
        assert _keys(problems) == ["server.shm_dir"]
        assert "not in memory (not a tmpfs)" in str(problems[0])
    config = load_config(None, [f"server.socket={tmp_path}/s.sock", "server.shm_dir=/dev/shm"])
    assert "server.shm_dir" not in _keys(preflight.check(config, HOST))


def test_an_l2_larger_than_the_disk_is_refused(tmp_path):
    config = load_config(
        None,
        [
            f"server.socket={tmp_path}/s.sock",
            "tiers.l2.enabled=true",
            f"tiers.l2.path={tmp_path}/l2",
            "tiers.l2.capacity_bytes=100TiB",
            "tiers.l2.file_bytes=1TiB",
        ],
    )
    problems = preflight.check(config, HOST)
    assert _keys(problems) == ["tiers.l2.capacity_bytes"]
    assert "cannot hold tiers.l2.capacity_bytes=100TiB" in str(problems[0])
    assert not (tmp_path / "l2").exists()  # nothing was created


# preflight.check run with this host's memory available set to argv[1] bytes and the config
# of the --set values after it; prints each problem on a line.
_CHECK_WITH_MEMORY = (
    "import sys; from kvtier.daemon import preflight; "
    "from kvtier.daemon.config import load_config; "
    "host = preflight.HostFacts(int(sys.argv[1]), 16 << 30, None); "
    "print(*preflight.check(load_config(None, sys.argv[2:]), host), sep='\\n')"
)


def test_regression_an_l2_on_a_tmpfs_was_not_counted_against_memory(tmp_path):
    """Regression: an L2 folder on a tmpfs (tiers.l2.path=/dev/shm/...) takes memory: its
    files, preallocated at start, come out of the memory L1 was checked against, and the
    tmpfs's own size, which the space check reads, may be far more than is free. It passed
    the checks whatever the memory left; L1 and L2 together past it pushed the host into
    swap or the OOM killer. A tmpfs of its own here (a private mount namespace)."""
    require_root()
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as disk:
        folder = Path(disk) / "l2"
        folder.mkdir()
        sets = [
            f"server.socket={tmp_path}/s.sock",
            "tiers.l1.capacity_bytes=512MiB",
            "tiers.l2.enabled=true",
            f"tiers.l2.path={folder}/l2",
            "tiers.l2.capacity_bytes=1GiB",
            "tiers.l2.file_bytes=1GiB",
        ]

        def problems(available: int, tmpfs: bool) -> str:
            cmd = [sys.executable, "-c", _CHECK_WITH_MEMORY, str(available), *sets]
            if tmpfs:
                mount = f'mount -t tmpfs -o size=4g tmpfs {folder} && exec "$@"'
                cmd = ["unshare", "--mount", "sh", "-c", mount, "sh", *cmd]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            return r.stdout.strip()

        found = problems(1 << 30, tmpfs=True)
        assert found.startswith(f"tiers.l2.path: {folder}/l2 is in memory (a tmpfs)"), found
        assert "(1025MiB still to allocate)" in found and "beside L1's 512MiB" in found
        assert problems(4 << 30, tmpfs=True) == ""  # room for both
        assert problems(1 << 30, tmpfs=False) == ""  # on a disk: L1 alone fits
        assert list(folder.iterdir()) == []  # nothing was created


def test_regression_a_read_only_folder_was_said_to_be_one_the_user_may_not_write(tmp_path):
    """Regression: an L2 folder, socket folder or removals_file folder on a read-only
    filesystem, as systemd's ProtectSystem=strict makes every folder outside the unit's
    ReadWritePaths= (an L2 on an NVMe mount, say), was refused as "not writable by uid N":
    the folder's owner and mode were right, the sandbox was the cause, and the message sent
    the operator to the wrong one. A read-only bind mount of its own here."""
    require_root()
    folder = tmp_path / "nvme"
    (folder / "l2").mkdir(parents=True)
    sets = [
        f"server.socket={folder}/run/s.sock",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={folder}/l2",
        "tiers.l3.enabled=true",
        f"tiers.l3.removals_file={folder}/removals.sqlite3",
    ]
    mount = f'mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && exec "$@"'
    check = [sys.executable, "-c", _CHECK_WITH_MEMORY, str(8 << 30), *sets]
    r = subprocess.run(
        ["unshare", "--mount", "sh", "-c", mount, "sh", *check],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    problems = r.stdout.strip().splitlines()
    assert [p.partition(":")[0] for p in problems] == [
        "tiers.l2.path",
        "server.socket",
        "tiers.l3.removals_file",
    ], problems
    for problem in problems:
        assert "is on a read-only filesystem" in problem and "ReadWritePaths=" in problem
        assert "not writable by uid" not in problem


@pytest.mark.parametrize(
    "make, expect",
    [
        (lambda p: p.write_text("not a socket"), "is not a socket"),
        (lambda p: None, None),
    ],
)
def test_socket_paths(tmp_path, make, expect):
    path = tmp_path / "s.sock"
    make(path)
    config = load_config(None, [f"server.socket={path}"])
    problems = preflight.check(config, HOST)
    if expect is None:
        assert problems == []
    else:
        assert _keys(problems) == ["server.socket"] and expect in str(problems[0])


def _listening_at(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen()
    return s


@pytest.mark.parametrize("there", ["directory", "file", "link", "live", "stale"])
def test_regression_what_stood_at_the_sockets_bind_name_passed_the_checks(tmp_path, there):
    """gRPC binds the daemon's socket at its path plus ``.new``, then the daemon renames it to
    the path (``unixsock.move_bound``). The checks looked at the path and the credential
    socket only: a directory, a file or a link at the bind name passed them, and the start
    failed in gRPC's bind with a traceback ("Failed to bind to address ... .new"); a socket
    another process listened on there, gRPC's bind removed. Each is refused as at the path,
    named; a stale socket (a start killed before its rename) is no problem."""
    path = tmp_path / "run" / "s.sock"
    path.parent.mkdir(mode=0o700)
    bind_name = f"{path}.new"
    held = []
    if there == "directory":
        os.mkdir(bind_name)
    elif there == "file":
        Path(bind_name).write_text("not a socket")
    elif there == "link":  # to a live socket outside the folder
        held.append(_listening_at(str(tmp_path / "elsewhere.sock")))
        os.symlink(tmp_path / "elsewhere.sock", bind_name)
    else:
        held.append(_listening_at(bind_name))
        if there == "stale":
            held.pop().close()
    try:
        problems = preflight.check(load_config(None, [f"server.socket={path}"]), HOST)
    finally:
        for s in held:
            s.close()
    if there == "stale":
        assert problems == []
        return
    assert _keys(problems) == ["server.socket"], problems
    if there == "live":
        assert f"another process is listening on {bind_name}" in str(problems[0])
    else:
        assert f"{bind_name} exists and is not a socket" in str(problems[0])
    assert os.path.lexists(bind_name)


def test_a_socket_path_too_long_is_refused():
    config = load_config(None, ["server.socket=/tmp/" + "x" * 120 + ".sock"])
    assert "107 bytes" in str(preflight.check(config, HOST)[0])


def test_check_config_reports_what_the_host_cannot_give(tmp_path):
    ok = _kvtierd("--check-config", *_sets(f"server.socket={tmp_path}/s.sock"))
    assert ok.returncode == 0, ok.stderr
    assert "config ok" in ok.stdout and f"socket: {tmp_path}/s.sock" in ok.stdout
    bad = _kvtierd(
        "--check-config",
        *_sets(f"server.socket={tmp_path}/s.sock", "tiers.l1.capacity_bytes=100TiB"),
    )
    assert bad.returncode == 1
    assert "tiers.l1.capacity_bytes" in bad.stderr and "memory" in bad.stderr


def test_a_second_daemon_on_a_live_socket_fails_before_allocating(daemon):
    """Regression: the second daemon used to pre-fault its whole L1 before finding the
    socket taken. Now it stops at the host checks, before any allocation: with an L1 of
    16 GiB it would need seconds (and the memory) otherwise."""
    path = daemon.socket
    started = time.monotonic()
    proc = _kvtierd(*_sets(f"server.socket={path}", "tiers.l1.capacity_bytes=2GiB"))
    elapsed = time.monotonic() - started
    assert proc.returncode == 1
    assert f"another kvtierd (pid {daemon.proc.pid}) serves {path}" in proc.stderr
    assert "L1 host arena" not in proc.stderr  # the arena log line: nothing was allocated
    assert elapsed < 30
    assert daemon.running()


def test_a_stale_socket_is_no_problem(tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # bound, never listening: what a crashed daemon leaves
    config = load_config(None, [f"server.socket={path}"])
    assert preflight.check(config, HOST) == []


def test_metrics_port_in_use_is_refused(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        config = load_config(
            None, [f"server.socket={tmp_path}/s.sock", f"metrics.address=127.0.0.1:{port}"]
        )
        problems = preflight.check(config, HOST)
        assert _keys(problems) == ["metrics.address"] and "in use" in str(problems[0])
    finally:
        taken.close()


@pytest.mark.parametrize("address", ["192.0.2.1:9464", "1.2.3.4:5"])
def test_a_metrics_address_not_on_this_host_is_refused_by_check_config(tmp_path, address):
    """A metrics.address whose host is no address of this machine (192.0.2.1: a
    documentation range, RFC 5737) cannot be bound: --check-config refuses it, naming the
    key, as the start's own bind would, rather than saying 'config ok'."""
    host = address.rsplit(":", 1)[0]
    with socket.socket() as probe, pytest.raises(OSError) as not_here:
        probe.bind((host, 0))
    assert not_here.value.errno == errno.EADDRNOTAVAIL  # the test's premise: not local
    proc = _kvtierd(
        "--check-config", *_sets(f"server.socket={tmp_path}/s.sock", f"metrics.address={address}")
    )
    assert proc.returncode == 1, proc.stdout
    assert f"metrics.address: cannot listen on {address}: " in proc.stderr
    assert "config ok" not in proc.stdout


def test_a_metrics_port_left_in_time_wait_by_a_scrape_is_free(tmp_path):
    """Regression: a daemon stopped right after a scrape leaves the scrape's connection in
    TIME_WAIT on its metrics port (the server closes first); the endpoint's own server binds
    with SO_REUSEADDR and could listen, but the host check refused to start for a minute."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    scraper = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end waits in TIME_WAIT
    scraper.recv(1)
    scraper.close()
    server.close()
    config = load_config(
        None, [f"server.socket={tmp_path}/s.sock", f"metrics.address=127.0.0.1:{port}"]
    )
    assert preflight.check(config, HOST) == []


@pytest.mark.parametrize(
    "address, url",
    [
        ("9464", "http://127.0.0.1:9464/metrics"),
        ("0.0.0.0:9464", "http://0.0.0.0:9464/metrics"),
        ("[::1]:9464", "http://[::1]:9464/metrics"),
    ],
)
def test_the_summary_names_the_metrics_url(tmp_path, address, url):
    """``kvtierd --check-config`` prints the URL the endpoint serves (a bare port printed as
    ``http://9464/metrics`` before)."""
    config = load_config(None, [f"server.socket={tmp_path}/s.sock", f"metrics.address={address}"])
    assert f"metrics: {url}" in preflight.summary(config, HOST)


# -------------------------------------------------------------------- default socket


def test_the_default_socket_rule():
    assert paths.daemon_socket({}, uid=0) == "/run/kvtier/kvtierd.sock"
    assert paths.daemon_socket({"RUNTIME_DIRECTORY": "/run/kvtier"}, uid=990) == (
        "/run/kvtier/kvtierd.sock"
    )
    user = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert paths.daemon_socket(user, uid=1000) == "/run/user/1000/kvtier/kvtierd.sock"
    assert paths.daemon_socket({}, uid=1000) == "/tmp/kvtier-1000/kvtierd.sock"
    # A relative XDG_RUNTIME_DIR is invalid by its spec and ignored.
    assert paths.daemon_socket({"XDG_RUNTIME_DIR": "run"}, uid=7) == "/tmp/kvtier-7/kvtierd.sock"
    assert paths.client_candidates(user, uid=1000) == [
        "/run/user/1000/kvtier/kvtierd.sock",
        "/run/kvtier/kvtierd.sock",
    ]
    for env, uid in (({}, 0), (user, 1000), ({}, 1000)):
        # With no daemon anywhere a client names the socket its own daemon would use.
        if not os.path.exists(paths.SYSTEM_SOCKET):
            assert paths.default_client_socket(env, uid) == paths.daemon_socket(env, uid)


def test_the_users_default_socket_in_a_folder_others_may_write_is_left_out(tmp_path):
    """Anyone may make /tmp/kvtier-$UID before its user does and listen there; a client with
    no address would have handed that listener its requests and its pools' memory."""
    require_root()
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    mine = paths.user_socket(env, uid=1000)
    os.makedirs(os.path.dirname(mine))
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(mine)
        folder = os.path.dirname(mine)
        os.chown(folder, NOBODY, -1)
        assert f"belongs to uid {NOBODY}" in paths.untrusted_folder(mine, 1000)
        assert paths.default_client_socket(env, uid=1000) == paths.SYSTEM_SOCKET
        os.chown(folder, 1000, -1)  # the user's own folder, but others may write it
        os.chmod(folder, 0o777)
        assert "writable by other users" in paths.untrusted_folder(mine, 1000)
        assert paths.default_client_socket(env, uid=1000) == paths.SYSTEM_SOCKET
        os.chmod(folder, 0o700)  # the user's own, private folder
        assert paths.untrusted_folder(mine, 1000) is None
        assert paths.default_client_socket(env, uid=1000) == mine


def test_regression_a_user_kept_out_of_the_system_socket_folder_was_told_to_start_a_daemon(
    monkeypatch,
):
    """A user not (yet) in the service's group cannot enter its 0750 /run/kvtier: the default
    address skipped the system socket there and named the user's own, absent one, so the
    client said `No such file or directory` and `kvtier` told the operator to start a daemon
    (the one that runs was never mentioned). The address is now the socket behind the folder,
    and connecting to it says that this user may not."""
    require_root()
    folder = tempfile.mkdtemp(prefix="kvt-sys-")  # root's, 0700: closed to NOBODY
    system = os.path.join(folder, paths.SOCKET_NAME)
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", system)
    try:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(system)
            env = {"XDG_RUNTIME_DIR": "/nonexistent-kvtier-test"}
            mine = paths.user_socket(env, NOBODY)
            assert paths.client_candidates(env, NOBODY) == [mine, system]
            assert run_as(NOBODY, NOGROUP, lambda: paths.default_client_socket(env)) == system
            # Root enters the folder and finds the socket itself.
            assert paths.default_client_socket(env, uid=NOBODY) == system
    finally:
        shutil.rmtree(folder)


_FIND_EACH_OTHER = """
import json, os, subprocess, sys
daemon_dir, client_dir = sys.argv[1], sys.argv[2]
env = dict(os.environ)
env.pop("KVTIER_ADDRESS", None)
env.pop("RUNTIME_DIRECTORY", None)
proc = subprocess.Popen(
    [sys.executable, "-m", "kvtier.daemon", "--set", "tiers.l1.capacity_bytes=64MiB"],
    cwd=daemon_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
)
try:
    line = ""
    for line in proc.stdout:
        if "listening on" in line:
            break
    code = "from kvtier.client import Client\\nwith Client() as c: print(c.address, c.health())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=client_dir, env=env, capture_output=True, text=True
    )
    print(json.dumps({"daemon": line.strip(), "client": out.stdout.strip(), "err": out.stderr}))
finally:
    proc.terminate()
    proc.wait(30)
"""


def test_client_and_daemon_find_each_other_from_any_directory(tmp_path):
    """Both started with no address, in different directories. As root (a system service) in
    a mount namespace with its own empty /run, so that no daemon of the host interferes; as a
    user under a fresh $XDG_RUNTIME_DIR."""
    daemon_dir, client_dir = tmp_path / "daemon-cwd", tmp_path / "client-cwd"
    daemon_dir.mkdir()
    client_dir.mkdir()
    driver = [sys.executable, "-c", _FIND_EACH_OTHER, str(daemon_dir), str(client_dir)]
    env = dict(os.environ)
    if os.geteuid() == 0:
        expected = paths.SYSTEM_SOCKET
        cmd = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /run && exec "$@"', "sh"]
        cmd += driver
    else:
        runtime = tmp_path / "rt"
        runtime.mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        expected = str(runtime / "kvtier" / "kvtierd.sock")
        cmd = driver
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert f"listening on unix:{expected}" in result["daemon"], result
    assert result["client"] == f"unix:{expected} True", result


def _path_of_length(tmp_path, n: int) -> str:
    head = f"{tmp_path}/"
    return head + "s" * (n - len(head) - len(".sock")) + ".sock"


def test_a_socket_path_whose_credential_socket_is_too_long_is_refused(tmp_path):
    """The credential socket is the path plus '.cred': a path of 103-107 bytes passed the
    checks ('config ok'), then the daemon failed at start, after allocating L1."""
    path = _path_of_length(tmp_path, 105)
    problems = preflight.check(load_config(None, [f"server.socket={path}"]), HOST)
    assert _keys(problems) == ["server.socket"]
    assert "credential socket" in str(problems[0]) and "within 102 bytes" in str(problems[0])
    ok = _path_of_length(tmp_path, 102)
    assert preflight.check(load_config(None, [f"server.socket={ok}"]), HOST) == []


def test_a_socket_folder_others_may_write_is_refused_by_the_checks_too(tmp_path):
    """The daemon refuses such a folder when it binds; --check-config said 'config ok'."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    config = load_config(None, [f"server.socket={folder}/s.sock"])
    problems = preflight.check(config, HOST)
    assert _keys(problems) == ["server.socket"] and "writable by other users" in str(problems[0])
    # Regression: a sticky folder (as /tmp) was accepted. Others cannot remove the daemon's
    # sockets there, but the daemon removes them when it stops: a user who then listened on
    # their names received the clients' requests (and kept the daemon from starting).
    folder.chmod(0o1777)
    problems = preflight.check(config, HOST)
    assert _keys(problems) == ["server.socket"] and "writable by other users" in str(problems[0])
    proc = _kvtierd("--check-config", *_sets(f"server.socket={tmp_path}/s.sock"))
    assert proc.returncode == 0, proc.stderr


def test_regression_a_lock_file_another_user_put_in_a_shared_socket_folder_held_the_checks(
    tmp_path,
):
    """The checks probed ``<socket>.lock`` before they looked at the socket's folder: in one
    that others may write (/tmp), another user's FIFO at the lock's path held --check-config,
    and every start (whose checks these are), in its open until a writer came, SIGTERM
    ignored; their own file, flocked with a pid in it, made the check say that pid's kvtierd
    served there. The folder is refused first now. The files are made here as that user
    would: the checks do not look at their owner."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    path = f"{folder}/s.sock"
    os.mkfifo(f"{path}.lock")
    proc = _kvtierd("--check-config", *_sets(f"server.socket={path}"))
    assert proc.returncode == 1, proc.stderr
    assert "writable by other users" in proc.stderr, proc.stderr
    os.unlink(f"{path}.lock")
    with open(f"{path}.lock", "w") as lock:
        lock.write("1\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX)
        problems = preflight.check(load_config(None, [f"server.socket={path}"]), HOST)
    assert _keys(problems) == ["server.socket"]
    assert "writable by other users" in str(problems[0]), problems
    assert "another kvtierd" not in str(problems[0]), problems


@pytest.mark.parametrize("kind", ["directory", "FIFO", "link", "dangling link"])
def test_regression_a_socket_lock_path_that_is_no_regular_file_passed_the_checks(tmp_path, kind):
    """Something other than a regular file at ``<socket>.lock`` (left by hand, a restore, a
    link planted while the folder was open to others): --check-config said 'config ok', and
    every start then failed in the lock's open, a directory and a link with a bare errno
    ('Is a directory', 'Too many levels of symbolic links'). The checks, the start's own,
    name the path and what is there; nothing is created or followed."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    path = f"{folder}/s.sock"
    lock = Path(f"{path}.lock")
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    if kind == "directory":
        lock.mkdir()
    elif kind == "FIFO":
        os.mkfifo(lock)
    else:
        lock.symlink_to(target if kind == "link" else tmp_path / "absent")
    said = {
        "directory": "is a directory",
        "FIFO": "is not a regular file",
        "link": "is a symbolic link",
        "dangling link": "is a symbolic link",
    }[kind]
    for mode in (["--check-config"], []):
        proc = _kvtierd(*mode, *_sets(f"server.socket={path}"))
        assert proc.returncode == 1, (mode, proc.stderr)
        assert f"{lock} {said}" in proc.stderr, (mode, proc.stderr)
        assert "Traceback" not in proc.stderr and "[Errno" not in proc.stderr, proc.stderr
    assert not os.path.exists(path) and target.read_bytes() == b"precious"
    assert not (tmp_path / "absent").exists()


def test_regression_a_socket_lock_file_the_daemon_may_not_take_passed_the_checks():
    """A regular ``<socket>.lock`` the daemon's user does not own (a daemon run as another
    user, root, left it), or may not write: --check-config said 'config ok', and every start
    then failed in the lock's open with a bare "[Errno 13] Permission denied". The checks
    name the file, its owner and mode. One the user owns and writes, as a killed daemon
    leaves it (its pid inside), passes; so does any for root, which may take anyone's."""
    require_root()
    # Not pytest's tmp_path: its folders above are root's 0700, which nobody may not search.
    base = Path(tempfile.mkdtemp(prefix="kvtier-lock-"))
    try:
        base.chmod(0o711)
        folder = base / "run"
        folder.mkdir(mode=0o700)
        os.chown(folder, NOBODY, NOGROUP)
        sets = [f"server.socket={folder}/s.sock"]
        lock = folder / "s.sock.lock"
        lock.write_text("12345\n")
        lock.chmod(0o600)
        roots = _problems_as_user(sets)
        os.chown(lock, NOBODY, NOGROUP)
        left_by_a_killed_daemon = _problems_as_user(sets)
        lock.chmod(0o400)
        read_only = _problems_as_user(sets)
        os.chown(folder, 0, 0)
        root_takes_it = [str(p) for p in preflight.check(load_config(None, sets), HOST)]
    finally:
        shutil.rmtree(base)
    assert root_takes_it == []
    assert len(roots) == 1 and f"{lock} is uid 0's, mode 0600" in roots[0], roots
    assert f"(uid {NOBODY})" in roots[0] and "Errno" not in roots[0], roots
    assert left_by_a_killed_daemon == []
    assert len(read_only) == 1 and f"{lock} is uid {NOBODY}'s, mode 0400" in read_only[0]


def test_regression_a_socket_group_the_daemon_may_not_give_passed_the_checks(tmp_path):
    """Regression: a daemon may give its sockets only a group it is a member of, unless it
    holds CAP_CHOWN; root without capabilities (the DaemonSet's, which drops them all) given
    another group said 'config ok' to --check-config, and its start opened L2 (its files
    preallocated) and L1 before it stopped on that group. Run as such a root here."""
    require_root()
    sets = [
        f"server.socket={tmp_path}/run/s.sock",
        f"server.socket_group={NOGROUP}",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path}/l2",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.file_bytes=64MiB",
    ]
    without_caps = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
    for mode in ("--check-config", None):
        r = subprocess.run(
            [*without_caps, sys.executable, "-m", "kvtier.daemon", *_sets(*sets)]
            + ([mode] if mode else []),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1, (mode, r.stdout, r.stderr)
        assert "config ok" not in r.stdout
        assert f"cannot start: server.socket_group: the daemon is no member of group {NOGROUP}" in (
            r.stderr
        ), r.stderr
        assert not (tmp_path / "l2").exists() and not (tmp_path / "run").exists()
    # With the group among its own (the pod's supplementalGroups) it may.
    in_group = [*without_caps[:-1], f"--groups={NOGROUP}", "--"]
    r = subprocess.run(
        [*in_group, sys.executable, "-m", "kvtier.daemon", *_sets(*sets), "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    # And root with its capabilities may give any group.
    assert _kvtierd("--check-config", *_sets(*sets)).returncode == 0


def test_regression_a_socket_group_its_folder_gives_was_refused(tmp_path):
    """Regression: a socket made in a set-group-ID folder takes the folder's group, so a
    daemon given that folder's group as server.socket_group needs neither membership nor
    CAP_CHOWN (its sockets have the group already; it changes nothing): such a daemon (a
    folder root:G 2750, made for the engines of group G) started, and the check added in
    2884293 refused it. A folder that does not exist yet takes the group of a set-group-ID
    folder above it, as the socket then does. Run as root without capabilities here."""
    require_root()
    run = tmp_path / "run"
    run.mkdir()
    os.chown(run, 0, NOGROUP)
    run.chmod(0o2750)
    without_caps = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
    for socket_path in (run / "s.sock", run / "below" / "s.sock"):
        sets = [f"server.socket={socket_path}", f"server.socket_group={NOGROUP}"]
        r = subprocess.run(
            [*without_caps, sys.executable, "-m", "kvtier.daemon", *_sets(*sets), "--check-config"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0 and "config ok" in r.stdout, r.stderr
    # The daemon does start there: its sockets have the group, with no chown.
    sets = [f"server.socket={run}/s.sock", f"server.socket_group={NOGROUP}"]
    proc = subprocess.Popen(
        [
            *without_caps,
            sys.executable,
            "-m",
            "kvtier.daemon",
            *_sets(*sets),
            "--set",
            "tiers.l1.capacity_bytes=64MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, proc.stderr.read() if proc.stderr else line
        assert os.stat(run / "s.sock").st_gid == NOGROUP
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    # Another folder's group is still refused.
    run.chmod(0o750)
    r = subprocess.run(
        [*without_caps, sys.executable, "-m", "kvtier.daemon", *_sets(*sets), "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "is no member of group" in r.stderr, r.stderr


def test_a_live_listener_on_the_credential_socket_is_refused(tmp_path):
    path = f"{tmp_path}/s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".cred")
    listener.listen()
    try:
        config = load_config(None, [f"server.socket={path}"])
        problems = preflight.check(config, HOST)
        assert _keys(problems) == ["server.socket"]
        assert f"another process is listening on {path}.cred" in str(problems[0])
    finally:
        listener.close()


@pytest.mark.parametrize("name", ["index.sqlite3", "index.sqlite3-wal", "lock", "data-0001.bin"])
def test_an_l2_file_that_is_a_directory_is_refused_by_the_checks(tmp_path, name):
    """--check-config said 'config ok' for an L2 folder whose index or a data file had been
    replaced by a directory; the daemon then refused at start, the index with a bare
    'Is a directory'. The check names the file; a folder holding only files passes."""
    directory = tmp_path / "l2"
    directory.mkdir(mode=0o700)
    config = load_config(None, _l2_sets(tmp_path, directory))
    for other in ("index.sqlite3", "lock", "data-0000.bin", "data-0001.bin"):
        (directory / other).write_bytes(b"")
    assert preflight.check(config, HOST) == []
    (directory / name).unlink(missing_ok=True)
    (directory / name).mkdir()
    problems = preflight.check(config, HOST)
    assert _keys(problems) == ["tiers.l2.path"]
    assert f"L2 file {directory / name} is a directory" in str(problems[0])


@pytest.mark.parametrize(
    "name",
    ["index.sqlite3", "index.sqlite3-wal", "index.sqlite3.restore", "lock", "data-0000.bin"],
)
def test_regression_an_l2_file_that_is_a_link_is_refused_by_the_checks(tmp_path, name):
    """A symbolic link where an L2 file goes (planted while the folder was open to others):
    the checks passed it, as a link to a regular file, and the tier followed it, making the
    file it named (anywhere, as root any file) a data file of 8 MiB, mode 0600."""
    directory = tmp_path / "l2"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    config = load_config(None, _l2_sets(tmp_path, directory))
    (directory / name).symlink_to(victim)
    problems = preflight.check(config, HOST)
    assert _keys(problems) == ["tiers.l2.path"]
    assert f"L2 file {directory / name} is a symbolic link" in str(problems[0])
    assert victim.read_bytes() == b"precious"


def test_regression_an_l2_within_its_index_of_the_free_space_passed_the_check(
    tmp_path, monkeypatch
):
    """--check-config (and the daemon's own preflight) said ok for an L2 capacity within
    ~20 KiB of the filesystem's free space; the disk tier then refused to start, its index
    having taken those bytes before it checked. One rule (``space_shortfall``) now answers
    both, on a filesystem whose free space is ``total`` less what the tier's files hold."""
    from kvtier.tiers.base import TierUnavailable
    from kvtier.tiers.disk import DiskTier

    real_statvfs = os.statvfs
    total = 0

    def statvfs(path):
        if not str(path).startswith(str(tmp_path)):
            return real_statvfs(path)
        held = sum(p.lstat().st_blocks * 512 for p in tmp_path.rglob("*"))
        free = max(0, total - held) // 4096
        return os.statvfs_result((4096, 4096, total // 4096, free, free, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", statvfs)
    data = 4 << 20
    outcomes = []
    for total in [data + (k << 10) for k in (-4, 0, 4, 20, 40, 1020, 1024, 1028, 2048)]:
        directory = tmp_path / f"l2-{total}"
        config = load_config(
            None,
            [
                f"server.socket={tmp_path}/s.sock",
                "tiers.l2.enabled=true",
                f"tiers.l2.path={directory}",
                "tiers.l2.capacity_bytes=4MiB",
                "tiers.l2.segment_bytes=1MiB",
            ],
        )
        problems = preflight.check(config, HOST)
        try:
            DiskTier(directory, 4 << 20, 1 << 20).close()
            started = True
        except TierUnavailable as e:
            assert "cannot hold" in str(e)
            started = False
        assert started == (problems == []), (total, problems)
        outcomes.append(started)
        shutil.rmtree(directory)
    # Room for the data files alone is refused: the tier's index needs some too.
    assert outcomes == [False] * 6 + [True] * 3


def test_an_l3_password_file_the_tier_cannot_read_is_refused_by_the_checks(tmp_path):
    """--check-config said 'config ok' for an L3 password file of bytes that are not UTF-8;
    the start then ended with a traceback. The check reads it as the tier does."""
    pw = tmp_path / "l3.password"
    pw.write_bytes(b"\xff\xfe\n")
    pw.chmod(0o600)
    sets = [
        f"server.socket={tmp_path}/s.sock",
        "tiers.l3.enabled=true",
        f"tiers.l3.password_file={pw}",
    ]
    problems = preflight.check(load_config(None, sets), HOST)
    assert _keys(problems) == ["tiers.l3.password_file"]
    assert "is not UTF-8 text" in str(problems[0])
    pw.write_text("s3cret\n")
    assert preflight.check(load_config(None, sets), HOST) == []


# kvtierd in a Python where redis-py cannot be imported, as in `make run`'s venv (runtime
# dependencies only; L3's redis-py is the `redis` extra).
_WITHOUT_REDIS = (
    "import sys; sys.modules['redis'] = None; "
    "from kvtier.daemon.entry import main; sys.exit(main())"
)


def test_an_enabled_l3_without_redis_py_is_refused_by_the_checks(tmp_path, monkeypatch):
    """Regression: with L3 enabled in `make run`'s venv, which lacks redis-py, --check-config
    said 'config ok' (exit 0) and the start ended with an ImportError traceback (exit 1)."""
    sets = [f"server.socket={tmp_path}/s.sock", "tiers.l3.enabled=true"]
    assert preflight.check(load_config(None, sets), HOST) == []
    assert "L3: single at redis://127.0.0.1:6379" in preflight.summary(load_config(None, sets))
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis...` raises ImportError
    problems = preflight.check(load_config(None, sets), HOST)
    assert _keys(problems) == ["tiers.l3.enabled"]
    assert "pip install 'kvtier[redis]'" in str(problems[0])
    assert preflight.check(load_config(None, sets[:1]), HOST) == []  # L3 off: not needed
    assert "L3: off" in preflight.summary(load_config(None, sets[:1]))
    for mode in ("--check-config", None):
        args = [sys.executable, "-c", _WITHOUT_REDIS, *_sets(*sets)]
        r = subprocess.run(
            args + ([mode] if mode else []), capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 1, (mode, r.stdout, r.stderr)
        assert "config ok" not in r.stdout
        assert "Traceback" not in r.stderr, r.stderr
        assert "cannot start: tiers.l3.enabled: the L3 tier needs redis-py" in r.stderr
        assert not (tmp_path / "s.sock").exists()


# kvtierd as in an environment without torch (the image's, `make run`'s): torch is the
# `torch` extra, which page-locking L1 and the GPU tier need.
_WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; "
    "from kvtier.daemon.entry import main; sys.exit(main())"
)


@pytest.mark.parametrize(
    "setting", ["tiers.l1.pin_memory=true", "tiers.l0.enabled=true"], ids=["pin", "l0"]
)
def test_regression_a_gpu_setting_without_torch_was_a_traceback(tmp_path, monkeypatch, setting):
    """Regression: tiers.l1.pin_memory=true (or tiers.l0.enabled=true) where torch is not
    installed passed --check-config ('config ok') and the start ended with a
    ModuleNotFoundError traceback."""
    sets = [f"server.socket={tmp_path}/s.sock", setting]
    key = setting.partition("=")[0]
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    problems = preflight.check(load_config(None, sets), HOST)
    assert _keys(problems) == [key]
    assert "pip install 'kvtier[torch]'" in str(problems[0])
    assert preflight.check(load_config(None, sets[:1]), HOST) == []  # neither: not needed
    for mode in ("--check-config", None):
        args = [sys.executable, "-c", _WITHOUT_TORCH, *_sets(*sets)]
        r = subprocess.run(
            args + ([mode] if mode else []), capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 1, (mode, r.stdout, r.stderr)
        assert "config ok" not in r.stdout
        assert "Traceback" not in r.stderr, r.stderr
        assert f"cannot start: {key}: " in r.stderr, r.stderr
        assert not (tmp_path / "s.sock").exists()


def test_regression_pinning_l1_on_a_host_without_cuda_was_a_traceback(tmp_path):
    """Regression: tiers.l1.pin_memory=true where torch sees no CUDA device (none here:
    CUDA_VISIBLE_DEVICES hides any) ended the start with a RuntimeError traceback; it is one
    line naming the key, as tiers.l0.enabled's is."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.daemon",
            *_sets(f"server.socket={tmp_path}/s.sock", "tiers.l1.pin_memory=true"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "cannot start: tiers.l1.pin_memory=true needs a CUDA device" in r.stderr, r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_regression_pin_memory_auto_on_a_gpu_host_without_torch_ended_the_start(
    monkeypatch, caplog
):
    """Regression: with tiers.l1.pin_memory auto (the default), a host with a GPU driver
    and no torch (the image, no torch in it, on a GPU node whose container runtime mounts
    /dev/nvidiactl) ended the start with a ModuleNotFoundError traceback. Auto pins only
    where it can. The driver's device is the GPU boundary: it cannot exist here."""
    exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl" or exists(p))
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with caplog.at_level(logging.INFO, logger="kvtier.daemon.stack"):
        assert stack._want_pinning(load_config(None)) is False
    assert "L1 is not page-locked (tiers.l1.pin_memory=auto)" in caplog.text


def test_an_l2_directory_another_daemon_holds_is_refused_by_the_checks_too(
    tmp_path, daemon_factory
):
    """The second daemon refused to start ('in use by another process'), after allocating
    L1, while --check-config said 'config ok'."""
    l2 = [
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp_path}/l2",
        "tiers.l2.capacity_bytes=64MiB",
        "tiers.l2.file_bytes=64MiB",
    ]
    d = daemon_factory(*l2)
    config = load_config(None, [f"server.socket={tmp_path}/other.sock", *l2])
    problems = preflight.check(config, HOST)
    assert _keys(problems) == ["tiers.l2.path"] and "in use" in str(problems[0])
    d.stop()
    assert preflight.check(config, HOST) == []


def test_a_daemon_starting_while_check_config_probes_its_l2_lock_starts(tmp_path, monkeypatch):
    """Regression: --check-config took the L2 directory's lock for a moment, and a daemon
    opening the directory in that moment failed ('in use by another process'). The probe
    now holds it shared, as no tier does, and a tier that finds only such holders tries
    again. Deterministic: the tier's first attempt is made while the probe holds the lock,
    and the probe lets go only after that attempt failed."""
    import fcntl
    import threading

    from kvtier.tiers.base import TierUnavailable
    from kvtier.tiers.disk.tier import DiskTier

    directory = tmp_path / "l2"
    DiskTier(directory, 8 << 20, 1 << 20, file_bytes=8 << 20, direct_io=False).close()
    real_flock = fcntl.flock
    probe_thread = threading.get_ident()
    tier_tried = threading.Event()
    opened: list[object] = []

    def open_tier() -> None:
        try:
            opened.append(DiskTier(directory, 8 << 20, 1 << 20, file_bytes=8 << 20))
        except TierUnavailable as e:
            opened.append(e)
            tier_tried.set()

    def flock(fd: int, op: int) -> None:
        if threading.get_ident() != probe_thread:  # the tier's
            try:
                real_flock(fd, op)
            except OSError:
                tier_tried.set()
                raise
            return
        real_flock(fd, op)
        if op & fcntl.LOCK_UN:
            return
        starting = threading.Thread(target=open_tier)
        starting.start()  # while the probe holds the lock
        assert tier_tried.wait(30)
        monkeypatch.setattr(fcntl, "flock", real_flock)  # the probe goes on, lets go
        starting_threads.append(starting)

    starting_threads: list[threading.Thread] = []
    monkeypatch.setattr(fcntl, "flock", flock)
    config = load_config(
        None,
        [
            f"server.socket={tmp_path}/d.sock",
            "tiers.l2.enabled=true",
            f"tiers.l2.path={directory}",
            "tiers.l2.capacity_bytes=8MiB",
            "tiers.l2.segment_bytes=1MiB",
            "tiers.l2.file_bytes=8MiB",
        ],
    )
    assert preflight.check(config, HOST) == []
    assert len(starting_threads) == 1
    starting_threads[0].join(30)
    assert len(opened) == 1 and isinstance(opened[0], DiskTier), opened
    tier = opened[0]
    try:  # and while it holds the directory, the probe says so, and a second tier is refused
        problems = preflight.check(config, HOST)
        assert _keys(problems) == ["tiers.l2.path"] and "in use" in str(problems[0])
        with pytest.raises(TierUnavailable, match="in use"):
            DiskTier(directory, 8 << 20, 1 << 20, file_bytes=8 << 20)
    finally:
        tier.close()


def test_a_second_daemon_on_the_same_tcp_address_is_refused(tmp_path, daemon_factory):
    """gRPC binds TCP with SO_REUSEPORT by default: a second daemon given the first one's
    server.tcp_address started and listened beside it, and the kernel split the clients'
    connections between the two."""
    token = tmp_path / "t.token"
    token.write_text("s" * 32)
    token.chmod(0o600)
    tenants = f"tenants=[{{name: r, token_file: {token}}}]"
    # The port the first one took (one chosen before its start may be taken by then).
    first = daemon_factory("server.tcp_address=127.0.0.1:0", tenants)
    tcp = [f"server.tcp_address={first.tcp_address()}", tenants]
    proc = _kvtierd(*_sets(f"server.socket={tmp_path}/second.sock", *tcp))
    assert proc.returncode == 1, proc.stderr
    assert "server.tcp_address" in proc.stderr and "in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_metrics_token_file_others_may_read_is_refused(tmp_path):
    token = tmp_path / "metrics.token"
    token.write_text("m" * 32)
    token.chmod(0o644)
    sets = [
        f"server.socket={tmp_path}/s.sock",
        "metrics.address=127.0.0.1:0",
        f"metrics.token_file={token}",
    ]
    problems = preflight.check(load_config(None, sets), HOST)
    assert _keys(problems) == ["metrics.token_file"]
    assert "chmod 600" in str(problems[0])
    token.chmod(0o600)
    assert preflight.check(load_config(None, sets), HOST) == []


def test_two_tenants_with_the_same_token_are_refused(tmp_path):
    """Such a token binds neither tenant (it is refused as ambiguous): say so at start."""
    files = []
    for name, secret in (("a", "one-secret-of-both"), ("b", "one-secret-of-both"), ("c", "c" * 20)):
        path = tmp_path / f"{name}.token"
        path.write_text(secret + "\n")
        path.chmod(0o600)
        files.append(f"{{name: {name}, token_file: {path}}}")
    sets = [f"server.socket={tmp_path}/s.sock", f"tenants=[{', '.join(files)}]"]
    problems = preflight.check(load_config(None, sets), HOST)
    assert _keys(problems) == ["tenants[1].token_file"]
    assert "same token as tenant 'a'" in str(problems[0])
    (tmp_path / "b.token").write_text("b" * 20)
    assert preflight.check(load_config(None, sets), HOST) == []


def _problems_as_user(sets: list[str]) -> list[str]:
    """The checks' problems for ``sets``, as an unprivileged user: root searches every
    folder, so as root the checks run in a child dropped to nobody."""
    config = load_config(None, sets)

    def check() -> list[str]:
        return [str(p) for p in preflight.check(config, HOST)]

    return run_as(NOBODY, NOGROUP, check) if os.geteuid() == 0 else check()


def test_regression_a_socket_or_l2_path_under_a_file_was_a_traceback(tmp_path):
    """server.socket (or tiers.l2.path) inside what is a file, not a folder: the checks
    ended kvtierd (and --check-config) with a NotADirectoryError traceback for the socket,
    and the disk check said the file "is not writable by uid 0"."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    problems = preflight.check(load_config(None, [f"server.socket={not_a_folder}/s.sock"]), HOST)
    assert _keys(problems) == ["server.socket"]
    assert f"{not_a_folder} is not a directory" in str(problems[0])
    sets = [
        f"server.socket={tmp_path}/s.sock",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={not_a_folder}/deeper/l2",
    ]
    problems = preflight.check(load_config(None, sets), HOST)
    assert _keys(problems) == ["tiers.l2.path"]
    assert f"{not_a_folder} is not a directory" in str(problems[0])


def test_regression_a_socket_or_l2_path_in_a_folder_the_user_may_not_search_was_a_traceback():
    """kvtierd run by a user whose server.socket or tiers.l2.path lies in a folder it may not
    search (another user's home, say): the checks ended with a PermissionError traceback.
    Each is now a problem naming the folder."""
    # Not pytest's tmp_path: its folders above are root's 0700, which nobody may not search.
    base = Path(tempfile.mkdtemp(prefix="kvtier-search-"))
    try:
        base.chmod(0o711)
        private = base / "private"
        private.mkdir()
        private.chmod(0o700 if os.geteuid() == 0 else 0o000)
        sockets = base / "sockets"
        sockets.mkdir()
        sockets.chmod(0o755)
        if os.geteuid() == 0:
            os.chown(sockets, NOBODY, NOGROUP)
        socket_problems = _problems_as_user([f"server.socket={private}/sub/s.sock"])
        l2_problems = _problems_as_user(
            [
                f"server.socket={sockets}/s.sock",
                "tiers.l2.enabled=true",
                f"tiers.l2.path={private}/sub/l2",
            ]
        )
    finally:
        (base / "private").chmod(0o700)
        shutil.rmtree(base)
    assert isinstance(socket_problems, list), socket_problems
    assert len(socket_problems) == 1, socket_problems
    assert socket_problems[0].startswith("server.socket:")
    assert f"may not search {private}" in socket_problems[0]
    assert isinstance(l2_problems, list), l2_problems
    assert len(l2_problems) == 1, l2_problems
    assert l2_problems[0].startswith("tiers.l2.path:")
    assert f"may not search {private}" in l2_problems[0]


def _l2_sets(tmp_path: Path, directory: Path) -> list[str]:
    return [
        f"server.socket={tmp_path}/s.sock",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={directory}",
        "tiers.l2.capacity_bytes=8MiB",
        "tiers.l2.file_bytes=4MiB",
        "tiers.l2.segment_bytes=1MiB",
    ]


def test_regression_an_l2_folder_of_another_user_passed_the_checks(tmp_path):
    """An L2 folder another user made (in /tmp, before the daemon did) passed: the tier
    sets it 0700, but its owner may loosen it again and plant links where the index, its
    WAL or journal goes, which SQLite follows (as root, to any file). Refused as the socket's
    folder is, naming the folder, its owner and the chown; root's or the daemon's passes."""
    require_root()
    directory = tmp_path / "l2"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOGROUP)
    problems = preflight.check(load_config(None, _l2_sets(tmp_path, directory)), HOST)
    assert _keys(problems) == ["tiers.l2.path"]
    assert f"the L2 folder {directory} belongs to uid {NOBODY}" in str(problems[0])
    assert f"chown -R 0 {directory}" in str(problems[0])
    proc = _kvtierd("--check-config", *_sets(*_l2_sets(tmp_path, directory)))
    assert proc.returncode == 1 and f"belongs to uid {NOBODY}" in proc.stdout + proc.stderr
    os.chown(directory, 0, 0)
    assert preflight.check(load_config(None, _l2_sets(tmp_path, directory)), HOST) == []


def test_regression_an_l2_folder_in_a_folder_others_may_write_passed_the_checks(tmp_path):
    """A parent of the L2 folder that other users may write, without the sticky bit: they
    may rename the L2 folder away and put their own, with links in it, in its place. A
    sticky parent (as /tmp) keeps them from renaming what is not theirs, and passes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "l2").mkdir(mode=0o700)
    for directory in (shared / "l2", shared / "absent" / "l2"):
        problems = preflight.check(load_config(None, _l2_sets(tmp_path, directory)), HOST)
        assert _keys(problems) == ["tiers.l2.path"]
        assert f"parent {shared} (mode 0777) is writable by other users" in str(problems[0])
    shared.chmod(0o1777)
    assert preflight.check(load_config(None, _l2_sets(tmp_path, shared / "l2")), HOST) == []


def test_regression_an_l2_path_that_is_a_dangling_link_passed_the_checks(tmp_path):
    """tiers.l2.path a symbolic link to a folder that does not exist: --check-config said
    'config ok', and the start failed with "cannot start: [Errno 17] File exists", naming
    no key. The checks name the link and where it points."""
    directory = tmp_path / "l2"
    directory.symlink_to(tmp_path / "nowhere")
    problems = preflight.check(load_config(None, _l2_sets(tmp_path, directory)), HOST)
    assert _keys(problems) == ["tiers.l2.path"]
    assert f"{directory} is a symbolic link to {tmp_path / 'nowhere'}, which does not" in str(
        problems[0]
    )
    (tmp_path / "nowhere").mkdir(mode=0o700)
    assert preflight.check(load_config(None, _l2_sets(tmp_path, directory)), HOST) == []


def test_regression_an_l3_removals_file_another_daemon_holds_passed_the_checks(tmp_path):
    """--check-config said 'config ok' for a tiers.l3.removals_file another daemon holds (a
    second daemon given it does not start), and the start then stopped on it, as for an L2
    directory another daemon holds, which the checks refuse. They name it too, taking its
    lock only shared and for a moment, so a daemon opening it meanwhile is not refused."""
    path = tmp_path / "removals.sqlite3"
    sets = [
        f"server.socket={tmp_path}/s.sock",
        "tiers.l3.enabled=true",
        f"tiers.l3.removals_file={path}",
    ]
    held = RemovalFile(path)
    try:
        problems = preflight.check(load_config(None, sets), HOST)
        r = _kvtierd("--check-config", *_sets(*sets))
    finally:
        held.close()
    assert [str(p) for p in problems] == [
        f"tiers.l3.removals_file: {path} is in use: another process holds its lock (a "
        "kvtierd running?): Resource temporarily unavailable"
    ]
    assert r.returncode == 1 and "config ok" not in r.stdout, (r.stdout, r.stderr)
    assert preflight.check(load_config(None, sets), HOST) == []  # let go: free
    RemovalFile(path).close()  # the probes left it to the next daemon


def test_regression_a_removals_file_a_check_held_refused_the_daemon_s_start(tmp_path):
    """Regression: the checks take tiers.l3.removals_file's lock shared, for a moment (b984fc9),
    and the tier took it exclusively without waiting, so a --check-config that held it just
    then (beside a daemon's restart) made the start fail ('in use by another process'): the
    L2 tier's lock waits out such probes, as this one does now. A daemon's hold is still
    refused at once."""
    path = tmp_path / "removals.sqlite3"
    RemovalFile(path).close()
    probe = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # as probe_lock holds it
    # Let go from another thread while the tier tries (a probe holds it for a moment).
    release = threading.Timer(0.2, os.close, (probe,))
    release.start()
    try:
        RemovalFile(path).close()
    finally:
        release.join()
    held = RemovalFile(path)
    try:
        with pytest.raises(RemovalFileError, match="in use by another process"):
            RemovalFile(path)
    finally:
        held.close()


def test_regression_an_l3_removals_file_the_tier_cannot_open_passed_the_checks(tmp_path):
    """--check-config said 'config ok' for a tiers.l3.removals_file in a folder that does not
    exist or that the daemon's user may not write (SQLite makes its journal files beside
    it), and the start then stopped naming it. The checks name it, as every start's do."""
    sets = [f"server.socket={tmp_path}/s.sock", "tiers.l3.enabled=true"]
    missing = tmp_path / "no such folder" / "removals.sqlite3"
    problems = preflight.check(
        load_config(None, [*sets, f"tiers.l3.removals_file={missing}"]), HOST
    )
    assert _keys(problems) == ["tiers.l3.removals_file"]
    assert f"its folder {missing.parent} does not exist" in str(problems[0])
    r = _kvtierd("--check-config", *_sets(*sets, f"tiers.l3.removals_file={missing}"))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "config ok" not in r.stdout
    assert "kvtierd: cannot start: tiers.l3.removals_file: cannot create" in r.stderr
    a_folder = tmp_path / "folder"
    a_folder.mkdir()
    problems = preflight.check(
        load_config(None, [*sets, f"tiers.l3.removals_file={a_folder}"]), HOST
    )
    assert [str(p) for p in problems] == [
        f"tiers.l3.removals_file: {a_folder} exists and is not a file"
    ]
    # Not pytest's tmp_path: its folders above are root's 0700, which nobody may not search.
    base = Path(tempfile.mkdtemp(prefix="kvtier-removals-"))
    try:
        base.chmod(0o755)  # root's: nobody may not write it
        in_base = f"tiers.l3.removals_file={base}/removals.sqlite3"
        sockets = base / "sockets"
        sockets.mkdir()
        if os.geteuid() == 0:
            os.chown(sockets, NOBODY, NOGROUP)
        else:
            base.chmod(0o555)
        user_sets = [f"server.socket={sockets}/s.sock", "tiers.l3.enabled=true"]
        refused = _problems_as_user([*user_sets, in_base])
        ok = _problems_as_user([*user_sets, f"tiers.l3.removals_file={sockets}/r.sqlite3"])
    finally:
        base.chmod(0o755)
        shutil.rmtree(base)
    assert refused == [
        f"tiers.l3.removals_file: cannot create or open {base}/removals.sqlite3: its folder "
        f"{base} is not writable by uid {NOBODY if os.geteuid() == 0 else os.geteuid()}"
    ]
    assert ok == []
    assert preflight.check(load_config(None, sets), HOST) == []  # not set: nothing to check


def test_regression_an_l3_removals_file_through_a_link_was_judged_by_the_links_folder():
    """SQLite makes a database's -wal and -shm files beside the file a link names, and the
    tier opens the file through the link: a removals_file linked from a folder the daemon
    may not write to one in a folder it may write was refused ("its folder ... is not
    writable"), though the daemon opens it; one linked the other way passed, and the start
    then stopped. The checks judge the folder the link leads to."""
    base = Path(tempfile.mkdtemp(prefix="kvtier-removals-"))
    try:
        base.chmod(0o755)  # root's: nobody may not write it
        sockets = base / "sockets"  # the user's own, where its socket goes too
        sockets.mkdir()
        (base / "into-writable").symlink_to(sockets / "removals.sqlite3")
        (sockets / "into-read-only").symlink_to(base / "removals.sqlite3")
        if os.geteuid() == 0:
            os.chown(sockets, NOBODY, NOGROUP)
        else:
            base.chmod(0o555)
        user_sets = [f"server.socket={sockets}/s.sock", "tiers.l3.enabled=true"]
        linked_ok = _problems_as_user([*user_sets, f"tiers.l3.removals_file={base}/into-writable"])
        linked_refused = _problems_as_user(
            [*user_sets, f"tiers.l3.removals_file={sockets}/into-read-only"]
        )

        def opened() -> str:
            RemovalFile(base / "into-writable").close()
            return "opened"

        opens = run_as(NOBODY, NOGROUP, opened) if os.geteuid() == 0 else opened()
    finally:
        base.chmod(0o755)
        shutil.rmtree(base)
    assert opens == "opened"
    assert linked_ok == []
    assert linked_refused == [
        f"tiers.l3.removals_file: cannot create or open {sockets}/into-read-only: its folder "
        f"{base} is not writable by uid {NOBODY if os.geteuid() == 0 else os.geteuid()}"
    ]


# kvtierd whose group lookups find a name only the first time it is asked for (a directory
# service that stops answering between two lookups).
_ENTRY_WITH_GROUPS_FOUND_ONCE = """
import grp, sys
from kvtier.daemon.main import main

asked = set()
getgrnam = grp.getgrnam

def found_once(name):
    if name in asked:
        raise KeyError(name)
    asked.add(name)
    return getgrnam(name)

grp.getgrnam = found_once
sys.exit(main(sys.argv[1:]))
"""


def test_regression_the_host_checks_looked_up_the_config_names_again(tmp_path):
    """The host checks ran outside the book of ids the config was loaded with (main's
    known_ids, which the daemon itself serves with), so they asked the host for
    server.socket_group a second time: a directory service that answered the load and not
    the checks ended kvtierd in a traceback (UnknownName), not the start it had checked. The
    checks now take the ids the config resolved, as the daemon does."""
    group = grp.getgrgid(os.getegid()).gr_name
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _ENTRY_WITH_GROUPS_FOUND_ONCE,
            "--check-config",
            *_sets(
                f"server.socket={tmp_path / 'd.sock'}",
                f"server.socket_group={group}",
                "tiers.l1.capacity_bytes=64MiB",
            ),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "config ok" in r.stdout, r.stderr
