"""The daemon's error hierarchy. Each class maps to exactly one gRPC status, applied in one
place (the servicer). Expected pressure (a full tier, an absent block) is never an error; it
is a return value."""

from __future__ import annotations

import grpc


class KvtierError(Exception):
    """Base: a request the daemon refuses; the daemon's state is unchanged."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KvtierError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvtierError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(KvtierError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(KvtierError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KvtierError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvtierError):
    code = grpc.StatusCode.UNAVAILABLE


class ConfigError(ValueError):
    """A config file or override that the daemon cannot start with; names the key."""
