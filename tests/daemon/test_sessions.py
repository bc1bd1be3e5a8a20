from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.errors import NotFound, PermissionDenied
from kvtier.daemon.sessions import SessionRegistry


def test_leases_belong_to_their_session_and_die_with_it():
    reg = SessionRegistry()
    a, b = reg.open("a", 0.0), reg.open("b", 0.0)
    lease = reg.add_lease(a.session_id, np.array([1, 2]), expires_at=10.0)
    assert reg.lease_owner(lease.lease_id) == a.session_id
    with pytest.raises(PermissionDenied):
        reg.pop_lease(b.session_id, lease.lease_id)
    dropped = reg.close(a.session_id)
    assert [x.lease_id for x in dropped] == [lease.lease_id]
    assert reg.lease_count == 0 and reg.session_count == 1
    with pytest.raises(NotFound):
        reg.get(a.session_id)
    with pytest.raises(NotFound):
        reg.add_lease(a.session_id, np.array([1]), 1.0)


def test_expiry_returns_each_lease_once_in_deadline_order():
    reg = SessionRegistry()
    s = reg.open("s", 0.0)
    late = reg.add_lease(s.session_id, np.array([1]), 5.0)
    early = reg.add_lease(s.session_id, np.array([2]), 2.0)
    released = reg.add_lease(s.session_id, np.array([3]), 1.0)
    reg.pop_lease(s.session_id, released.lease_id)
    assert reg.pop_expired(1.5) == []
    assert [x.lease_id for x in reg.pop_expired(6.0)] == [early.lease_id, late.lease_id]
    assert reg.pop_expired(7.0) == []
    with pytest.raises(NotFound):
        reg.pop_lease(s.session_id, early.lease_id)


def test_requests_without_a_session_are_told_how_to_get_one():
    with pytest.raises(NotFound, match="OpenSession"):
        SessionRegistry().get("")
