"""Property-based fuzzing of the real gRPC server (issue 9, item 10).

Hypothesis draws sequences of requests, valid and not: random and known keys of every
length, page indices up to 2**32-1 and negative ones (varints the client library would never
send), interleaved pool registrations and unregistrations, leases and sessions of the other
tenant, namespaces and tenants that are not the caller's, admin calls from a non-admin, raw
bytes that are no message at all, and calls cancelled as soon as they are sent. They go
through one daemon (two tenants, L1 and L2) over its real socket. After each sequence: the
daemon is alive, every call was answered with a status (never UNKNOWN or INTERNAL, and none
timed out), and the daemon's invariant check finds nothing broken.

The run is bounded and reproducible: a fixed number of sequences, derandomized, no example
database; ``KVTIER_FUZZ_EXAMPLES`` raises the count and ``KVTIER_FUZZ_SEED`` draws other
sequences, for a longer hunt.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from peer_client import TicketPeer
from peers import NOBODY, NOGROUP, require_root

from kvtier.client import PoolLayout, SharedMemoryPool
from kvtier.client import credentials as cred
from kvtier.client.types import layout_to_pb
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "200"))
SEED = os.environ.get("KVTIER_FUZZ_SEED")
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=16, block_tokens=4, chunk_bytes=4096)
KNOWN_KEYS = [bytes([i]) * 32 for i in range(8)]
MAX_BATCH = 64
C = grpc.StatusCode
# Statuses that would mean a bug or a hang; CANCELLED is expected of cancelled calls only.
NEVER = {C.UNKNOWN, C.INTERNAL, C.DEADLINE_EXCEEDED}
TOTALS: Counter[str] = Counter()
BY_METHOD: Counter[str] = Counter()


@dataclass
class Env:
    d: Any
    channel: grpc.Channel
    stub: pb_grpc.KVTierStub
    cred_path: str
    shm: SharedMemoryPool
    sessions: dict[str, str] = field(default_factory=dict)
    pools: dict[str, int] = field(default_factory=dict)
    leases: list[int] = field(default_factory=list)
    streams: dict[str, Any] = field(default_factory=dict)
    bob: TicketPeer | None = None

    def open(self, name: str) -> None:
        """(Re)open the session ``name``: alice's are root's, bob's nobody's."""
        if name in self.streams:
            self.streams[name].cancel()
        assert self.bob is not None
        ticket = self.bob.session_ticket() if name == "bob" else cred.session_ticket(self.cred_path)
        stream = self.stub.OpenSession(
            pb.OpenSessionRequest(client_name=name, credential_ticket=ticket)
        )
        self.streams[name] = stream
        self.sessions[name] = next(stream).session_id


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require_root()
    from harness import DaemonFactory

    tmp = tmp_path_factory.mktemp("fuzz")
    factory = DaemonFactory(tmp)
    os.chmod(factory._sockdir, 0o711)
    d = factory(
        "server.socket_mode=0666",
        f"server.max_batch_blocks={MAX_BATCH}",
        "server.max_pools_per_session=8",
        "policy.protect_s=0.05",
        "tiers.l1.segment_bytes=1MiB",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={tmp / 'l2'}",
        "tiers.l2.capacity_bytes=8MiB",
        "tiers.l2.segment_bytes=1MiB",
        "tiers.l2.file_bytes=8MiB",
        f"tenants=[{{name: alice, uids: [0], admin: true}}, {{name: bob, uids: [{NOBODY}]}}]",
        "shared_namespaces=[{name: common, tenants: [alice, bob]}]",
        l1_bytes="2MiB",
    )
    channel = grpc.insecure_channel(d.address)
    shm = SharedMemoryPool.for_layout(LAYOUT)
    e = Env(d, channel, pb_grpc.KVTierStub(channel), cred.cred_socket_path(d.address) or "", shm)
    e.bob = TicketPeer(e.cred_path, NOBODY, NOGROUP)
    for name in ("alice", "alice2", "bob"):
        e.open(name)
    e.pools["alice"] = _register(e, e.sessions["alice"], cred.pool_ticket(e.cred_path, shm.fd))
    e.pools["bob"] = _register(e, e.sessions["bob"], _bob_pool(e))
    yield e
    for stream in e.streams.values():
        stream.cancel()
    channel.close()
    shm.close()
    e.bob.close()
    factory.close()
    print(f"\nfuzz: {dict(sorted(TOTALS.items()))}")
    print(f"fuzz by method: {dict(sorted(BY_METHOD.items()))}")


def _bob_pool(e: Env) -> bytes:
    """A pool ticket for memory that bob's uid made and handed over itself."""
    assert e.bob is not None
    return e.bob.pool_ticket(LAYOUT.extent_bytes)


def _register(e: Env, session: str, ticket: bytes) -> int:
    req = pb.RegisterPoolRequest(
        session_id=session,
        fd=pb.FdRegion(ticket=ticket, size_bytes=LAYOUT.extent_bytes),
        layout=layout_to_pb(LAYOUT),
    )
    return int(e.stub.RegisterPool(req, timeout=10).pool_id)


# ------------------------------------------------------------------ strategies


def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], odds: int = 4) -> Any:
    """``common`` ``odds`` times in ``odds + 1``, else ``rare``."""
    return st.integers(0, odds).flatmap(lambda n: common if n < odds else rare)


# Mostly valid sessions and keys, so that requests get past the first checks and reach the
# store; the rest is another tenant's, unknown, empty or garbage.
sessions = st.sampled_from(["alice"] * 5 + ["alice2", "bob", "bob", "unknown", "empty", "garbage"])
main_pools = st.sampled_from(["alice"] * 4 + ["bob", "latest"])
pools = mostly(main_pools, st.integers(0, 2**64 - 1).map(str))
key = mostly(st.sampled_from(KNOWN_KEYS), st.binary(max_size=40))
keys = mostly(
    st.lists(st.sampled_from(KNOWN_KEYS), min_size=1, max_size=6),
    st.one_of(
        st.lists(key, max_size=6),
        st.lists(st.sampled_from(KNOWN_KEYS), min_size=MAX_BATCH - 1, max_size=MAX_BATCH + 3),
    ),
)
lease_ms = mostly(st.integers(0, 5000), st.integers(0, 2**32 - 1))
page = mostly(st.integers(0, LAYOUT.num_pages - 1), st.integers(LAYOUT.num_pages, 2**32 - 1))
namespaces = st.one_of(
    st.sampled_from(
        ["", "", "", "m", "shared:common", "shared:common/x", "shared:nope", "shared:"]
    ),
    st.text(max_size=8),
    st.just("n" * 300),
)
parent_keys = mostly(st.sampled_from([b"", b"", *KNOWN_KEYS]), st.binary(max_size=40))
evict_tiers = mostly(st.sampled_from([2, 3]), st.integers(0, 7))
tenants = mostly(st.just(""), st.sampled_from(["alice", "bob", "nobody", "bad name!"]))
leases = mostly(st.sampled_from(["last", "first", "none"]), st.integers(0, 2**64 - 1))


@st.composite
def keys_and_pages(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """Keys with as many pages (mostly), or any two lists."""
    ks = draw(keys)
    if draw(st.integers(0, 3)) == 0:
        return ks, draw(st.lists(page, max_size=8))
    return ks, draw(st.lists(page, min_size=len(ks), max_size=len(ks)))


good_namespaces = st.sampled_from(["", "m", "shared:common"])


@st.composite
def good_block_op(draw: st.DrawFn, kind: str) -> tuple[Any, ...]:
    """A well-formed Put, Get or pinning Lookup of a session on its own pool, so that the
    store sees real traffic between the malformed requests."""
    who = draw(st.sampled_from(["alice", "bob"]))
    ks = draw(st.lists(st.sampled_from(KNOWN_KEYS), min_size=1, max_size=6))
    pages = draw(
        st.lists(
            st.integers(0, LAYOUT.num_pages - 1), min_size=len(ks), max_size=len(ks), unique=True
        )
    )
    ns = draw(good_namespaces)
    if kind == "Put":
        return ("Put", who, who, (ks, pages), b"", ns, draw(st.booleans()))
    if kind == "Get":
        return ("Get", who, who, (ks, pages), draw(st.sampled_from(["last", "none"])), ns)
    return ("Lookup", who, ks, True, 0, ns)


ops = st.one_of(
    good_block_op("Put"),
    good_block_op("Put"),
    good_block_op("Get"),
    good_block_op("Lookup"),
    st.tuples(
        st.just("Lookup"), sessions, keys, st.booleans(), st.integers(0, 2**32 - 1), namespaces
    ),
    st.tuples(
        st.just("Put"),
        sessions,
        pools,
        keys_and_pages(),
        st.binary(max_size=40),
        namespaces,
        st.booleans(),
    ),
    st.tuples(st.just("Get"), sessions, pools, keys_and_pages(), leases, namespaces),
    st.tuples(st.just("Release"), sessions, leases),
    st.tuples(
        st.just("Prefetch"),
        sessions,
        keys,
        st.integers(0, 2**32 - 1),
        st.integers(-(2**31), 2**31 - 1),
        namespaces,
    ),
    st.tuples(st.just("Delete"), sessions, keys, namespaces, tenants),
    st.tuples(st.just("Evict"), sessions, keys, evict_tiers, namespaces, tenants),
    st.tuples(st.just("RegisterPool"), sessions, st.sampled_from(["memfd", "bad-ticket", "shm"])),
    st.tuples(st.just("UnregisterPool"), sessions, pools),
    st.tuples(st.just("Stats"), sessions),
    st.tuples(st.just("Check"), sessions),
    st.tuples(st.just("Drain"), sessions),
    st.tuples(
        st.just("Garbage"),
        st.sampled_from(["Lookup", "Put", "Get", "Delete", "Evict", "Check", "OpenSession"]),
        st.binary(max_size=64),
    ),
    st.tuples(st.just("NegativePages"), sessions, st.sampled_from(["Put", "Get"])),
    # A session ends (its client went away) and comes back, whatever it had in flight.
    st.tuples(st.just("Reopen"), st.sampled_from(["alice2", "bob", "alice"])),
)
# One call in eight is cancelled as soon as it is sent.
cancels = st.integers(0, 7).map(lambda n: n == 7)


# ------------------------------------------------------------------- running


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class Runner:
    def __init__(self, e: Env) -> None:
        self.e = e
        self.latest_pool = e.pools["alice"]

    def session(self, name: str) -> str:
        return {"unknown": "0" * 32, "empty": "", "garbage": "\x00zz" * 20}.get(
            name, self.e.sessions.get(name, "")
        )

    def pool(self, name: str) -> int:
        if name == "latest":
            return self.latest_pool
        return self.e.pools[name] if name in self.e.pools else int(name)

    def lease(self, which: Any) -> int:
        if which == "none" or not self.e.leases:
            return 0 if which in ("none", "last", "first") else int(which)
        if which == "last":
            return self.e.leases[-1]
        if which == "first":
            return self.e.leases[0]
        return int(which)

    def request(self, op: tuple[Any, ...]) -> tuple[str, Any]:
        """(method, request message or raw bytes)."""
        kind = op[0]
        s = self.session(op[1]) if kind != "Garbage" else ""
        if kind == "Lookup":
            return kind, pb.LookupRequest(
                session_id=s, keys=op[2], pin=op[3], lease_ms=op[4], namespace=op[5]
            )
        if kind == "Put":
            return kind, pb.PutRequest(
                session_id=s,
                pool_id=self.pool(op[2]),
                keys=op[3][0],
                pages=op[3][1],
                parent_key=op[4],
                namespace=op[5],
                durable=op[6],
            )
        if kind == "Get":
            return kind, pb.GetRequest(
                session_id=s,
                pool_id=self.pool(op[2]),
                keys=op[3][0],
                pages=op[3][1],
                lease_id=self.lease(op[4]),
                namespace=op[5],
            )
        if kind == "Release":
            return kind, pb.ReleaseRequest(session_id=s, lease_id=self.lease(op[2]))
        if kind == "Prefetch":
            return kind, pb.PrefetchRequest(
                session_id=s, keys=op[2], deadline_ms=op[3], priority=op[4], namespace=op[5]
            )
        if kind == "Delete":
            return kind, pb.DeleteRequest(session_id=s, keys=op[2], namespace=op[3], tenant=op[4])
        if kind == "Evict":
            return kind, pb.EvictRequest(
                session_id=s, keys=op[2], tier=op[3], namespace=op[4], tenant=op[5]
            )
        if kind == "RegisterPool":
            layout = layout_to_pb(LAYOUT)
            if op[2] == "memfd":
                ticket = cred.pool_ticket(self.e.cred_path, self.e.shm.fd)
                region = {"fd": pb.FdRegion(ticket=ticket, size_bytes=LAYOUT.extent_bytes)}
            elif op[2] == "bad-ticket":
                region = {"fd": pb.FdRegion(ticket=os.urandom(32), size_bytes=1)}
            else:
                region = {"shm": pb.ShmRegion(name="kvtier-fuzz-absent", size_bytes=4096)}
            return kind, pb.RegisterPoolRequest(session_id=s, layout=layout, **region)
        if kind == "UnregisterPool":
            return kind, pb.UnregisterPoolRequest(session_id=s, pool_id=self.pool(op[2]))
        if kind == "Stats":
            return kind, pb.StatsRequest(session_id=s)
        if kind == "Check":
            return kind, pb.CheckRequest(session_id=s)
        if kind == "Drain":
            return kind, pb.DrainRequest(session_id=s)
        if kind == "Garbage":
            return op[1], op[2]
        if kind == "NegativePages":
            method = op[2]
            cls = pb.PutRequest if method == "Put" else pb.GetRequest
            body = cls(
                session_id=s, pool_id=self.e.pools["alice"], keys=KNOWN_KEYS[:2]
            ).SerializeToString()
            # Field 4 (pages), unpacked, as 64-bit varints the client library cannot send.
            for value in (-1, -(2**31), 2**40):
                body += _varint(4 << 3) + _varint(value)
            return method, body
        raise AssertionError(kind)

    def call(self, method: str, request: Any, cancel: bool) -> None:
        raw = isinstance(request, bytes)
        fn = self.e.channel.unary_unary(
            f"/kvtier.v1.KVTier/{method}",
            request_serializer=None if raw else type(request).SerializeToString,
            response_deserializer=None,
        )
        if method == "OpenSession":  # a stream: read its first answer, then end it
            fn = self.e.channel.unary_stream(f"/kvtier.v1.KVTier/{method}")
            stream = fn(request if raw else request.SerializeToString(), timeout=10)
            try:
                next(stream)
                TOTALS["ok"] += 1
            except grpc.RpcError as err:
                self.status(err.code(), False, method)
            finally:
                stream.cancel()
            return
        try:
            if cancel:
                future = fn.future(request, timeout=10)
                future.cancel()
                try:
                    reply = future.result()
                except grpc.FutureCancelledError:
                    TOTALS["cancelled"] += 1
                    return
            else:
                reply = fn(request, timeout=10)
        except grpc.RpcError as err:
            self.status(err.code(), cancel, method)
            return
        TOTALS["ok"] += 1
        BY_METHOD[f"{method} OK"] += 1
        self.after(method, reply)

    def restore_pools(self) -> None:
        """Register the main pools again where a sequence unregistered them (a cancelled
        UnregisterPool may have run unseen), so that later sequences still reach the store."""
        for who in ("alice", "bob"):
            probe = pb.PutRequest(session_id=self.e.sessions[who], pool_id=self.e.pools[who])
            try:
                self.e.stub.Put(probe, timeout=10)  # no keys: refused after the pool check
            except grpc.RpcError as err:
                if err.code() != C.NOT_FOUND:
                    continue
            ticket = (
                cred.pool_ticket(self.e.cred_path, self.e.shm.fd)
                if who == "alice"
                else _bob_pool(self.e)
            )
            self.e.pools[who] = _register(self.e, self.e.sessions[who], ticket)

    def status(self, code: C, cancel: bool, method: str = "") -> None:
        assert code not in NEVER, (method, code)
        assert code != C.CANCELLED or cancel, (method, code)
        TOTALS[code.name] += 1
        BY_METHOD[f"{method} {code.name}"] += 1

    def after(self, method: str, reply: bytes) -> None:
        if method == "Lookup":
            lease = pb.LookupResponse.FromString(reply).lease_id
            if lease:
                self.e.leases.append(lease)
        elif method == "RegisterPool":
            self.latest_pool = pb.RegisterPoolResponse.FromString(reply).pool_id
        elif method == "UnregisterPool":
            self.restore_pools()
        elif method == "Drain":
            # An admin drained: take sessions again, so the next sequences can open some.
            self.e.stub.Drain(
                pb.DrainRequest(session_id=self.e.sessions["alice"], resume=True), timeout=10
            )


def test_random_and_malformed_request_sequences_never_break_the_daemon(env):
    runner = Runner(env)

    @seed(int(SEED or 0))
    @settings(
        max_examples=EXAMPLES,
        derandomize=SEED is None,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(st.tuples(ops, cancels), min_size=1, max_size=12))
    def run(sequence: list[tuple[tuple[Any, ...], bool]]) -> None:
        for op, cancel in sequence:
            if op[0] == "Reopen":
                # A Drain cancelled unseen would refuse bob's new session: resume first.
                env.stub.Drain(
                    pb.DrainRequest(session_id=env.sessions["alice"], resume=True), timeout=10
                )
                env.open(op[1])
                runner.restore_pools()
                TOTALS["reopened"] += 1
                continue
            method, request = runner.request(op)
            runner.call(method, request, cancel and op[0] != "Garbage")
            TOTALS["calls"] += 1
        TOTALS["sequences"] += 1
        assert env.d.running(), env.d.log()[-3000:]
        # A cancelled Drain or UnregisterPool may have run unseen: undo them.
        env.stub.Drain(pb.DrainRequest(session_id=env.sessions["alice"], resume=True), timeout=10)
        runner.restore_pools()
        report = env.stub.Check(
            pb.CheckRequest(session_id=env.sessions["alice"], settle_ms=2000), timeout=30
        )
        TOTALS["strict_checks" if report.strict else "loose_checks"] += 1
        assert list(report.problems) == [], list(report.problems)

    run()
    assert TOTALS["sequences"] >= EXAMPLES and TOTALS["calls"] >= EXAMPLES
    assert env.d.running()
    assert "Traceback" not in env.d.log()
