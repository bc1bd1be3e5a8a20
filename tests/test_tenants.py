"""Tenants bound on the server (issue 9, items 3, 4 and 5), through the real daemon.

Two real clients run as two users (uid 1 is tenant alice, uid 65534 tenant bob; neither is
an admin) and use the same keys: neither can find, read, overwrite, delete, evict or
prefetch the other's blocks, nor use the other's leases. Namespaces are shared only when the
config says so; quotas bind per tenant and show in stats; admin calls need an admin.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from peer_client import LAYOUT, PeerClient, PeerError
from peers import NOBODY, NOGROUP, require_root

from kvtier.client import (
    PermissionDeniedError,
    PoolLayout,
    ResourceExhaustedError,
    SharedMemoryPool,
    Tier,
)

ALICE = (1, 1)  # uid, gid ("daemon" on Debian)
BOB = (NOBODY, NOGROUP)
BLOCK = 16 * 1024  # peer_client.LAYOUT: 2 layers x K,V x 4 KiB
L1, L2 = int(Tier.L1_HOST), int(Tier.L2_DISK)
STORED = 0

TENANTS = (
    f"tenants=[{{name: alice, uids: [{ALICE[0]}]}}, {{name: bob, uids: [{BOB[0]}]}}, "
    "{name: ops, uids: [0], admin: true}]"
)


def keys(n: int, tag: int = 0) -> list[bytes]:
    rng = np.random.default_rng(tag)
    return [rng.bytes(32) for _ in range(n)]


@pytest.fixture
def tenant_daemon(daemon_factory, tmp_path):
    """Tenants alice, bob and ops (root, admin); L1 and L2; sockets open to both uids."""
    require_root()
    os.chmod(daemon_factory._sockdir, 0o711)

    def start(*extra: str):
        return daemon_factory(
            "server.socket_mode=0666",
            "policy.protect_s=0",
            "tiers.l1.segment_bytes=1MiB",
            "tiers.l2.enabled=true",
            f"tiers.l2.path={tmp_path / 'l2'}",
            "tiers.l2.capacity_bytes=16MiB",
            "tiers.l2.segment_bytes=1MiB",
            "tiers.l2.file_bytes=16MiB",
            TENANTS,
            *extra,
            l1_bytes="8MiB",
        )

    return start


@pytest.fixture
def peers(tenant_daemon):
    made: list[PeerClient] = []

    def make(who: tuple[int, int], d, **kwargs) -> PeerClient:
        made.append(PeerClient(d.address, *who, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _err(fn, *args, **kwargs) -> PeerError:
    with pytest.raises(PeerError) as info:
        fn(*args, **kwargs)
    return info.value


def test_a_tenant_cannot_find_read_overwrite_delete_evict_or_prefetch_anothers_blocks(
    tenant_daemon, peers
):
    d = tenant_daemon()
    alice, bob = peers(ALICE, d), peers(BOB, d)
    assert alice("whoami") == {"tenant": "alice", "admin": False}
    assert bob("whoami") == {"tenant": "bob", "admin": False}
    ks = keys(4)
    pages = [0, 1, 2, 3]
    theirs = bob("fill", pages=pages, values=[0xB0, 0xB1, 0xB2, 0xB3])
    assert bob("put", keys=ks, pages=pages) == [STORED] * 4
    # Bob's first two blocks go down to L2 (his own evict), so a prefetch would move them.
    assert bob("evict", keys=ks[:2], tier=L1) == [2, 0, 0]
    assert bob("lookup", keys=ks)["tiers"] == [L2, L2, L1, L1]

    # find
    assert alice("lookup", keys=ks) == {"prefix": 0, "tiers": [0] * 4, "lease": 0}
    assert alice("lookup", keys=ks, pin=True)["lease"] == 0
    # read: nothing loads, alice's pages keep her bytes
    mine = alice("fill", pages=pages, values=[0xA0, 0xA1, 0xA2, 0xA3])
    got = alice("get", keys=ks, pages=pages)
    assert got["loaded"] == [False] * 4 and got["pages"] == mine
    # prefetch: nothing of bob's is found or moved
    assert alice("prefetch", keys=ks) == [0, 0, 4]
    # delete and evict: nothing of bob's is touched
    assert alice("delete", keys=ks) == [0, 4, 0]
    assert alice("evict", keys=ks, tier=L1) == [0, 4, 0]
    assert alice("evict", keys=ks, tier=L2) == [0, 4, 0]
    # overwrite: alice's put of the same keys stores her own blocks beside bob's
    assert alice("put", keys=ks, pages=pages) == [STORED] * 4
    other = alice("fill", pages=[4, 5, 6, 7], values=[0] * 4)
    got = alice("get", keys=ks, pages=[4, 5, 6, 7])
    assert got["loaded"] == [True] * 4 and got["pages"] == mine != other

    # Bob's blocks are where he left them, byte for byte.
    assert bob("lookup", keys=ks)["tiers"] == [L2, L2, L1, L1]
    bob("fill", pages=[8, 9, 10, 11], values=[0] * 4)
    got = bob("get", keys=ks, pages=[8, 9, 10, 11])
    assert got["loaded"] == [True] * 4 and got["pages"] == theirs
    # Alice's own delete removes only hers.
    assert alice("delete", keys=ks) == [4, 0, 0]
    assert bob("lookup", keys=ks)["prefix"] == 4
    assert bob("stats")[0]["tenant"] == "bob"  # a tenant sees its own usage only


def test_leases_serve_every_session_of_their_tenant_and_no_other_tenant(tenant_daemon, peers):
    d = tenant_daemon()
    bob, bob2, alice = peers(BOB, d), peers(BOB, d), peers(ALICE, d)
    ks = keys(2, tag=1)
    bob("fill", pages=[0, 1], values=[7, 8])
    bob("put", keys=ks, pages=[0, 1])
    lease = bob("lookup", keys=ks, pin=True)["lease"]
    assert lease
    # Another tenant may neither load under it nor release it.
    err = _err(alice, "get", keys=ks, pages=[0, 1], lease_id=lease)
    assert err.kind == "PermissionDeniedError" and "another tenant" in err.details
    assert _err(alice, "release", lease_id=lease).kind == "PermissionDeniedError"
    # Another session of the same tenant may load (an engine's scheduler pins, its worker
    # loads); only the session that took it releases it.
    assert bob2("get", keys=ks, pages=[2, 3], lease_id=lease)["loaded"] == [True, True]
    assert _err(bob2, "release", lease_id=lease).kind == "PermissionDeniedError"
    bob("release", lease_id=lease)
    assert _err(bob, "release", lease_id=lease).kind == "NotFoundError"


def test_namespaces_are_shared_only_when_the_config_says_so(tenant_daemon, peers):
    d = tenant_daemon("shared_namespaces=[{name: common, tenants: [alice, bob]}]")
    alice, bob = peers(ALICE, d), peers(BOB, d)
    ks = keys(2, tag=2)
    theirs = bob("fill", pages=[0, 1], values=[0x5A, 0x5B])
    assert bob("put", keys=ks, pages=[0, 1], namespace="shared:common/llama") == [0, 0]
    # The shared namespace is one namespace for both tenants...
    got = alice("get", keys=ks, pages=[2, 3], namespace="shared:common/llama")
    assert got["loaded"] == [True, True] and got["pages"] == theirs
    # ...and distinct from each tenant's own namespaces and its other names.
    assert alice("lookup", keys=ks)["prefix"] == 0
    assert alice("lookup", keys=ks, namespace="llama")["prefix"] == 0
    assert alice("lookup", keys=ks, namespace="shared:common/other")["prefix"] == 0
    err = _err(alice, "lookup", keys=ks, namespace="shared:secret")
    assert err.kind == "PermissionDeniedError" and "shared_namespaces" in err.details
    # Each tenant's named namespaces are its own: the same name in another tenant is another.
    bob("put", keys=ks, pages=[0, 1], namespace="llama")
    assert alice("lookup", keys=ks, namespace="llama")["prefix"] == 0
    assert bob("lookup", keys=ks, namespace="llama")["prefix"] == 2


def test_an_admin_reads_and_writes_no_shared_namespace_it_is_not_listed_in(tenant_daemon, peers):
    """Admins delete and evict in any namespace, shared ones included, but read no one's
    blocks: a shared namespace that does not list the admin's tenant is closed to its
    lookups, loads, prefetches and puts (a put there would hand its bytes to the tenants
    that load from it)."""
    d = tenant_daemon("shared_namespaces=[{name: common, tenants: [alice, bob]}]")
    bob = peers(BOB, d)
    ks = keys(2, tag=8)
    bob("fill", pages=[0, 1], values=[0x5A, 0x5B])
    shared = "shared:common"
    assert bob("put", keys=ks, pages=[0, 1], namespace=shared) == [STORED] * 2
    with d.client() as admin, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert admin.tenant == "ops" and admin.admin
        pool = admin.register_pool(shm, LAYOUT)
        shm.array()[:] = 0xEE
        for call in (
            lambda: admin.lookup(ks, namespace=shared),
            lambda: admin.get(pool.pool_id, ks, [0, 1], namespace=shared),
            lambda: admin.prefetch(ks, deadline_ms=1000, namespace=shared),
            lambda: admin.put(pool.pool_id, [keys(1, tag=9)[0]], [2], namespace=shared),
        ):
            with pytest.raises(PermissionDeniedError, match="no shared namespace"):
                call()
        assert (shm.array() == 0xEE).all()  # nothing of bob's was loaded
        assert bob("lookup", keys=[keys(1, tag=9)[0]], namespace=shared)["prefix"] == 0
        # Deleting and evicting there stay admin calls.
        assert admin.evict(ks[:1], "L1", namespace=shared).evicted == 1
        assert admin.delete(ks[1:], namespace=shared).deleted == 1
    assert bob("lookup", keys=ks, namespace=shared)["tiers"] == [L2, 0]


def test_a_tenant_at_its_quota_evicts_its_own_blocks_and_stats_show_usage(tenant_daemon, peers):
    quota = 8 * BLOCK
    d = tenant_daemon(
        f"tenants=[{{name: alice, uids: [{ALICE[0]}]}}, "
        f"{{name: bob, uids: [{BOB[0]}], quotas: {{l1: {quota}}}}}, "
        "{name: ops, uids: [0], admin: true}]"
    )
    alice, bob = peers(ALICE, d), peers(BOB, d)
    hers = keys(4, tag=3)
    alice("put", keys=hers, pages=[0, 1, 2, 3])
    his = keys(24, tag=4)
    for i in range(0, 24, 4):
        assert bob("put", keys=his[i : i + 4], pages=[0, 1, 2, 3]) == [STORED] * 4
    # Bob never holds more than his quota in L1: his older blocks went to L2, alice's stayed.
    assert alice("lookup", keys=hers)["tiers"] == [L1] * 4
    tiers = bob("lookup", keys=his)["tiers"]
    assert tiers.count(L1) == 8 and tiers.count(L2) == 16
    usage = {t["tenant"]: t for t in bob("stats")}
    assert list(usage) == ["bob"]
    assert usage["bob"]["tiers"]["L1_HOST"] == [quota, quota, 8]
    assert usage["bob"]["tiers"]["L2_DISK"][2] == 16
    with d.client() as admin:  # root: tenant ops, an admin, sees every tenant
        by = {t.tenant: t for t in admin.stats().tenants}
        assert set(by) >= {"alice", "bob", "ops"}
        l1 = {t: next(u for u in by[t].tiers if u.tier == Tier.L1_HOST) for t in by}
        assert (l1["alice"].used_bytes, l1["alice"].quota_bytes) == (4 * BLOCK, 0)
        assert (l1["bob"].used_bytes, l1["bob"].quota_bytes) == (quota, quota)
        assert by["bob"].sessions == 1 and by["alice"].sessions == 1
        assert admin.stats().counter("quota_evictions", tenant="bob", tier="L1") == 16
        assert admin.check().problems == []


def test_admin_calls_need_an_admin(tenant_daemon, peers):
    d = tenant_daemon()
    alice, bob = peers(ALICE, d), peers(BOB, d)
    ks = keys(2, tag=5)
    bob("put", keys=ks, pages=[0, 1])
    for op, kwargs in [
        ("check", {}),
        ("drain", {}),
        ("delete", {"keys": ks, "tenant": "bob"}),
        ("evict", {"keys": ks, "tier": L1, "tenant": "bob"}),
    ]:
        err = _err(alice, op, **kwargs)
        assert err.kind == "PermissionDeniedError", (op, err)
    assert bob("lookup", keys=ks)["prefix"] == 2
    with d.client() as admin:
        assert admin.tenant == "ops" and admin.admin
        assert admin.evict(ks, "L1", tenant="bob").evicted == 2
        assert bob("lookup", keys=ks)["tiers"] == [L2, L2]
        assert admin.delete(ks, tenant="bob").deleted == 2
        assert bob("lookup", keys=ks)["prefix"] == 0
        assert admin.check().problems == []


def test_drain_refuses_new_sessions_but_admins_and_lets_open_ones_finish(tenant_daemon, peers):
    d = tenant_daemon()
    bob = peers(BOB, d)
    ks = keys(2, tag=6)
    with d.client() as admin:
        state = admin.drain()
        assert state.draining and state.sessions == 1  # bob's
        assert not admin.health()  # NOT_SERVING for load balancers and probes
        # The open session carries on; a new one is refused, with the reason.
        assert bob("put", keys=ks, pages=[0, 1]) == [STORED] * 2
        with pytest.raises(PeerError) as info:
            peers(ALICE, d)
        assert info.value.kind == "UnavailableError" and "draining" in info.value.details
        with d.client() as another_admin:
            assert another_admin.stats().gauges["sessions"] >= 2
        bob.close()
        assert admin.drain().sessions == 0
        assert not admin.drain(resume=True).draining
        assert admin.health()
    assert peers(ALICE, d)("whoami")["tenant"] == "alice"


def test_a_peer_in_no_tenant_is_refused_and_root_is_the_admin_tenant(daemon_factory, peers):
    require_root()
    os.chmod(daemon_factory._sockdir, 0o711)
    d = daemon_factory("server.socket_mode=0666", f"tenants=[{{name: bob, uids: [{NOBODY}]}}]")
    with pytest.raises(PeerError) as info:
        peers(ALICE, d)
    assert info.value.kind == "PermissionDeniedError"
    assert "uid 1 (gid 1) belongs to no tenant" in info.value.details
    with d.client() as root:  # no tenant lists root: it is the admin tenant
        assert (root.tenant, root.admin) == ("admin", True)
        with pytest.raises(PermissionDeniedError, match="no shared namespace"):
            root.lookup(keys(1), namespace="shared:x")


def test_recovered_blocks_keep_their_tenant(tenant_daemon, peers):
    d = tenant_daemon()
    bob = peers(BOB, d)
    ks = keys(3, tag=7)
    theirs = bob("fill", pages=[0, 1, 2], values=[1, 2, 3])
    bob("put", keys=ks, pages=[0, 1, 2], namespace="m")
    bob.close()
    d.restart()  # SIGTERM flushes L1 to L2; the new process reads L2's index
    alice, bob = peers(ALICE, d, namespace="m"), peers(BOB, d, namespace="m")
    assert alice("lookup", keys=ks)["prefix"] == 0
    got = bob("get", keys=ks, pages=[3, 4, 5])
    assert got["loaded"] == [True] * 3 and got["pages"] == theirs
    usage = {t["tenant"]: t for t in bob("stats")}
    assert usage["bob"]["tiers"]["L2_DISK"][2] == 3


def test_stats_show_a_tenant_nothing_of_another_tenants_blocks_or_traffic(tenant_daemon, peers):
    # Regression: Stats answered every session the daemon-wide tier usage, counters and
    # gauges, so bob read alice's bytes and blocks (tier total minus his own), her hits and
    # puts as they happened, and counters labelled with her name (quota evictions).
    d = tenant_daemon(
        f"tenants=[{{name: alice, uids: [{ALICE[0]}], quotas: {{l1: {4 * BLOCK}}}}}, "
        f"{{name: bob, uids: [{BOB[0]}]}}, {{name: ops, uids: [0], admin: true}}]"
    )
    alice, bob = peers(ALICE, d), peers(BOB, d)
    hers = keys(8, tag=5)
    for i in (0, 4):  # the second four evict the first (her quota) down to L2
        assert alice("put", keys=hers[i : i + 4], pages=[0, 1, 2, 3]) == [STORED] * 4
    assert alice("lookup", keys=hers)["prefix"] == 8
    assert bob("put", keys=keys(2, tag=6), pages=[0, 1]) == [STORED] * 2

    seen = bob("daemon_stats")
    assert seen["tiers"] == {"L1_HOST": [2 * BLOCK, 2], "L2_DISK": [0, 0]}
    assert not [name for name in seen["counters"] if "alice" in name]
    assert seen["counters"].get("lookup_hits", 0) == 0
    assert alice("daemon_stats")["counters"] == {'quota_evictions{tenant="alice",tier="L1"}': 4}
    assert seen["gauges"].get("blocks", 0) == 0 and seen["gauges"].get("sessions", 0) == 0
    # An admin still sees the whole daemon.
    with d.client() as admin:
        s = admin.stats()
        l1 = next(u for u in s.tiers if u.tier == Tier.L1_HOST)
        assert (l1.used_bytes, l1.blocks) == (6 * BLOCK, 6)
        assert s.counter("lookup_hits") == 8 and s.gauges["sessions"] >= 3
        assert s.counter("quota_evictions", tenant="alice", tier="L1") == 4


PIN_LAYOUT = PoolLayout.staging(num_layers=1, num_pages=32, block_tokens=1, chunk_bytes=64 << 10)
PIN_BLOCK = 2 * (64 << 10)  # K and V of one layer


def _token_tenants(
    daemon_factory, tmp_path, *names: str, protect_s: float = 0, overrides: tuple[str, ...] = ()
):
    """A daemon with an L1 of 32 blocks of PIN_LAYOUT and tenants ``names`` known by their
    tokens (so one uid acts as each), and a client factory for each tenant."""
    tenants = []
    for name in names:
        token = tmp_path / f"{name}.token"
        token.write_text(f"a-long-enough-secret-for-tenant-{name}\n")
        token.chmod(0o600)
        tenants.append(f"{{name: {name}, token_file: {token}}}")
    d = daemon_factory(
        f"policy.protect_s={protect_s}",
        "tiers.l1.segment_bytes=1MiB",
        f"tenants=[{', '.join(tenants)}]",
        *overrides,
        l1_bytes="4MiB",
    )
    return d, lambda name: d.client(token_file=str(tmp_path / f"{name}.token"))


def test_regression_one_tenants_pins_held_every_block_and_refused_every_other_tenants_puts(
    daemon_factory, tmp_path
):
    # Regression: leases were bounded by the memory their records take (512 bytes a lease,
    # 8 a block), not by the blocks they pin: alice pinned every block she held (the whole
    # L1, lease after lease) and bob's every put was REJECTED_FULL for as long as she renewed
    # her leases. What her leases pin now counts, with what her hints protect, against
    # policy.hint_max_share of the top tier.
    d, as_tenant = _token_tenants(daemon_factory, tmp_path, "alice", "bob")
    with (
        as_tenant("alice") as alice,
        as_tenant("bob") as bob,
        d.client() as admin,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as hers,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as his,
    ):
        registered = alice.register_pool(hers, PIN_LAYOUT)
        pool = registered.binding.pool_id
        held = keys(32, tag=20)  # 4 MiB: all of L1
        assert alice.put(pool, held, range(32)).stored == 32
        with pytest.raises(ResourceExhaustedError, match=r"policy\.hint_max_share"):
            alice.lookup(held, pin=True, lease_ms=600_000)
        leases = []
        for i in range(0, 32, 4):  # as much as she may, four blocks a lease
            try:
                leases.append(alice.lookup(held[i : i + 4], pin=True, lease_ms=600_000).lease_id)
            except ResourceExhaustedError:
                break
        assert len(leases) * 4 * PIN_BLOCK == 2 << 20  # half of L1 (the default share)
        assert admin.stats().gauges["blocks_pinned"] == len(leases) * 4
        # Her pins at the budget, a load (pin, then get) loads unpinned rather than nothing.
        assert registered.load_keys(held[16:24], range(24, 32)) == 8
        assert admin.stats().gauges["blocks_pinned"] == len(leases) * 4

        mine = bob.register_pool(his, PIN_LAYOUT).binding.pool_id
        assert bob.put(mine, keys(16, tag=21), range(16)).stored == 16  # her unpinned half went
        assert alice.lookup(held).prefix_len == 16  # her pinned half stayed
        for lease in leases:
            alice.release(lease)
        assert alice.lookup(held[16:], pin=True).lease_id == 0  # evicted: nothing to pin
        assert admin.stats().gauges["blocks_pinned"] == 0
        assert admin.check().problems == []


def test_regression_a_tenant_reading_its_blocks_held_the_whole_top_tier(daemon_factory, tmp_path):
    # Regression: a block read or written within policy.protect_s was never evicted, and
    # every read renews that, a lookup's too: alice looked her blocks up once a second and
    # bob's every put was REJECTED_FULL (no tier below), with no pin or hint to bound. A put
    # with nowhere else to go now evicts other tenants' protected blocks. Her blocks stay
    # protected for the whole test (a long protect_s), as her lookups kept them.
    d, as_tenant = _token_tenants(daemon_factory, tmp_path, "alice", "bob", protect_s=600)
    with (
        as_tenant("alice") as alice,
        as_tenant("bob") as bob,
        d.client() as admin,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as hers,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as his,
    ):
        pool = alice.register_pool(hers, PIN_LAYOUT).binding.pool_id
        held = keys(32, tag=24)
        assert alice.put(pool, held, range(32)).stored == 32  # all of L1
        assert alice.lookup(held).prefix_len == 32
        # Protection still holds within a tenant: her own blocks are not made room of.
        assert alice.put(pool, keys(8, tag=25), range(8)).stored == 0

        mine = bob.register_pool(his, PIN_LAYOUT).binding.pool_id
        assert bob.put(mine, keys(16, tag=26), range(16)).stored == 16
        tiers = alice.lookup(held).tiers
        assert sum(t != Tier.ABSENT for t in tiers) == 16
        assert admin.check().problems == []


@pytest.mark.parametrize(("put", "stored", "kept"), [(8, 8, 20), (20, 18, 10)])
def test_a_put_with_nowhere_else_to_go_displaces_only_tenants_over_their_share(
    daemon_factory, tmp_path, put, stored, kept
):
    # A put with no lower tier evicts other tenants' protected blocks only where they hold
    # more than an equal share of the tier among the tenants holding blocks there: carol,
    # who filled most of L1, loses protected blocks to bob's put; alice, within her share,
    # keeps hers, though they are the coldest (written first). Regression (the second
    # case): the shares were weighed once a round, not per victim, so a put of 20 took
    # all 20 from carol (28 of L1's 32 blocks against a share of 32/3), who kept 8, below
    # her share. She loses protected blocks only while she holds more than it: 18, keeping 10.
    d, as_tenant = _token_tenants(daemon_factory, tmp_path, "alice", "bob", "carol", protect_s=600)
    with (
        as_tenant("alice") as alice,
        as_tenant("bob") as bob,
        as_tenant("carol") as carol,
        d.client() as admin,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as hers,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as his,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as theirs,
    ):
        a = alice.register_pool(hers, PIN_LAYOUT).binding.pool_id
        small = keys(4, tag=27)
        assert alice.put(a, small, range(4)).stored == 4
        c = carol.register_pool(theirs, PIN_LAYOUT).binding.pool_id
        big = keys(28, tag=28)
        assert carol.put(c, big, range(28)).stored == 28  # L1 is full
        b = bob.register_pool(his, PIN_LAYOUT).binding.pool_id
        assert bob.put(b, keys(put, tag=29), range(put)).stored == stored
        assert all(t != Tier.ABSENT for t in alice.lookup(small).tiers)
        assert sum(t != Tier.ABSENT for t in carol.lookup(big).tiers) == kept
        # Each of her blocks that went was protected: counted, with her name.
        stats = admin.stats()
        assert stats.counter("displaced_evictions", tenant="carol", tier="L1") == 28 - kept
        assert stats.counter("displaced_evictions", tenant="alice", tier="L1") == 0
        assert admin.check().problems == []


def test_a_put_with_nowhere_else_to_go_displaces_no_pinned_or_hinted_block(
    daemon_factory, tmp_path
):
    # Displacement lifts protection periods only: carol's coldest blocks, pinned by a lease
    # or named by a live Prefetch deadline, stay; bob's put takes her other blocks over her
    # share (18 of 20) instead.
    d, as_tenant = _token_tenants(daemon_factory, tmp_path, "alice", "bob", "carol", protect_s=600)
    with (
        as_tenant("alice") as alice,
        as_tenant("bob") as bob,
        as_tenant("carol") as carol,
        d.client() as admin,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as hers,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as his,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as theirs,
    ):
        a = alice.register_pool(hers, PIN_LAYOUT).binding.pool_id
        assert alice.put(a, keys(4, tag=33), range(4)).stored == 4
        c = carol.register_pool(theirs, PIN_LAYOUT).binding.pool_id
        big = keys(28, tag=34)
        assert carol.put(c, big, range(28)).stored == 28  # L1 is full
        carol.lookup(big[:4], pin=True, lease_ms=600_000)
        carol.prefetch(big[4:8], deadline_ms=600_000)
        b = bob.register_pool(his, PIN_LAYOUT).binding.pool_id
        assert bob.put(b, keys(20, tag=35), range(20)).stored == 18
        held = [t != Tier.ABSENT for t in carol.lookup(big).tiers]
        assert held[:8] == [True] * 8 and sum(held) == 10
        assert admin.check().problems == []


def test_a_put_into_a_shared_namespace_displaces_its_tenants_own_blocks_over_their_share(
    daemon_factory, tmp_path
):
    # A shared namespace's blocks are an owner of their own in the shares a displacing put
    # weighs: alice's put there takes her own protected blocks over her share (16 of 32),
    # as another tenant's put would; her put into her own namespace takes none.
    d, as_tenant = _token_tenants(
        daemon_factory,
        tmp_path,
        "alice",
        "bob",
        protect_s=600,
        overrides=("shared_namespaces=[{name: team, tenants: [alice, bob]}]",),
    )
    with (
        as_tenant("alice") as alice,
        d.client() as admin,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as hers,
    ):
        a = alice.register_pool(hers, PIN_LAYOUT).binding.pool_id
        own = keys(28, tag=36)
        assert alice.put(a, own, range(28)).stored == 28
        assert alice.put(a, keys(4, tag=37), range(4)).stored == 4  # L1 is full
        assert alice.put(a, keys(4, tag=38), range(4)).stored == 0
        assert alice.put(a, keys(8, tag=39), range(8), namespace="shared:team").stored == 8
        assert sum(t != Tier.ABSENT for t in alice.lookup(own).tiers) == 20
        assert admin.check().problems == []


def test_regression_a_tenants_pins_and_hints_together_held_the_whole_top_tier(
    daemon_factory, tmp_path
):
    # Regression (of a pin budget apart from the hint budget, half of the top tier each):
    # alice pinned half of L1 and hinted the other half, and bob's puts were REJECTED_FULL
    # (no tier below). Pins and hints share one budget, a block counted once.
    d, as_tenant = _token_tenants(daemon_factory, tmp_path, "alice", "bob")
    with (
        as_tenant("alice") as alice,
        as_tenant("bob") as bob,
        d.client() as admin,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as hers,
        SharedMemoryPool.for_layout(PIN_LAYOUT) as his,
    ):
        pool = alice.register_pool(hers, PIN_LAYOUT).binding.pool_id
        held = keys(32, tag=22)
        assert alice.put(pool, held, range(32)).stored == 32
        lease = alice.lookup(held[:16], pin=True, lease_ms=600_000).lease_id
        assert lease
        alice.prefetch(held[16:], deadline_ms=60_000)  # her share is taken: protects nothing
        assert admin.stats().counter("hints_over_budget_blocks") == 16
        mine = bob.register_pool(his, PIN_LAYOUT).binding.pool_id
        assert bob.put(mine, keys(8, tag=23), range(8)).stored == 8

        # The other way round: what her hints protect leaves her pins no room but on the
        # hinted blocks themselves, which cost nothing more.
        alice.release(lease)
        assert alice.prefetch(held[:16], deadline_ms=60_000).resident == 16
        assert admin.stats().counter("hinted_blocks") == 16
        again = alice.lookup(held[:16], pin=True).lease_id
        assert again
        tiers = alice.lookup(held[16:]).tiers
        rest = [k for k, t in zip(held[16:], tiers, strict=True) if t != Tier.ABSENT]
        assert len(rest) == 8  # bob's puts took the other eight
        with pytest.raises(ResourceExhaustedError, match=r"hints and pins"):
            alice.lookup(rest[:1], pin=True)
        alice.release(again)
        assert admin.stats().gauges["blocks_pinned"] == 0
        assert admin.check().problems == []
