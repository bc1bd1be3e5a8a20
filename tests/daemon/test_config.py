from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.daemon.config import Config, load_config, parse_size
from kvtier.daemon.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "deploy", "kvtier.yaml")


def test_embedded_defaults_need_no_file():
    config = load_config()
    assert config == Config()
    assert config.server.socket == "var/kvtierd.sock"
    assert config.tiers.l1.capacity_bytes == 1 << 30


def test_the_documented_example_is_exactly_the_defaults():
    assert load_config(EXAMPLE) == Config()


@pytest.mark.parametrize(
    "value, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("1.5 GiB", 3 << 29),
        ("2GB", 2 * 10**9),
        ("1kib", 1024),
    ],
)
def test_sizes(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["", "12 parsecs", "-1", True, 1.5, None, "GiB"])
def test_bad_sizes(value):
    with pytest.raises(ValueError):
        parse_size(value)


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
        ("logging:\n  level: LOUD\n", "logging.level"),
        ("tiers:\n  l1:\n    low_watermark: 0.99\n", "tiers.l1.low_watermark"),
        ("tiers:\n  l1:\n    segment_bytes: 1000\n", "tiers.l1.segment_bytes"),
        ("tiers:\n  l1: [1, 2]\n", "'tiers.l1'"),
        ("- just a list\n", "mapping"),
        ("tiers: {l1: {capacity_bytes: 1GiB\n", "not valid YAML"),
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
        path, ["tiers.l1.capacity_bytes=512MiB", "server.tcp_address=127.0.0.1:5000"]
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
    assert "capacity_bytes: 2147483648" in proc.stdout


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
    """Every key of tiers.l3 but `enabled` and `admission` is a RemoteOptions field, with the
    same default: the daemon's config and the tier cannot drift apart."""
    import dataclasses

    from kvtier.daemon.config import L3Config
    from kvtier.tiers.remote.options import RemoteOptions

    config = {f.name: f.default for f in dataclasses.fields(L3Config)}
    tier = {f.name: f.default for f in dataclasses.fields(RemoteOptions)}
    assert set(config) - set(tier) == {"enabled", "admission"}
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
    one = load_config(None, ["tiers.l3.urls=rediss://cache:6380", "tiers.l3.ttl_s=60"])
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


def test_shm_share_pairs():
    from kvtier.daemon.config import ANY_PEER

    server = load_config(None, ["server.shm_share=[65534=0, any=root]"]).server
    assert server.shm_share_pairs() == {(65534, 0), (ANY_PEER, 0)}
    one = load_config(None, ["server.shm_share=nobody=root"]).server
    assert one.shm_share_pairs() == {(65534, 0)}
