"""Deployment files: the systemd unit (verified and rated by systemd-analyze, its notify
protocol spoken by a real daemon, its Documentation= installed), the container image
definition, the Kubernetes DaemonSet (validated against the Kubernetes schemas, its probe run
against a real daemon), the stop timeouts of all three against the config's, and the Grafana
dashboard (every query names a metric the daemon exports)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvtier import __version__
from kvtier.daemon.config import ConfigError, config_keys, env_name, load_config, parse_size
from kvtier.daemon.metrics import CATALOGUE
from kvtier.daemon.probes import HEALTH_REUSE_S, HEALTH_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "kvtierd.service"
MAX_EXPOSURE = 4.0


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing: apt-get install systemd"
    return tool


def _section(name: str) -> dict[str, list[str]]:
    """One section of the unit (``[Unit]``); repeated keys keep every value."""
    values: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif line and not line.startswith("#") and section == name:
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def _unit() -> dict[str, list[str]]:
    """The [Service] section."""
    return _section("[Service]")


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    """In a scratch root that has the unit's ExecStart (and the host's own units, for the
    targets it orders after): a missing binary or a bad directive fails."""
    root = tmp_path / "root"
    exe = root / "opt/kvtier/.venv/bin/kvtierd"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system/kvtierd.service")
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib/systemd").symlink_to("/usr/lib/systemd")
    (root / "bin").mkdir()
    shutil.copy("/bin/kill", root / "bin/kill")  # ExecReload's, as on the host
    out = subprocess.run(
        [_systemd_analyze(), "verify", f"--root={root}", "kvtierd.service"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    ours = [line for line in (out.stdout + out.stderr).splitlines() if "kvtierd.service" in line]
    assert out.returncode == 0 and ours == [], out.stderr
    exe.unlink()
    missing = subprocess.run(
        [_systemd_analyze(), "verify", f"--root={root}", "kvtierd.service"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0 and "is not executable" in missing.stderr


def test_the_unit_is_rated_ok_by_systemd_analyze_security():
    out = subprocess.run(
        [_systemd_analyze(), "security", "--offline=true", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for kvtierd.service: ([\d.]+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, out.stdout


def test_the_units_documentation_is_a_file_the_install_puts_there():
    """Regression: Documentation=file:///opt/kvtier/README.md named a file that nothing
    installs (`pip install .` into /opt/kvtier/.venv, as the README's install steps do).
    Every file: URI of the unit is one of the package's data files, under the prefix of the
    venv that ExecStart runs."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data_files = setuptools.get("data-files", {})
    exe = Path(_unit()["ExecStart"][0].split()[0])
    assert exe.parent.name == "bin", exe
    prefix = exe.parent.parent  # /opt/kvtier/.venv
    installed = {
        prefix / folder / Path(source).name: ROOT / source
        for folder, sources in data_files.items()
        for source in sources
    }
    docs = " ".join(_section("[Unit]")["Documentation"]).split()
    files = [Path(uri.removeprefix("file://")) for uri in docs if uri.startswith("file:")]
    assert files, docs
    for path in files:
        assert path in installed, f"{path}: no install puts it there ({sorted(installed)})"
        assert installed[path].is_file(), installed[path]


def test_the_sandbox_still_reaches_the_socket_shared_memory_and_l2():
    unit = _unit()
    rw = " ".join(unit["ReadWritePaths"]).split()
    assert {"/run/kvtier", "/var/lib/kvtier", "/dev/shm"} <= set(rw)
    assert unit["RuntimeDirectory"] == ["kvtier"] and unit["StateDirectory"] == ["kvtier"]
    # The default L2 path is relative: under the working directory, inside StateDirectory.
    assert unit["WorkingDirectory"] == ["/var/lib/kvtier"]
    assert "AF_UNIX" in unit["RestrictAddressFamilies"][0].split()
    assert unit["IPAddressAllow"] == ["localhost"]  # loopback metrics keep working
    assert "@system-service" in unit["SystemCallFilter"]
    # Page-locked L1 needs the limit, not a capability (the bounding set is empty).
    assert unit["LimitMEMLOCK"] == ["infinity"] and unit["CapabilityBoundingSet"] == [""]
    assert unit["Type"] == ["notify"] and unit["KillSignal"] == ["SIGTERM"]


def test_systemctl_reload_sends_the_daemon_sighup():
    """`systemctl reload kvtierd` said "Job type reload is not applicable": the unit had no
    ExecReload, though SIGHUP is how kvtierd reloads its config."""
    assert _unit()["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_a_config_error_is_not_restarted_in_a_loop(tmp_path):
    """Restart=on-failure restarted a daemon refused for a bad config (exit 2) every
    RestartSec=2 s for good: each try took under a second, so systemd's start limit (5 in
    10 s) never tripped, and the unit stayed "activating" with an error every few seconds
    instead of failed. The unit leaves that status alone; a host check that failed (exit 1:
    a port or socket still held) may pass on the next try and is restarted."""
    bad = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--set", "server.no_such_key=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown config key" in bad.stderr, bad.stderr
    assert _unit()["Restart"] == ["on-failure"]
    assert _unit()["RestartPreventExitStatus"] == [str(bad.returncode)]


def test_regression_a_user_or_group_name_not_found_at_start_was_never_tried_again():
    """A name in the config the host did not know (server.socket_group here) exited 2, a
    config error, which the unit does not restart; but a directory service (LDAP, SSSD) that
    does not answer yet looks the same to the lookup, and a boot where it answered seconds
    late left the node without its daemon. It exits 4, which the unit restarts, and a start
    limit that a try every RestartSec trips ends the restarts of a misspelt name."""
    refused = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--set", "server.socket_group=no-such-group-kv"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 4, refused.stderr
    assert "server.socket_group': no group 'no-such-group-kv'" in refused.stderr
    assert "directory service" in refused.stderr
    unit, service = _section("[Unit]"), _unit()
    assert service["Restart"] == ["on-failure"]
    assert str(refused.returncode) not in service["RestartPreventExitStatus"][0].split()
    # Names from LDAP or SSSD are looked up once their services run.
    assert "nss-user-lookup.target" in " ".join(unit["After"]).split()
    # Each try fails within a second: the limit's burst, a try every RestartSec, fits well
    # inside its interval (systemd's default, 5 in 10 s, never tripped).
    (burst,), (interval_s,), (restart_s,) = (
        unit["StartLimitBurst"],
        unit["StartLimitIntervalSec"],
        service["RestartSec"],
    )
    assert int(burst) * (float(restart_s) + 1) < float(interval_s)


def test_regression_the_start_limit_refused_the_restart_the_readme_told_to_run():
    """9e2ddd4's start limit counts every start, manual ones too (systemd.unit): once ten
    tries of a name not found (exit 4) had stopped the unit, README's 'fix the file (or,
    for a name, the directory), then systemctl restart kvtierd' was refused
    (start-limit-hit) until the interval had passed. README and the unit say to run
    systemctl reset-failed first."""
    assert _section("[Unit]")["StartLimitBurst"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    restart = readme.index("then `systemctl restart kvtierd`")
    assert "`systemctl reset-failed kvtierd`" in readme[restart : restart + 400]
    assert "systemctl reset-failed kvtierd" in UNIT.read_text()


def test_kvtierd_speaks_the_units_notify_protocol(tmp_path):
    """Type=notify and WatchdogSec=: kvtierd tells systemd READY=1 once it serves (systemd
    would otherwise fail the start after TimeoutStartSec), pings WATCHDOG=1 at half of
    WATCHDOG_USEC from its event loop (else systemd kills it as hung), and says STOPPING=1
    when SIGTERM starts its drain."""
    import os
    import signal
    import socket
    import sys
    import tempfile

    from kvtier.client import Client

    short = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))  # within AF_UNIX's 108 bytes
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(short / "notify"))
    notify.settimeout(30)
    sock = str(short / "k.sock")
    env = dict(os.environ, NOTIFY_SOCKET=str(short / "notify"), WATCHDOG_USEC="200000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.daemon", "--set", f"server.socket={sock}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ready = notify.recv(4096).decode()
        assert ready.splitlines()[0] == "READY=1", ready
        with Client(f"unix:{sock}") as client:  # serving when it says so
            assert client.health()
        # Every 0.1 s here: five come well within the socket's timeout.
        assert {notify.recv(4096).decode() for _ in range(5)} == {"WATCHDOG=1"}
        proc.send_signal(signal.SIGTERM)
        while (message := notify.recv(4096).decode()) == "WATCHDOG=1":
            pass
        assert message == "STOPPING=1"
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
        notify.close()
        shutil.rmtree(short, ignore_errors=True)


def _stop_bound_s(path: Path | None, environ: dict[str, str] | None = None) -> float:
    """The longest a SIGTERM keeps the daemon of the config ``path`` and ``environ`` give: its
    stop's bound (drain, flush, grace: server.stop_bound_s), then what the process may take
    past it (its event loop blocked, or its exit held once stopped). The flush at stop is
    counted where L2 is still off, as in deploy/kvtier.yaml, since turning it on changes no
    timeout."""
    from kvtier.daemon.main import EXIT_AFTER_STOP_S
    from kvtier.daemon.server import ABANDON_BLOCKED_AFTER_S, stop_bound_s

    with_l2 = load_config(path, ["tiers.l2.enabled=true"], environ=environ)
    return stop_bound_s(with_l2) + max(ABANDON_BLOCKED_AFTER_S, EXIT_AFTER_STOP_S)


def test_the_deployments_wait_for_the_daemons_stop_before_killing_it():
    """systemd's TimeoutStopSec and the DaemonSet's terminationGracePeriodSeconds outlast the
    stop of the config each runs (past them the daemon is SIGKILLed mid-flush and the L1
    blocks not yet written are lost); so does the `docker run --stop-timeout` the image
    asks for."""
    unit = _unit()
    assert int(unit["TimeoutStopSec"][0]) > _stop_bound_s(DEPLOY / "kvtier.yaml")
    (ds,) = [d for d in _manifests() if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    config = load_config(None, environ=env)
    assert config.tiers.l2.enabled and config.tiers.l2.flush_on_stop
    assert pod["terminationGracePeriodSeconds"] > _stop_bound_s(None, env)
    asked = re.search(r"--stop-timeout (\d+)", (DEPLOY / "Dockerfile").read_text())
    assert asked and int(asked[1]) > _stop_bound_s(DEPLOY / "kvtier.yaml")


# ------------------------------------------------------------------------- container


def _dockerfile() -> list[tuple[str, str]]:
    lines, current = [], ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        if raw.strip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            lines.append((word.upper(), rest))
            current = ""
    return lines


def test_the_dockerfile_copies_every_package_and_runs_the_daemon():
    instructions = _dockerfile()
    copied = set()
    for word, rest in instructions:
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), src
                copied.add(src.rstrip("/"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    for package in re.findall(r'"kvtier\.(\w+)', pyproject):
        assert package in copied, f"{package}/ is not copied into the image"
    entry = next(rest for word, rest in instructions if word == "ENTRYPOINT")
    assert json.loads(entry) == ["kvtierd"]
    health = next(rest for word, rest in instructions if word == "HEALTHCHECK")
    assert '"kvtier"' in health and '"health"' in health
    env = next(rest for word, rest in instructions if word == "ENV")
    names = set(re.findall(r"(KVTIER_\w+)=", env))
    known = {env_name(k) for k in config_keys()} | {"KVTIER_CONFIG"}
    assert names <= known, names - known
    assert "torch" not in (DEPLOY / "Dockerfile").read_text().lower().split("#")[0]


def test_the_image_runs_l2_only_once_enabled_and_then_in_var_lib_kvtier():
    """The image's config is deploy/kvtier.yaml plus its ENV: its L2 path alone leaves L2 off
    (the README and the Dockerfile say so), and enabling L2 puts it in the volume."""
    instructions = _dockerfile()
    env = dict(
        re.findall(r"(\w+)=(\S+)", next(rest for word, rest in instructions if word == "ENV"))
    )
    copied = [rest.split() for word, rest in instructions if word == "COPY"]
    assert ["deploy/kvtier.yaml", env.pop("KVTIER_CONFIG")] in copied
    volumes = json.loads(next(rest for word, rest in instructions if word == "VOLUME"))
    config = load_config(DEPLOY / "kvtier.yaml", environ=env)
    assert not config.tiers.l2.enabled
    env |= {"KVTIER_TIERS_L2_ENABLED": "true", "KVTIER_TIERS_L2_CAPACITY_BYTES": "1GiB"}
    config = load_config(DEPLOY / "kvtier.yaml", environ=env)
    assert config.tiers.l2.enabled
    assert str(config.tiers.l2.path) == "/var/lib/kvtier/l2"
    assert any(str(config.tiers.l2.path).startswith(volume + "/") for volume in volumes)


# ------------------------------------------------------------------------ kubernetes


def _manifests() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "kubernetes" / "kvtierd-daemonset.yaml").read_text()))


def test_the_daemonset_is_a_valid_kubernetes_object():
    for doc in _manifests():
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_daemonset_shares_socket_dir_l2_and_shm_with_the_node():
    (ds,) = [d for d in _manifests() if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    for path in ("/run/kvtier", "/var/lib/kvtier", "/dev/shm"):
        assert mounts[path]["hostPath"]["path"] == path, path
    env = {e["name"]: e["value"] for e in container["env"]}
    config = load_config(None, environ=env)  # every variable names a real key
    assert config.tiers.l2.path.startswith("/var/lib/kvtier")
    assert config.server.socket == "/run/kvtier/kvtierd.sock"  # root in the pod: the system path
    memory = parse_size(container["resources"]["requests"]["memory"])
    assert memory > config.tiers.l1.capacity_bytes
    assert parse_size(container["resources"]["limits"]["memory"]) >= memory
    assert container["image"].endswith(f":{__version__}")
    port = int(config.metrics.address.rsplit(":", 1)[1])
    assert {p["containerPort"] for p in container["ports"]} == {port}
    # The port Prometheus's pod discovery scrapes, by the annotations.
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    (named,) = [p["name"] for p in container["ports"]]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == named
        # The daemon's own 503 comes before the kubelet gives up on an answer.
        assert container[probe]["timeoutSeconds"] > HEALTH_TIMEOUT_S


def test_regression_a_service_in_the_namespace_stopped_the_daemon_s_start():
    """Kubernetes gives a pod's containers variables for each Service of its namespace (a
    Service kvtier-metrics: KVTIER_METRICS_SERVICE_HOST, KVTIER_METRICS_PORT, ...), which
    fall under a config section's prefix and name no key: the daemon refused to start. The
    manifest turns those links off."""
    (ds,) = [d for d in _manifests() if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    links = {
        "KVTIER_METRICS_SERVICE_HOST": "10.96.0.12",
        "KVTIER_METRICS_SERVICE_PORT": "9464",
        "KVTIER_METRICS_PORT": "tcp://10.96.0.12:9464",
    }
    with pytest.raises(ConfigError, match="KVTIER_METRICS_"):
        load_config(None, environ={**env, **links})
    assert pod["enableServiceLinks"] is False


def test_the_probes_pass_against_a_serving_daemon(daemon_factory):
    """Each probe's path, asked of a daemon started with the manifest's metrics address (on a
    free port here), answers 200."""
    (ds,) = [d for d in _manifests() if d["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    host = env["KVTIER_METRICS_ADDRESS"].rsplit(":", 1)[0]
    d = daemon_factory(f"metrics.address={host}:0")
    (port,) = set(re.findall(r"metrics on http://[^/]*:(\d+)/metrics", d.log()))
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        url = f"http://127.0.0.1:{port}{container[probe]['httpGet']['path']}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200, probe


def test_a_draining_daemon_is_alive_to_liveness_checks_and_not_ready(daemon_factory, capsys):
    """A daemon that drains (`kvtier drain`) runs and answers, but takes no new sessions: the
    image's HEALTHCHECK exited 2 then, so Docker marked a draining container unhealthy (and
    an orchestrator could restart it mid-drain). The liveness checks (HEALTHCHECK, the
    livenessProbe) pass while it drains, the readiness ones (the readinessProbe, plain
    `kvtier health`) fail; after `drain --resume` all pass."""
    from kvtier.cli.main import main

    (ds,) = [d for d in _manifests() if d["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    d = daemon_factory("metrics.address=127.0.0.1:0")
    (port,) = set(re.findall(r"metrics on http://[^/]*:(\d+)/metrics", d.log()))
    health = next(rest for word, rest in _dockerfile() if word == "HEALTHCHECK")
    command = json.loads(health[health.index("CMD") + 3 :])
    assert command[0] == "kvtier"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        """`kvtier --address ... *args`, in this process: 7 interpreters started for it spent
        the test's seconds importing the client."""
        try:
            code = main(["--address", d.address, *args])
        except SystemExit as e:
            code = int(e.code or 0)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    def probe(name: str) -> int:
        url = f"http://127.0.0.1:{port}{container[name]['httpGet']['path']}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    assert run(*command[1:]).returncode == 0
    assert run("drain").returncode == 0
    # The tests run as root, an admin whom a drain does not turn away: the probe reads the
    # tiers' states in a session of its own.
    alive = run(*command[1:])
    assert alive.returncode == 0, alive
    assert alive.stdout.startswith(f"alive: kvtierd at {d.address} draining"), alive.stdout
    assert probe("livenessProbe") == 200
    ready = run("health")
    assert ready.returncode == 2 and "draining" in ready.stdout, ready
    assert probe("readinessProbe") == 503
    assert run("drain", "--resume").returncode == 0
    assert run(*command[1:]).returncode == 0 and run("health").returncode == 0
    time.sleep(HEALTH_REUSE_S)  # past the draining answer, which the probes reuse that long
    assert probe("livenessProbe") == probe("readinessProbe") == 200


# -------------------------------------------------------------------------- grafana


def test_every_dashboard_query_names_an_exported_metric():
    dash = json.loads((DEPLOY / "grafana" / "kvtier-dashboard.json").read_text())
    declared = {m.name for m in CATALOGUE}
    # kvtier_, and the standard families' process_ and python_
    prefixes = "|".join(sorted({m.name.split("_", 1)[0] for m in CATALOGUE}))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
        for name in re.findall(rf"\b(?:{prefixes})_[a-z0-9_]+", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in declared or base in declared, name
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dash["panels"])


def test_the_readme_tables_list_every_declared_metric_with_its_type_and_labels():
    """The tables of README's Metrics section have one row per catalogue entry (the daemon's
    own and the standard families), each with the entry's type, labels and help text (the
    HELP a scrape shows; README may quote a name with backticks), and no other."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### Metrics\n", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        # The daemon's own table has a last column more: the name kvtier stats prints.
        m = re.fullmatch(r"\| `([a-z0-9_]+)` \| (\w+) \| ([^|]*) \| ([^|]*) \|( [^|]* \|)?", line)
        if m:
            assert m[1] not in rows, m[1]
            rows[m[1]] = (m[2], m[3].strip(), m[4].strip().replace("`", ""))
    assert rows == {m.name: (m.kind, ", ".join(m.labels), m.help) for m in CATALOGUE}


@pytest.mark.parametrize("name", ["kvtier.yaml", "kvtierd.service", "Dockerfile"])
def test_deploy_files_name_no_machine_specific_paths(name):
    """Nothing under this checkout or this user's home: paths of the machine that wrote them."""
    text = (DEPLOY / name).read_text()
    for here in {str(ROOT.resolve()), str(Path.home())}:
        assert len(here) < 2 or here + "/" not in text, here


def _bootstrap():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvtier_bootstrap", DEPLOY / "bootstrap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bootstrap_installs_again_for_another_checkout_or_other_inputs():
    """The venv's stamp counts only for the checkout that wrote it and the inputs it hashed: a
    git worktree's `make` that installed itself into the same venv left it importing the
    worktree's code, and the main checkout's next `make` believed the venv ready."""
    boot = _bootstrap()
    digest = boot.inputs_hash()
    mine = {"hash": digest, "root": str(boot.ROOT), "extras": ["dev"]}
    assert boot.installed_extras(mine, digest) == {"dev"}
    assert boot.installed_extras({**mine, "root": "/elsewhere/kvtier"}, digest) is None
    assert boot.installed_extras({k: v for k, v in mine.items() if k != "root"}, digest) is None
    assert boot.installed_extras(mine, "other inputs") is None
    assert boot.installed_extras({**mine, "extras": "dev"}, digest) is None
