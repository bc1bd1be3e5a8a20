"""Test harness: real kvtierd processes on temporary Unix sockets.

``start_daemon`` runs ``python -m kvtier.daemon`` as a subprocess with config overrides (by
default a child of a fork server that has done its imports: forkserver.py), waits until its
health check answers SERVING, and returns a handle to stop, kill or restart it and to read its
log. Sockets live under a short /tmp folder (Unix socket paths are limited to
107 bytes, and pytest's tmp_path can be longer).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from forkserver import DEFAULT_ENTRY, FORKABLE, ForkedDaemon, fork_server, forkable

from kvtier.client import Client, wait_until_serving
from kvtier.paths import unix_address

START_TIMEOUT_S = 60.0
_NAMESPACES = itertools.count()


@dataclass
class DaemonProcess:
    workdir: Path
    socket: str
    overrides: list[str]
    proc: subprocess.Popen[bytes] | ForkedDaemon | None = None
    # What runs the daemon, after the interpreter: ``-m kvtier.daemon`` unless a test says
    # otherwise (``-c CODE``). The default one, and code that starts with forkserver.FORKABLE
    # (``entry_setting``'s), is a child of this process's fork server (forkserver.py) where
    # it can be, without the ~0.4 s of CPU of the imports.
    entry: tuple[str, ...] = DEFAULT_ENTRY
    # tiers.l1.prefault, before the overrides (which may set it): not pre-faulted, the thread
    # faulting the arena in once the daemon serves took ~0.15 s of CPU for 128 MiB (2.2 s for
    # the default 1 GiB) beside ~0.45 s of the daemon's imports, where make test starts
    # hundreds of daemons on 2 cores.
    l1_prefault: str = "none"
    log_path: Path = field(init=False)
    _log_file: object = None

    def __post_init__(self) -> None:
        self.log_path = self.workdir / f"kvtierd-{os.getpid()}-{id(self)}.log"

    @property
    def address(self) -> str:
        return unix_address(self.socket)

    def start(self, wait: bool = True) -> DaemonProcess:
        args = [
            "--set",
            f"server.socket={self.socket}",
            "--set",
            f"tiers.l1.prefault={self.l1_prefault}",
            *self.overrides,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self._log_file = log
        server = fork_server() if self.entry == DEFAULT_ENTRY or forkable(self.entry) else None
        try:
            if server is not None and server.serves():
                self.proc = server.start(args, str(self.workdir), log.fileno(), self.entry)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, *self.entry, *args],
                    cwd=self.workdir,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        except BaseException:
            # No process to stop (the fork server kills a child it may still fork): none
            # would close the log.
            log.close()
            self._log_file = None
            raise
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                # A module fixture whose daemon never served yields nothing, so nothing
                # would stop it: it outlived the test run.
                self.kill()
                raise
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        proc = self.proc
        assert proc is not None

        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"kvtierd exited with {proc.returncode} during start:\n{self.log()}"
                )

        # The daemon binds its socket when it is about to serve: until the file is there a
        # health check cannot succeed, and wait_until_serving sleeps 50 ms after each failed
        # one. A stat every 5 ms finds the moment sooner (about 45 ms a start here, where the
        # tests start hundreds of daemons). A socket left by a killed run only skips this.
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.socket) and time.monotonic() < deadline:
            alive()
            time.sleep(0.005)
        try:
            wait_until_serving(self.address, max(0.0, deadline - time.monotonic()), check=alive)
            self.wait_recovered(timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"{e}:\n{self.log()}") from None

    def wait_recovered(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until the daemon has indexed every block its disk tier held (it serves while
        it does, so a test that restarts it and expects every block back waits for this)."""
        wait_gauge_clear(self, "recovering", timeout_s, "kvtierd still recovering")

    def client(self, **kwargs: object) -> Client:
        return Client(self.address, **kwargs)  # type: ignore[arg-type]

    def tcp_address(self) -> str:
        """``host:port`` of the daemon's TCP listener as its start line names it: the port
        it took where ``server.tcp_address`` asked for port 0. A test lets the daemon take
        one so: a port a test found free and let go may be bound by any process before the
        daemon binds it (other workers' daemons and Redis servers do)."""
        # The line's Unix socket is this handle's, written as it is (its path may hold
        # spaces), and a JSON log's line is its "msg" (escaped); the last start's line, as a
        # restarted daemon logs to the same file (it may have taken another port).
        start = re.compile(re.escape(f"kvtierd listening on {self.address}, ") + r"(\S+)")
        found = [
            match.group(1)
            for line in self.log().splitlines()
            if (match := start.search(_message(line)))
        ]
        assert found, f"no TCP listener in the daemon's start line:\n{self.log()}"
        return found[-1]

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait: the graceful path (drain, flush)."""
        return self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> int:
        """SIGKILL: the crash path."""
        return self._signal(signal.SIGKILL, 10.0)

    def restart(self, wait: bool = True) -> DaemonProcess:
        if self.running():
            self.stop()
        return self.start(wait)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _signal(self, sig: int, timeout_s: float) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.wait()  # ended: its status
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None
        return code


def _message(line: str) -> str:
    """A log line's message: a JSON line's "msg", else the line."""
    if line.startswith("{"):
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and isinstance(entry.get("msg"), str):
                return entry["msg"]
    return line


class DaemonFactory:
    """Starts daemons for one test and stops every one of them afterwards."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._sockdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
        self._daemons: list[DaemonProcess] = []

    def __call__(
        self,
        *overrides: str,
        l1_bytes: str = "128MiB",
        wait: bool = True,
        entry: tuple[str, ...] = DEFAULT_ENTRY,
    ) -> DaemonProcess:
        sock = os.path.join(self._sockdir, f"d{len(self._daemons)}.sock")
        d = DaemonProcess(
            self.workdir, sock, [f"tiers.l1.capacity_bytes={l1_bytes}", *overrides], entry=entry
        )
        d.overrides = [arg for o in d.overrides for arg in ("--set", o)]
        self._daemons.append(d)
        return d.start(wait)

    def close(self) -> None:
        """SIGKILL every daemon still running: the end of a test is no test of the graceful
        stop (the tests of it call ``stop()`` and check what it did), which drains and
        flushes L1 to L2 first, tenths of a second a daemon that nothing here reads. The
        daemons start no processes of their own, so nothing outlives them."""
        for d in self._daemons:
            d.kill()
        shutil.rmtree(self._sockdir, ignore_errors=True)


class NamespacedDaemon:
    """A daemon shared by the tests of a module, seen by one test through a namespace of its
    own: its clients call in ``namespace`` unless told otherwise, so the blocks of earlier
    tests on the same daemon are not there for it (a fresh daemon, as far as keys go). Made
    by ``fresh`` (through the ``namespaced_daemon`` fixture, for instance), which first waits
    until the pools of earlier tests are gone. Tests that kill, stop or reconfigure their
    daemon start their own."""

    def __init__(self, daemon: DaemonProcess, namespace: str) -> None:
        self.daemon = daemon
        self.namespace = namespace

    @classmethod
    def fresh(cls, daemon: DaemonProcess) -> NamespacedDaemon:
        """A view of ``daemon`` in a namespace no earlier view had, once the daemon holds no
        pool of an earlier test."""
        view = cls(daemon, f"test-{next(_NAMESPACES)}")
        view.wait_no_pools()
        return view

    @property
    def address(self) -> str:
        return self.daemon.address

    def client(self, **kwargs: object) -> Client:
        kwargs.setdefault("namespace", self.namespace)
        return self.daemon.client(**kwargs)

    def log(self) -> str:
        return self.daemon.log()

    def wait_no_pools(self, timeout_s: float = 30.0) -> None:
        wait_no_pools(self.daemon, timeout_s)


def wait_no_pools(daemon: DaemonProcess, timeout_s: float = 30.0) -> None:
    """Wait until ``daemon`` holds no registered pool: a daemon shared by tests drops the
    pools of an earlier test's sessions as it sees those sessions end."""
    wait_gauge_clear(daemon, "pools", timeout_s, "the shared daemon still holds pools")


def wait_gauge_clear(daemon: DaemonProcess, gauge: str, timeout_s: float, what: str) -> None:
    """Wait until ``daemon``'s gauge ``gauge`` is 0 (TimeoutError saying ``what`` if not)."""
    deadline = time.monotonic() + timeout_s
    with daemon.client() as client:
        while client.stats().gauges.get(gauge, 0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} after {timeout_s}s")
            time.sleep(0.01)


# entry_setting's test of a constant: the other loaded modules that bound it by name as they
# imported it. Not one that holds the same object under that name as a constant of its own
# (a cached small int: arc's and lru's _SCAN_BATCH), nor one without the name (None).
_IMPORTED_BY_NAME = """
def imported_by_name(module, name):
    import ast, contextlib, importlib.util, inspect
    value, missing, held = getattr(module, name), object(), []
    for other_name, other in list(sys.modules.items()):
        if other is module or getattr(other, "__dict__", {}).get(name, missing) is not value:
            continue
        try:
            tree = ast.parse(inspect.getsource(other))
        except (OSError, TypeError, SyntaxError):  # no source of its own: no import of ours
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not any(alias.name in (name, "*") for alias in node.names):
                continue
            base = "." * node.level + (node.module or "")
            with contextlib.suppress(ImportError, ValueError):  # relative beyond the top
                origin = importlib.util.resolve_name(base, other.__package__ or "")
                if origin == module.__name__:
                    held.append(other_name)
                    break
    return held
"""


def entry_setting(constants: dict[str, float]) -> tuple[str, ...]:
    """A daemon entry that sets module constants before kvtierd starts, for intervals that
    are not configuration (``{"kvtier.daemon.connections.CHECK_INTERVAL_S": 0.2}``): a test
    that waits for a periodic check then waits a fraction of the default's period. Forked
    (forkserver.FORKABLE) where it can be, after the daemon's imports: a constant that
    another module took by name as it was imported (``from ... import NAME``) would keep
    its value there, so the daemon refuses one that another module imported so."""
    lines = [FORKABLE + "import importlib, sys", _IMPORTED_BY_NAME]
    for dotted, value in constants.items():
        module, name = dotted.rsplit(".", 1)
        lines.append(f"module = importlib.import_module({module!r})")
        lines.append(f"assert hasattr(module, {name!r}), {dotted!r}")
        lines.append(f"held = imported_by_name(module, {name!r})")
        lines.append(f"assert not held, f'{dotted} is also bound in {{held}}'")
        lines.append(f"setattr(module, {name!r}, {value!r})")
    lines += ["from kvtier.daemon.entry import main", "sys.exit(main())"]
    return ("-c", "\n".join(lines))


def l2_quota_args(path: Path, quota_bytes: int) -> tuple[str, ...]:
    """Overrides for a daemon with an L2 at ``path`` on which the tests' own tenant (their
    uid's) may hold ``quota_bytes``: puts past it are held above the disk, not written. The
    blocks written stay protected for the test's length (``policy.protect_s``): past the 2 s
    default the quota evicts them for the next put's, which is then written."""
    return (
        "tiers.l2.enabled=true",
        f"tiers.l2.path={path}",
        "tiers.l2.capacity_bytes=16MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=16MiB",
        "policy.protect_s=3600",
        f"tenants=[{{name: ops, uids: [{os.getuid()}], admin: true, "
        f"quotas: {{l2: {quota_bytes}}}}}]",
    )


@contextlib.contextmanager
def held_port(shared: bool = True) -> Iterator[int]:
    """A loopback TCP port kept bound, not listening, by this process until the block ends:
    for a port a test must name before its server starts (two daemons on one port, a server
    started late on a port a client was given). A port found free and let go may be any
    process's by the time the server binds it; while this one is bound, the kernel gives it
    to no bind of port 0 elsewhere, and a connect to it is refused until a server listens.
    ``shared``: bound with SO_REUSEADDR, so that a server binding so too (kvtierd's gRPC and
    metrics listeners and its host check, redis-server) listens on it beside this socket;
    only a process that chose the same number before it was held could still bind it so,
    and then the later of the two servers fails to start, saying the port is in use. Not
    shared: no one else may bind it at all."""
    with socket.socket() as s:
        if shared:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def tenant_token(folder: Path, name: str) -> tuple[Path, str]:
    """A token file of tenant ``name`` in ``folder``, private to its owner as the daemon
    requires, and the ``tenants=`` override that declares the tenant by it."""
    token = folder / f"{name}.token"
    token.write_text(f"a-long-enough-secret-for-tenant-{name}\n")
    token.chmod(0o600)
    return token, f"tenants=[{{name: {name}, token_file: {token}}}]"


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler in for ``signum`` now (its SigCgt mask): how a
    test knows a starting daemon has reached the point where a signal is held."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def run_into_closed_pipe(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with stdout a pipe whose reader is gone before the first
    write (EPIPE, whatever the timing: ``... | head`` once head has exited); stderr kept."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
