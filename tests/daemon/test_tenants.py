"""Tenant binding and namespace derivation (daemon/tenants.py), and the tenants config."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from peers import require_root

from kvtier.daemon.config import load_config
from kvtier.daemon.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from kvtier.daemon.sessions import PeerCred
from kvtier.daemon.tenants import (
    _SPACES_KEPT,
    DEFAULT_NAMESPACE,
    MAX_TOKEN_BYTES,
    SharedSpace,
    Tenant,
    TenantDirectory,
    TokenFileError,
    _digest,
    namespace_id,
    read_token_file,
)
from kvtier.paths import link_problem
from kvtier.tiers.base import TierKind

SECRET = b"bob-secret-0123456789"
ROBOT = b"robot-secret-0123456789"


def peer(uid: int, gid: int | None = None) -> PeerCred:
    return PeerCred(pid=1, uid=uid, gid=uid if gid is None else gid)


@pytest.fixture
def directory() -> TenantDirectory:
    return TenantDirectory(
        [
            Tenant("alice", uids=frozenset({1000})),
            Tenant(
                "bob", uids=frozenset({1001}), gids=frozenset({50}), token_digest=_digest(SECRET)
            ),
            Tenant("robot", token_digest=_digest(ROBOT)),  # by token only
            Tenant("ops", uids=frozenset({7}), admin=True),
        ],
        [SharedSpace("common", frozenset({"alice", "bob"}))],
        admin_uids={0},
    )


def test_namespace_ids_are_stable_64_bit_hashes_of_owner_and_name():
    assert namespace_id("tenant:default", "") == DEFAULT_NAMESPACE == 0
    ids = {
        namespace_id(owner, name)
        for owner in ("tenant:alice", "tenant:bob", "shared:alice", "tenant:default")
        for name in ("", "m", "llama")
    }
    assert len(ids) == 12 and all(0 <= i < 2**64 for i in ids)
    assert namespace_id("tenant:alice", "m") == namespace_id("tenant:alice", "m")
    # Length-prefixed fields: moving a character from owner to name changes the id.
    assert namespace_id("tenant:ab", "c") != namespace_id("tenant:a", "bc")


def test_without_tenants_every_peer_is_default_and_limited_per_uid():
    d = TenantDirectory(admin_uids={0})
    b = d.bind(peer(1000), b"")
    assert (b.tenant, b.admin, b.limit_key) == ("default", False, "uid:1000")
    assert d.bind(peer(0), b"").admin
    assert d.space("default", "").ns == 0
    with pytest.raises(Unauthenticated, match="token"):
        d.bind(None, b"")


def test_peers_bind_by_uid_then_gid_and_the_unknown_are_refused(directory):
    assert directory.bind(peer(1000), b"").tenant == "alice"
    assert directory.bind(peer(1000, gid=50), b"").tenant == "alice"  # the uid wins
    assert directory.bind(peer(4242, gid=50), b"").tenant == "bob"
    ops = directory.bind(peer(7), b"")
    assert (ops.tenant, ops.admin, ops.limit_key) == ("ops", True, "ops")
    with pytest.raises(PermissionDenied, match=r"uid 4242 \(gid 4242\) belongs to no tenant"):
        directory.bind(peer(4242), b"")
    root = directory.bind(peer(0), b"")  # an admin uid in no tenant
    assert (root.tenant, root.admin) == ("admin", True)


def test_tokens_bind_their_tenant_where_the_peer_may_use_it(directory):
    assert directory.bind(None, SECRET).tenant == "bob"  # TCP
    assert directory.bind(None, ROBOT).tenant == "robot"
    assert directory.bind(peer(1001), SECRET).tenant == "bob"
    assert directory.bind(peer(1000), ROBOT).tenant == "robot"  # a token-only tenant
    with pytest.raises(PermissionDenied, match="tenant 'bob'"):
        directory.bind(peer(1000), SECRET)  # alice's uid with bob's token
    with pytest.raises(Unauthenticated, match="not any tenant's"):
        directory.bind(None, b"guess-0123456789")
    assert directory.bind(peer(0), ROBOT).admin  # an admin uid keeps its rights


def test_set_tokens_replaces_a_tenants_token_and_keeps_the_rest(directory):
    fresh = b"bob-second-secret-0123"
    assert directory.set_tokens({"bob": _digest(fresh), "robot": _digest(ROBOT)}) == ["bob"]
    assert directory.bind(None, fresh).tenant == "bob"
    with pytest.raises(Unauthenticated, match="not any tenant's"):
        directory.bind(None, SECRET)
    assert directory.bind(None, ROBOT).tenant == "robot"
    assert directory.bind(peer(1001), b"").tenant == "bob"  # its uids and gids unchanged
    assert directory.bind(peer(50 + 1, 50), b"").tenant == "bob"
    assert directory.set_tokens({"bob": _digest(fresh)}) == []


def test_regression_a_token_of_two_tenants_bound_whichever_came_last(directory):
    """bob's file rotated to robot's secret (a copy slip at a SIGHUP; two files of the same
    content at start did it too): a session presenting it bound the last tenant of the
    config that matched, so one of the two got the other's namespaces. A token that is more
    than one tenant's binds none, and the directory names the tenants that share one."""
    assert directory.token_clashes() == []
    directory.set_tokens({"bob": _digest(ROBOT)})
    assert directory.token_clashes() == [["bob", "robot"]]
    for who in (None, peer(1001)):
        with pytest.raises(Unauthenticated, match="more than one tenant's"):
            directory.bind(who, ROBOT)
    assert directory.bind(peer(1001), b"").tenant == "bob"  # its uid still binds it
    directory.set_tokens({"bob": _digest(SECRET)})
    assert directory.bind(None, ROBOT).tenant == "robot"
    assert directory.token_clashes() == []


def test_spaces_are_the_tenants_own_or_configured_shared_ones(directory):
    mine = directory.space("alice", "m")
    assert (mine.owner, mine.ns) == ("alice", namespace_id("tenant:alice", "m"))
    assert directory.space("bob", "m").ns != mine.ns
    shared = directory.space("alice", "shared:common/llama")
    assert shared == directory.space("bob", "shared:common/llama")
    assert shared.owner == "shared:common" and shared.ns == namespace_id("shared:common", "llama")
    assert directory.space("alice", "shared:common").ns != shared.ns
    with pytest.raises(PermissionDenied, match="shared_namespaces"):
        directory.space("robot", "shared:common")
    with pytest.raises(PermissionDenied):
        directory.space("alice", "shared:secret")
    assert directory.space("ops", "shared:common", admin=True).owner == "shared:common"
    with pytest.raises(InvalidArgument, match="200 bytes"):
        directory.space("alice", "x" * 201)


@pytest.mark.parametrize("declared", ["shared:", "shared:/x", "shared:a b", "shared:\n"])
def test_regression_a_shared_namespace_of_no_valid_name_was_called_named(directory, declared):
    """'shared:' (or any name no shared namespace can have) was refused as "no shared
    namespace 'named'", which reads as a namespace of that name."""
    with pytest.raises(PermissionDenied) as info:
        directory.space("alice", declared)
    assert "no shared namespace of that name" in str(info.value)
    assert "'named'" not in str(info.value)


def test_resolved_spaces_are_remembered_within_a_bound_and_refusals_are_not(directory):
    first = directory.space("alice", "m")
    assert directory.space("alice", "m") is first
    # The same name as another tenant, or as an admin, is resolved on its own.
    assert directory.space("bob", "m").ns != first.ns
    for _ in range(2):
        with pytest.raises(PermissionDenied):
            directory.space("robot", "shared:common")
    assert directory.space("robot", "shared:common", admin=True).owner == "shared:common"
    with pytest.raises(PermissionDenied):
        directory.space("robot", "shared:common")
    for i in range(3 * _SPACES_KEPT):
        assert directory.space("alice", f"n{i}").ns == namespace_id("tenant:alice", f"n{i}")
    assert len(directory._spaces) <= _SPACES_KEPT
    assert directory.space("alice", "m") == first


def test_rebind_says_what_an_open_session_would_be_bound_to_now(directory):
    """After a reload replaced the tenants, each open session is bound again as it would be
    (the reload ends those that differ): by its peer's credentials, or, for one bound by a
    token, by its tenant as it stands (the token itself is not kept)."""
    assert directory.rebind(peer(1000), "alice", b"") == directory.bind(peer(1000), b"")
    assert directory.rebind(peer(1001), "bob", _digest(SECRET)) == directory.bind(
        peer(1001), SECRET
    )
    assert directory.rebind(None, "robot", _digest(ROBOT)).tenant == "robot"
    # A token no tenant has now (rotated): bound to its tenant as that stands.
    assert directory.rebind(None, "robot", _digest(b"rotated-out-0123456789")).tenant == "robot"
    changed = TenantDirectory(
        [
            Tenant("alice", uids=frozenset({1001})),  # bob's uid moved to alice
            Tenant("bob", gids=frozenset({50})),  # no token any more
            Tenant("ops", uids=frozenset({7})),  # no longer admin
        ],
        [SharedSpace("common", frozenset({"bob"}))],  # alice left it
        admin_uids={0},
    )
    assert directory.space("alice", "shared:common").owner == "shared:common"  # resolved, kept
    directory.replace_with(changed)
    assert directory.rebind(peer(1001), "bob", b"").tenant == "alice"
    with pytest.raises(PermissionDenied, match="uid 1000"):
        directory.rebind(peer(1000), "alice", b"")
    with pytest.raises(Unauthenticated, match="tenant 'bob' has no token"):
        directory.rebind(peer(1001, 50), "bob", _digest(SECRET))
    with pytest.raises(Unauthenticated, match="tenant 'robot'"):
        directory.rebind(None, "robot", _digest(ROBOT))
    assert not directory.rebind(peer(7), "ops", b"").admin
    assert directory.rebind(peer(0), "ops", b"").admin  # root is an admin anyway
    with pytest.raises(PermissionDenied, match="shared_namespaces"):
        directory.space("alice", "shared:common")  # resolved again, not from before
    with pytest.raises(Unauthenticated, match="not any tenant's"):
        directory.bind(peer(1001), SECRET)


def test_rebind_follows_a_token_that_moved_to_another_tenant(directory):
    """Token files moved between tenants: a session opened with bob's token is bound again
    by that token, now robot's (so the reload ends it), not left bob's; a token that is
    now more than one tenant's binds none."""
    directory.replace_with(
        TenantDirectory(
            [
                Tenant("bob", token_digest=_digest(ROBOT)),
                Tenant("robot", token_digest=_digest(SECRET)),
                Tenant("ops", token_digest=_digest(SECRET)),
            ]
        )
    )
    assert directory.rebind(None, "robot", _digest(ROBOT)).tenant == "bob"
    with pytest.raises(Unauthenticated, match="more than one tenant's"):
        directory.rebind(None, "bob", _digest(SECRET))


def test_a_reloaded_directory_keeps_the_tokens_of_unchanged_paths_and_reads_new_ones(tmp_path):
    """A reload that changes the tenants reads the token files of added tenants and of
    changed paths, and keeps the token read before for a path that stayed (every file is
    read again by the reload after that); a file that cannot be used raises, so that the
    reload is refused whole."""

    def token(name: str, secret: str) -> str:
        path = tmp_path / f"{name}.token"
        path.write_text(secret)
        path.chmod(0o600)
        return str(path)

    def config(*tenants: tuple[str, str]):
        listed = ", ".join(f"{{name: {n}, token_file: {f}}}" for n, f in tenants)
        return load_config(None, [f"tenants=[{listed}]"])

    a, b = token("a", "secret-of-a-0123456789"), token("b", "secret-of-b-0123456789")
    running = config(("a", a))
    directory = TenantDirectory.from_config(running)
    with open(a, "w") as f:
        f.write("a-second-secret-0123456789")  # read again by the reload, not here
    fresh = directory.reloaded(running, config(("a", a), ("b", b)))
    assert fresh.bind(None, b"secret-of-a-0123456789").tenant == "a"
    assert fresh.bind(None, b"secret-of-b-0123456789").tenant == "b"
    fresh = directory.reloaded(running, config(("a", b)))  # a's new path: read now
    assert fresh.bind(None, b"secret-of-b-0123456789").tenant == "a"
    os.chmod(b, 0o644)
    with pytest.raises(TokenFileError, match="others"):
        directory.reloaded(running, config(("a", a), ("b", b)))
    assert directory.bind(None, b"secret-of-a-0123456789").tenant == "a"  # unchanged


def test_stats_show_a_tenant_its_own_and_its_shared_namespaces(directory):
    assert directory.visible_to("alice", False) == ["alice", "shared:common"]
    assert directory.visible_to("robot", False) == ["robot"]
    assert directory.visible_to("ops", True) is None


def test_token_files_must_be_private_regular_and_long_enough(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(b"  " + SECRET + b"\n")
    good.chmod(0o600)
    assert read_token_file(str(good)) == SECRET
    good.chmod(0o640)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token_file(str(good))
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(TokenFileError, match="at least 16"):
        read_token_file(str(short))
    link = tmp_path / "link"
    os.symlink(short, link)
    with pytest.raises(TokenFileError, match="at least 16"):  # the file it names is judged
        read_token_file(str(link))
    with pytest.raises(TokenFileError, match="cannot read"):
        read_token_file(str(tmp_path / "absent"))


def test_regression_a_token_file_from_a_kubernetes_secret_was_refused(tmp_path):
    """A Kubernetes Secret volume (the way a pod gets secrets) projects each key as a link,
    `token -> ..data/token`, `..data` a link to the folder of the current version, which a
    rotation swaps: token files there were refused ('cannot read token file ...: Too many
    levels of symbolic links'), for tenants and the metrics endpoint alike (the L3
    password_file, through the same volume, was read). The file the links name is judged:
    regular, private, long enough. Built here as the kubelet builds it."""
    volume = tmp_path / "secret"
    version = volume / "..2026_12_06_05_00_00.000000001"
    version.mkdir(parents=True)
    (version / "token").write_bytes(SECRET + b"\n")
    (version / "token").chmod(0o400)  # the Secret's defaultMode: 0400
    (volume / "..data").symlink_to(version.name)
    (volume / "token").symlink_to("..data/token")
    assert read_token_file(str(volume / "token")) == SECRET
    sets = [
        f"server.socket={tmp_path}/s.sock",
        f"tenants=[{{name: alice, token_file: {volume}/token}}]",
        f"metrics.token_file={volume}/token",
        "metrics.address=127.0.0.1:0",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--check-config"]
        + [arg for s in sets for arg in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "config ok" in r.stdout, r.stderr
    (version / "token").chmod(0o444)  # defaultMode left at Kubernetes' 0644
    with pytest.raises(TokenFileError, match="others may read it"):
        read_token_file(str(volume / "token"))


def test_regression_a_token_file_past_the_bound_was_read_cut_short(tmp_path):
    """A token file of more than MAX_TOKEN_BYTES (a link to the wrong file, a log) was read
    cut at the bound: --check-config said 'config ok' and the daemon took the first 4 KiB as
    the tenant's token, which no session can present (the daemon refuses a longer token, and
    a client sends the first 4096 bytes of its copy). Refused, naming the bound, as the L3
    password_file's reading refuses a file past its own."""
    long = tmp_path / "long"
    long.write_bytes(b"x" * (MAX_TOKEN_BYTES + 1) + b"\n")
    long.chmod(0o600)
    with pytest.raises(TokenFileError, match=f"at most {MAX_TOKEN_BYTES}"):
        read_token_file(str(long))
    big = tmp_path / "big"
    big.write_bytes(b"y" * (8 << 20))
    big.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(big)
    with pytest.raises(TokenFileError, match=f"at most {MAX_TOKEN_BYTES}"):
        read_token_file(str(link))
    r = subprocess.run(
        [
            *(sys.executable, "-m", "kvtier.daemon", "--check-config"),
            *("--set", f"server.socket={tmp_path}/s.sock"),
            *("--set", f"tenants=[{{name: alice, token_file: {link}}}]"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and f"at most {MAX_TOKEN_BYTES}" in r.stderr, r.stderr
    exact = tmp_path / "exact"
    exact.write_bytes(b"z" * MAX_TOKEN_BYTES + b"\n")
    exact.chmod(0o600)
    assert read_token_file(str(exact)) == b"z" * MAX_TOKEN_BYTES


def test_regression_a_link_of_another_user_led_a_token_file_to_any_file(tmp_path):
    """783fc84 followed links so that a Kubernetes Secret's keys (links of root's) could be
    read; it followed anyone's: a tenant who may write the folder of its token file linked it
    to another tenant's file, which it may not read, and the next SIGHUP gave both the same
    token, which binds neither (the other's sessions ended). A link on the way (at the file
    or at a folder) of a user other than root and the daemon's own is refused, naming it; the
    file at the end of the links is the one read."""
    require_root()  # links of another user
    theirs = tmp_path / "bob.token"
    theirs.write_bytes(SECRET)
    theirs.chmod(0o600)
    home = tmp_path / "alice"
    home.mkdir()
    os.chown(home, 4321, 4321)  # a tenant's folder
    link = home / "token"
    link.symlink_to(theirs)
    os.lchown(link, 4321, 4321)
    with pytest.raises(TokenFileError, match=f"{link}, a link of uid 4321"):
        read_token_file(str(link))
    os.unlink(link)
    (home / "kv").symlink_to(tmp_path)  # a folder on the way
    os.lchown(home / "kv", 4321, 4321)
    with pytest.raises(TokenFileError, match="a link of uid 4321"):
        read_token_file(str(home / "kv" / "bob.token"))
    os.lchown(home / "kv", os.geteuid(), -1)  # the daemon's own user's link
    assert read_token_file(str(home / "kv" / "bob.token")) == SECRET
    # ".." after a link is the folder above the link's target, as the kernel takes it.
    around = home / "kv" / ".." / tmp_path.name / "." / "bob.token"
    assert read_token_file(str(around)) == SECRET
    # A link moved between the open and the look at the links: the path leads elsewhere now
    # (here: the file opened was another), so what was read is not trusted.
    opened = os.stat(tmp_path / "alice")
    assert "changed while it was read" in (link_problem(str(around), os.geteuid(), opened) or "")


def test_the_directory_is_built_from_the_config(tmp_path):
    token = tmp_path / "t"
    token.write_bytes(SECRET)
    token.chmod(0o600)
    config = load_config(
        None,
        [
            f"tenants=[{{name: a, uids: [1000, root], quotas: {{l1: 1MiB}}}}, "
            f"{{name: b, gids: [0], token_file: {token}, admin: true}}]",
            "shared_namespaces=[{name: s, tenants: [a, b], quotas: {l1: 2MiB}}]",
            "server.admin_uids=[12]",
        ],
    )
    d = TenantDirectory.from_config(config)
    assert d.tenants["a"].uids == {1000, 0} and d.tenants["b"].gids == {0}
    assert d.bind(None, SECRET).tenant == "b"
    assert d.bind(peer(12), b"").admin
    assert sorted(d.quotas()) == sorted(
        [("a", TierKind.HOST, 1 << 20), ("shared:s", TierKind.HOST, 2 << 20)]
    )
    # Sizes in units as the config spells them (the start line said "quotas L1 1048576"),
    # and a shared namespace's quotas too (they were left out).
    assert d.describe() == (
        "tenants: a (uids [0, 1000]; quotas L1 1MiB), b (gids [0]; token; admin); "
        "shared namespaces: shared:s (a, b; quotas L1 2MiB)"
    )


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["tenants=[{name: a, uids: [1]}, {name: b, uids: [1]}]"], "uid 1 is already"),
        (["tenants=[{name: a, gids: [5]}, {name: b, gids: [5]}]"], "gid 5 is already"),
        (["tenants=[{name: a, uids: [1]}, {name: a, uids: [2]}]"], "appears twice"),
        (["tenants=[{name: admin, uids: [1]}]"], "reserved"),
        (["tenants=[{name: 'no spaces', uids: [1]}]"], r"tenants\[0\]\.name"),
        (["tenants=[{name: a}]"], "no session could ever belong"),
        (["tenants=[{name: a, uids: [no-such-user-here]}]"], r"tenants\[0\]\.uids"),
        (["tenants=[{name: a, uids: [1], quota: {l1: 1}}]"], r"tenants\[0\]\.quota'"),
        (["tenants=[{name: a, uids: [1], quotas: {l3: 1}}]"], r"tenants\[0\]\.quotas\.l3"),
        (["tenants=[{name: a, uids: [1], quotas: {l2: 1GiB}}]"], "tiers.l2 is not enabled"),
        (["tenants={name: a}"], "list of mappings"),
        (
            ["tenants=[{name: a, uids: [1]}]", "shared_namespaces=[{name: s, tenants: [z]}]"],
            "no tenant 'z'",
        ),
        (["server.tcp_address=127.0.0.1:5000"], "need a tenant token"),
        (["server.admin_uids=[no-such-user-here]"], r"server\.admin_uids"),
    ],
)
def test_bad_tenant_configs_name_the_key(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)


def test_tenants_print_and_load_back(tmp_path):
    import yaml

    config = load_config(
        None,
        [
            "tenants=[{name: a, uids: [1, root], quotas: {l1: 1GiB}}]",
            "shared_namespaces=[{name: s, tenants: [a]}]",
        ],
    )
    path = tmp_path / "printed.yaml"
    printed = config.printable()
    assert printed["tenants"][0]["quotas"]["l1"] == "1GiB"
    path.write_text(yaml.safe_dump(printed, sort_keys=False))
    assert load_config(path) == config


def test_preflight_names_a_token_file_the_daemon_must_not_use(tmp_path):
    from kvtier.daemon.preflight import _tokens

    token = tmp_path / "t"
    token.write_bytes(SECRET)
    token.chmod(0o644)
    config = load_config(
        None, [f"tenants=[{{name: a, uids: [1]}}, {{name: b, token_file: {token}}}]"]
    )
    problems = _tokens(config)
    assert [p.key for p in problems] == ["tenants[1].token_file"]
    assert "chmod 600" in problems[0].message
    token.chmod(0o600)
    assert _tokens(config) == []


def test_regression_a_fifo_token_file_hung_the_daemon_at_start(tmp_path):
    """Opening a FIFO for reading waits for a writer: kvtierd (and --check-config) hung at
    start on a tenant whose token_file was one. It is refused as not a regular file."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(read_token_file(str(fifo)))
        except BaseException as e:
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # let the blocked open go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
        pytest.fail("read_token_file waited for a writer of the FIFO")
    assert isinstance(outcome[0], TokenFileError) and "not a regular file" in str(outcome[0])
