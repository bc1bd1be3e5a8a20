from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
from harness import run_into_closed_pipe

from kvtier import paths
from kvtier.daemon.config import Config, build_config, env_name, load_config, parse_size
from kvtier.daemon.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "deploy", "kvtier.yaml")


def _unresolved(config: Config) -> Config:
    """``config`` with its socket as written before ``auto`` was resolved."""
    assert config.server.socket == paths.daemon_socket()
    return dataclasses.replace(config, server=dataclasses.replace(config.server, socket="auto"))


def test_embedded_defaults_need_no_file():
    config = load_config()
    assert _unresolved(config) == Config()
    assert os.path.isabs(config.server.socket)
    assert config.tiers.l1.capacity_bytes == 1 << 30


def test_the_documented_example_is_exactly_the_defaults():
    assert _unresolved(load_config(EXAMPLE)) == Config()


@pytest.mark.parametrize(
    "value, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("1.5 GiB", 3 << 29),
        ("2GB", 2 * 10**9),
        ("1kib", 1024),
        ("2G", 2 * 10**9),
        ("2g", 2 * 10**9),
        ("2Gi", 2 << 30),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("512Mi", 512 << 20),
        ("1Ti", 1 << 40),
        ("10 B", 10),
    ],
)
def test_sizes(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value", ["", "12 parsecs", "-1", True, 1.5, None, "GiB", "2Gb2", "2 GiBs", "2iB"]
)
def test_bad_sizes(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_regression_a_config_file_of_no_end_took_memory_until_the_daemon_was_killed(tmp_path):
    """The file was read whole: `kvtierd --config /dev/zero --check-config` grew until the
    kernel killed it (and a SIGHUP would have done so to a running daemon). A file past
    MAX_CONFIG_FILE_BYTES is refused after reading that much."""
    from kvtier.daemon.config import MAX_CONFIG_FILE_BYTES

    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(MAX_CONFIG_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match="holds more than 16 MiB"):
        load_config(big)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--config", "/dev/zero", "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "/dev/zero holds more than 16 MiB" in proc.stderr


@pytest.mark.parametrize(
    "text, key",
    [
        ("tiers:\n  l1:\n    capcity_bytes: 1GiB\n", "tiers.l1.capcity_bytes"),
        ("l3:\n  x: 1\n", "'l3'"),
        ("tiers:\n  l3:\n    x: 1\n", "tiers.l3"),
        ("l1:\n  capacity_bytes: 1GiB\n", "now 'tiers.l1'"),
        ("tiers:\n  l1:\n    capacity_bytes: lots\n", "tiers.l1.capacity_bytes"),
        ("tiers:\n  l1:\n    high_watermark: 1.5\n", "tiers.l1.high_watermark"),
        ("tiers:\n  l1:\n    high_watermark: yes\n", "tiers.l1.high_watermark"),
        ("server:\n  max_batch_blocks: 0\n", "server.max_batch_blocks"),
        ("server:\n  max_batch_blocks: 2.5\n", "server.max_batch_blocks"),
        ("server:\n  max_batch_blocks: 200000\n", "server.max_message_bytes"),
        ("logging:\n  level: LOUD\n", "logging.level"),
        ("tiers:\n  l1:\n    low_watermark: 0.99\n", "tiers.l1.low_watermark"),
        ("tiers:\n  l1:\n    segment_bytes: 1000\n", "tiers.l1.segment_bytes"),
        ("tiers:\n  l1: [1, 2]\n", "'tiers.l1'"),
        ("- just a list\n", "mapping"),
        ("tiers: {l1: {capacity_bytes: 1GiB\n", "not valid YAML"),
        # A name ending in a newline: "$" matched before it (the whole name must match now).
        ('tenants: [{name: "alice\\n", uids: [1000]}]\n', "tenants[0].name"),
        ('shared_namespaces: [{name: "common\\n", tenants: []}]\n', "shared_namespaces[0].name"),
    ],
)
def test_bad_files_name_the_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        load_config(path)


def test_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tiers:\n  l1:\n    capacity_bytes: 2GiB\n")
    config = load_config(
        path,
        [
            "tiers.l1.capacity_bytes=512MiB",
            "server.tcp_address=127.0.0.1:5000",
            "tenants=[{name: remote, token_file: remote.token}]",  # TCP needs a token tenant
        ],
    )
    assert config.tiers.l1.capacity_bytes == 512 << 20
    assert config.server.tcp_address == "127.0.0.1:5000"


@pytest.mark.parametrize(
    "override",
    [
        "l1",
        "tiers.l1.capacity_bytes",
        "nosuch.key=1",
        "tiers.l1.nosuch=1",
        "tiers.l1=1",
        "l1.capacity_bytes=1GiB",
    ],
)
def test_bad_overrides(override):
    with pytest.raises(ConfigError):
        load_config(None, [override])


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_kvtierd_refuses_a_bad_config_with_the_key_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers:\n  l1:\n    capcity_bytes: 1GiB\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "tiers.l1.capcity_bytes" in proc.stderr


def test_kvtierd_prints_its_effective_config():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.daemon",
            "--print-config",
            "--set",
            "tiers.l1.capacity_bytes=2GiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "capacity_bytes: 2GiB" in proc.stdout
    assert "max_message_bytes: 4MiB" in proc.stdout


@pytest.mark.parametrize("option", ["--print-config", "--check-config"])
def test_regression_print_config_into_a_closed_pipe_ended_in_a_traceback(option, tmp_path):
    """`kvtierd --print-config | head` (the reader gone before the config is written) ended
    in BrokenPipeError's traceback and exit status 1, and so did --check-config, whose 1
    says the host cannot run the config; both end quietly with their own status (0 here),
    as `kvtier`'s commands do."""
    proc = run_into_closed_pipe(
        "kvtier.daemon",
        option,
        "--set",
        f"server.socket={tmp_path}/s.sock",
        "--set",
        "tiers.l1.capacity_bytes=64MiB",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_kvtierd_refuses_a_disk_tier_the_filesystem_cannot_hold(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.daemon",
            "--set",
            f"server.socket={tmp_path}/s.sock",
            "--set",
            "tiers.l2.enabled=true",
            "--set",
            f"tiers.l2.path={tmp_path}/l2",
            "--set",
            "tiers.l2.capacity_bytes=1000TiB",
            "--set",
            "tiers.l2.file_bytes=4TiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "cannot start" in proc.stderr and "cannot hold" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "override, key",
    [
        ("policy.name=opt", "policy.name"),
        ("tiers.l2.admission=belady", "tiers.l2.admission"),
        ("tiers.l2.write_policy=sometimes", "tiers.l2.write_policy"),
    ],
)
def test_policies_the_daemon_cannot_run_are_config_errors(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_l3_keys_are_the_tiers_own_options_with_the_same_defaults():
    """Every key of tiers.l3 but `enabled`, `admission` and `known_s` is a RemoteOptions field, with the
    same default: the daemon's config and the tier cannot drift apart."""
    import dataclasses

    from kvtier.daemon.config import L3Config
    from kvtier.tiers.remote.options import RemoteOptions

    config = {f.name: f.default for f in dataclasses.fields(L3Config)}
    tier = {f.name: f.default for f in dataclasses.fields(RemoteOptions)}
    assert set(config) - set(tier) == {"enabled", "admission", "known_s"}
    assert set(tier) <= set(config)
    assert {k: config[k] for k in tier} == tier
    assert L3Config().tier_options() == RemoteOptions()
    assert Config().tiers.l3.enabled is False


def test_l3_urls_take_a_list_or_one_string(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "tiers:\n  l3:\n    enabled: true\n    mode: cluster\n"
        "    urls: [redis://10.0.0.1:7000, redis://10.0.0.2:7000]\n"
    )
    config = load_config(path)
    assert config.tiers.l3.urls == ("redis://10.0.0.1:7000", "redis://10.0.0.2:7000")
    assert config.tiers.l3.tier_options().mode == "cluster"
    one = load_config(
        None, ["tiers.l3.enabled=false", "tiers.l3.urls=rediss://cache:6380", "tiers.l3.ttl_s=60"]
    )
    assert one.tiers.l3.urls == ("rediss://cache:6380",)
    assert one.tiers.l3.tier_options().ttl_s == 60


@pytest.mark.parametrize(
    "override, key",
    [
        (["tiers.l3.urls=[1, 2]"], "tiers.l3.urls"),
        (["tiers.l3.mode=sentinel"], "tiers.l3.mode"),
        (["tiers.l3.admission=sometimes"], "tiers.l3.admission"),
        (["tiers.l3.pool_size=1"], "tiers.l3.pool_size"),
        (["tiers.l3.max_value_bytes=1GiB"], "tiers.l3.max_value_bytes"),
        (["tiers.l3.enabled=true", "tiers.l3.urls=http://h:1"], "tiers.l3"),
        (["tiers.l3.enabled=true", "tiers.l3.urls=redis://u:pw@h:1"], "credentials"),
        (["tiers.l3.enabled=true", "tiers.l3.key_prefix='kv{x}:'"], "hash tag"),
    ],
)
def test_bad_l3_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, override)


# ------------------------------------------------------------ units, levels, environment


@pytest.mark.parametrize("nbytes", [0, 1, 1000, 1024, 3 << 29, 2 * 10**9, 1 << 40, 123456789])
def test_sizes_print_in_units_that_read_back_exactly(nbytes):
    from kvtier.tiers.sizes import format_size

    text = format_size(nbytes)
    assert parse_size(text) == nbytes
    assert format_size(1 << 30) == "1GiB" and format_size(2 * 10**9) == "2GB"


def test_printed_config_loads_back_to_the_same_config(tmp_path):
    import yaml

    config = load_config(
        None,
        ["tiers.l1.capacity_bytes=1536MiB", "tiers.l2.enabled=true", "tiers.l2.capacity_bytes=3G"],
    )
    path = tmp_path / "printed.yaml"
    path.write_text(yaml.safe_dump(config.printable(), sort_keys=False))
    assert load_config(path) == config


@pytest.mark.parametrize("level", ["debug", "Debug", "DEBUG"])
def test_levels_and_other_choices_ignore_case(level):
    config = load_config(
        None,
        [f"logging.level={level}", "tiers.l2.enabled=false", "tiers.l2.write_policy=WRITE_THROUGH"],
    )
    assert config.logging.level == "DEBUG"
    assert config.tiers.l2.write_policy == "write_through"


def test_every_key_has_an_environment_variable_and_they_sit_between_file_and_set(tmp_path):
    from kvtier.daemon.config import config_keys, env_name

    keys = config_keys()
    names = [env_name(k) for k in keys]
    assert len(set(names)) == len(names)  # no two keys share a variable
    assert "KVTIER_TIERS_L1_CAPACITY_BYTES" in names and "KVTIER_LOGGING_LEVEL" in names
    path = tmp_path / "c.yaml"
    path.write_text("tiers:\n  l1:\n    capacity_bytes: 2GiB\n  l2:\n    enabled: false\n")
    env = {
        "KVTIER_TIERS_L1_CAPACITY_BYTES": "512Mi",  # beats the file
        "KVTIER_TIERS_L2_ENABLED": "true",
        "KVTIER_POLICY_PROTECT_S": "0.5",
        "KVTIER_SERVER_TCP_ADDRESS": "[::1]:5000",
        "KVTIER_TENANTS": "[{name: remote, token_file: remote.token}]",
        "KVTIER_ADDRESS": "unix:/elsewhere.sock",  # the client's, not config
        "HOME": "/root",
    }
    config = load_config(path, ["policy.protect_s=3"], environ=env)  # --set beats env
    assert config.tiers.l1.capacity_bytes == 512 << 20
    assert config.tiers.l2.enabled is True
    assert config.policy.protect_s == 3.0
    assert config.server.tcp_address == "[::1]:5000"
    assert [t.name for t in config.tenants] == ["remote"]


@pytest.mark.parametrize(
    "key, text",
    [
        ("tiers.l3.key_prefix", "kvtier:"),  # the default, as deploy/kvtier.yaml gives it
        ("tiers.l3.key_prefix", "team-a:kv:"),
        ("tiers.l3.key_prefix", "0123"),
        ("tiers.l3.username", "no"),
        ("tiers.l3.password_file", "#secret"),
    ],
)
def test_regression_a_string_key_set_to_text_yaml_reads_as_another_type_was_refused_or_changed(
    key, text
):
    """A string key takes a ``--set`` or variable value as written: read as YAML,
    ``kvtier:`` was a mapping and ``no`` false (refused: "expected a string"), ``#secret`` a
    comment, and ``0123`` the octal 83, taken silently as the prefix "83"."""
    name = key.rpartition(".")[2]
    for config in (
        load_config(None, ["tiers.l3.enabled=true", f"{key}={text}"]),
        load_config(None, environ={"KVTIER_TIERS_L3_ENABLED": "true", env_name(key): text}),
    ):
        assert getattr(config.tiers.l3, name) == text
    # A quoted value is still read as YAML reads it.
    quoted = load_config(None, ["tiers.l3.enabled=true", "tiers.l3.key_prefix='a: b'"])
    assert quoted.tiers.l3.key_prefix == "a: b"


def test_a_misspelt_environment_variable_is_a_config_error():
    with pytest.raises(ConfigError, match="KVTIER_TIERS_L1_CAPACITY"):
        load_config(None, environ={"KVTIER_TIERS_L1_CAPACITY": "1Gi"})


@pytest.mark.parametrize("var", ["KVTIER_SERVER", "KVTIER_TIERS", "KVTIER_LOGGING"])
def test_regression_a_variable_naming_a_whole_section_was_ignored(var):
    """``KVTIER_SERVER=1`` names a section, no key: it was taken silently (a misspelt key
    under the section is refused)."""
    with pytest.raises(ConfigError, match=f"environment variable {var} names no config key"):
        load_config(None, environ={var: "1"})


@pytest.mark.parametrize(
    "var, named",
    [
        (
            "KVTIER_SERVER_SOCKT",
            "did you mean KVTIER_SERVER_SOCKET, the variable of server.socket?",
        ),
        (
            "KVTIER_TIERS_L2_PATHH",
            "did you mean KVTIER_TIERS_L2_PATH, the variable of tiers.l2.path?",
        ),
        ("KVTIER_TIERS_L1", "but the section tiers.l1 "),
        ("KVTIER_SERVER", "but the section server (a key's variable names the key too: "),
    ],
)
def test_regression_a_misspelt_variable_was_pointed_at_tiers_l1_capacity_bytes(var, named):
    """Every misspelt variable's error said "the variable of tiers.l1.capacity_bytes is
    KVTIER_TIERS_L1_CAPACITY_BYTES", whichever key it was meant for, where a misspelt key in
    the file lists its section's keys: it now names the nearest key's variable, or the
    section a variable names."""
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={var: "1"})
    assert f"environment variable {var} names no config key" in str(e.value)
    assert named in str(e.value)


@pytest.mark.parametrize(
    "var, named",
    [
        ("KVTIER_TIERS_L1_", "but the section tiers.l1 "),
        ("KVTIER_TENANTS_0_TOKEN_FILE", "(the variable of tenants is KVTIER_TENANTS, "),
        ("KVTIER_SERVER_" + "X" * 30, "(known in server: socket, socket_mode, "),
        ("KVTIER_server_socket", "(did you mean KVTIER_SERVER_SOCKET, the variable of server"),
    ],
)
def test_regression_a_misspelt_variable_was_pointed_at_another_sections_key(var, named):
    """The nearest variable was sought over every key and a lower-case one skipped:
    KVTIER_TIERS_L1_ was pointed at tiers.l3.tls, a tenant's key at metrics.token_file, a
    variable near none at tiers.l1.capacity_bytes, and KVTIER_server_socket was taken as no
    config. Only the variable's own section is searched now, in capitals, and a top-level
    list's variable says it takes the whole list."""
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={var: "1"})
    assert f"environment variable {var} names no config key {named}" in str(e.value)


@pytest.mark.parametrize(
    "var, named",
    [
        ("KVTIER_SERVER_ZZZZZZZZ", "(known in server: socket, socket_mode, "),
        ("KVTIER_TIERS_L2_QQQQ", "(known in tiers.l2: "),
        ("KVTIER_SERVER_SOCKT", "(did you mean KVTIER_SERVER_SOCKET, the variable of server"),
    ],
)
def test_regression_a_variable_near_no_key_was_pointed_at_one_for_its_sections_prefix(var, named):
    """README (Configure): a misspelt variable is named with the nearest key's variable in its
    section, else the section's keys. The whole names were compared, and the section's prefix
    they share (KVTIER_SERVER_) made nearly any variable near a key: KVTIER_SERVER_ZZZZZZZZ got
    "did you mean KVTIER_SERVER_SOCKET", and the keys were listed only past some 30 letters.
    Only what follows the prefix is compared now."""
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={var: "1"})
    assert f"environment variable {var} names no config key {named}" in str(e.value)


@pytest.mark.parametrize("var", ["KVTIER_tenants", "kvtier_shared_namespaces"])
def test_regression_a_top_level_lists_variable_in_lower_case_was_skipped(var):
    """``KVTIER_server_socket`` stops the daemon (01de91d), but ``KVTIER_tenants`` was
    taken as no config: the daemon started without the tenants it gave. It is refused,
    naming the variable of the list."""
    key = var.upper().removeprefix("KVTIER_").lower()
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={var: "[]"})
    assert str(e.value) == (
        f"environment variable {var} names no config key (the variable of {key} is "
        f"{env_name(key)}, for its whole list as YAML)"
    )


def test_regression_every_variable_of_the_environment_was_searched_for_a_hint(monkeypatch):
    """The search for what a variable of no key names (dad933a) ran for every variable of
    the environment, ``PATH`` and ``HOME`` too: 0.1 ms each, 35 ms at the start of a daemon
    beside 300 (a pod's service variables). It runs only for ``KVTIER_*`` ones, in any
    case, as before."""
    from kvtier.daemon import config

    searched: list[str] = []
    hint = config._env_hint
    monkeypatch.setattr(
        config, "_env_hint", lambda var, names: searched.append(var) or hint(var, names)
    )
    environ = {f"SERVICE_{i}_PORT": "80" for i in range(300)}
    environ |= {"KVTIER_ADDRESS": "unix:/tmp/x", "KVTIER_SERVER_SOCKET": "/tmp/x"}
    assert config.env_overrides(environ) == ["server.socket=/tmp/x"]
    assert searched == ["KVTIER_ADDRESS"]
    with pytest.raises(ConfigError, match="did you mean KVTIER_SERVER_SOCKET"):
        config.env_overrides({"kvtier_server_sockt": "/tmp/x"})
    assert searched == ["KVTIER_ADDRESS", "kvtier_server_sockt"]


def test_kvtierd_reads_its_environment(tmp_path):
    env = {**os.environ, "KVTIER_TIERS_L1_CAPACITY_BYTES": "256Mi", "KVTIER_LOGGING_LEVEL": "debug"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "capacity_bytes: 256MiB" in proc.stdout and "level: DEBUG" in proc.stdout


@pytest.mark.parametrize(
    "address, ok",
    [
        ("", True),
        ("9464", True),
        ("127.0.0.1:0", True),
        ("[::1]:9", True),
        ("x", False),
        ("1:99999", False),
    ],
)
def test_metrics_address(address, ok):
    if ok:
        assert load_config(None, [f"metrics.address={address}"]).metrics.address == address
    else:
        with pytest.raises(ConfigError, match=r"metrics\.address"):
            load_config(None, [f"metrics.address={address}"])


def test_the_documented_example_names_every_key():
    import dataclasses

    import yaml

    with open(EXAMPLE) as f:
        documented = yaml.safe_load(f)

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory):
                yield from keys(f.default_factory, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    def flatten(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from flatten(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    assert sorted(flatten(documented)) == sorted(keys(Config))


@pytest.mark.parametrize(
    "override, value",
    [
        ("server.socket_mode=0600", "0600"),
        ("server.socket_mode='0640'", "0640"),
        ("server.socket_mode=0o600", "0600"),
        ("server.socket_group=0", "0"),
        ("server.socket_group=root", "root"),
    ],
)
def test_socket_access_keys(override, value):
    server = load_config(None, [override]).server
    key = override.split("=")[0].split(".")[1]
    assert getattr(server, key) == value
    assert server.socket_mode_bits() in (0o600, 0o640, 0o660)
    assert server.socket_gid() in (None, 0)


@pytest.mark.parametrize(
    "override, words",
    [
        ("server.socket_mode=660", "write 0660"),
        ("server.socket_mode=rw", "octal"),
        ("server.socket_mode=01777", "0000-0777"),
        ("server.socket_group=no-such-group-here", "no group"),
        ("server.shm_share=alice", "CLIENT=OWNER"),
        ("server.shm_share=any=no-such-user-here", "no user"),
    ],
)
def test_bad_socket_and_sharing_keys_name_the_key(override, words):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        load_config(None, [override])
    assert words in str(info.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["server.max_health_watches=8", "server.max_health_watches_per_peer=9"],
            "server.max_health_watches_per_peer (9) exceeds server.max_health_watches (8)",
        ),
        (
            ["policy.hint_max_share=0.6", "policy.hint_max_total_share=0.5"],
            "policy.hint_max_share (0.6) exceeds policy.hint_max_total_share (0.5)",
        ),
        (["server.shm_dir=dev/shm"], "'server.shm_dir': 'dev/shm' is not an absolute path"),
    ],
)
def test_settings_that_contradict_each_other_or_depend_on_the_folder_are_refused(overrides, words):
    """Each was taken before: a per-host bound above the total bound it is part of, one
    tenant's share above every tenant's together (neither can take effect as written), and
    a shared-memory folder read relative to wherever the daemon was started."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert words in str(info.value)


def test_regression_a_socket_path_with_a_nul_byte_crashed_the_checks(tmp_path):
    """A socket name with a leading NUL is Linux's abstract namespace, which the daemon does
    not serve (no file, so no mode or folder guards it: anyone may take the name); with one
    anywhere, the host checks ended in a traceback ('embedded null byte'). A config error
    now, exit 2, naming the key."""
    config = tmp_path / "kvtier.yaml"
    for socket_path in ("\\0kvtier", f"{tmp_path}/a\\0b.sock"):
        config.write_text(f'server:\n  socket: "{socket_path}"\n')
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.daemon", "--config", str(config), "--check-config"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert "config key 'server.socket'" in proc.stderr, proc.stderr
        assert "NUL" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_regression_a_socket_path_with_a_comma_was_served_where_no_client_could_reach(tmp_path):
    """gRPC binds a Unix socket path holding a comma, but reads a client's address as a list
    split at its commas (escaped as %2C too): the daemon started and served a socket no
    client could connect to (``unix:/run/a,b/s.sock`` reached ``b/s.sock`` in the client's
    working folder). Refused at start and by --check-config, exit 2, naming the key; a
    relative path made absolute in a folder with one too."""
    folder = tmp_path / "a,b"
    folder.mkdir()
    for cwd, socket_path in ((tmp_path, f"{folder}/s.sock"), (folder, "s.sock")):
        for check in ([], ["--check-config"]):
            sets = [
                "--set",
                f"server.socket={socket_path}",
                "--set",
                "tiers.l1.capacity_bytes=64MiB",
            ]
            proc = subprocess.run(
                [sys.executable, "-m", "kvtier.daemon", *sets, *check],
                capture_output=True,
                text=True,
                timeout=30,
                cwd=cwd,
            )
            assert proc.returncode == 2, proc.stderr
            assert "config key 'server.socket'" in proc.stderr, proc.stderr
            assert "holds a comma" in proc.stderr and "Traceback" not in proc.stderr
        assert not os.path.exists(folder / "s.sock")


def test_a_default_socket_with_a_comma_says_auto_chose_it(tmp_path, monkeypatch):
    """``server.socket: auto`` under a runtime folder holding a comma: the refusal says the
    path is the one auto chose (the operator set no socket), and what to set instead."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "a,b"))
    with pytest.raises(ConfigError, match=r"server\.socket': auto chose .*a,b.* holds a comma"):
        build_config({})
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "ab"))
    assert build_config({}).server.socket == str(tmp_path / "ab" / paths.SOCKET_NAME)


def test_regression_a_path_key_with_a_nul_byte_crashed_the_checks(tmp_path):
    """397a83a refused a NUL byte in server.socket alone: one in any other path (the L2
    folder, the shared-memory folder, a tenant's token file) still ended the host checks in
    a traceback ('embedded null byte'), a name (a group, an admin user) too. Every text key
    refuses one now, as a config error (exit 2) naming the key."""
    config = tmp_path / "kvtier.yaml"
    cases = {
        "tiers.l2.path": "tiers:\n  l2:\n    enabled: true\n    path: VALUE\n",
        "server.shm_dir": "server:\n  shm_dir: VALUE\n",
        "server.socket_group": "server:\n  socket_group: VALUE\n",
        "server.admin_uids": "server:\n  admin_uids: [VALUE]\n",
        "tenants[0].token_file": "tenants:\n  - name: a\n    token_file: VALUE\n",
    }
    for key, text in cases.items():
        config.write_text(text.replace("VALUE", f'"{tmp_path}/x\\0y"'))
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.daemon", "--config", str(config), "--check-config"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, (key, proc.stderr)
        assert f"config key '{key}'" in proc.stderr and "NUL" in proc.stderr, (key, proc.stderr)
        assert "Traceback" not in proc.stderr, (key, proc.stderr)


def test_shm_share_pairs():
    from kvtier.daemon.config import ANY_PEER

    server = load_config(None, ["server.shm_share=[65534=0, any=root]"]).server
    assert server.shm_share_pairs() == {(65534, 0), (ANY_PEER, 0)}
    one = load_config(None, ["server.shm_share=nobody=root"]).server
    assert one.shm_share_pairs() == {(65534, 0)}


def test_a_config_file_that_is_not_utf8_is_a_config_error_not_a_traceback(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"server:\n  socket: /run/caf\xe9.sock\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9"):
        load_config(path)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--config", str(path), "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "text, key",
    [
        ("server:\n  max_batch_blocks: 10\n  max_batch_blocks: 20\n", "'max_batch_blocks'"),
        # A repeated section would replace every key of the first one.
        ("server:\n  max_batch_blocks: 10\nserver:\n  lease_max_ms: 5\n", "'server'"),
        ("tiers: {l1: {capacity_bytes: 1GiB, capacity_bytes: 2GiB}}\n", "'capacity_bytes'"),
    ],
)
def test_a_key_given_twice_is_a_config_error(tmp_path, text, key):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{key} appears twice"):
        load_config(path)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "server:\n  max_batch_blocks: [1,\n tiers: {\n",
            "line 4, column 1: expected the node content, but found '<stream end>' "
            "(while parsing a flow node)",
        ),
        (
            "server:\n  max_batch_blocks: 10\n  max_batch_blocks: 20\n",
            "line 3, column 3: key 'max_batch_blocks' appears twice in one mapping (first on "
            "line 2); YAML would silently keep only the last",
        ),
    ],
)
def test_a_file_that_is_not_yaml_is_refused_in_one_line_naming_where(tmp_path, text, message):
    """The log says one line per event: a SIGHUP whose file YAML could not read logged
    PyYAML's own text, four lines with the spot under a caret, under '"<unicode string>"'."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == f"config file {path} is not valid YAML: {message}"


def test_a_key_given_twice_in_a_set_or_variable_value_is_named():
    # Read as a string it was refused as "expected a list of mappings", the repeat unnamed.
    twice = "[{name: a, uids: [1], name: b}]"
    with pytest.raises(ConfigError, match=r"config key 'tenants': key 'name' appears twice"):
        load_config(None, [f"tenants={twice}"])
    with pytest.raises(ConfigError, match=r"'tiers\.l1\.capacity_bytes': key 'a' appears twice"):
        load_config(None, environ={"KVTIER_TIERS_L1_CAPACITY_BYTES": "{a: 1, a: 2}"})
    with pytest.raises(ConfigError, match=r"'logging\.level': '\[a' is not one of"):
        load_config(None, ["logging.level=[a"])  # not YAML at all: still taken as the text


@pytest.mark.parametrize(
    "tier, key", [("l0", "streams=4"), ("l2", "path=/srv/l2"), ("l3", "ttl_s=60")]
)
def test_a_tier_given_settings_but_not_enabled_is_refused(tmp_path, tier, key):
    # The tier is off unless enabled: settings alone would leave it off without a word.
    with pytest.raises(
        ConfigError, match=rf"'tiers\.{tier}' sets {key.split('=')[0]} but not 'enabled'"
    ):
        load_config(None, [f"tiers.{tier}.{key}"])
    name, value = key.split("=")
    path = tmp_path / "c.yaml"
    path.write_text(f"tiers:\n  {tier}:\n    {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"add 'tiers\.{tier}\.enabled: true'"):
        load_config(path)
    # Said either way, the settings load; an empty section says nothing and is fine.
    off = load_config(None, [f"tiers.{tier}.enabled=false", f"tiers.{tier}.{key}"])
    assert getattr(off.tiers, tier).enabled is False
    path.write_text(f"tiers:\n  {tier}:\n")
    assert getattr(load_config(path).tiers, tier).enabled is False
    # A bad value is named before the missing switch.
    with pytest.raises(ConfigError, match=rf"tiers\.{tier}\.{name}"):
        load_config(None, [f"tiers.{tier}.{name}=[1, 2]"])


def test_yaml_merge_keys_are_not_repeats(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(
        "tiers:\n  l1: &l1 {capacity_bytes: 64MiB, segment_bytes: 4MiB}\n"
        "  l0:\n    <<: *l1\n    enabled: false\n    capacity_bytes: 32MiB\n"
    )
    config = load_config(path)
    assert config.tiers.l0.capacity_bytes == 32 << 20
    assert config.tiers.l0.segment_bytes == 4 << 20


@pytest.mark.parametrize(
    "override",
    [
        "policy.protect_s=.nan",
        "tiers.l1.high_watermark=.nan",
        "server.drain_timeout_s=.inf",
        "policy.half_life_s=.inf",
        "mover.balance_interval_s=.nan",
    ],
)
def test_floats_must_be_finite(override):
    # NaN passed every range check (comparisons with it are false).
    with pytest.raises(ConfigError, match=f"'{override.split('=')[0]}'.*finite"):
        load_config(None, [override])


def _time_keys() -> list[tuple[str, dataclasses.Field]]:
    """Every duration in the config, by its unit in the name (``_s``, ``_ms``; a rate such as
    ``write_bytes_s`` is not one), sections and records alike."""
    found: list[tuple[str, dataclasses.Field]] = []

    def walk(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(f.default_factory if callable(f.default_factory) else None):
                walk(f"{key}.", f.default_factory)  # a section
            elif f.metadata.get("record") is not None:
                walk(f"{key}[0].", f.metadata["record"])
            elif re.search(r"_m?s$", f.name) and not f.name.endswith("_bytes_s"):
                found.append((key, f))

    walk("", Config)
    return found


def test_every_duration_has_a_bounded_range():
    keys = _time_keys()
    assert {"server.drain_timeout_s", "tiers.l2.flush_timeout_s", "server.lease_max_ms"} <= {
        k for k, _ in keys
    }
    for key, f in keys:
        assert f.metadata.get("unit") in ("s", "ms"), key
        hi = f.metadata["hi"]
        assert hi is not None and hi <= 366 * 86400 * (1000 if f.name.endswith("_ms") else 1), key


@pytest.mark.parametrize("key", [k for k, _ in _time_keys() if "[" not in k])
@pytest.mark.parametrize("value", ["1.0e+300", "100000000000000000000"])
def test_a_huge_duration_is_refused_naming_its_key(key, value):
    """Regression: server.drain_timeout_s=1e300 (and other durations: protect_s, warmup_s,
    half_life_s, lease_max_ms, tiers.l3.ttl_s, ...) was accepted: only some durations had a
    maximum. Every duration has one now, from one rule (``_opt(..., unit=)``)."""
    with pytest.raises(ConfigError, match=rf"'{re.escape(key)}'"):
        load_config(None, [f"{key}={value}"])


def test_a_config_nested_too_deeply_is_a_config_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("server: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config(path)


@pytest.mark.parametrize("address", ["notaport", "[::1]:abc", "127.0.0.1:99999", "5000"])
def test_a_tcp_address_that_is_not_host_port_is_a_config_error(address):
    """Was 'config ok', then a RuntimeError traceback at start ('127.0.0.1:99999' even ran,
    announcing a port that cannot exist)."""
    with pytest.raises(ConfigError, match=r"server\.tcp_address"):
        load_config(
            None,
            [f"server.tcp_address={address}", "tenants=[{name: r, token_file: r.token}]"],
        )


def test_the_l2_index_watch_is_off_at_0_and_refuses_a_period_that_only_spins():
    def watch_s(value: str) -> float:
        overrides = ["tiers.l2.enabled=false", f"tiers.l2.index_watch_s={value}"]
        return load_config(None, overrides).tiers.l2.index_watch_s

    assert Config().tiers.l2.index_watch_s == 2.0
    assert watch_s("0") == 0.0
    assert watch_s("0.05") == 0.05
    with pytest.raises(ConfigError, match=r"'tiers\.l2\.index_watch_s': 0\.001 is below 0\.05"):
        watch_s("0.001")
    with pytest.raises(ConfigError, match=r"tiers\.l2\.index_watch_s"):
        watch_s("-1")


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("server.drain_timeout_s=1e3", "drain_timeout_s", 1000.0),
        ("server.drain_timeout_s=1.5E2", "drain_timeout_s", 150.0),
        ("server.drain_timeout_s=2e+1", "drain_timeout_s", 20.0),
        ("server.drain_timeout_s=5e-1", "drain_timeout_s", 0.5),
    ],
)
def test_regression_a_float_in_exponent_notation_was_not_a_number(override, key, value):
    """server.drain_timeout_s=1e3 was refused as "expected a number, got '1e3'": YAML 1.1
    reads an exponent without a dot and a signed exponent (1e3, 1.5E2) as a string."""
    assert getattr(load_config(None, [override]).server, key) == value


def test_regression_exponent_notation_in_a_file_is_checked_as_the_number_it_is(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("policy:\n  protect_s: 25e-1\nserver:\n  drain_timeout_s: 1e10\n")
    with pytest.raises(
        ConfigError, match=r"'server.drain_timeout_s': 10000000000.0 is above the maximum"
    ):
        load_config(str(path), [])
    with pytest.raises(ConfigError, match=r"'policy.protect_s'.*finite"):
        load_config(None, ["policy.protect_s=1e400"])
    path.write_text("policy:\n  protect_s: 25e-1\n")
    assert load_config(str(path), []).policy.protect_s == 2.5


@pytest.mark.parametrize("written", ['"1e3"', "'1e3'", '"5e-1"', '"30"', '"0.5"'])
def test_regression_a_quoted_exponent_was_a_number_while_a_quoted_number_was_refused(
    tmp_path, written
):
    """protect_s: "1e3" was taken as 1000 while protect_s: "30" was refused: an exponent was
    read as a number from any string. Quoted, each is a string, refused naming the key;
    unquoted, each is the number it is."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"policy:\n  protect_s: {written}\n")
    with pytest.raises(
        ConfigError,
        match=rf"^config key 'policy.protect_s': expected a number, got '{written[1:-1]}' "
        r"\(quoted, it is a string: write the number without quotes\)$",
    ):
        load_config(str(path), [])
    with pytest.raises(ConfigError, match=r"'policy.protect_s': expected a number"):
        load_config(None, [f"policy.protect_s={written}"])
    path.write_text(f"policy:\n  protect_s: {written[1:-1]}\n")
    assert load_config(str(path), []).policy.protect_s == float(written[1:-1])


def test_a_quoted_integer_is_refused_and_an_unquoted_exponent_stays_text_where_text_is_taken():
    with pytest.raises(
        ConfigError,
        match=r"'server.max_connections': expected an integer, got '64' \(quoted, it is a "
        "string",
    ):
        load_config(None, ['server.max_connections="64"'])
    config = load_config(None, ["tiers.l3.enabled=true", "tiers.l3.key_prefix=1e3"])
    assert type(config.tiers.l3.key_prefix) is str and config.tiers.l3.key_prefix == "1e3"


def test_regression_exponent_notation_is_refused_as_written():
    """policy.protect_s=1e400 was refused as "got inf", a value the operator never wrote;
    and digits of other scripts (Python's \\d and float take them) passed as a number."""
    with pytest.raises(
        ConfigError, match=r"'policy.protect_s': expected a finite number, got '1e400'"
    ):
        load_config(None, ["policy.protect_s=1e400"])
    with pytest.raises(ConfigError, match=r"'policy.protect_s': expected a number, got '1e\u0663'"):
        load_config(None, ["policy.protect_s=1e\u0663"])


def test_the_readme_names_the_bound_of_every_duration_shorter_than_a_year():
    """README ("Running the daemon") says durations are at most a year and names the keys
    bounded lower; it named two of the fourteen (session_ping_s: an hour, unsaid)."""
    from kvtier.daemon.config import MAX_DURATION_S, _is_section

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    start = text.index("Durations (keys ending in")
    said = text[start : text.index("--print-config", start)]
    spans = {"a day": 86400, "an hour": 3600, "ten minutes": 600, "a minute": 60}
    named: dict[str, float] = {}
    for span, keys in re.findall(r"(a day|an hour|ten minutes|a minute) \(([^)]*)\)", said):
        for key in re.findall(r"`([a-z0-9_.]+)`", keys):
            named[key] = spans[span]

    def durations(cls, prefix=""):
        for f in dataclasses.fields(cls):
            if _is_section(f):
                yield from durations(f.default_factory, f"{prefix}{f.name}.")
            elif f.metadata and f.metadata["unit"]:
                yield f"{prefix}{f.name}", f.metadata

    bounds = {}
    for key, meta in durations(Config):
        per_s = 1000 if meta["unit"] == "ms" else 1
        bounds[key] = meta["hi"] / per_s
    assert bounds, "no duration keys found"
    assert {k: bounds[k] for k in named} == named
    assert {k: b for k, b in bounds.items() if k not in named and b != MAX_DURATION_S} == {}


@pytest.mark.parametrize(
    "line, key",
    [
        ("server:\n  admin_uids: [0100]\n", "server.admin_uids"),
        ("server:\n  max_pools: 0100\n", "server.max_pools"),
        ("server:\n  max_pools: 010\n", "server.max_pools"),
        ("tiers:\n  l1:\n    capacity_bytes: 0100000000\n", "tiers.l1.capacity_bytes"),
        ("policy:\n  protect_s: 030\n", "policy.protect_s"),
        ("server:\n  socket_group: 0100\n", "server.socket_group"),
    ],
)
def test_regression_a_number_with_a_leading_zero_was_silently_octal(tmp_path, line, key):
    """YAML 1.1 reads 0100 as the octal 64: `admin_uids: [0100]` made uid 64 an admin and
    `max_pools: 0100` allowed 64. Where a key takes a number or an id it is refused."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(line)
    with pytest.raises(ConfigError, match=rf"'{key}': '0+\d+' is written with a leading zero"):
        load_config(str(path), [])


def test_a_leading_zero_is_octal_for_permission_bits_and_text_for_text_keys(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text(
        "server:\n  socket_mode: 0640\n  max_pools: 10\n"
        "tiers:\n  l3:\n    enabled: true\n    key_prefix: 0123\n"
    )
    config = load_config(str(path), [])
    assert config.server.socket_mode == "0640"
    assert config.server.max_pools == 10
    assert config.tiers.l3.key_prefix == "0123"


def test_regression_a_uid_in_another_scripts_digits_was_taken_as_a_number():
    """str.isdigit takes any script's digits: "\u0661\u0662" was uid 12."""
    with pytest.raises(ConfigError, match="admin_uids"):
        load_config(None, ["server.admin_uids=[\u0661\u0662]"])


def test_regression_a_text_keys_set_value_lost_what_followed_a_hash():
    """`--set tiers.l2.path=/data/l2 #2` was read as YAML, which dropped ` #2` as a comment;
    a quoted value is still read as YAML (its quotes removed)."""
    sets = ["tiers.l2.enabled=true", "tiers.l2.path=/data/l2 #2"]
    assert load_config(None, sets).tiers.l2.path == "/data/l2 #2"
    sets[1] = "tiers.l2.path='/data/l2'"
    assert load_config(None, sets).tiers.l2.path == "/data/l2"


@pytest.mark.parametrize("written, value", [("off", "false"), ("no", "false"), ("on", "true")])
def test_regression_a_choice_key_set_to_a_yaml_boolean_word_was_refused(tmp_path, written, value):
    """A file's ``pin_memory: off`` is false, which the key takes as its choice ``false``;
    5bd85b9 took every text key's ``--set`` or variable value as written, so
    ``tiers.l1.pin_memory=off`` (or ``KVTIER_TIERS_L0_GDS=off``), which loaded before, was
    refused: 'off' is not one of auto, true, false."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"tiers:\n  l1:\n    pin_memory: {written}\n")
    assert load_config(path).tiers.l1.pin_memory == value
    config = load_config(
        None,
        [f"tiers.l1.pin_memory={written}"],
        environ={"KVTIER_TIERS_L0_ENABLED": "false", "KVTIER_TIERS_L0_GDS": written},
    )
    assert (config.tiers.l1.pin_memory, config.tiers.l0.gds) == (value, value)


@pytest.mark.parametrize(
    "text, section, key, value",
    [
        ("server:\n  max_pools: 07\n", "server", "max_pools", 7),
        ("policy:\n  protect_s: 00\n", "policy", "protect_s", 0.0),
        ("server:\n  admin_uids: [00, 07, 08]\n", "server", "admin_uids", ("0", "7", "08")),
        ("server:\n  socket_group: 09\n", "server", "socket_group", "09"),
        ("server:\n  socket_mode: 0_660\n", "server", "socket_mode", "0660"),
    ],
)
def test_regression_a_leading_zero_that_meant_the_number_written_was_refused(
    tmp_path, text, section, key, value
):
    """ab06e09 refused every number written with a leading zero where a number or an id is
    due, also those whose octal reading is the number written (``07``) and those YAML 1.1
    reads as no octal number (``08``: text, which an id and a size take as decimal digits);
    and ``socket_mode`` no longer took YAML's octal with an underscore (``0_660``). Each
    loaded before as it reads."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    assert getattr(getattr(load_config(path), section), key) == value


def test_regression_a_printed_id_with_a_leading_zero_did_not_load_back(tmp_path):
    """``admin_uids: ["0800"]`` is uid 800; ``--print-config`` writes it plain (``0800``, which
    YAML 1.1 reads as text: an 8 is no octal digit), which ab06e09 refused as a number with a
    leading zero: the printed config did not load back."""
    import yaml

    path = tmp_path / "kvtier.yaml"
    path.write_text('server:\n  admin_uids: ["0800"]\n  socket_group: "0900"\n')
    config = load_config(path)
    printed = tmp_path / "printed.yaml"
    printed.write_text(yaml.safe_dump(config.printable(), sort_keys=False))
    assert load_config(printed) == config


def test_regression_a_signed_fraction_written_plain_was_told_it_was_quoted(tmp_path):
    """PyYAML reads ``.5`` as a number but ``+.5`` and ``-.5`` as strings (YAML 1.1 reads all
    three as numbers), and fbdcd8f's message for a quoted number told the operator of a plain
    ``+.5`` to write it without quotes. Written plain, each is the number, as ``.5`` is."""
    path = tmp_path / "kvtier.yaml"
    path.write_text("policy:\n  hint_max_share: +.5\n")
    assert load_config(path).policy.hint_max_share == 0.5
    assert load_config(None, ["policy.protect_s=+.25"]).policy.protect_s == 0.25
    with pytest.raises(ConfigError, match=r"'policy.protect_s': -0.5 is below the minimum 0$"):
        load_config(None, ["policy.protect_s=-.5"])
    with pytest.raises(ConfigError, match=r"'server.max_pools': expected an integer, got '\+.5'$"):
        load_config(None, ["server.max_pools=+.5"])


@pytest.mark.parametrize("written", ["0x1F", "-0x1F", "0b101", "1_000", "1:30"])
def test_regression_a_text_key_written_as_a_number_in_another_form_changed_in_a_file(
    tmp_path, written
):
    """YAML 1.1 reads 0x1F, 0b101, 1_000 and 1:30 (base 60) as integers, which a text key took
    as their decimal text: ``key_prefix: 0x1F`` in a file was '31' while 5bd85b9 takes
    ``KVTIER_TIERS_L3_KEY_PREFIX=0x1F`` as written, so two nodes, one configured by file, one
    by variable, would not share L3. A text key keeps what a file writes, as ab06e09 made it
    keep 0123."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"tiers:\n  l3:\n    enabled: true\n    key_prefix: {written}\n")
    by_variable = load_config(
        None, environ={"KVTIER_TIERS_L3_ENABLED": "true", "KVTIER_TIERS_L3_KEY_PREFIX": written}
    )
    assert load_config(path).tiers.l3.key_prefix == by_variable.tiers.l3.key_prefix == written


def test_numbers_in_other_forms_stay_the_numbers_yaml_reads(tmp_path):
    import yaml

    path = tmp_path / "kvtier.yaml"
    path.write_text(
        "server:\n  max_pools: 0x1F\n  drain_timeout_s: 1:30\n  admin_uids: [0x3E8, 1_001]\n"
        "  socket_mode: 0x1A0\n"
        "tiers:\n  l1:\n    capacity_bytes: 1_073_741_824\n"
    )
    config = load_config(path)
    assert (config.server.max_pools, config.server.drain_timeout_s) == (31, 90.0)
    assert type(config.server.max_pools) is int and type(config.tiers.l1.capacity_bytes) is int
    assert config.server.admin_uids == ("1000", "1001")
    assert (config.server.socket_mode, config.tiers.l1.capacity_bytes) == ("0640", 1 << 30)
    printed = tmp_path / "printed.yaml"
    printed.write_text(yaml.safe_dump(config.printable(), sort_keys=False))
    assert load_config(printed) == config


@pytest.mark.parametrize(
    "written", ["2001-13-01", "2001-01-01 25:00:00", "!!int x", "!!timestamp x"]
)
def test_regression_a_value_yaml_could_not_build_escaped_the_load_as_another_error(
    tmp_path, written
):
    """YAML takes 2001-13-01 for a date and ``!!int x`` for an integer, and its constructors
    then fail with a ValueError (or an AttributeError): kvtierd stopped with a traceback
    instead of a config error, and a SIGHUP's reload (which handles a ConfigError) with it."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"server:\n  max_pools: {written}\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: line 2, column 14: cannot read "):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'server.max_pools': expected an integer, got "):
        load_config(None, [f"server.max_pools={written}"])


def test_regression_the_largest_max_message_bytes_taken_stopped_the_start(daemon_factory):
    """Regression: server.max_message_bytes took up to 2GiB, one byte past what gRPC takes
    (its limits are C ints): --check-config said 'config ok' and the start ended with an
    OverflowError traceback. 2GiB is refused, naming the key; the largest taken serves."""
    largest = (1 << 31) - 1
    with pytest.raises(ConfigError, match=rf"2147483648 is above the maximum {largest}"):
        load_config(None, ["server.max_message_bytes=2GiB"])
    d = daemon_factory(f"server.max_message_bytes={largest}")
    with d.client() as client:
        assert client.health()
    assert "Traceback" not in d.log()


def test_l1_prefault_takes_background_or_none_and_names_them_otherwise():
    assert load_config().tiers.l1.prefault == "background"
    assert load_config(None, ["tiers.l1.prefault=none"]).tiers.l1.prefault == "none"
    with pytest.raises(ConfigError, match=r"tiers\.l1\.prefault.*background.*none"):
        load_config(None, ["tiers.l1.prefault=sync"])
