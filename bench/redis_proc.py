"""Real ``redis-server`` processes on loopback, for the L3 benchmark and tests.

``RedisServer`` is one server in its own folder, on a free loopback port, with a config file
written there (a password, if any, goes in that file, never on a command line). A port taken
by another process between its choice and the server's bind (its log says so as it exits)
is chosen afresh, as long as nobody has been told it yet: at a server's first start.
``RedisClusterProcs`` is N such servers joined into a Redis Cluster with ``redis-cli --cluster
create`` (masters only, or with ``replicas`` per master). Both are context managers and stop every process they started;
each server also dies with the process that started it (Linux parent-death signal), so a
crashed test run leaves nothing behind. Nothing is persisted: a server restarted with
``start()`` comes back empty (a cluster node keeps its ``nodes.conf``, so it rejoins with
its slots).

Thread-safety: none; one owner drives each object.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


class RedisProcError(RuntimeError):
    """A server could not be started, or a cluster could not be formed."""


def redis_binaries() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli``; RedisProcError naming the missing one."""
    found = []
    for name in ("redis-server", "redis-cli"):
        path = shutil.which(name) or next(
            (p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}") if os.access(p, os.X_OK)),
            None,
        )
        if path is None:
            raise RedisProcError(
                f"{name} is not installed (Debian: apt-get install redis-server; .ci/run does)"
            )
        found.append(path)
    return found[0], found[1]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (all bound at once, then let go): free when
    chosen, not when used, as anything on the machine may bind one meanwhile."""
    with contextlib.ExitStack() as stack:
        held = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            held.append(int(s.getsockname()[1]))
        return held


# A server whose ports were taken between their choice and its bind starts again on fresh
# ones, this many times in all.
START_ATTEMPTS = 5
_IN_USE = re.compile(r"Failed listening on port (\d+) \((\w+)\)")


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls_files(folder: Path, name: str = "ca") -> TlsFiles:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it (``openssl`` CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisProcError("openssl is not installed (Debian: apt-get install openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca = folder / f"{name}.key", folder / f"{name}.pem"
    key, csr, cert = folder / "server.key", folder / "server.csr", folder / "server.pem"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    sign = ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial"]
    steps = [
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", f"/CN={name}"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [*sign, "-out", cert, "-days", "2", "-extfile", ext],
    ]
    for step in steps:
        done = subprocess.run([openssl, *map(str, step)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RedisProcError(f"openssl {step[0]}: {done.stderr.strip()}")
    return TlsFiles(ca, cert, key)


def _dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when this process dies (Linux parent-death
    signal, set by util-linux's ``setpriv``; where it is missing, ``stop()`` and the fixtures
    are the only cleanup). Not a ``preexec_fn``: running Python in the child of a threaded
    process before ``exec`` can abort it (another thread held a lock at the fork), which is
    how a cluster node restarted while client threads ran once died of SIGABRT."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else argv


class PortInUse(RedisProcError):
    """The server exited because one of its ports was bound by another socket."""

    def __init__(self, message: str, port: int, kind: str) -> None:
        super().__init__(message)
        self.port = port
        self.kind = kind


class RedisServer:
    """One ``redis-server``. ``start()`` (again after ``kill()`` or ``stop()``: same port,
    same folder, empty data) and ``stop()``; ``kill()`` is a crash (SIGKILL).

    Ports not given are chosen with ``choose_ports`` (n distinct ports free now). One taken
    by another process before the server binds it makes the first ``start()`` choose them
    again and retry (``START_ATTEMPTS`` in all), so ``port`` and ``url`` are the server's
    once it has started; a port given, or one that served, is kept: its loss is an error."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        cluster: bool = False,
        password: str | None = None,
        maxmemory_bytes: int = 0,
        extra_config: str = "",
        cluster_node_timeout_ms: int = 1000,
        tls: TlsFiles | None = None,
        choose_ports: Callable[[int], list[int]] = free_ports,
    ) -> None:
        self.server_bin, self.cli_bin = redis_binaries()
        self.tls = tls
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.password = password
        self.maxmemory_bytes = maxmemory_bytes
        self.extra_config = extra_config
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.choose_ports = choose_ports
        # The cluster bus port is given too (not the default port + 10000, which nothing
        # checked was free).
        self.port, self.cluster_port = port or 0, 0
        self._ports_kept = bool(port)
        self._choose_ports()
        self.proc: subprocess.Popen[bytes] | None = None

    def _choose_ports(self) -> None:
        n = (0 if self._ports_kept else 1) + (1 if self.cluster else 0)
        chosen = self.choose_ports(n) if n else []
        if not self._ports_kept:
            self.port = chosen.pop(0)
        if self.cluster:
            self.cluster_port = chosen.pop(0)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        if self.tls is not None:
            ports = [
                "port 0",
                f"tls-port {self.port}",
                f'tls-cert-file "{self.tls.server_cert}"',
                f'tls-key-file "{self.tls.server_key}"',
                f'tls-ca-cert-file "{self.tls.ca_cert}"',
                "tls-auth-clients no",
            ]
        else:
            ports = [f"port {self.port}"]
        lines = [
            "bind 127.0.0.1",
            *ports,
            f'dir "{self.dir}"',
            f'logfile "{self.dir / "redis.log"}"',
            "daemonize no",
            "protected-mode no",
            'save ""',
            "appendonly no",
            "io-threads 1",
        ]
        if self.password is not None:
            lines.append(f'requirepass "{self.password}"')
        if self.maxmemory_bytes:
            lines += [f"maxmemory {self.maxmemory_bytes}", "maxmemory-policy noeviction"]
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                'cluster-config-file "nodes.conf"',
                f"cluster-node-timeout {self.cluster_node_timeout_ms}",
                f"cluster-port {self.cluster_port}",
            ]
        if self.extra_config:
            lines.append(self.extra_config)
        path = self.dir / "redis.conf"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return path

    def start(self, timeout_s: float = 15.0) -> None:
        if self.running:
            return
        if self._ports_kept:
            self._start_once(timeout_s)
            return
        taken = []
        for attempt in range(START_ATTEMPTS):
            if attempt:
                # What the failed server wrote of itself names the ports it did not get.
                with contextlib.suppress(FileNotFoundError):
                    (self.dir / "nodes.conf").unlink()
                self._choose_ports()
            try:
                self._start_once(timeout_s)
            except PortInUse as e:
                taken.append(f"{e.port} ({e.kind})")
                continue
            self._ports_kept = True
            return
        raise RedisProcError(
            f"redis-server in {self.dir} found its port taken on each of {START_ATTEMPTS} "
            f"starts, on fresh ports each time: {', '.join(taken)} in use"
        )

    def _start_once(self, timeout_s: float) -> None:
        conf = self._write_config()
        # Nothing persisted is wanted back: a restart is an empty server.
        for name in ("dump.rdb", "appendonly.aof"):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
        log = self.dir / "redis.log"
        logged = log.stat().st_size if log.exists() else 0
        # What the server says before its log file is open goes here.
        with open(self.dir / "redis.stderr", "wb") as err:
            self.proc = subprocess.Popen(
                _dying_with_parent([self.server_bin, str(conf)]),
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=subprocess.STDOUT,
            )
        # Another server that holds the port would answer a PING: ready is this one's pid.
        ours = f"process_id:{self.proc.pid}"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                said = ""
                with contextlib.suppress(FileNotFoundError), open(log, "rb") as f:
                    f.seek(logged)
                    said = f.read().decode(errors="replace")
                failed = _IN_USE.search(said)
                if failed and "Address already in use" in said:
                    raise PortInUse(
                        f"redis-server in {self.dir}: port {failed[1]} ({failed[2]}) in use",
                        int(failed[1]),
                        failed[2],
                    )
                early = (self.dir / "redis.stderr").read_text(errors="replace").strip()
                raise RedisProcError(
                    f"redis-server on port {self.port} exited with {self.proc.returncode}: "
                    f"{early[-500:] or '(nothing on stderr)'}; log: {self.log_tail()}"
                )
            # Whatever holds the port may never answer (a hung server, a silent listener):
            # wait for an answer a moment at a time, and see between whether ours exited.
            left_s = deadline - time.monotonic()
            try:
                info = self.cli("INFO", "server", check=False, timeout_s=min(1.0, max(left_s, 0.1)))
            except subprocess.TimeoutExpired:
                info = ""
            if ours in info.split():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RedisProcError(
                    f"redis-server on port {self.port} did not answer INFO with its {ours} "
                    f"in {timeout_s} s"
                )
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown work."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing (a hung store)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def cli(self, *args: str, check: bool = True, timeout_s: float = 30.0) -> str:
        """``redis-cli`` against this server (the password, if any, through the
        environment, never the command line)."""
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password
        tls = ["--tls", "--cacert", str(self.tls.ca_cert)] if self.tls is not None else []
        proc = subprocess.run(
            [self.cli_bin, "-h", "127.0.0.1", "-p", str(self.port), *tls, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
        if check and (proc.returncode != 0 or proc.stdout.startswith("ERR")):
            raise RedisProcError(f"redis-cli {' '.join(args)}: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join((self.dir / "redis.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _wait(what: str, ok: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise RedisProcError(f"timed out waiting for {what}")
        time.sleep(0.05)


class RedisClusterProcs:
    """``masters`` cluster-enabled servers joined with ``redis-cli --cluster create``, each
    with ``replicas`` replicas (which node serves which role is the cluster's to say, and
    changes with failovers: ``primaries``, ``replicas_of``)."""

    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
        extra_config: str = "",
        choose_ports: Callable[[int], list[int]] = free_ports,
    ) -> None:
        self.dir = Path(workdir)
        self.replicas = replicas
        self._ids: dict[int, str] = {}
        self.nodes = [
            RedisServer(
                self.dir / f"node{i}",
                cluster=True,
                cluster_node_timeout_ms=node_timeout_ms,
                extra_config=extra_config,
                choose_ports=choose_ports,
            )
            for i in range(masters * (1 + replicas))
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            for node in self.nodes:
                node.start()
            self.nodes[0].cli(
                "--cluster",
                "create",
                *(n.address for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
                timeout_s=timeout_s,
            )
            self.wait_ok(timeout_s)
            for node in self.nodes:
                self.node_id(node)
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports cluster_state:ok and knows every node, and every
        running replica has its master's data (link up, first sync done): a replica still
        syncing cannot take over from its master."""

        def ok() -> bool:
            for node in self.nodes:
                if not node.running:
                    return False
                info = node.cli("CLUSTER", "INFO", check=False)
                if "cluster_state:ok" not in info:
                    return False
                if f"cluster_known_nodes:{len(self.nodes)}" not in info:
                    return False
                if not self.replicas:
                    continue  # masters only: no sync to wait for, and no cost to it
                repl = node.cli("INFO", "replication", check=False)
                if "role:slave" in repl and "master_link_status:up" not in repl:
                    return False
            return True

        _wait("the cluster to report ok on every node", ok, timeout_s)

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Until every running replica has applied all its master has (equal replication
        offsets): what was written before is then on both."""

        def caught_up() -> bool:
            for master in self.primaries():
                repl = master.cli("INFO", "replication", check=False)
                fields = dict(line.split(":", 1) for line in repl.splitlines() if ":" in line)
                offset = fields.get("master_repl_offset", "").strip()
                links = [v for k, v in fields.items() if k.startswith("slave") and k[5:].isdigit()]
                if len(links) < len(self.replicas_of(master)):
                    return False
                if any(f"offset={offset}," not in link for link in links):
                    return False
            return True

        _wait("the replicas to catch up with their masters", caught_up, timeout_s)

    def wait_fail(self, timeout_s: float = 30.0) -> None:
        """Until the running nodes report cluster_state:fail (a master is gone)."""

        def failed() -> bool:
            return all(
                "cluster_state:fail" in n.cli("CLUSTER", "INFO", check=False)
                for n in self.nodes
                if n.running
            )

        _wait("the cluster to notice a lost master", failed, timeout_s)

    def node_id(self, node: RedisServer) -> str:
        """``node``'s cluster id (kept in its ``nodes.conf``, so known while it is down too
        once asked)."""
        if node.port not in self._ids:
            self._ids[node.port] = node.cli("CLUSTER", "MYID").strip()
        return self._ids[node.port]

    def owner_of_slot(self, slot: int) -> RedisServer:
        for node in self.nodes:
            if not node.running:
                continue
            for line in node.cli("CLUSTER", "NODES").splitlines():
                fields = line.split()
                if "myself" not in fields[2] or "master" not in fields[2]:
                    continue
                for r in fields[8:]:
                    if r.startswith("["):
                        continue
                    lo, _, hi = r.partition("-")
                    if int(lo) <= slot <= int(hi or lo):
                        return node
        raise RedisProcError(f"no running node owns slot {slot}")

    def _roles(self) -> dict[str, tuple[str, str]]:
        """Node id -> (role, its master's id or "-"), as a running node sees the cluster."""
        for node in self.nodes:
            if node.running:
                roles = {}
                for line in node.cli("CLUSTER", "NODES").splitlines():
                    fields = line.split()
                    role = "master" if "master" in fields[2] else "replica"
                    roles[fields[0]] = (role, fields[3])
                return roles
        raise RedisProcError("no node of the cluster is running")

    def primaries(self) -> list[RedisServer]:
        """The running nodes that are masters now."""
        roles = self._roles()
        return [n for n in self.nodes if n.running and roles[self.node_id(n)][0] == "master"]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        """The running nodes that replicate ``master`` now."""
        roles, master_id = self._roles(), self.node_id(master)
        return [
            n for n in self.nodes if n.running and roles[self.node_id(n)] == ("replica", master_id)
        ]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProcs:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
