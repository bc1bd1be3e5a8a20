"""The standard gRPC health check (``grpc.health.v1.Health/Check``), spoken without the
grpcio-health-checking package, so that installing the client pulls grpcio, protobuf and
numpy only. Both messages have one field (``string service = 1`` and ``ServingStatus status =
1``), encoded here in protobuf's wire format; the daemon serves the real service.
"""

from __future__ import annotations

from kvtier.client.errors import InvalidArgumentError

CHECK_METHOD = "/grpc.health.v1.Health/Check"
# grpc.health.v1.HealthCheckResponse.ServingStatus
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint in a health check response")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def encode_request(service: str) -> bytes:
    """A HealthCheckRequest: field 1 (length-delimited) unless empty (proto3 default)."""
    if not isinstance(service, str):
        raise InvalidArgumentError(f"Health: service: expected str, not {type(service).__name__}")
    try:
        raw = service.encode()
    except UnicodeEncodeError as e:  # a lone surrogate: protobuf refuses it in any str field
        raise InvalidArgumentError(
            f"Health: service: not encodable as UTF-8 ({e.reason})"
        ) from None
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def decode_response(data: bytes) -> int:
    """The ``status`` of a HealthCheckResponse; unknown fields are skipped."""
    status = UNKNOWN
    i = 0
    while i < len(data):
        tag, i = _read_varint(data, i)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = _read_varint(data, i)
            if field == 1:
                status = value
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, i = _read_varint(data, i)
            i += length
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {wire} in a health check response")
    if i != len(data):
        raise ValueError("truncated health check response")
    return status
