"""The daemon's error hierarchy. Domain code raises these; the servicer alone maps each class to
its gRPC status (``server.STATUS``), so nothing below the server knows the transport. Expected
pressure (a full tier, an absent block) is never an error; it is a return value."""

from __future__ import annotations


class KvtierError(Exception):
    """Base: a request the daemon refuses; the daemon's state is unchanged."""


class InvalidArgument(KvtierError):
    """The request is malformed or names something impossible."""


class NotFound(KvtierError):
    """The session, pool, lease or object the request names does not exist."""


class SessionGone(NotFound):
    """The session the request names is not open (it ended, or never was); nothing of the
    request was done (see ``proto.wire.SESSION_GONE_KEY``)."""


class SessionEnded(SessionGone):
    """The daemon ended the session while the request ran (a reload bound it otherwise, or its
    client named it given up), and nothing of the request was done: its client sends it
    again in a new session, so what the request had spent (a pool's credential ticket) is
    given back."""


class Unauthenticated(KvtierError):
    """The request carries no valid credential (a missing, spent or expired ticket)."""


class TicketRefused(Unauthenticated):
    """The credential ticket the request carries is unknown, spent, expired or of another
    kind, whatever its session or token (see ``proto.wire.TICKET_REFUSED_KEY``): a new
    ticket may do."""


class PermissionDenied(KvtierError):
    """The caller may not use what it names (another session's pool, another user's memory)."""


class FailedPrecondition(KvtierError):
    """The daemon cannot do this in its present configuration or state."""


class ResourceExhausted(KvtierError):
    """A limit was reached (batch size, pools per session, quota)."""


class Unavailable(KvtierError):
    """The daemon is shutting down or a needed part is down."""


class Draining(Unavailable):
    """The daemon is draining (``kvtier drain``) and opens this peer no new session: it runs
    (see ``proto.wire.DRAINING_KEY``)."""


class DeadlineExceeded(KvtierError):
    """The request's deadline passed before its answer could go out; what it did is undone."""


class ConfigError(ValueError):
    """A config file or override that the daemon cannot start with; names the key."""


class UnknownName(ConfigError):
    """A user or group name in the config that the host does not know. A directory service
    (LDAP, SSSD) that does not answer yet looks the same to a lookup, so unlike other config
    errors a start refused for one may pass when tried again."""
