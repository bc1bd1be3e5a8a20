"""The tests' fork server (forkserver.py): a forked daemon is what ``python -m kvtier.daemon``
would have been, started in the test's working directory, umask and environment of the time,
with ``Popen``'s exit statuses, and none outlives its server."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import threading

import forkserver
import pytest
from forkserver import FORKABLE, SWITCH, ForkedDaemon, close_fork_server
from harness import DaemonFactory, entry_setting


def _umask_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))


@pytest.fixture(autouse=True)
def forking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWITCH, raising=False)


def test_a_forked_daemon_starts_in_the_test_s_working_directory_and_umask(
    daemon_factory: DaemonFactory,
) -> None:
    daemon_factory()  # the server started before the umask changes
    old = os.umask(0o027)
    try:
        d = daemon_factory()
    finally:
        os.umask(old)
    assert isinstance(d.proc, ForkedDaemon)
    assert os.readlink(f"/proc/{d.proc.pid}/cwd") == str(d.workdir)
    assert _umask_of(d.proc.pid) == 0o027


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_daemon_sees_the_environment_of_its_start_and_exits_with_its_status(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch, fork: str
) -> None:
    """The same refusal, forked or exec'd: a KVTIER_* variable set after the server started
    is read, and the exit status is the process's own."""
    monkeypatch.setenv(SWITCH, fork)
    daemon_factory()
    monkeypatch.setenv("KVTIER_TIERS_L1_NO_SUCH_KEY", "1")
    d = daemon_factory(wait=False)
    assert isinstance(d.proc, ForkedDaemon) == (fork == "1")
    assert d.proc is not None
    assert d.proc.wait(60) == 2, d.log()
    assert "KVTIER_TIERS_L1_NO_SUCH_KEY" in d.log()


def test_a_forked_daemon_s_signal_death_is_minus_the_signal(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    assert isinstance(d.proc, ForkedDaemon)
    assert d.kill() == -signal.SIGKILL
    d.start()
    assert d.stop() == 0 and "kvtierd stopped" in d.log()


def test_a_changed_import_time_variable_starts_the_daemon_by_exec(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPC_VERBOSITY is read as grpc is imported, which the server did before: a start that
    sets another is exec'd, and logs as that verbosity says."""
    daemon_factory()
    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    d = daemon_factory()
    assert isinstance(d.proc, subprocess.Popen)


def test_the_fork_server_s_children_end_with_it(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    assert isinstance(d.proc, ForkedDaemon)
    pid = d.proc.pid
    close_fork_server()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert d.proc.wait(0) == -signal.SIGKILL


def test_a_fork_server_killed_takes_its_children_and_is_replaced(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    assert isinstance(d.proc, ForkedDaemon)
    server = d.proc.server
    # Opened while the server is its parent: once it dies, the orphan (SIGKILLed as its parent
    # died) may be reaped and its pid reused before a pidfd could name it.
    pidfd = os.pidfd_open(d.proc.pid)
    try:
        server.proc.kill()
        server.proc.wait(10)
        with pytest.raises(RuntimeError, match="fork server ended"):
            d.proc.wait(10)
        assert select.select([pidfd], [], [], 10)[0] == [pidfd]
    finally:
        os.close(pidfd)
    d.proc.returncode = -signal.SIGKILL  # what no server relays now, for the factory's end
    again = daemon_factory()
    assert isinstance(again.proc, ForkedDaemon) and again.proc.server is not server


def test_regression_a_start_given_up_on_does_not_leave_its_daemon_running(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start whose answer came after the test stopped waiting forked a daemon that no handle
    could stop: it ran until the server ended, holding its socket, ports and folders."""
    server = daemon_factory().proc.server  # type: ignore[union-attr]
    os.kill(server.proc.pid, signal.SIGSTOP)  # it answers nothing until the wait is over
    try:
        with monkeypatch.context() as m, pytest.raises(TimeoutError, match="did not answer"):
            m.setattr(forkserver, "REPLY_TIMEOUT_S", 0.0)
            daemon_factory()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    given_up = server._next_id - 1
    assert server.exit_code(given_up, 60) == -signal.SIGKILL
    assert given_up not in server._replies


_FORKABLE_WRITING_ITS_START = (
    FORKABLE
    + """
import json, sys
import __main__
with open(sys.argv[1], "w") as f:
    json.dump([sys.argv[:3], sys.path[0], __name__, __main__.__dict__ is globals()], f)
del sys.argv[1]
from kvtier.daemon.entry import main
sys.exit(main())
"""
)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_forkable_code_runs_forked_as_python_c_runs_it(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch, tmp_path, fork: str
) -> None:
    monkeypatch.setenv(SWITCH, fork)
    seen = tmp_path / "seen.json"
    d = daemon_factory(entry=("-c", _FORKABLE_WRITING_ITS_START, str(seen)))
    assert isinstance(d.proc, ForkedDaemon) == (fork == "1")
    assert json.loads(seen.read_text()) == [["-c", str(seen), "--set"], "", "__main__", True]
    assert d.stop() == 0 and "kvtierd stopped" in d.log()


def test_a_forked_entry_setting_refuses_a_constant_another_module_took_by_name(
    daemon_factory: DaemonFactory,
) -> None:
    """Set after the imports, the module that imported it by name would keep the old value
    (exec'd, one imported after the setting took the new one): the daemon says so and
    exits."""
    d = daemon_factory(entry=entry_setting({"kvtier.daemon.health.SERVING": 0}), wait=False)
    assert isinstance(d.proc, ForkedDaemon)
    assert d.proc is not None and d.proc.wait(60) == 1, d.log()
    assert "kvtier.daemon.health.SERVING is also bound in" in d.log()


def test_regression_entry_setting_sets_a_constant_whose_value_another_module_holds_by_chance(
    daemon_factory: DaemonFactory,
) -> None:
    """entry_setting refused a constant whose object another module held under the same name
    without importing it: lru's and arc's own _SCAN_BATCH (both the cached int 256), and one
    that is None (every module without the name "held" it): the daemon exited at its start."""
    constants = {"kvtier.daemon.policy.lru._SCAN_BATCH": 128}
    constants["kvtier.daemon.policy.density._EXHAUSTED"] = None  # type: ignore[assignment]
    d = daemon_factory(entry=entry_setting(constants), wait=False)
    assert isinstance(d.proc, ForkedDaemon)
    d.wait_ready()
    assert "also bound in" not in d.log()


def test_regression_forked_daemons_number_their_requests_from_starts_of_their_own(
    daemon_factory: DaemonFactory,
) -> None:
    """The daemon numbers its requests from a random start drawn as kvtier.daemon.observe is
    imported, so that two processes' ids do not collide: every child of the fork server
    counted from the server's draw, each daemon's first requests had the ids of the last's."""
    ids = []
    for _ in range(2):
        d = daemon_factory()
        assert isinstance(d.proc, ForkedDaemon)
        with d.client() as client:
            client.stats()
        # The daemon's own request id (12 hex digits) on the line of the session it opened.
        found = re.findall(r" opened by .*\[req=([0-9a-f]{12})\]", d.log())
        assert found, d.log()
        ids.append(int(found[-1], 16))
    # Random 48-bit starts: within 2**24 of each other once in 2**23 pairs; one start, a few
    # requests apart.
    assert abs(ids[0] - ids[1]) >= 1 << 24, [hex(i) for i in ids]


def test_regression_a_forked_daemon_s_signal_is_sent_when_send_signal_returns(
    daemon_factory: DaemonFactory,
) -> None:
    """``send_signal`` returned once the request was on the server's socket, before the
    server had sent the signal: a test that stopped its daemon (SIGSTOP) and then called it
    was sometimes answered (test_api's fenced pool: 'assert True is False')."""
    d = daemon_factory()
    assert isinstance(d.proc, ForkedDaemon)
    server = d.proc.server.proc.pid
    sent = threading.Event()

    def send() -> None:
        d.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        sent.set()

    os.kill(server, signal.SIGSTOP)  # it sends nothing until it runs again
    sender = threading.Thread(target=send)
    try:
        sender.start()
        assert not sent.wait(1.0)
    finally:
        os.kill(server, signal.SIGCONT)
        sender.join(60)
    assert sent.is_set()
