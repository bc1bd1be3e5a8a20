"""Tables that translate the wire's enums, shared by the client and the daemon (neither
imports the other). Generated code lives beside this file; this is the one hand-written
module of ``proto/``, kept next to the enums it mirrors so the two change together."""

from __future__ import annotations

from typing import cast

from kvtier.proto import kvtier_pb2 as pb

DTYPES: dict[str, pb.DType] = {
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "float32": pb.DTYPE_FLOAT32,
    "float8_e4m3fn": pb.DTYPE_FLOAT8_E4M3,
    "float8_e5m2": pb.DTYPE_FLOAT8_E5M2,
    "uint8": pb.DTYPE_UINT8,
    "int8": pb.DTYPE_INT8,
}
"""dtype name (torch's spelling) -> ``kvtier.v1.DType``."""

DTYPE_NAMES: dict[int, str] = {v: k for k, v in DTYPES.items()}


def tier_enum(number: int) -> pb.Tier:
    """A tier's wire number as the enum type protobuf's stubs give the message fields (at run
    time it is the same int)."""
    return cast("pb.Tier", number)


SESSION_GONE_KEY = "kvtier-session-gone"
"""Trailing metadata on a NOT_FOUND status for a request naming a session that is not open
(the daemon ended it at a reload of its tenants, or restarted since), which the daemon
answers before anything of the request is done: the client may open another session and
send the request again. The session's stream ends too, but its client may make a call
before it sees that end."""

TICKET_REFUSED_KEY = "kvtier-ticket-refused"
"""Trailing metadata on an UNAUTHENTICATED status for a credential ticket that is unknown,
spent, expired or of another kind, not for a session or token refused: a pool's
registration whose ticket expired while it waited (or that the daemon spent in a session
ended) may be made again with a new ticket, where a token refused would only be refused
again."""

DRAINING_KEY = "kvtier-draining"
"""Trailing metadata on an UNAVAILABLE status (with ``ANSWERED_KEY``) that turns a new
session away because the daemon is draining: it runs, unlike one that is stopping."""

ANSWERED_KEY = "kvtier-answered"
"""Trailing metadata on an UNAVAILABLE status the daemon sends itself (it is draining,
stopping, or a part it needs is down). gRPC answers UNAVAILABLE for a daemon it cannot reach
too; the key tells the two apart, so a client does not ask whether a daemon that just
answered is running."""
