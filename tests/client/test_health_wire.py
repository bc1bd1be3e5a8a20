"""The client's hand-encoded health check speaks the standard messages byte for byte."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2

from kvtier.client import health as hc


@pytest.mark.parametrize("service", ["", "kvtier.v1.KVTier", "x" * 300])
def test_requests_match_the_standard_encoding(service):
    expected = health_pb2.HealthCheckRequest(service=service).SerializeToString()
    assert hc.encode_request(service) == expected
    assert health_pb2.HealthCheckRequest.FromString(hc.encode_request(service)).service == service


@pytest.mark.parametrize("status", [0, 1, 2, 3])
def test_responses_decode_as_the_standard_does(status):
    data = health_pb2.HealthCheckResponse(status=status).SerializeToString()
    assert hc.decode_response(data) == status


def test_unknown_fields_are_skipped_and_garbage_refused():
    # field 2 varint, field 3 bytes, field 4 fixed32, then status SERVING
    data = b"\x10\x05" + b"\x1a\x02ab" + b"\x25\x00\x00\x00\x00" + b"\x08\x01"
    assert hc.decode_response(data) == hc.SERVING
    for bad in (b"\x08", b"\x1a\x05ab", b"\x0f"):
        with pytest.raises(ValueError):
            hc.decode_response(bad)


def test_the_daemon_answers_the_client_health_check(daemon):
    with daemon.client() as client:
        assert client.health() is True
        assert client.health("kvtier.v1.KVTier") is True
