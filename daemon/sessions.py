"""Client sessions, who they are, and the leases they hold.

A session lives exactly as long as the client's OpenSession stream (or until the same
process opens another that names it, or the credential ticket that opened it, as given up,
see ``KVService.end_given_up``); pools and
leases belong to one session and die with it, so a crashed engine never leaves pins or
mappings behind. A lease pins a set of blocks until it is released, its session ends, or it
expires.

A session carries its peer's credentials (pid, uid, gid), read by the kernel (SO_PEERCRED)
when the client asked for its credential ticket (none over TCP), the tenant it is bound to
(``daemon/tenants.py`` decides which), whether it may use admin calls, and the namespaces
it has stored blocks in. Each tenant may hold at most ``max_per_tenant`` sessions at once,
counted by the binding's ``limit_key``.

A lease belongs to the session that took it and dies with it, and only that session may
release it; any session of the same tenant may load under it (an engine's scheduler pins,
its workers load), another tenant's session may not. What a tenant's live leases hold in the
daemon's memory (``lease_bytes``: ``LEASE_BYTES`` a lease plus 8 bytes a pinned block) is
kept per ``limit_key``, for the limit the service enforces.

Thread-safety: none; owned by the server's event loop.
"""

from __future__ import annotations

import heapq
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvtier.daemon.errors import NotFound, PermissionDenied, ResourceExhausted, SessionGone
from kvtier.daemon.loops import InTurns
from kvtier.daemon.stats import Counters
from kvtier.tiers.sizes import counted

_SESSION_ID = re.compile(r"[0-9a-f]{32}")
# A session id is the session's secret: any request that names it acts as the session, from
# any connection. Logs show only this many characters of it.
SHOWN_ID_CHARS = 8


# What one lease holds in the daemon's memory besides its refs (8 bytes a pinned block): the
# Lease, its refs array's header, its entries in the lease table, its session's set and the
# expiry heap: about 450 bytes with a one-block refs array (tracemalloc), rounded up.
LEASE_BYTES = 512


# The live leases one step of the event loop adds to a new expiry heap while the heap is rebuilt
# without its released leases' entries (``SessionRegistry._compact_expiry``), a turn between
# slices; the old heap's entries are dropped as many a turn after. The rebuild took one step: 29
# ms of the loop's CPU time at 131,072 live leases (what one tenant's
# server.max_lease_bytes_per_tenant allows), every other client's calls waiting; in slices the
# longest step is 12-16 ms (the last one's heapify, 8 ms, included).
COMPACT_SLICE_LEASES = 8192


def lease_bytes(blocks: int) -> int:
    """What a lease pinning ``blocks`` blocks holds in the daemon's memory."""
    return LEASE_BYTES + 8 * blocks


def shown_id(session_id: str) -> str:
    """The part of a session id that logs and messages may show."""
    return session_id[:SHOWN_ID_CHARS]


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The credentials of a client process as the kernel reported them (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


@dataclass(eq=False, slots=True)
class Lease:
    lease_id: int
    session_id: str
    refs: np.ndarray  # the pinned blocks, as block-table refs
    expires_at: float
    tenant: str = ""


@dataclass(eq=False, slots=True)
class Session:
    session_id: str
    client_name: str
    opened_at: float
    peer: PeerCred | None = None
    tenant: str = ""
    admin: bool = False
    limit_key: str = ""
    leases: set[int] = field(default_factory=set)
    token_digest: bytes = b""  # of the token that bound it, if one did (see tenants.rebind)
    # Of the credential ticket that opened it, if one did (see ``opened_by``).
    ticket_digest: bytes = b""
    # Namespaces (declared name, tenant acted for) -> (id, owner index) this session has
    # bound for its puts (``store.namespace`` ran for each once).
    bound: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    # ``bound``'s length at which the next trim runs (0: twice the namespace limit); twice
    # what the last trim kept, so binds that all stay bound rebuild it only as it doubles.
    bound_trim_at: int = 0


class SessionRegistry:
    def __init__(self, max_per_tenant: int = 1 << 30, counters: Counters | None = None) -> None:
        """``counters``: where the failures of its work in turns are counted (the store's)."""
        self.max_per_tenant = max_per_tenant
        self.counters = Counters() if counters is None else counters
        self._sessions: dict[str, Session] = {}
        self._per_tenant: Counter[str] = Counter()
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        # While the expiry heap is rebuilt (``_compact_expiry``): the live leases of the
        # moment it began, how many of them the new heap has, and the new heap, which takes
        # the leases added since too; None otherwise.
        self._rebuild: list[Lease] | None = None
        self._rebuilt_upto = 0
        self._rebuilt: list[tuple[float, int]] = []
        self._rebuilds = InTurns(self._rebuild_a_slice, "rebuilding the expiry heap", self.counters)
        # Heaps a rebuild replaced, their entries dropped a slice a turn (``_drop_a_slice``).
        self._old_heaps: list[list[tuple[float, int]]] = []
        self._drops = InTurns(self._drop_a_slice, "dropping an old expiry heap", self.counters)
        # limit_key -> bytes the live leases of its sessions hold (``lease_bytes``).
        self._lease_bytes: Counter[str] = Counter()
        # ticket_digest -> the open session that ticket opened (``opened_by``).
        self._by_ticket: dict[bytes, str] = {}

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def tenant_sessions(self, limit_key: str) -> int:
        """Open sessions counted against ``limit_key`` (a tenant, or ``uid:<n>``)."""
        return self._per_tenant[limit_key]

    def tenant_lease_bytes(self, limit_key: str) -> int:
        """Bytes the live leases of the sessions counted against ``limit_key`` hold."""
        return self._lease_bytes[limit_key]

    def per_tenant_lease_bytes(self) -> dict[str, int]:
        """The lease bytes the limit keeps, for the invariant check."""
        return dict(self._lease_bytes)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def per_tenant_counts(self) -> dict[str, int]:
        """The session counts the limit keeps, for the invariant check."""
        return dict(self._per_tenant)

    def open(
        self,
        client_name: str,
        now: float,
        peer: PeerCred | None = None,
        tenant: str = "default",
        *,
        admin: bool = False,
        limit_key: str = "",
        token_digest: bytes = b"",
        ticket_digest: bytes = b"",
    ) -> Session:
        key = limit_key or tenant
        if self._per_tenant[key] >= self.max_per_tenant:
            who = f"tenant {tenant}" if key == tenant else f"tenant {tenant} ({key})"
            raise ResourceExhausted(
                f"{who} already holds {counted(self._per_tenant[key], 'session')}, the most one "
                "tenant may hold (server.max_sessions_per_tenant)"
            )
        session = Session(
            secrets.token_hex(16),
            client_name,
            now,
            peer,
            tenant,
            admin,
            key,
            token_digest=token_digest,
            ticket_digest=ticket_digest,
        )
        self._sessions[session.session_id] = session
        self._per_tenant[key] += 1
        if ticket_digest:
            self._by_ticket[ticket_digest] = session.session_id
        return session

    def get(self, session_id: str) -> Session:
        if not session_id:
            raise SessionGone("this request needs a session; open one with OpenSession")
        session = self._sessions.get(session_id)
        if session is None:
            # Checked before it is echoed: a client's text is never repeated unbounded.
            shown = session_id if _SESSION_ID.fullmatch(session_id) else "named by session_id"
            raise SessionGone(f"session {shown} is not open (it ended or never existed)")
        return session

    def find(self, session_id: str) -> Session | None:
        """The open session ``session_id``, or None."""
        return self._sessions.get(session_id)

    def opened_by(self, ticket_digest: bytes) -> Session | None:
        """The open session that the credential ticket of ``ticket_digest`` opened, or None
        (a ticket opens one session at most: it is spent as it does)."""
        session_id = self._by_ticket.get(ticket_digest)
        return None if session_id is None else self._sessions.get(session_id)

    def limit_key_of(self, session_id: str) -> str:
        """The ``limit_key`` of open session ``session_id``; "" if none is open by that id."""
        session = self._sessions.get(session_id)
        return "" if session is None else session.limit_key

    def close(self, session_id: str) -> list[Lease]:
        """End a session; returns its leases, which the caller unpins."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return []
        self._by_ticket.pop(session.ticket_digest, None)
        self._per_tenant[session.limit_key] -= 1
        if self._per_tenant[session.limit_key] == 0:  # a negative count stays, for Check
            del self._per_tenant[session.limit_key]
        leases = [self._leases.pop(lid) for lid in session.leases]
        self._unaccount(session.limit_key, sum(lease_bytes(len(x.refs)) for x in leases))
        self._compact_expiry()
        return leases

    def add_lease(self, session_id: str, refs: np.ndarray, expires_at: float) -> Lease:
        session = self.get(session_id)
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = Lease(lease_id, session_id, refs, expires_at, session.tenant)
        self._leases[lease_id] = lease
        session.leases.add(lease_id)
        self._lease_bytes[session.limit_key] += lease_bytes(len(refs))
        heapq.heappush(self._expiry, (expires_at, lease_id))
        if self._rebuild is not None:
            self._rebuilt.append((expires_at, lease_id))
        return lease

    def lease_for(self, session_id: str, lease_id: int) -> Lease | None:
        """The live lease ``lease_id`` if a session of ``session_id``'s tenant took it; None
        when there is none (released or expired); PermissionDenied when it is another
        tenant's."""
        session = self.get(session_id)
        lease = self._leases.get(lease_id)
        if lease is not None and lease.tenant != session.tenant:
            raise PermissionDenied(f"lease {lease_id} belongs to another tenant")
        return lease

    def pop_lease(self, session_id: str, lease_id: int) -> Lease:
        """End a lease ``session_id`` took."""
        lease = self.lease_for(session_id, lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} does not exist (released, expired or never taken)")
        if lease.session_id != session_id:
            raise PermissionDenied(
                f"lease {lease_id} belongs to another session; only the one that took it may "
                "release it"
            )
        self.end_lease(lease)
        self._compact_expiry()
        return lease

    def _unaccount(self, key: str, nbytes: int) -> None:
        """Take ``nbytes`` of ended leases off what ``key``'s live leases hold."""
        self._lease_bytes[key] -= nbytes
        if self._lease_bytes[key] == 0:  # a negative count stays, for Check to report
            del self._lease_bytes[key]

    def _compact_expiry(self) -> None:
        """Released leases stay in the heap until their deadline; a client that pins and
        releases at a high rate must not grow it for lease_max_ms. Past twice the live
        leases (and 1,024), a new heap of the live leases' entries is built,
        ``COMPACT_SLICE_LEASES`` a turn of the event loop (without a running loop: at once),
        while the old one serves on; it takes the leases added meanwhile too, and replaces
        the old one when whole (a lease that ends meanwhile may leave an entry in it, as
        released leases do in any)."""
        if self._rebuild is None and len(self._expiry) > 2 * len(self._leases) + 1024:
            self._rebuild, self._rebuilt_upto, self._rebuilt = list(self._leases.values()), 0, []
            self._rebuilds.begin()

    def _rebuild_a_slice(self) -> bool:
        """Add the next ``COMPACT_SLICE_LEASES`` leases to the new heap, and swap it in once
        whole; whether more are left (``InTurns``). A slice that raises changes nothing
        (tried again, it adds the same leases)."""
        leases, rebuilt, live = self._rebuild, self._rebuilt, self._leases
        if leases is None:
            return False
        start = self._rebuilt_upto
        end = start + COMPACT_SLICE_LEASES
        rebuilt += [(x.expires_at, x.lease_id) for x in leases[start:end] if x.lease_id in live]
        self._rebuilt_upto = end
        if end < len(leases):
            return True
        heapq.heapify(rebuilt)
        self._old_heaps.append(self._expiry)
        self._expiry = rebuilt
        self._rebuild = None
        self._rebuilt = []
        self._drops.begin()
        return False

    def _drop_a_slice(self) -> bool:
        """The old heaps' entries go ``COMPACT_SLICE_LEASES`` a turn: freed at once, the
        263,169 entries of 131,072 live leases' heap took some 14 ms."""
        old = self._old_heaps
        del old[-1][-COMPACT_SLICE_LEASES:]
        if not old[-1]:
            old.pop()
        return bool(old)

    def pop_expired(self, now: float, limit: int) -> list[Lease]:
        """End and return the leases whose deadline is at or before ``now``, earliest first,
        looking at most ``limit`` expiry entries: a released lease's entry counts too, since
        the pop is the cost (the caller releases the rest in later steps, see
        ``expiry_due``)."""
        expired: list[Lease] = []
        expiry = self._expiry
        for _ in range(limit):
            if not expiry or expiry[0][0] > now:
                break
            lease = self._leases.get(heapq.heappop(expiry)[1])
            if lease is not None:
                self.end_lease(lease)
                expired.append(lease)
        return expired

    def expiry_due(self, now: float) -> bool:
        """Whether an expiry entry (of a live lease or a released one) is due at ``now``."""
        return bool(self._expiry) and self._expiry[0][0] <= now

    def due_lease(self, lease_id: int, now: float) -> Lease | None:
        """The live lease ``lease_id`` if its deadline is at or before ``now``, whoever took
        it (it is gone at its deadline: no caller may be told more of it)."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.expires_at <= now else None

    def end_lease(self, lease: Lease) -> None:
        """End the live ``lease``, whatever its session (released, or past its deadline); its
        heap entry stays until that deadline comes up (see ``_compact_expiry``)."""
        del self._leases[lease.lease_id]
        session = self._sessions[lease.session_id]
        session.leases.discard(lease.lease_id)
        self._unaccount(session.limit_key, lease_bytes(len(lease.refs)))
