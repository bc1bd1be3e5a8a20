"""The session and pool an RPC's log lines name (daemon/observe.py)."""

from __future__ import annotations

from kvtier.daemon.observe import _ids
from kvtier.proto import kvtier_pb2 as pb


class _Counted:
    """A request type without a pool_id field that counts the reads of fields it lacks."""

    misses = 0

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def __getattr__(self, name: str) -> object:
        type(self).misses += 1
        raise AttributeError(name)


def test_regression_a_request_without_a_pool_raised_an_attribute_error_at_every_call():
    """A Lookup names no pool (a health Check neither a session): reading the missing field
    raised and caught an AttributeError on every call, which cost more than the rest of the
    call's observation. Which fields a type has is now found out once per type."""
    fields: dict[type, tuple[bool, bool]] = {}
    for _ in range(3):
        assert _ids(_Counted("0123456789abcdef"), fields) == ("01234567", 0)
    assert _Counted.misses == 1
    assert _ids(pb.LookupRequest(session_id="s" * 20), fields) == ("s" * 8, 0)
    assert _ids(pb.GetRequest(session_id="abc", pool_id=7), fields) == ("abc", 7)
    assert _ids(pb.GetRequest(), fields) == ("", 0)
