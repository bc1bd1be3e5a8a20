"""How failed calls become typed exceptions."""

from __future__ import annotations

import grpc

from kvtier.client.errors import (
    InvalidArgumentError,
    KvtierError,
    UnavailableError,
    from_rpc_error,
    unclean,
)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_regression_a_call_the_stopping_daemon_cancelled_was_a_bare_kvtier_error():
    """At SIGTERM the server's gRPC ends the calls it holds unanswered with CANCELLED; clients
    got KvtierError('CANCELLED'), which says nothing of why nor that a retry later may work."""
    err = from_rpc_error(_Failed(grpc.StatusCode.CANCELLED, "CANCELLED"))
    assert isinstance(err, UnavailableError) and "stopping" in str(err)
    assert err.code == grpc.StatusCode.CANCELLED
    assert unclean(err)  # unanswered: the daemon may still have been copying


def test_other_codes_keep_their_types():
    err = from_rpc_error(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert isinstance(err, InvalidArgumentError) and str(err) == "bad"
    assert type(from_rpc_error(_Failed(grpc.StatusCode.UNKNOWN, "?"))) is KvtierError
