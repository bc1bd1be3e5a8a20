"""SIGHUP on a real daemon: live keys apply at once, the others are named as needing a
restart, a config that does not load changes nothing, and token files are read again."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from harness import DaemonProcess, catches_signal, tenant_token
from peers import require_root

from kvtier.client import (
    InvalidArgumentError,
    NotFoundError,
    PoolLayout,
    SharedMemoryPool,
    Tier,
    UnauthenticatedError,
)
from kvtier.daemon.reload import is_live, plan
from kvtier.daemon.tenants import TenantDirectory

CONFIG = """
server:
  max_batch_blocks: {batch}
tiers:
  l1:
    capacity_bytes: {l1}
policy:
  protect_s: {protect}
logging:
  level: {level}
"""


def _wait_for_log(d: DaemonProcess, text: str, count: int = 1, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while d.log().count(text) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not logged:\n{d.log()}")
        time.sleep(0.05)
    return d.log()


def test_sighup_applies_live_keys_and_names_the_rest(tmp_path, daemon_factory):
    path = tmp_path / "kvtier.yaml"
    path.write_text(CONFIG.format(batch=8, l1="64MiB", protect=2.0, level="info"))
    d = _start_with(path, tmp_path, daemon_factory, "reload")
    ten = [os.urandom(32) for _ in range(10)]
    with d.client() as client:
        with pytest.raises(InvalidArgumentError, match="max_batch_blocks"):
            client.lookup(ten)
        path.write_text(CONFIG.format(batch=16, l1="128MiB", protect=0.5, level="DEBUG"))
        d.proc.send_signal(signal.SIGHUP)
        _wait_for_log(d, "SIGHUP: applied")
        # The keys that need a restart are named on the next line, a moment later.
        log = _wait_for_log(d, "need a restart")
        assert "server.max_batch_blocks: 16" in log.replace("8 -> ", "")
        assert "policy.protect_s: 2.0 -> 0.5" in log
        assert "logging.level: INFO -> DEBUG" in log
        # Sizes in units on both lines, as the config spells them (not 67108864 -> ...).
        assert (
            "need a restart and were not applied: tiers.l1.capacity_bytes: 64MiB -> 128MiB" in log
        )
        assert client.lookup(ten).prefix_len == 0  # the new limit holds
        assert client.stats().tiers[0].capacity_bytes == 64 << 20  # L1 keeps its size

        path.write_text("server:\n  max_batch_blocks: lots\n")
        d.proc.send_signal(signal.SIGHUP)
        _wait_for_log(d, "config not reloaded")
        assert "server.max_batch_blocks" in d.log().split("config not reloaded")[-1]
        assert client.lookup(ten).prefix_len == 0  # still 16
        assert client.health()


def test_regression_a_sighup_read_a_config_given_through_a_pipe_again(tmp_path, daemon_factory):
    """A config given as a pipe or FIFO (`--config <(...)`, `--config /dev/stdin`) is read
    once: at a SIGHUP the daemon opened it again, and a pipe read empty, so the reload
    applied the defaults (protect_s 7 -> 2, restart keys named as changed to theirs), while a
    FIFO with no writer held the event loop (no call answered) until one came. Such a config
    is not reloaded now, saying why; the token files are still read again."""
    fifo = tmp_path / "kvtier.fifo"
    os.mkfifo(fifo)
    d = DaemonProcess(tmp_path, f"{daemon_factory._sockdir}/fifo.sock", ["--config", str(fifo)])
    daemon_factory._daemons.append(d)
    d.start(wait=False)
    with open(fifo, "w") as f:  # waits for the daemon to open it
        f.write(CONFIG.format(batch=8, l1="64MiB", protect=7.0, level="info"))
    d.wait_ready()
    d.proc.send_signal(signal.SIGHUP)
    log = _wait_for_log(d, "config not reloaded")
    assert f"config file {fifo} is not a regular file" in log, log
    with d.client(timeout_s=10) as client:
        assert client.health()
    assert "SIGHUP: applied" not in d.log()


def test_the_reload_plan_keeps_restart_keys_at_their_running_value():
    from kvtier.daemon.config import load_config

    running = load_config(
        None, ["policy.readahead_blocks=4", "tiers.l2.enabled=true", "tiers.l2.read_bytes_s=0"]
    )
    loaded = load_config(
        None,
        [
            "policy.readahead_blocks=8",
            "tiers.l2.enabled=true",
            "tiers.l2.read_bytes_s=1GiB",
            "policy.name=lru",
        ],
    )
    effective, applied, restart = plan(running, loaded)
    assert effective.policy.readahead_blocks == 8
    assert effective.tiers.l2.read_bytes_s == 1 << 30
    assert effective.policy.name == running.policy.name  # needs a restart
    assert [a.split(":")[0] for a in applied] == [
        "tiers.l2.read_bytes_s",
        "policy.readahead_blocks",
    ]
    assert [r.split(":")[0] for r in restart] == ["policy.name"]
    assert is_live("tiers.l1.high_watermark") and not is_live("tiers.l1.capacity_bytes")
    assert not is_live("server.socket") and is_live("logging.level")
    assert not is_live("logging.level\n")  # the whole key must match, as the others


def test_a_reload_whose_live_keys_do_not_hold_beside_the_running_ones_changes_nothing():
    """server.max_batch_blocks is live, server.max_message_bytes needs a restart: raising both
    in the file loads, but the mix (new batch limit, old message limit) is a config the
    daemon refuses at start. The reload applied it; now it changes nothing and says why."""
    from types import SimpleNamespace

    from kvtier.daemon.config import load_config
    from kvtier.daemon.reload import Reloader

    running = load_config(None, [])
    loaded = load_config(None, ["server.max_batch_blocks=100000", "server.max_message_bytes=8MiB"])
    daemon = SimpleNamespace(config=running, tenants=TenantDirectory.from_config(running))
    applied: list[object] = []
    reloader = Reloader(daemon, lambda: loaded)  # type: ignore[arg-type]
    reloader.apply = lambda config, directory=None: applied.append(config)  # type: ignore[method-assign]
    report = reloader.reload()
    assert applied == []
    assert report.applied == [] and "server.max_message_bytes" in report.error
    assert daemon.config is running


def test_a_sighup_while_the_daemon_starts_does_not_kill_it(tmp_path, daemon_factory):
    """SIGHUP's default action ends the process: before the daemon's reload handler went in
    (once serving), a reload sent to a starting daemon killed it silently (exit 129)."""
    d = DaemonProcess(
        tmp_path,
        f"{daemon_factory._sockdir}/early.sock",
        [
            "--set=tiers.l1.capacity_bytes=64MiB",
            "--set=tiers.l2.enabled=true",
            f"--set=tiers.l2.path={tmp_path / 'l2'}",
            "--set=tiers.l2.capacity_bytes=64MiB",
            "--set=tiers.l2.file_bytes=64MiB",
        ],
    )
    daemon_factory._daemons.append(d)
    d.start(wait=False)
    assert d.proc is not None
    # As early as the daemon catches SIGHUP, or as soon as it logs (it is starting).
    deadline = time.monotonic() + 30
    while not (catches_signal(d.proc.pid, signal.SIGHUP) or d.log()):
        assert d.proc.poll() is None and time.monotonic() < deadline, d.log()
        time.sleep(0.001)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_ready()
    _wait_for_log(d, "SIGHUP: applied")
    assert d.running()


# Runs the console script ``kvtierd`` as pip's wrapper does (the entry point named in
# pyproject.toml), with a SIGHUP sent to the process as ``kvtier.daemon.main`` starts to be
# imported: inside the window of the imports, on every run.
_ENTRY_HANGING_UP_ON_IMPORT = """
import importlib, os, signal, sys, tomllib
from pathlib import Path

class HangUpOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "kvtier.daemon.main":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGHUP)
        return None

scripts = tomllib.loads(Path(sys.argv.pop(1)).read_text())["project"]["scripts"]
module, func = scripts["kvtierd"].split(":")
sys.meta_path.insert(0, HangUpOnImport())
sys.exit(getattr(importlib.import_module(module), func)())
"""


def test_a_sighup_while_the_daemon_imports_its_modules_is_a_reload_once_it_serves(
    tmp_path, daemon_factory
):
    """Regression: the handler that holds an early SIGHUP went in only once
    ``kvtier.daemon.main`` was imported (~240 ms after exec), and a SIGHUP in that window
    killed the daemon (its default action). The console script's entry point now holds
    SIGHUP before importing anything heavy; the daemon reloads once it serves."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    d = DaemonProcess(
        tmp_path,
        f"{daemon_factory._sockdir}/import.sock",
        ["--set=tiers.l1.capacity_bytes=64MiB"],
        entry=("-c", _ENTRY_HANGING_UP_ON_IMPORT, str(pyproject)),
    )
    daemon_factory._daemons.append(d)
    d.start()
    log = _wait_for_log(d, "SIGHUP: applied")
    assert "SIGHUP arrived while starting" in log
    assert d.running()


def test_a_reload_keeps_the_ids_the_running_config_s_names_resolved_to(monkeypatch):
    """Regression: a reload resolved every user and group name of the config again, so once
    a name the daemon started with was gone from the host (a group deleted, a directory
    service unreachable) every reload was refused, even one that changed nothing of it. The
    names the running config has resolve as they did at start; a name the reload brings in
    is still looked up, and refused naming its key."""
    import grp
    import pwd
    from types import SimpleNamespace

    from kvtier.daemon.config import ids_from, load_config
    from kvtier.daemon.reload import Reloader

    group = grp.getgrgid(os.getgid()).gr_name
    user = pwd.getpwuid(os.getuid()).pw_name
    names = [
        f"server.socket_group={group}",
        f"server.admin_uids=[{user}]",
        f"server.shm_share=[any={user}]",
        f"tenants=[{{name: a, uids: [{user}], gids: [{group}]}}]",
    ]
    known: dict[tuple[str, str], int] = {}
    with ids_from(known):
        running = load_config(None, names)
        tenants = TenantDirectory.from_config(running)
    assert known == {("group", group): os.getgid(), ("user", user): os.getuid()}

    def gone(name: str) -> None:
        raise KeyError(name)

    monkeypatch.setattr(grp, "getgrnam", gone)
    monkeypatch.setattr(pwd, "getpwnam", gone)
    daemon = SimpleNamespace(config=running, tenants=tenants)
    applied: list[object] = []
    reloader = Reloader(daemon, lambda: load_config(None, [*names, "policy.protect_s=5"]), known)  # type: ignore[arg-type]
    reloader.apply = lambda config, directory=None: applied.append(config)  # type: ignore[method-assign]
    report = reloader.reload()
    assert report.error == "" and [a.split(":")[0] for a in report.applied] == ["policy.protect_s"]
    assert len(applied) == 1
    reloader.load = lambda: load_config(None, [*names, "server.socket_group=kvtier-nosuchgroup"])
    report = reloader.reload()
    assert "server.socket_group" in report.error and "kvtier-nosuchgroup" in report.error
    assert len(applied) == 1
    assert known == {("group", group): os.getgid(), ("user", user): os.getuid()}


def _rotate(path: Path, secret: str) -> None:
    """Replace a token file the way an operator's tooling does: a new file renamed over it."""
    fresh = path.with_suffix(".new")
    fresh.write_text(secret + "\n")
    fresh.chmod(0o600)
    fresh.rename(path)


def test_sighup_reads_token_files_again(tmp_path, daemon_factory):
    """A rotated secret binds new sessions from the reload on and the old one no longer does;
    sessions opened with the old one carry on. A token file that cannot be used at the
    reload (readable by others) keeps the token read before, and the log says why."""
    token, tenants = tenant_token(tmp_path, "bob")
    metrics_token = tmp_path / "metrics.token"
    metrics_token.write_text("metrics-secret-one\n")
    metrics_token.chmod(0o600)
    d = daemon_factory(
        tenants, "metrics.address=127.0.0.1:0", f"metrics.token_file={metrics_token}"
    )
    (url,) = set(re.findall(r"metrics on (http://\S+/metrics)", d.log()))
    old = token.read_text().strip()
    with d.client(token=old) as before:
        assert before.tenant == "bob"
        _rotate(token, "the-second-secret-of-bob")
        _rotate(metrics_token, "metrics-secret-two")
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "SIGHUP: new token for")
        assert "new token for tenant 'bob', metrics" in log
        assert "the-second-secret" not in log and "metrics-secret" not in log
        with d.client(token=old) as stale, pytest.raises(UnauthenticatedError):
            stale.stats()
        with d.client(token="the-second-secret-of-bob") as fresh:
            assert fresh.tenant == "bob"
        assert before.stats().tenants[0].tenant == "bob"  # the open session stays
        assert _scrape_status(url, "metrics-secret-one") == 401
        assert _scrape_status(url, "metrics-secret-two") == 200

        token.chmod(0o644)
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "token file not read again")
        assert "tenant 'bob'" in log.split("token file not read again")[-1]
        with d.client(token="the-second-secret-of-bob") as fresh:
            assert fresh.tenant == "bob"


def _scrape_status(url: str, token: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("bad", ["lots", "2001-13-01"])
def test_regression_a_config_that_did_not_load_kept_the_rotated_out_token(
    tmp_path, daemon_factory, bad
):
    """The token files read again are the running config's, whatever the new config holds;
    but a SIGHUP whose config did not load stopped before reading them, so a secret rotated
    out (leaked, say) still bound new sessions while an unrelated key of the file was wrong.
    A value YAML takes for a date it cannot build (2001-13-01) escaped the load as a
    ValueError, past the reload's handling, and stopped it so too."""
    token, tenants = tenant_token(tmp_path, "bob")
    path = tmp_path / "kvtier.yaml"
    path.write_text(CONFIG.format(batch=8, l1="64MiB", protect=2.0, level="info"))
    sock = f"{daemon_factory._sockdir}/rotate.sock"
    d = DaemonProcess(tmp_path, sock, ["--config", str(path), "--set", tenants])
    daemon_factory._daemons.append(d)
    d.start()
    old = token.read_text().strip()
    path.write_text(f"server:\n  max_batch_blocks: {bad}\n")
    _rotate(token, "the-second-secret-of-bob")
    d.proc.send_signal(signal.SIGHUP)
    _wait_for_log(d, "config not reloaded")
    assert "new token for tenant 'bob'" in _wait_for_log(d, "SIGHUP: new token for")
    with d.client(token=old) as stale, pytest.raises(UnauthenticatedError):
        stale.stats()
    with d.client(token="the-second-secret-of-bob") as fresh:
        assert fresh.tenant == "bob"


def test_a_reload_names_tenants_whose_token_files_came_to_hold_the_same_token(tmp_path, caplog):
    from types import SimpleNamespace

    from kvtier.daemon.config import load_config
    from kvtier.daemon.reload import Reloader
    from kvtier.daemon.sessions import SessionRegistry

    bob, _ = tenant_token(tmp_path, "bob")
    robot, _ = tenant_token(tmp_path, "robot")
    tenants = f"tenants=[{{name: bob, token_file: {bob}}}, {{name: robot, token_file: {robot}}}]"
    running = load_config(None, [tenants])
    daemon = SimpleNamespace(
        config=running, tenants=TenantDirectory.from_config(running), sessions=SessionRegistry()
    )
    reloader = Reloader(daemon, lambda: running)  # type: ignore[arg-type]
    _rotate(bob, robot.read_text().strip())
    changed, problems = reloader.reread_tokens()
    assert changed == ["tenant 'bob'"]
    assert problems == [
        "tenants 'bob', 'robot': their token files hold the same token, which binds none of them"
    ]
    assert "give each its own" in caplog.text and "secret-for-tenant" not in caplog.text


def test_regression_a_client_opened_its_next_session_with_the_token_rotated_out(
    tmp_path, daemon_factory
):
    """A client made with token_file read the file once, at construction: after a rotation,
    the next session it opened (its session ended: a daemon restart, a lapse of pings)
    presented the old token, refused until the engine's process made a new client. It reads
    the file again at each session it opens; a file it cannot read then keeps the token
    read before."""
    import asyncio
    import threading

    from kvtier.client import AsyncClient, Client

    token, tenants = tenant_token(tmp_path, "bob")
    d = daemon_factory(tenants)
    mine = tmp_path / "engine.token"  # the engine's copy of the secret
    _rotate(mine, token.read_text().strip())
    # The asyncio client's loop runs all along, as an engine's does: it sees its session end.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def connect() -> AsyncClient:
        return AsyncClient(d.address, token_file=str(mine))

    async def tenant_of(client: AsyncClient) -> str:
        return (await client.stats()).tenants[0].tenant

    with Client(d.address, token_file=str(mine)) as client:
        aclient = on_loop(connect())
        try:
            assert client.stats().tenants[0].tenant == "bob"
            assert on_loop(tenant_of(aclient)) == "bob"
            for path in (token, mine):
                _rotate(path, "the-second-secret-of-bob")
            d.proc.send_signal(signal.SIGHUP)
            _wait_for_log(d, "SIGHUP: new token for tenant 'bob'")
            assert client.stats().tenants[0].tenant == "bob"  # the open session carries on
            d.restart()  # every session ends
            assert client.stats().tenants[0].tenant == "bob"
            assert on_loop(tenant_of(aclient)) == "bob"
            mine.unlink()
            d.restart()
            assert client.stats().tenants[0].tenant == "bob"  # the token read before
        finally:
            on_loop(aclient.close())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


QUOTA_CONFIG = """
tiers:
  l1:
    capacity_bytes: 64MiB
    segment_bytes: 1MiB
policy:
  protect_s: 0
tenants:
  - name: ops
    uids: [0]
    admin: true
    quotas: {{l1: {quota}}}
"""


def test_sighup_applies_a_tenants_new_quota(tmp_path, daemon_factory):
    """Quotas change live: a tenant above a lowered quota makes room among its own blocks at
    its next put."""
    require_root()
    block = 64 << 10
    layout = PoolLayout.staging(
        num_layers=1, num_pages=16, block_tokens=16, chunk_bytes=block, dtype="uint8"
    )
    path = tmp_path / "kvtier.yaml"
    path.write_text(QUOTA_CONFIG.format(quota=8 * block))
    d = _start_with(path, tmp_path, daemon_factory, "quota")

    def l1_of_ops(client):
        (ops,) = [t for t in client.stats().tenants if t.tenant == "ops"]
        (l1,) = [u for u in ops.tiers if u.tier == Tier.L1_HOST]
        return l1.used_bytes, l1.quota_bytes

    with d.client() as client, SharedMemoryPool.for_layout(layout) as shm:
        pool = client.register_pool(shm, layout).pool_id
        client.put(pool, [os.urandom(32) for _ in range(8)], range(8))
        assert l1_of_ops(client) == (8 * block, 8 * block)
        path.write_text(QUOTA_CONFIG.format(quota=2 * block))
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "SIGHUP: applied")
        # Sizes spelled as the rest of the line, not a dict's repr ({'L1': '512KiB'} -> ...).
        line = next(x for x in log.splitlines() if "SIGHUP: applied" in x)
        assert line.endswith("SIGHUP: applied tenants[ops].quotas.l1: 512KiB -> 128KiB")
        assert l1_of_ops(client) == (8 * block, 2 * block)  # held until its next put
        client.put(pool, [os.urandom(32)], [8])
        assert l1_of_ops(client) == (2 * block, 2 * block)
        assert client.check().problems == []

        # More than a quota changes live too; root stays an admin, so its session goes on.
        path.write_text(QUOTA_CONFIG.format(quota=2 * block).replace("admin: true", "admin: false"))
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "SIGHUP: applied tenants: changed ops")
        assert "need a restart" not in log and "ended" not in log
        assert client.check().problems == []


def test_the_reload_plan_takes_quota_changes_of_tenants_and_shared_namespaces_only():
    from kvtier.daemon.config import load_config

    def config(alice_l1: str, shared_l2: str, bob_gids: str = "[]"):
        return load_config(
            None,
            [
                f"tenants=[{{name: alice, uids: [1000], quotas: {{l1: {alice_l1}}}}},"
                f" {{name: bob, uids: [1001], gids: {bob_gids}}}]",
                f"shared_namespaces=[{{name: s, tenants: [alice, bob], quotas: {{l2: {shared_l2}}}}}]",
                "tiers.l2.enabled=true",
                "tiers.l2.capacity_bytes=64GiB",
            ],
        )

    running = config("1GiB", "2GiB")
    effective, applied, restart = plan(running, config("512MiB", "4GiB"))
    assert applied == [
        "tenants[alice].quotas.l1: 1GiB -> 512MiB",
        "shared_namespaces[s].quotas.l2: 2GiB -> 4GiB",
    ]
    assert restart == [] and effective == config("512MiB", "4GiB")
    effective, applied, restart = plan(running, config("512MiB", "2GiB", bob_gids="[50]"))
    assert applied == ["tenants: changed bob", "tenants[alice].quotas.l1: 1GiB -> 512MiB"]
    assert restart == []
    assert effective.tenants == config("512MiB", "2GiB", bob_gids="[50]").tenants
    # One entry per tier whose quota changed, a quota added or removed from or to 0 (none).
    effective, applied, restart = plan(running, config("1GiB, l2: 3GB", "2GiB"))
    assert applied == ["tenants[alice].quotas.l2: 0 -> 3GB"] and restart == []
    effective, applied, restart = plan(config("1GiB, l2: 3GB", "2GiB"), config("2GiB", "2GiB"))
    assert applied == [
        "tenants[alice].quotas.l1: 1GiB -> 2GiB",
        "tenants[alice].quotas.l2: 3GB -> 0",
    ]


def test_regression_a_quota_changed_beside_another_tenant_change_was_logged_as_changed_only():
    """A SIGHUP that lowered alice's quota and added carol in the same edit logged "tenants:
    added carol; changed alice": the quota, which README says each reload line gives old and
    new ("tenants[ops].quotas.l1: 8GiB -> 4GiB"), was named only when nothing else of the
    list changed. Each quota that changed is its own line whatever else changed; a record
    changed in more than its quota is also named as changed."""
    from kvtier.daemon.config import load_config

    def config(*tenants: str):
        return load_config(
            None,
            [
                f"tenants=[{', '.join(tenants)}]",
                "tiers.l2.enabled=true",
                "tiers.l2.capacity_bytes=64GiB",
            ],
        )

    alice = "{{name: alice, uids: [1000]{admin}, quotas: {{l1: {l1}, l2: 1GiB}}}}"
    bob, carol = "{name: bob, uids: [1001]}", "{name: carol, uids: [1002]}"
    running = config(alice.format(admin="", l1="8GiB"), bob)
    loaded = config(alice.format(admin="", l1="4GiB"), carol)
    effective, applied, restart = plan(running, loaded)
    assert applied == [
        "tenants: added carol; removed bob",
        "tenants[alice].quotas.l1: 8GiB -> 4GiB",
    ]
    assert restart == [] and effective == loaded
    loaded = config(alice.format(admin=", admin: true", l1="0"), bob)
    _, applied, _ = plan(running, loaded)
    assert applied == ["tenants: changed alice", "tenants[alice].quotas.l1: 8GiB -> 0"]
    # Order alone, and quotas alone, as before.
    _, applied, _ = plan(running, config(bob, alice.format(admin="", l1="8GiB")))
    assert applied == ["tenants: reordered"]
    _, applied, _ = plan(running, config(bob, alice.format(admin="", l1="2GiB")))
    assert applied == ["tenants[alice].quotas.l1: 8GiB -> 2GiB"]


def test_the_reload_plan_spells_sizes_in_units_on_both_lines():
    """Regression: the keys that need a restart showed their sizes in bytes
    ("tiers.l2.capacity_bytes: 68719476736 -> 34359738368"); both the live changes and those
    that need a restart now spell sizes as the config does, and other values as they are."""
    from kvtier.daemon.config import load_config

    def config(capacity: str, rate: str, protect: float):
        return load_config(
            None,
            [
                "tiers.l2.enabled=true",
                f"tiers.l2.capacity_bytes={capacity}",
                f"tiers.l2.write_bytes_s={rate}",
                f"policy.protect_s={protect}",
            ],
        )

    effective, applied, restart = plan(config("64GiB", "0", 2.0), config("32GiB", "100MB", 0.5))
    assert applied == ["tiers.l2.write_bytes_s: 0 -> 100MB", "policy.protect_s: 2.0 -> 0.5"]
    assert restart == ["tiers.l2.capacity_bytes: 64GiB -> 32GiB"]
    assert effective == config("64GiB", "100MB", 0.5)


def test_reload_lines_spell_values_as_the_config_file_does():
    """Not Python's repr ('INFO', True, ('a',)): YAML, as an SRE wrote them."""
    from kvtier.daemon.config import load_config

    running = load_config(None, ["logging.level=info", "tiers.l2.enabled=false"])
    loaded = load_config(
        None, ["logging.level=debug", "tiers.l2.enabled=true", "policy.protect_s=2.5"]
    )
    _, applied, restart = plan(running, loaded)
    assert "logging.level: INFO -> DEBUG" in applied
    assert "tiers.l2.enabled: false -> true" in restart
    assert any(
        line.startswith("policy.protect_s: ") and line.endswith(" -> 2.5") for line in applied
    )
    assert not [line for line in applied + restart if "'" in line or "True" in line]


def test_the_reload_plan_takes_tenant_changes_unless_tenants_go_on_or_off():
    from kvtier.daemon.config import load_config

    def config(*tenants: str, admins: str = "[]"):
        return load_config(None, [f"tenants=[{', '.join(tenants)}]", f"server.admin_uids={admins}"])

    alice, bob = "{name: alice, uids: [1000]}", "{name: bob, uids: [1001]}"
    running = config(alice, bob)
    loaded = config("{name: alice, uids: [1000], admin: true}", "{name: carol, gids: [77]}")
    effective, applied, restart = plan(running, loaded)
    assert applied == ["tenants: added carol; removed bob; changed alice"] and restart == []
    assert effective == loaded
    effective, applied, restart = plan(running, config(alice, bob, admins="[1002]"))
    assert applied == ['server.admin_uids: [] -> ["1002"]'] and restart == []
    # Turning tenants off (or on) changes what a session is counted by: a restart.
    effective, applied, restart = plan(running, config())
    assert applied == [] and restart == ["tenants: removed alice, bob (turns tenants off)"]
    assert effective == running
    effective, applied, restart = plan(config(), running)
    assert applied == [] and restart == ["tenants: added alice, bob (turns tenants on)"]


def test_regression_turning_tenants_off_by_sighup_logged_their_records_as_python():
    """A SIGHUP that turned tenants off (or on) logged the records that need a restart as
    Python's repr of each ("tenants: [TenantConfig(name='alice', uids=(), ...), ...] -> []"),
    up to a line per tenant of it; it names them as the other tenant changes do."""
    from kvtier.daemon.config import load_config

    running = load_config(
        None,
        [
            "tenants=[{name: alice, uids: [1000], quotas: {l1: 1GiB}}]",
            "shared_namespaces=[{name: pub, tenants: [alice]}]",
        ],
    )
    _, applied, restart = plan(running, load_config(None, []))
    assert applied == []
    assert restart == [
        "tenants: removed alice (turns tenants off)",
        "shared_namespaces: removed pub (turns tenants off)",
    ]


TENANTS_CONFIG = """
tiers:
  l1:
    capacity_bytes: 64MiB
    segment_bytes: 1MiB
tenants:
{tenants}
"""


def _tenants_config(path: Path, tokens: dict[str, Path]) -> None:
    lines = [f"  - {{name: {name}, token_file: {file}}}" for name, file in tokens.items()]
    path.write_text(TENANTS_CONFIG.format(tenants="\n".join(lines)))


def _start_with(path: Path, tmp_path: Path, daemon_factory, name: str) -> DaemonProcess:
    """A daemon of the config file ``path`` (which a test rewrites, then sends SIGHUP)."""
    d = DaemonProcess(tmp_path, f"{daemon_factory._sockdir}/{name}.sock", ["--config", str(path)])
    daemon_factory._daemons.append(d)
    return d.start()


def test_sighup_adds_and_removes_tenants_and_ends_the_sessions_it_no_longer_binds(
    tmp_path, daemon_factory, caplog
):
    """Tenants change at SIGHUP without a restart: an added tenant's token binds sessions at
    once; a removed tenant's open session ends then (PERMISSION_DENIED, with why), its client's
    next session is refused, and its blocks stay; the other tenants' sessions go on. A tenant
    whose token file cannot be used refuses the whole reload."""
    require_root()  # root's sessions are admins', which see every tenant's usage
    tokens = {name: tenant_token(tmp_path, name)[0] for name in ("alice", "bob", "carol")}
    secret = {name: file.read_text().strip() for name, file in tokens.items()}
    path = tmp_path / "kvtier.yaml"
    _tenants_config(path, {"alice": tokens["alice"], "bob": tokens["bob"]})
    d = _start_with(path, tmp_path, daemon_factory, "tenants")
    layout = PoolLayout.staging(
        num_layers=1, num_pages=4, block_tokens=16, chunk_bytes=4096, dtype="uint8"
    )
    with (
        d.client(token=secret["alice"]) as alice,
        d.client(token=secret["bob"]) as bob,
        SharedMemoryPool.for_layout(layout) as shm,
    ):
        keys = {}
        for name, client in (("alice", alice), ("bob", bob)):
            pool = client.register_pool(shm, layout).pool_id
            keys[name] = [os.urandom(32) for _ in range(2)]
            assert client.put(pool, keys[name], [0, 1]).stored == 2
        with d.client(token=secret["carol"]) as carol, pytest.raises(UnauthenticatedError):
            carol.stats()
        alice_session, bob_session = alice.session_id, bob.session_id

        _tenants_config(path, {"alice": tokens["alice"], "carol": tokens["carol"]})
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "SIGHUP: applied tenants: added carol; removed bob")
        assert log.count("SIGHUP: session") == 1
        assert "would now be refused: tenant 'bob' has no token any more" in log
        with d.client(token=secret["carol"]) as carol:
            assert carol.tenant == "carol" and carol.lookup(keys["alice"]).prefix_len == 0
        assert alice.lookup(keys["alice"]).prefix_len == 2
        assert alice.session_id == alice_session  # the same session went on
        # Bob's client sees its session end, and says why.
        deadline = time.monotonic() + 10
        while not (
            ended := [r.getMessage() for r in caplog.records if "ended (" in r.getMessage()]
        ):
            assert time.monotonic() < deadline, "bob's client did not log its session's end"
            time.sleep(0.02)
        assert ended == [
            f"kvtier session {bob_session[:8]} ended (the daemon ended it: the daemon's tenants "
            "changed, and this session would now be refused: tenant 'bob' has no token any "
            "more (or is gone))"
        ]
        with pytest.raises(UnauthenticatedError, match="not any tenant's"):
            bob.lookup(keys["bob"])
        # Root's sessions are admins': every tenant's usage. Bob's blocks stay, under its name.
        assert alice.admin and alice.check().problems == []
        usage = {t.tenant: t for t in alice.stats().tenants}
        (l1,) = [u for u in usage["bob"].tiers if u.tier == Tier.L1_HOST]
        assert l1.blocks == 2 and usage["bob"].sessions == 0
        # Once they are gone, so is bob's name from the usage (and the metrics' labels).
        assert alice.delete(keys["bob"], tenant="bob").deleted == 2
        assert "bob" not in {t.tenant for t in alice.stats().tenants}

        # An added tenant whose token file others may read: nothing of the reload applies.
        dave, _ = tenant_token(tmp_path, "dave")
        dave.chmod(0o644)
        _tenants_config(path, {"alice": tokens["alice"], "dave": dave})
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "SIGHUP: config not reloaded")
        assert "dave.token" in log.split("SIGHUP: config not reloaded")[-1]
        with d.client(token=secret["carol"]) as carol:
            assert carol.tenant == "carol"  # carol was not removed
        assert alice.session_id == alice_session


def test_sighup_ends_a_token_session_whose_token_is_now_another_tenant_s(tmp_path, daemon_factory):
    """Token files moved between tenants (alice's path given to bob, bob's to alice): a
    session opened with alice's old token would now be bound to bob, so it ends; it must not
    go on acting as alice (reading her blocks) with what is now bob's token."""
    require_root()
    tokens = {name: tenant_token(tmp_path, name)[0] for name in ("alice", "bob")}
    secret = {name: file.read_text().strip() for name, file in tokens.items()}
    path = tmp_path / "kvtier.yaml"
    _tenants_config(path, {"alice": tokens["alice"], "bob": tokens["bob"]})
    d = _start_with(path, tmp_path, daemon_factory, "swap")
    with d.client(token=secret["alice"]) as client, d.client(token=secret["bob"]) as other:
        assert client.tenant == "alice" and other.tenant == "bob"
        first = client.session_id
        _tenants_config(path, {"alice": tokens["bob"], "bob": tokens["alice"]})
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "SIGHUP: applied tenants: changed alice, bob")
        assert log.count("SIGHUP: session") == 2
        assert "would now be bound to tenant 'bob' (admin), not 'alice' (admin)" in log
        # Its next call opens a new session, bound as the tokens are now.
        assert client.check().problems == []
        assert client.session_id != first and client.tenant == "bob"


def _swapping_tokens(tmp_path: Path) -> tuple[Path, str, list[dict[str, Path]]]:
    """Tenants alice and bob with token files, configured in ``path``; ``orders`` gives them
    their own files and each other's in turn (each swap ends alice's sessions), and ``secret``
    is the one alice's file holds at first."""
    tokens = {name: tenant_token(tmp_path, name)[0] for name in ("alice", "bob")}
    path = tmp_path / "kvtier.yaml"
    orders = [
        {"alice": tokens["alice"], "bob": tokens["bob"]},
        {"alice": tokens["bob"], "bob": tokens["alice"]},
    ]
    _tenants_config(path, orders[0])
    return path, tokens["alice"].read_text().strip(), orders


def test_calls_of_a_session_the_daemon_ended_at_a_reload_go_to_a_new_session(
    tmp_path, daemon_factory
):
    """A session a reload ends answers NOT_FOUND at once, while its client may not have seen
    its stream end yet: the client's calls made in that moment open a new session and are
    sent again (up to three times), as its next call would be, rather than failing with NotFoundError."""
    require_root()
    path, secret, orders = _swapping_tokens(tmp_path)
    d = _start_with(path, tmp_path, daemon_factory, "gone")
    keys = [os.urandom(32)]
    errors: list[Exception] = []
    answered = [0]
    stop = threading.Event()
    with d.client(token=secret) as client:
        assert client.tenant == "alice"  # its session is open before the reloads

        def calls() -> None:
            while not stop.is_set():
                try:
                    client.lookup(keys)
                except Exception as e:
                    errors.append(e)
                else:
                    answered[0] += 1

        caller = threading.Thread(target=calls)
        caller.start()
        try:
            for i in range(1, 9):
                _tenants_config(path, orders[i % 2])
                d.proc.send_signal(signal.SIGHUP)
                _wait_for_log(d, "SIGHUP: session", count=i)
                _wait_for_log(d, "SIGHUP: applied", count=i)
                time.sleep(0.05)  # the caller's calls meet the ended session, or the new one
                # Two answers from now: the second was sent after the reload, so its session
                # is open for the next one to end (on a loaded machine the caller had not
                # opened one yet, that reload ended none, and no line came).
                seen = answered[0]
                deadline = time.monotonic() + 30
                while answered[0] < seen + 2 and not errors:
                    assert time.monotonic() < deadline, "the caller's lookups stopped"
                    time.sleep(0.005)
        finally:
            stop.set()
            caller.join()
        assert errors == []
        assert client.tenant == "alice" and client.check().problems == []


def test_sighup_ends_a_token_session_whose_token_file_content_went_to_another_tenant(
    tmp_path, daemon_factory
):
    """The token files' contents swapped (paths and config unchanged): the token a session
    of alice opened with is now bob's, so the re-read tokens end that session as a changed
    config would; a token rotated out (no tenant's now) leaves its sessions open."""
    require_root()
    tokens = {name: tenant_token(tmp_path, name)[0] for name in ("alice", "bob", "carol")}
    secret = {name: file.read_text() for name, file in tokens.items()}
    path = tmp_path / "kvtier.yaml"
    _tenants_config(path, tokens)
    d = _start_with(path, tmp_path, daemon_factory, "content")
    with (
        d.client(token=secret["alice"].strip()) as client,
        d.client(token=secret["carol"].strip()) as carol,
    ):
        assert client.tenant == "alice" and carol.tenant == "carol"
        first, carols = client.session_id, carol.session_id
        tokens["alice"].write_text(secret["bob"])
        tokens["bob"].write_text(secret["alice"])
        tokens["carol"].write_text("a-new-secret-for-tenant-carol-0123456789")
        d.proc.send_signal(signal.SIGHUP)
        log = _wait_for_log(d, "SIGHUP: session")
        assert "would now be bound to tenant 'bob' (admin), not 'alice' (admin)" in log
        assert client.check().problems == []
        assert client.session_id != first and client.tenant == "bob"
        assert carol.session_id == carols  # rotated out: still carol's session


def test_an_async_client_s_call_of_a_session_a_reload_ended_goes_to_a_new_session(
    tmp_path, daemon_factory
):
    """The AsyncClient as the blocking one: its event loop busy while the reload ended the
    session (its watcher has not seen the end), its next call is answered NOT_FOUND and sent
    again in a new session, bound as the tenants are now."""
    import asyncio

    from kvtier.client import AsyncClient

    require_root()
    tokens = {name: tenant_token(tmp_path, name)[0] for name in ("alice", "bob")}
    path = tmp_path / "kvtier.yaml"
    _tenants_config(path, tokens)
    d = _start_with(path, tmp_path, daemon_factory, "aio")

    async def main() -> tuple[str, str, str]:
        async with AsyncClient(d.address, token=tokens["alice"].read_text().strip()) as client:
            first = await client.session()
            _tenants_config(path, {"alice": tokens["bob"], "bob": tokens["alice"]})
            d.proc.send_signal(signal.SIGHUP)
            _wait_for_log(d, "SIGHUP: session")  # blocks the loop: the watcher waits
            await client.lookup([os.urandom(32)])
            return first, await client.session(), client.tenant

    first, now, tenant = asyncio.run(main())
    assert now != first and tenant == "bob"


def _memfds_of(pid: int) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                found.append(fd)
    return found


@pytest.mark.slow  # ~10-20 s of reloads: `make test-slow`
def test_memfd_pools_register_while_reloads_end_their_sessions(tmp_path, daemon_factory):
    """Three clients register and unregister memfd pools in a loop while 100 SIGHUPs, about
    0.1 s apart, swap two tenants' token files, each ending the clients' sessions. Every
    registration succeeds: one whose session ended while its memory was mapped is sent again
    in a new session with the same credential ticket, which the daemon gave back (it had
    spent it: 56 of 5,149 registrations here were UNAUTHENTICATED; the deterministic case is
    in tests/daemon/test_pool_registration.py). Nothing of the memfds stays open in the
    daemon. Each SIGHUP waits until the last one is applied and every client has registered
    since: at a fixed 0.1 s, on a loaded machine the reloads came faster than the calls, a
    call saw the new sessions it was sent again in ended too, past the clients' three
    resends, and failed with NotFoundError."""
    require_root()
    path, secret, orders = _swapping_tokens(tmp_path)
    d = _start_with(path, tmp_path, daemon_factory, "memfd")
    layout = PoolLayout.staging(
        num_layers=1, num_pages=64, block_tokens=16, chunk_bytes=64 << 10, dtype="uint8"
    )
    errors: list[Exception] = []
    registered = [0, 0, 0]  # each client's
    stop = threading.Event()

    def register_in_a_loop(me: int) -> None:
        with d.client(token=secret) as client, SharedMemoryPool.for_layout(layout) as shm:
            while not stop.is_set():
                try:
                    pool = client.register_pool(shm, layout)
                except Exception as e:
                    errors.append(e)
                    continue
                registered[me] += 1
                with contextlib.suppress(NotFoundError):  # a reload ended it with its session
                    client.unregister_pool(pool.pool_id)

    threads = [threading.Thread(target=register_in_a_loop, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        for i in range(1, 101):
            _tenants_config(path, orders[i % 2])
            d.proc.send_signal(signal.SIGHUP)
            _wait_for_log(d, "SIGHUP: applied", count=i, timeout_s=60)
            before = list(registered)
            deadline = time.monotonic() + 60
            while not errors and any(registered[j] == before[j] for j in range(3)):
                assert time.monotonic() < deadline, f"clients stalled: {registered}"
                time.sleep(0.005)
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert d.log().count("SIGHUP: session") >= 50  # the reloads ended sessions
    assert sum(registered) > 100 and errors == []
    deadline = time.monotonic() + 30
    while held := _memfds_of(d.proc.pid):
        assert time.monotonic() < deadline, f"the daemon holds {len(held)} memfds"
        time.sleep(0.05)
    with d.client(token=secret) as client:
        assert client.check().problems == []


def test_a_call_whose_new_sessions_reloads_end_too_is_sent_again_up_to_three_times(
    tmp_path, daemon_factory
):
    """Reloads that come faster than a call can end each new session it is sent again in
    (reloads every 0.1 s on a loaded CI machine did: one registration of a memfd pool failed
    with NotFoundError, the session not open): a call is sent again in a new session up to
    three times. Reloads here end the session under each try of one call: with three
    endings, a memfd pool's registration and an async Lookup land in the fourth session; a
    fourth ending fails the call with NotFoundError, session_gone."""
    import asyncio

    from kvtier.client import AsyncClient

    require_root()
    path, secret, orders = _swapping_tokens(tmp_path)
    d = _start_with(path, tmp_path, daemon_factory, "thrice")
    reloads = [0]

    def ending(call, endings: int, method: str):
        """``call`` that first ends the session by a reload, ``endings`` times."""
        left = [endings]

        def before(name: str) -> None:
            if name == method and left[0]:
                left[0] -= 1
                reloads[0] += 1
                _tenants_config(path, orders[reloads[0] % 2])
                d.proc.send_signal(signal.SIGHUP)
                _wait_for_log(d, "SIGHUP: session", count=reloads[0])

        if asyncio.iscoroutinefunction(call):

            async def wrapped(name: str, request, timeout_s: float):
                before(name)
                return await call(name, request, timeout_s)

        else:

            def wrapped(name: str, request, timeout_s: float):
                before(name)
                return call(name, request, timeout_s)

        return wrapped

    layout = PoolLayout.staging(
        num_layers=1, num_pages=4, block_tokens=16, chunk_bytes=4 << 10, dtype="uint8"
    )
    with d.client(token=secret) as client, SharedMemoryPool.for_layout(layout) as shm:
        first = client.session_id
        client.call = ending(client.call, 3, "RegisterPool")
        pool = client.register_pool(shm, layout)
        assert reloads[0] == 3 and client.session_id not in ("", first)
        assert pool.pool_id and client.check().problems == []
        client.call = ending(client.call, 4, "Lookup")
        with pytest.raises(NotFoundError) as raised:
            client.lookup([os.urandom(32)])
        assert raised.value.session_gone and reloads[0] == 7

    async def main() -> int:
        async with AsyncClient(d.address, token=secret) as aclient:
            await aclient.session()
            aclient.call = ending(aclient.call, 3, "Lookup")
            found = await aclient.lookup([os.urandom(32)])
            return found.prefix_len

    assert asyncio.run(main()) == 0 and reloads[0] == 10
