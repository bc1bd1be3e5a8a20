"""Client sessions and the leases they hold.

A session lives exactly as long as the client's OpenSession stream; pools and leases belong
to one session and die with it, so a crashed engine never leaves pins or mappings behind. A
lease pins a set of blocks until it is released, its session ends, or it expires.

Thread-safety: none; owned by the server's event loop.
"""

from __future__ import annotations

import heapq
import secrets
from dataclasses import dataclass, field

import numpy as np

from kvtier.daemon.errors import NotFound, PermissionDenied


@dataclass(eq=False, slots=True)
class Lease:
    lease_id: int
    session_id: str
    refs: np.ndarray  # the pinned blocks, as block-table refs
    expires_at: float


@dataclass(eq=False, slots=True)
class Session:
    session_id: str
    client_name: str
    opened_at: float
    leases: set[int] = field(default_factory=set)


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def open(self, client_name: str, now: float) -> Session:
        session = Session(secrets.token_hex(16), client_name, now)
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        if not session_id:
            raise NotFound("this request needs a session; open one with OpenSession")
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id} is not open (it ended or never existed)")
        return session

    def close(self, session_id: str) -> list[Lease]:
        """End a session; returns its leases, which the caller unpins."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return []
        return [self._leases.pop(lid) for lid in session.leases]

    def add_lease(self, session_id: str, refs: np.ndarray, expires_at: float) -> Lease:
        session = self.get(session_id)
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = Lease(lease_id, session_id, refs, expires_at)
        self._leases[lease_id] = lease
        session.leases.add(lease_id)
        heapq.heappush(self._expiry, (expires_at, lease_id))
        return lease

    def lease_owner(self, lease_id: int) -> str | None:
        lease = self._leases.get(lease_id)
        return lease.session_id if lease else None

    def pop_lease(self, session_id: str, lease_id: int) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} does not exist (released, expired or never taken)")
        if lease.session_id != session_id:
            raise PermissionDenied(f"lease {lease_id} belongs to another session")
        del self._leases[lease_id]
        self._sessions[session_id].leases.discard(lease_id)
        return lease

    def pop_expired(self, now: float) -> list[Lease]:
        expired = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._sessions[lease.session_id].leases.discard(lease_id)
                expired.append(lease)
        return expired
