"""A fork server for the tests' daemons: ``python -m kvtier.daemon ARGS`` without the imports.

A daemon start cost ~0.45 s of CPU, ~90% of it the interpreter importing numpy, grpc, asyncio,
yaml and the daemon's modules, and the tests start hundreds of daemons on two cores. One
server per test process (started by ``fork_server()`` on the first start, ended with the test
process) imports them once and forks a child per start that becomes what ``python -m
kvtier.daemon ARGS`` would be from then on: its stdout and stderr on the log the test passes
(SCM_RIGHTS), the test's working directory, umask and environment at the time of the start,
``sys.argv`` and ``sys.path[0]`` as ``-m`` sets them, fresh seeds for ``random`` and numpy's
global generator, then ``kvtier.daemon.entry.main`` (which holds SIGHUP, SIGINT and SIGTERM
first, as a started one does) and an exit with its status. The server is the children's
parent: it reaps them and relays each exit status (``Popen.returncode``'s meaning: -signum for
a signal's death) to ``ForkedDaemon``, the test's ``Popen``-like handle.

The server creates no thread, event loop, gRPC channel or server before it forks: the imports
alone (numpy's OpenBLAS starts its threads and stops them around a fork itself). What is read
at import rather than at the start cannot follow the test: environment variables of the
interpreter, gRPC's core (GRPC_VERBOSITY, read as grpc is imported), numpy's BLAS and the C
library (``IMPORT_TIME_ENV``), and the resource limits: a start whose environment differs from
the server's in one of them, or whose limits differ, is left to ``python -m kvtier.daemon``
(``serves``). So is every other entry (``-c CODE``) but one whose code starts with
``FORKABLE``: code that may run after the daemon's modules are imported (the signals, hooks
and imports of daemon/entry.py's tests may not) runs in a child as ``python -c CODE ARGS``
would (``sys.argv``, ``sys.path[0]``, a ``__main__`` of its own). The children share the
server's hash seed (PYTHONHASHSEED's randomisation happens once per interpreter).
KVTIER_TEST_FORK_DAEMONS=0 runs every daemon as before.

Requests and answers are JSON messages on a SOCK_SEQPACKET socket pair: ``start`` (argv, cwd,
umask, environment; the log's descriptor beside it) answered by the child's pid, ``signal``
(sent through the child's pidfd, so never to a reaped child's reused pid) answered once sent,
and, unasked, each child's exit. The server ends when its socket closes (the test process ended or closed it),
SIGKILLing the children still running first (their statuses relayed where the test process
still reads); a server killed takes its children with it (PR_SET_PDEATHSIG): none outlives the
tests. A start the test gave up on (no answer in time, an interrupt) is followed by a SIGKILL
for its child, which no handle stops: it does not run until the server ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterable
from typing import Any

SWITCH = "KVTIER_TEST_FORK_DAEMONS"
DEFAULT_ENTRY = ("-m", "kvtier.daemon")
# Read once per interpreter, as it starts or as a module is imported: a child could not see a
# change made after the server started.
IMPORT_TIME_ENV = ("PYTHON", "GRPC_", "OPENBLAS_", "GOTO", "OMP_", "MKL_", "NPY_", "LD_", "MALLOC_")
IMPORT_TIME_ENV_NAMES = ("GLIBC_TUNABLES",)
HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What the daemon imports, as kvtier.daemon.main starts and as it builds its server, its tiers
# (redis: ~0.1 s) and its policies. One missing here is imported by each child.
PRELOAD = (
    "kvtier.daemon.main",
    "kvtier.daemon.server",
    "kvtier.daemon.reload",
    "kvtier.daemon.tenants",
    "kvtier.daemon.metrics",
    "kvtier.daemon.heat",
    "kvtier.tiers.base",
    "kvtier.tiers.host",
    "kvtier.tiers.remote.tier",
    *(f"kvtier.daemon.policy.{name}" for name in ("arc", "density", "heat", "hints", "lru")),
    *(f"kvtier.daemon.policy.{name}" for name in ("memento", "opt")),
    "uvloop",
)
# The first line of ``-c`` code that a forked child may run, after the imports (PRELOAD).
FORKABLE = "# forkable: runs as well once the daemon's modules are imported\n"
MAX_MESSAGE_BYTES = 1 << 20
PR_SET_PDEATHSIG = 1
REPLY_TIMEOUT_S = 60.0


def _import_time_env(environ: dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in environ.items()
        if k.startswith(IMPORT_TIME_ENV) or k in IMPORT_TIME_ENV_NAMES
    }


def _rlimits() -> dict[str, tuple[int, int]]:
    return {
        name: resource.getrlimit(getattr(resource, name))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }


def _umask() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise RuntimeError("no Umask in /proc/self/status")


class ForkServer:
    """The test process's side: starts the server, sends it starts and signals, and keeps the
    exit statuses its reader thread receives. Thread-safe (a condition guards the replies and
    statuses, a lock the sends)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.owner = os.getpid()
        self._env = _import_time_env(dict(os.environ))
        self._rlimits = _rlimits()
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        self._sock = ours
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._abandoned: set[int] = set()  # starts whose requester stopped waiting
        self._next_signal = 0
        self._signalled: set[int] = set()  # signals sent, by their number
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="kvtier-forkserver", daemon=True)
        self._reader.start()

    def serves(self) -> bool:
        """Whether a child forked now would be the daemon an exec would start: the
        environment read at import and the resource limits are the server's."""
        return _import_time_env(dict(os.environ)) == self._env and _rlimits() == self._rlimits

    @property
    def gone(self) -> bool:
        """Whether the server has ended (its socket closed)."""
        with self._cond:
            return self._gone

    def start(
        self, args: list[str], cwd: str, log_fd: int, entry: tuple[str, ...] = DEFAULT_ENTRY
    ) -> ForkedDaemon:
        """A child running ``python ENTRY args`` in ``cwd`` (``-m kvtier.daemon``, or ``-c``
        code that starts with ``FORKABLE`` and its arguments), its stdout and stderr on
        ``log_fd``, in this process's environment and umask."""
        if entry != DEFAULT_ENTRY and not forkable(entry):
            raise ValueError(f"not an entry a forked child runs: {entry[:1]}")
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
        request = {
            "op": "start",
            "id": request_id,
            "args": args,
            "code": None if entry == DEFAULT_ENTRY else list(entry[1:]),
            "cwd": cwd,
            "umask": _umask(),
            "env": dict(os.environ),
        }
        self._send(request, [log_fd])
        try:
            with self._cond:
                if not self._cond.wait_for(
                    lambda: request_id in self._replies or self._gone, REPLY_TIMEOUT_S
                ):
                    raise TimeoutError(
                        f"the daemons' fork server did not answer in {REPLY_TIMEOUT_S}s"
                    )
                reply = self._replies.pop(request_id, None)
        except BaseException:
            # Given up on (a timeout, an interrupt): no handle will stop the child the server
            # may still fork, which ran until the server ended, holding its socket, ports and
            # folders. The kill follows the start on the server's socket, so it reaches the
            # child whenever the server forks it; its reply is not kept.
            with self._cond:
                if self._replies.pop(request_id, None) is None:
                    self._abandoned.add(request_id)
            with contextlib.suppress(OSError):  # the server has ended: so has the child
                self.signal(request_id, signal.SIGKILL, wait=False)
            raise
        if reply is None:
            raise RuntimeError(f"the daemons' fork server ended ({self.proc.poll()})")
        return ForkedDaemon(self, reply["pid"], request_id, ["python", *entry, *args])

    def signal(self, child: int, sig: int, wait: bool = True) -> None:
        """Signal the child of start ``child`` (its id) unless it has been reaped; once the
        server has sent it (``wait``), as ``os.kill`` returns: a test that stops a daemon and
        then calls it expects no answer."""
        with self._cond:
            sent = self._next_signal
            self._next_signal += 1
        self._send({"op": "signal", "id": child, "sig": int(sig), "seq": sent if wait else None})
        if wait:
            with self._cond:
                if not self._cond.wait_for(
                    lambda: sent in self._signalled or self._gone, REPLY_TIMEOUT_S
                ):
                    raise TimeoutError(
                        f"the daemons' fork server did not answer in {REPLY_TIMEOUT_S}s"
                    )
                self._signalled.discard(sent)

    def exit_code(self, child: int, timeout_s: float | None) -> int | None:
        """The exit status of the child of start ``child`` (its id) once the server has
        reaped it (waiting up to ``timeout_s``; None: not yet)."""
        with self._cond:
            self._cond.wait_for(lambda: child in self._exits or self._gone, timeout_s)
            if child in self._exits:
                return self._exits[child]
            if self._gone:
                raise RuntimeError(f"the daemons' fork server ended before child {child} did")
            return None

    def close(self, timeout_s: float = 30.0) -> None:
        """End the server, which SIGKILLs the children still running and relays their
        statuses, and wait for it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout_s)
        self._sock.close()

    def _send(self, message: dict[str, Any], fds: Iterable[int] = ()) -> None:
        data = json.dumps(message).encode()
        with self._send_lock:
            socket.send_fds(self._sock, [data], list(fds))

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
                if not data:
                    break
                message = json.loads(data)
                with self._cond:
                    if "signalled" in message:
                        self._signalled.add(message["signalled"])
                    elif "exit" in message:
                        # By the start's id, not the pid: the kernel hands a reaped child's
                        # pid to later processes, a later daemon of this server's among
                        # them, whose handle found the earlier one's status ("exited with
                        # -9 during start").
                        self._exits[message["exit"]] = message["code"]
                    elif message["id"] in self._abandoned:
                        self._abandoned.discard(message["id"])  # its child is being killed
                    else:
                        self._replies[message["id"]] = message
                    self._cond.notify_all()
        except OSError:
            pass
        finally:
            with self._cond:
                self._gone = True
                self._cond.notify_all()


def forkable(entry: tuple[str, ...]) -> bool:
    """Whether ``entry`` (after the interpreter) is ``-c`` code a forked child may run."""
    return len(entry) >= 2 and entry[0] == "-c" and entry[1].startswith(FORKABLE)


class ForkedDaemon:
    """A forked daemon as ``subprocess.Popen`` shows a process: ``pid``, ``returncode``
    (None while it runs, -signum for a signal's death), ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``. Thread-safe as the server's side is."""

    def __init__(self, server: ForkServer, pid: int, child: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.child = child  # the start's id: the server's name for it
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._returncode(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._returncode(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.server.signal(self.child, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _returncode(self, timeout_s: float | None) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.child, timeout_s)
        return self.returncode


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_server() -> ForkServer | None:
    """This process's fork server (started on the first call, and again after one ended: its
    children's handles raised), or None where KVTIER_TEST_FORK_DAEMONS=0 asks for exec'd
    daemons. A process forked from one that has a server starts its own."""
    global _server
    if os.environ.get(SWITCH, "1") == "0":
        return None
    with _server_lock:
        if _server is not None and _server.owner == os.getpid() and _server.gone:
            _server.close()
            _server = None
        if _server is None or _server.owner != os.getpid():
            _server = ForkServer()
        return _server


def close_fork_server() -> None:
    global _server
    with _server_lock:
        if _server is not None and _server.owner == os.getpid():
            _server.close()
        _server = None


# The server's side.


def serve(sock: socket.socket) -> None:
    # Blocked for good here, and in a child until just before the entry point holds them: a
    # signal for the test process's group does not end the server (its socket's end does).
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    # What kvtier.daemon.entry.main does before its imports (the children run it again).
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    # As kvtier.daemon.main does once it has started: its collection (~30 ms) then scans only
    # what the child made, and touches none of the pages the children share.
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    # Each child by its start's id (a pid may be another process's once reaped).
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, id)
    pidfds: dict[int, int] = {}  # id -> pidfd
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        while True:
            for fd, _ in poller.poll():
                if fd == sock.fileno():
                    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
                    if not data:
                        return
                    request = json.loads(data)
                    if request["op"] == "start":
                        (log_fd,) = fds
                        try:
                            pid = _fork_daemon(request, log_fd, sock, children)
                        finally:
                            os.close(log_fd)
                        pidfd = os.pidfd_open(pid)
                        children[pidfd] = (pid, request["id"])
                        pidfds[request["id"]] = pidfd
                        poller.register(pidfd, select.POLLIN)
                        sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
                    else:
                        if request["id"] in pidfds:  # a child not yet reaped
                            signal.pidfd_send_signal(pidfds[request["id"]], request["sig"])
                        if request["seq"] is not None:
                            sock.send(json.dumps({"signalled": request["seq"]}).encode())
                else:
                    pid, child = children.pop(fd)
                    del pidfds[child]
                    poller.unregister(fd)
                    os.close(fd)
                    _send_exit(sock, pid, child)
    except (BrokenPipeError, ConnectionResetError):
        return
    finally:
        for pidfd, (pid, child) in children.items():
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
            with contextlib.suppress(OSError):  # to a test process still reading
                _send_exit(sock, pid, child)


def _send_exit(sock: socket.socket, pid: int, child: int) -> None:
    """Reap child ``pid`` and send its exit status, named by its start's id ``child``."""
    _, status = os.waitpid(pid, 0)
    sock.send(json.dumps({"exit": child, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork_daemon(
    request: dict[str, Any],
    log_fd: int,
    sock: socket.socket,
    children: dict[int, tuple[int, int]],
) -> int:
    server_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        # SIGKILLed as the server ends, however it ends (it is single-threaded: the thread
        # that forked is the server's life).
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server_pid:
            os._exit(1)
        sock.close()
        for pidfd in children:
            os.close(pidfd)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd > 2:
                with contextlib.suppress(OSError):  # the listing's own
                    os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        import random

        import numpy as np

        import kvtier.daemon
        from kvtier.daemon.entry import main

        random.seed()
        np.random.seed()
        args = request["args"]
        if request["code"] is None:
            # As ``-m`` sets them: the module's path, and the working directory first on the
            # path.
            path = os.path.dirname(kvtier.daemon.__file__)
            sys.argv = [os.path.join(path, "__main__.py"), *args]
            sys.path[0] = os.getcwd()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
            code = main(args)
        else:
            # As ``-c`` sets them: "-c" and the arguments, the working directory ("") first on
            # the path, and a ``__main__`` module of the code's own.
            source, *entry_args = request["code"]
            sys.argv = ["-c", *entry_args, *args]
            sys.path[0] = ""
            module = types.ModuleType("__main__")
            sys.modules["__main__"] = module
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
            exec(compile(source, "<string>", "exec"), module.__dict__)
            code = 0
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        # What the interpreter does as it exits: wait for the threads that are not daemons,
        # run the atexit functions, flush the standard streams.
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
