"""Result types of the client API and their conversion from and to protobuf.

Both clients (sync and asyncio) build requests and read responses through these functions,
so the two share every rule and differ only in how they wait.
"""

from __future__ import annotations

import enum
import math
import numbers
import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar
from urllib.parse import unquote

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvtier import paths
from kvtier.client.errors import InvalidArgumentError
from kvtier.client.keys import KEY_BYTES, as_int
from kvtier.kernels.layout import PoolLayout, shown
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.wire import DTYPES as _DTYPES
from kvtier.proto.wire import tier_enum

ADDRESS_ENV = paths.ADDRESS_ENV


class Tier(enum.IntEnum):
    ABSENT = pb.TIER_ABSENT
    L0_GPU = pb.TIER_L0_GPU
    L1_HOST = pb.TIER_L1_HOST
    L2_DISK = pb.TIER_L2_DISK
    L3_REMOTE = pb.TIER_L3_REMOTE

    @property
    def label(self) -> str:
        """The tier's level (``L1``), the one name the daemon's logs, metrics labels, probes,
        counters and the CLI give it."""
        return self.name.split("_")[0]


class PutStatus(enum.IntEnum):
    STORED = pb.PUT_STORED
    EXISTS = pb.PUT_EXISTS
    REJECTED_FULL = pb.PUT_REJECTED_FULL


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_len: int
    tiers: list[Tier]
    lease_id: int  # 0 when nothing was pinned


@dataclass(frozen=True, slots=True)
class PutResult:
    statuses: list[PutStatus]
    stored: int
    # With durable=True: each key's block on the disk tier. False: L2 had no evictable room
    # for it or could not write it (the key still looks up), or the block is gone (it does
    # not: REJECTED_FULL, or an EXISTS key that another put writing it did not store).
    persisted: list[bool] | None = None

    @property
    def prefix_len(self) -> int:
        """Leading keys now held (stored by this call or before)."""
        for i, s in enumerate(self.statuses):
            if s == PutStatus.REJECTED_FULL:
                return i
        return len(self.statuses)


@dataclass(frozen=True, slots=True)
class GetResult:
    loaded: list[bool]
    prefix_len: int


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    resident: int
    scheduled: int
    missing: int


@dataclass(frozen=True, slots=True)
class DeleteResult:
    deleted: int
    missing: int
    busy: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    evicted: int  # no longer in the tier (moved down, or gone)
    missing: int  # no block of the key in the tier
    busy: int  # pinned, in flight or just used, so kept


@dataclass(frozen=True, slots=True)
class CheckDetail:
    """The first blocks (their keys) and slots one broken invariant names (``check`` with
    ``list_limit``); the totals count them all."""

    problem: int  # index in CheckResult.problems
    keys: list[bytes]
    slots: list[int]  # of the tier the problem names
    keys_total: int
    slots_total: int


@dataclass(frozen=True, slots=True)
class CheckResult:
    problems: list[str]  # empty when every invariant holds
    strict: bool  # nothing was in flight, so slot accounting was checked exactly
    blocks: int
    sessions: int
    leases: int
    pools: int
    # With list_limit: one per problem that names blocks or slots.
    details: list[CheckDetail] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class DrainResult:
    draining: bool
    sessions: int  # open sessions besides the caller's


@dataclass(frozen=True, slots=True)
class QuarantinedSlot:
    """A slot L2 holds out of use after a read of it failed."""

    slot: int
    slot_bytes: int
    file: str  # the data file it lies in
    offset: int  # its byte offset there
    reason: str  # the failed read's error, or what failed when a release checked it
    at: float  # when, in seconds since the epoch (0: not recorded)
    # Whether the last release that came to it checked it and the check failed (False where
    # that release left it unchecked, and from a daemon older than this field).
    tried: bool = False


@dataclass(frozen=True, slots=True)
class QuarantineResult:
    # The slots L2 holds after the call, in slot order, as many as one reply holds (the
    # daemon's server.max_message_bytes): held_count says how many in all.
    held: list[QuarantinedSlot]
    released: list[int]  # the slots the call gave back to use
    held_count: int  # the slots held after the call, listed or not
    held_bytes: int  # their extents' bytes
    # How many of them no release has tried since their quarantine (or since the daemon
    # started): a release naming no slot left them for the next; the others failed a check.
    untried_count: int
    # The slots the call was to give back and left held, no check of theirs having failed,
    # for a later release (a read of the slot was in flight, or the daemon's free of it was not
    # done yet): untried. Those asked for that are neither released nor here failed their
    # check (an older daemon leaves this empty).
    deferred: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TenantTierStats:
    tier: Tier
    used_bytes: int
    quota_bytes: int  # 0: no quota
    blocks: int


@dataclass(frozen=True, slots=True)
class TenantStats:
    tenant: str  # a tenant, or "shared:NAME"
    sessions: int
    tiers: list[TenantTierStats]


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    state: str


@dataclass(frozen=True, slots=True)
class Stats:
    tiers: list[TierStats]
    counters: dict[str, int]  # flat: ``name`` or ``name{label="value",...}``
    gauges: dict[str, float]
    uptime_s: float
    version: str
    # The caller's tenant and the shared namespaces it uses (every tenant for an admin).
    tenants: list[TenantStats] = field(default_factory=list)
    # Where the daemon listens, as bound: "unix:/path", "host:port" (the port it took where
    # its config asked for port 0); none from a daemon older than this field.
    addresses: list[str] = field(default_factory=list)
    # Its metrics endpoint's URL; '' where it has none, for a non-admin session of a daemon
    # with tenants, and from a daemon older than this field.
    metrics_url: str = ""

    def counter(self, name: str, **labels: object) -> int:
        """A counter's value: the sum over the label values not given, e.g.
        ``counter("evictions", tier="L1")`` or ``counter("evictions")`` for all tiers."""
        total = 0
        for key, value in self.counters.items():
            base, found = split_counter(key)
            if base == name and all(found.get(k) == str(v) for k, v in labels.items()):
                total += value
        return total


def split_counter(key: str) -> tuple[str, dict[str, str]]:
    """``'name{a="x",b="y"}'`` -> ``('name', {'a': 'x', 'b': 'y'})``."""
    base, brace, rest = key.partition("{")
    if not brace:
        return key, {}
    labels = {}
    for part in rest.rstrip("}").split(","):
        k, _, v = part.partition("=")
        labels[k] = v.strip('"')
    return base, labels


def resolve_address(address: str | None) -> str:
    """The gRPC target: ``address``, else ``$KVTIER_ADDRESS``, else the default socket
    (``kvtier.paths``: the first of the user's and the system's daemon sockets that exists).
    Unix socket paths are made absolute, and written as gRPC reads them
    (``paths.unix_address``). One that is no str is InvalidArgumentError (a ``Path`` raised
    AttributeError here, and an empty list took the default)."""
    if address is not None and not isinstance(address, str):
        raise InvalidArgumentError(f"address: expected str, not {type(address).__name__}")
    address = (
        address or os.environ.get(ADDRESS_ENV) or paths.unix_address(paths.default_client_socket())
    )
    if _has_scheme(address, "unix:") and not _has_scheme(address, "unix://"):
        # An empty path stays empty (``checked_address`` refuses it): abspath made it the
        # working directory.
        path = unix_socket_path(address)
        return paths.unix_address(os.path.abspath(path)) if path else address
    if address.startswith("/") or address.startswith("."):
        return paths.unix_address(os.path.abspath(address))
    return address


def _has_scheme(address: str, scheme: str) -> bool:
    """Whether ``address`` starts with ``scheme`` ("unix:"), in any case, as gRPC reads a
    target's scheme ("UNIX:/run/x.sock" is a Unix socket to it)."""
    return address[: len(scheme)].lower() == scheme


# Why a Unix socket's path or abstract name may hold no comma: gRPC reads one as a list.
_COMMA_SPLITS = (
    "holds a comma, which gRPC reads (written as %2C too) as the end of one socket's name "
    "and the start of another: no client reaches such a socket"
)
# sockaddr_un holds 108 bytes with the terminating NUL.
MAX_UNIX_PATH_BYTES = 107


# "host:port", "[v6]:port", "dns:[//authority/]host:port" and one "ipv4:"/"ipv6:" address:
# the TCP forms whose port is checked (gRPC's other target forms are left to gRPC), the scheme
# in any case, as gRPC reads it ("DNS:localhost:99999" went to port 34463 unchecked). The port
# as gRPC reads it: spaces around it skipped, a sign before it (group 1: "-" or none; a
# negative one it takes modulo 65536 too), a query or fragment after it dropped (each of
# those left the port unchecked, and gRPC took it modulo 65536). Matched against the address
# with its %XX escapes decoded, as gRPC reads a target as a URI and decodes them first.
_HOST_PORT = re.compile(
    r"(?i:dns:(?://[^/]*/)?|ipv4:|ipv6:)?(?:\[[^\]]*\]|[^:\[\]/,]+):"
    r"\s*(?:\+|(-))?([0-9]+)\s*(?:[?#].*)?",
    re.DOTALL,
)


# The port of an "ipv4:"/"ipv6:" address as gRPC reads it (C's sscanf "%d"): spaces (C's:
# Python's \s takes others too), a sign (group 1: "-" or none) and digits, anything after
# them ignored.
_IP_PORT = re.compile(r"[ \t\n\v\f\r]*(?:\+|(-))?([0-9]+)")
# An IPv6 zone as a number (gRPC reads a uint32; another zone names an interface).
_ZONE_INDEX = re.compile(r"0*([0-9]{1,10})")
_IP_SCHEMES = {"ipv4:": (socket.AF_INET, "127.0.0.1:80"), "ipv6:": (socket.AF_INET6, "[::1]:80")}


def _tcp_addresses(target: str) -> list[re.Match[str]]:
    """The TCP forms (``_HOST_PORT``) in a target: itself, its %XX escapes decoded, or each
    address of an "ipv4:"/"ipv6:" target, one or a list ("ipv4:10.0.0.1:80,10.0.0.2:80",
    which gRPC reads up to a query or fragment; ``_ip_port``). A list's bad port failed each
    call with gRPC's UNKNOWN 'Failed to create channel', after its core printed a line of its
    own, no typed refusal as one address's. ValueError names what gRPC cannot read in such a
    target. gRPC splits a target into its parts as written, and decodes each after: a "?" or
    "#" written as %3F or %23 is in the path, and an authority's "//" and "/" are no %2F; the
    path after an empty authority keeps its "/" ("ipv4:////127.0.0.1:80" reads
    "//127.0.0.1:80"): each was read decoded first, or one "/" short, and taken."""
    for scheme, (family, example) in _IP_SCHEMES.items():
        if _has_scheme(target, scheme):  # "IPV4:" too
            body = re.split("[?#]", target[len(scheme) :], maxsplit=1)[0]
            if body.startswith("//"):
                authority, slash, body = body[2:].partition("/")
                if authority:
                    raise ValueError(
                        f"gRPC reads no address and port in //{unquote(authority)}/ (an "
                        f"authority, which {scheme} takes none of)"
                    )
                body = slash + body
            # gRPC skips an empty address and drops one "/" before one.
            hosts = (one.removeprefix("/") for one in unquote(body).split(",") if one)
            return [_ip_port(one, family, f"{scheme}{example}") for one in hosts]
    tcp = _HOST_PORT.fullmatch(unquote(target))
    return [] if tcp is None else [tcp]


def _ip_port(text: str, family: socket.AddressFamily, example: str) -> re.Match[str]:
    """The port (``_IP_PORT``) of one address of an "ipv4:"/"ipv6:" target, or ValueError
    where gRPC reads none: it takes an address of the scheme's family (an IPv6 one in
    brackets, its zone an interface's name or number) and a port, nothing else ("ipv4:"'s
    "127.0.0.1", " 127.0.0.1:80" or "localhost:80", "ipv6:"'s "::1:80" each failed every
    call with UNKNOWN 'Failed to create channel', unchecked)."""
    host, port = text, None
    if family == socket.AF_INET6 and (bracketed := re.fullmatch(r"\[([^\]]*)\]:(.*)", text)):
        host, port = bracketed.groups()
        if "%" in host:  # gRPC reads the zone after the last one
            host, _, zone = host.rpartition("%")
            # A number up to 2**32 - 1 (Python's isdigit() took other digits, and more);
            # else an interface's name (an empty zone is none).
            index = _ZONE_INDEX.fullmatch(zone)
            if index is None or int(index.group(1)) >= 2**32:
                try:
                    socket.if_nametoindex(zone)
                except (OSError, ValueError):
                    port = None
    elif family == socket.AF_INET and text.count(":") == 1:
        host, port = text.split(":")
    try:
        socket.inet_pton(family, host)
    except (OSError, ValueError):
        port = None
    found = None if port is None else _IP_PORT.match(port)
    if found is None:
        raise ValueError(f"gRPC reads no address and port in {text!r} (as {example})")
    return found


def _uri_path(text: str) -> str:
    """A URI's path as gRPC reads it: up to a query ("?") or fragment ("#"), its %XX escapes
    decoded (to the bytes they name: a socket path need not be UTF-8)."""
    return unquote(re.split("[?#]", text, maxsplit=1)[0], errors="surrogateescape")


def unix_socket_path(address: str) -> str | None:
    """The socket path of a Unix socket address as gRPC reads it, or None for another kind:
    "unix:PATH" and "unix:///abs/path" (the URI form, which ``resolve_address`` leaves as
    is) name the same kind of socket. gRPC decodes %XX escapes in it and drops a "?..." or
    "#..." after it (``unix:/run/a%20b.sock`` and ``unix:/run/a b.sock?x`` reach
    ``/run/a b.sock``): the credential socket and the CLI's hints read the raw text, and
    named another file. The scheme is read in any case ("UNIX:", "Unix:///"), as gRPC reads
    it: only the lower-case one was, so such an address skipped the path checks and was
    "not a Unix socket" to ``pool_address_problem``."""
    if _has_scheme(address, "unix://"):
        return _uri_path(address[len("unix://") :])
    if _has_scheme(address, "unix:"):
        return _uri_path(address[len("unix:") :])
    return None


def pool_address_problem(address: str) -> str | None:
    """Why no memory pool can be registered through ``address`` (empty: ``$KVTIER_ADDRESS``,
    else the default socket, always a Unix one), or None. The daemon takes pools only on its
    Unix socket, whose peer credentials vouch for the memory: over TCP a memfd pool cannot
    be handed over and a named one is refused (PERMISSION_DENIED), and a session needs a
    tenant's token. The engine integrations, which register pools and take no token, check
    their address with this at start rather than failing at every call."""
    target = address or os.environ.get(ADDRESS_ENV, "")
    if not target or unix_socket_path(resolve_address(target)) is not None:
        return None
    source = "" if address else f" (from ${ADDRESS_ENV})"
    return (
        f"{target}{source} is not a Unix socket: the daemon takes memory pools only on its "
        "Unix socket (unix:PATH), so no transfer could run"
    )


def checked_address(address: str) -> str:
    """``address``, or InvalidArgumentError when no daemon can have it: a Unix socket path
    that no socket can have (gRPC took such a channel and failed each call with UNKNOWN
    'Failed to create channel', after its core printed a line of its own), none at all, or a
    relative one in the URI form (the same failure: "unix://run/x.sock" names a host), or
    one holding a comma, which gRPC splits it at ("unix:/run/a,b/x.sock" reached the socket
    "b/x.sock" in the working folder, another daemon's perhaps, and %2C is split too), each
    read as gRPC reads it (``unix_socket_path``); an abstract socket's name too long for one
    (digits alone were refused as a TCP port) or holding a comma, split as a path's is; a
    TCP port past 65535 or negative (gRPC took it modulo 65536: ``localhost:99999`` connected
    to port 34463, ``localhost:-1`` to 65535, and sent a tenant's token to whatever listened
    there; written with %XX escapes too, which gRPC decodes; in any address of an
    "ipv4:"/"ipv6:" list, ``_tcp_addresses``, each of which must be one gRPC reads); one not encodable as UTF-8 (a
    byte that is not, decoded by Python from ``--address`` or ``$KVTIER_ADDRESS``), which
    gRPC cannot take (UnicodeEncodeError; a Unix socket path's such bytes ``resolve_address``
    writes as escapes); one holding a NUL character, which gRPC reads
    only up to there (``localhost:99999`` and a NUL, which no check below matched, went to
    port 34463 too)."""
    try:
        address.encode()
    except UnicodeEncodeError:
        raise InvalidArgumentError(
            f"address {address!r}: not encodable as UTF-8 (gRPC takes only UTF-8 addresses)"
        ) from None
    if "\0" in address:
        raise InvalidArgumentError(
            f"address {address!r}: holds a NUL character (gRPC would read it only up to there)"
        )
    path = unix_socket_path(address)
    if _has_scheme(address, "unix-abstract:"):
        # An abstract socket's name, read as a path is (digits alone were refused as a port).
        name = _uri_path(address[len("unix-abstract:") :])
        if "," in name:  # split as a path is
            raise InvalidArgumentError(
                f"address {address}: its abstract socket name {_COMMA_SPLITS}"
            )
        size = len(os.fsencode(name))
        if size > MAX_UNIX_PATH_BYTES:
            raise InvalidArgumentError(
                f"address {address}: an abstract Unix socket name holds at most "
                f"{MAX_UNIX_PATH_BYTES} bytes, this one {size}"
            )
    elif path is None:
        try:
            found = _tcp_addresses(address)
        except ValueError as e:
            raise InvalidArgumentError(f"address {address}: {e}") from None
        for tcp in found:
            # Read as a number only where it may be a port: int() refuses one past 4,300
            # digits (Python's ValueError, untyped).
            minus, digits = tcp.group(1) or "", tcp.group(2)
            port = digits.lstrip("0")
            if minus or len(port) > 5 or not 0 < int(port or "0") < 65536:
                raise InvalidArgumentError(
                    f"address {address}: port {minus}{digits} is not a TCP port (1 to 65535)"
                )
    if path is not None:
        if not path:
            raise InvalidArgumentError(f"address {address!r} names no Unix socket path")
        if _has_scheme(address, "unix://") and not _has_scheme(address, "unix:///"):
            # gRPC reads what follows "unix://" up to a "/" as a host, which the scheme has not.
            raise InvalidArgumentError(
                f"address {address}: the URI form takes an absolute path (unix:///PATH); "
                f"a relative one is unix:{address[len('unix://') :]}"
            )
        if "\0" in path:
            raise InvalidArgumentError(
                f"address {address!r}: its socket path holds a NUL character (%00)"
            )
        if "," in path:
            # gRPC reads the path as a list of them, split at its commas (%2C too): the part
            # after one a path of its own, relative to the working folder.
            raise InvalidArgumentError(f"address {address}: its socket path {_COMMA_SPLITS}")
        size = len(os.fsencode(path))
        if size > MAX_UNIX_PATH_BYTES:
            raise InvalidArgumentError(
                f"address {address}: a Unix socket path holds at most {MAX_UNIX_PATH_BYTES} "
                f"bytes, this one {size}"
            )
    return address


def address_hint(address: str | None) -> str:
    """Where a resolved address came from, for an "unreachable" message."""
    if address:
        return "the address given"
    if os.environ.get(ADDRESS_ENV):
        return f"from ${ADDRESS_ENV}"
    hint = "the default; looked for " + " and ".join(paths.client_candidates())
    mine = paths.user_socket()
    if (problem := paths.untrusted_folder(mine, os.geteuid())) is not None:
        hint += f" (left out {mine}: its folder {problem})"
    return hint


# ---------------------------------------------------------------------- requests

M = TypeVar("M", bound=Message)
T = TypeVar("T")
Paged = TypeVar("Paged", pb.PutRequest, pb.GetRequest)
P = ParamSpec("P")
# Some of protobuf's refusals start with the field's full name, which the error names anyway.
_FIELD_PREFIX = re.compile(r"^Field [\w.]+: ")


def build_request(message: Callable[P, M], /, *args: P.args, **fields: P.kwargs) -> M:
    """``message(**fields)``, or InvalidArgumentError for a value protobuf refuses: a wrong
    type, an integer beyond its field's range ("Put: pages: value out of range: -1 (a uint32:
    0 to 4294967295)"), None (which protobuf takes as "unset": ``release(None)`` asked the
    daemon to release lease 0, ``put(None, ...)`` named pool 0, and it answered NotFound for
    ids the caller never gave), a key that is not ``KEY_BYTES`` long or an empty key list
    (both of which the daemon refuses too).

    Every request the clients build goes through here. Protobuf checks each value as it
    copies it in, so building the message is the only check of most arguments (an
    iterator is read into a list first, a bool field's type looked at); a call builds
    all its requests before it sends the first, so a refused one leaves the daemon untouched.
    Only a refused message is built again, field by field, to name what it refused. A
    repeated field given an iterator (keys as a generator) takes it as a list, read once
    here: protobuf's build used it up, so building the field again to name it found it empty
    and took it, and the refusal named no field. A bool field (``pin``, ``durable``) takes
    a bool, Python's or NumPy's, and no int: protobuf took any int up to C's long, so
    ``pin=2`` (or -1) pinned, and an integer field refuses a bool as the client refuses it
    for its own int arguments (``checked_int``)."""
    for value in fields.values():
        if value is None:
            raise _refused(message, fields, None)
    repeated, bools = _field_kinds(message)
    for name in repeated:
        value = fields.get(name)
        if type(value) not in (list, tuple) and isinstance(value, Iterator):
            fields[name] = list(value)  # type: ignore[assignment]
    for name in bools:
        if name in fields and not isinstance(fields[name], (bool, np.bool_)):
            raise _refused(message, fields, None)
    try:
        request = message(*args, **fields)
    except (TypeError, ValueError) as e:
        raise _refused(message, fields, e) from None
    if "keys" in fields:
        keys: Any = fields["keys"]
        # The caller's list when it is one (its items are the bytes protobuf took): reading
        # them back out of the message costs twice as much.
        _check_keys(message, keys if type(keys) in (list, tuple) else request.keys)  # type: ignore[attr-defined]
    parent: Any = fields.get("parent_key")
    if parent:
        _check_keys(message, [parent], "parent_key")
    return request


# Each message's repeated fields and its (single) bool fields, by message class (see
# ``build_request``).
_FIELD_KINDS: dict[Any, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _field_kinds(message: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    kinds = _FIELD_KINDS.get(message)
    if kinds is None:
        fields = message.DESCRIPTOR.fields
        kinds = _FIELD_KINDS[message] = (
            tuple(f.name for f in fields if _is_repeated(f)),
            tuple(f.name for f in fields if _is_bool(f) and not _is_repeated(f)),
        )
    return kinds


def _is_repeated(field: FieldDescriptor) -> bool:
    # ``is_repeated`` where protobuf has it (``label`` is deprecated there); the client's
    # oldest protobuf (3.20.3, tests/packaging) has only ``label``.
    repeated = getattr(field, "is_repeated", None)
    if repeated is None:
        return bool(field.label == FieldDescriptor.LABEL_REPEATED)
    return bool(repeated)


def _is_bool(field: FieldDescriptor) -> bool:
    return field.cpp_type == FieldDescriptor.CPPTYPE_BOOL


def _check_keys(message: Any, keys: Sequence[bytes], name: str = "keys") -> None:
    """The daemon's own rule (``daemon.table``): every key is ``KEY_BYTES`` long, and a call
    names at least one."""
    if len(keys) == 1 and len(keys[0]) == KEY_BYTES:  # the common single key: no set
        return
    if set(map(len, keys)) == {KEY_BYTES}:
        return
    call = message.DESCRIPTOR.name.removesuffix("Request")
    if not keys:
        raise InvalidArgumentError(f"{call}: {name}: empty; a call names at least one key")
    i = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
    where = f"{name}: key {i}" if name == "keys" else name
    raise InvalidArgumentError(
        f"{call}: {where} has {len(keys[i])} bytes; keys are {KEY_BYTES} bytes"
    )


def checked_int(value: object, what: str, minimum: int | None = None) -> int:
    """``value`` as an int: Python's, NumPy's or anything else with ``__index__``, but not a
    bool (protobuf's rule for every integer field, kept for the client's own arguments) nor
    a float, which ``int()`` would truncate; InvalidArgumentError naming ``what`` otherwise."""
    if (number := as_int(value)) is None:
        kind = "bool" if isinstance(value, np.bool_) else type(value).__name__
        raise InvalidArgumentError(f"{what}: expected int, not {kind}")
    if minimum is not None and number < minimum:
        raise InvalidArgumentError(f"{what}: must be at least {minimum} (got {shown(number)})")
    return number


# The longest duration a call or a wait takes (about 31 years). gRPC's deadline is the time
# since 1970 in int64 nanoseconds (up to some 292 years), and a later one failed the call at
# once with DEADLINE_EXCEEDED; a thread's wait refuses a timeout past that too (OverflowError,
# ``threading.TIMEOUT_MAX``). Well within both, with room for what the client adds (a pinning
# Lookup's ``ANSWER_GRACE_S``, a Check's settle).
MAX_SECONDS = 1e9


def as_float(value: Any) -> float:
    """``float(value)``, where an int past a float's range (OverflowError) is the infinity of
    its sign: refused, or taken as no limit, by the check that follows."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def checked_seconds(
    value: object, what: str, *, optional: bool = True, forever: bool = False
) -> float | None:
    """A duration in seconds: a real number >= 0, finite unless ``forever`` (then infinity
    is None: no limit); None passes when ``optional``. InvalidArgumentError naming ``what``
    otherwise: gRPC failed a call with a negative, NaN or infinite timeout as
    DEADLINE_EXCEEDED and a str one with a TypeError of its own, and a job's wait treated
    NaN one way in the sync client and another in the asyncio one. Past ``MAX_SECONDS``, no
    limit where ``forever``, else refused (gRPC failed such a call at once with
    DEADLINE_EXCEEDED, and a thread's wait raised OverflowError, as ``float()`` of an int
    past a float's range did)."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what}: expected a number of seconds, not {shown(value)}")
    seconds = as_float(value)
    if forever and seconds > MAX_SECONDS:
        return None  # as long as no limit
    if not 0 <= seconds < math.inf:  # False for NaN
        finite = "" if forever else "finite "
        raise InvalidArgumentError(
            f"{what}: expected a {finite}number of seconds >= 0, not {shown(value)}"
        )
    if seconds > MAX_SECONDS:
        raise InvalidArgumentError(
            f"{what}: expected at most {MAX_SECONDS:g} seconds (about 31 years), not {shown(value)}"
        )
    return seconds


def shown_keys(keys: Iterable[object]) -> str:
    """``keys`` for an error's message, as a list sorted by what it shows: ``sorted`` refuses
    keys of mixed types (TypeError), and ``repr`` a list holding an int past 4,300 digits,
    so a message naming unknown keys failed with Python's error, naming no option."""
    return "[" + ", ".join(sorted(shown(k) for k in keys)) + "]"


def checked_type(value: T, types: type | tuple[type, ...], what: str) -> T:
    """``value`` if it is one of ``types``; InvalidArgumentError naming ``what`` otherwise (the
    calls that take an object use its attributes, and a wrong one failed deep inside with an
    AttributeError)."""
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise InvalidArgumentError(f"{what}: expected {names}, not {type(value).__name__}")
    return value


# The daemon waits at most this long for transfers before a Check (longer settles are cut to
# it); the wire's field is milliseconds in 32 bits.
MAX_CHECK_SETTLE_S = 60.0
# The most blocks and slots of each broken invariant a Check lists (the daemon cuts a larger
# list_limit to it: ``service.MAX_CHECK_LIST``).
MAX_CHECK_LIST = 1000


def check_timeout_s(request: pb.CheckRequest, timeout_s: float) -> float:
    """How long a Check may take: the client's timeout for the check itself, after the wait
    for transfers in flight that the request asks the daemon for (a client timeout shorter
    than that wait ended the call DEADLINE_EXCEEDED while transfers ran)."""
    return timeout_s + request.settle_ms / 1000.0


def check_request(settle_s: float, list_limit: int = 0) -> pb.CheckRequest:
    """A Check request waiting up to ``settle_s`` (cut to ``MAX_CHECK_SETTLE_S``, as the daemon
    does) and listing up to ``list_limit`` blocks and slots of each broken invariant (the
    daemon lists at most ``MAX_CHECK_LIST``); a negative or NaN wait, or one that is not a
    number, is InvalidArgumentError naming ``settle_s``, as a ``list_limit`` out of range
    names it."""
    if isinstance(settle_s, (bool, np.bool_)) or not isinstance(settle_s, numbers.Real):
        ok = False  # a str, None, True: refused as any other bad argument
    else:
        ok = settle_s >= 0  # False for NaN
    if not ok:
        raise InvalidArgumentError(f"Check: settle_s must be a number >= 0 (got {shown(settle_s)})")
    return build_request(
        pb.CheckRequest,
        # In floats once cut: a NumPy integer's own type overflowed (np.int8(3) * 1000), and
        # a float of an int past its range does.
        settle_ms=int(float(min(settle_s, MAX_CHECK_SETTLE_S)) * 1000),
        list_limit=list_limit,
    )


def _refused(message: Any, fields: dict[str, Any], error: Exception | None) -> InvalidArgumentError:
    call = message.DESCRIPTOR.name.removesuffix("Request")
    for name, value in fields.items():
        problem = _field_problem(message, name, value)
        if problem is not None:
            return InvalidArgumentError(f"{call}: {problem}")
    # Every None is named by its field above.
    assert error is not None
    return InvalidArgumentError(f"{call}: {_protobuf_text(error)}")


def _field_problem(message: Any, name: str, value: object) -> str | None:
    """What protobuf refuses in ``value`` for field ``name``; None when it takes the value."""
    default = getattr(message(), name)
    repeated = isinstance(default, MutableSequence)
    if value is None:
        expected = "a sequence" if repeated else type(default).__name__
        return f"{name}: expected {expected}, not NoneType"
    if repeated and (isinstance(value, (str, bytes)) or not isinstance(value, Iterable)):
        return f"{name}: expected a sequence, not {type(value).__name__}"
    if type(default) is bool and not isinstance(value, (bool, np.bool_)):
        return f"{name}: expected bool, not {type(value).__name__}"
    try:
        message(**{name: value})
    except TypeError as e:
        if repeated:  # protobuf names the item's type
            return f"{name}: {_protobuf_text(e)}"
        return f"{name}: expected {type(default).__name__}, not {type(value).__name__}"
    except ValueError as e:
        # An integer out of its field's range, in protobuf's words but for what the field
        # holds: protobuf's own text shows the value, and for one past 4,300 digits it was
        # Python's refusal to print it ("Exceeds the limit (4300 digits) ...").
        field = message.DESCRIPTOR.fields_by_name[name]
        if (held := _INT_FIELDS.get(field.cpp_type)) is not None:
            what, low, high = held
            items = value if repeated and isinstance(value, Iterable) else (value,)
            for item in items:
                number = as_int(item)
                if number is not None and not low <= number <= high:
                    return f"{name}: value out of range: {shown(number)} ({what})"
        return f"{name}: {_protobuf_text(e)}"
    return None


# What each integer field holds, as its refusals say it (an enum is an int32 on the wire).
_INT_FIELDS = {
    FieldDescriptor.CPPTYPE_INT32: ("an int32: -2147483648 to 2147483647", -(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_ENUM: ("an int32: -2147483648 to 2147483647", -(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_UINT32: ("a uint32: 0 to 4294967295", 0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_INT64: (
        "an int64: -9223372036854775808 to 9223372036854775807",
        -(2**63),
        2**63 - 1,
    ),
    FieldDescriptor.CPPTYPE_UINT64: ("a uint64: 0 to 18446744073709551615", 0, 2**64 - 1),
}


def int_field_range(message: Any, name: str) -> tuple[int, int]:
    """The integers field ``name`` of ``message`` holds, outside which ``build_request``
    refuses a value: an option that a connector sends in that field is checked against it
    when the connector is built, not refused at every call."""
    _, low, high = _INT_FIELDS[message.DESCRIPTOR.fields_by_name[name].cpp_type]
    return low, high


def _protobuf_text(error: Exception) -> str:
    """Protobuf's reason, to follow a colon: its sentence case dropped ("value out of range:
    -1"), not a value it starts with ("None has type ...")."""
    text = _FIELD_PREFIX.sub("", str(error))
    first = text.split(" ", 1)[0]
    if first.isalpha() and first not in ("None", "True", "False"):
        return text[:1].lower() + text[1:]
    return text


def build_paged_request(message: Callable[P, Paged], /, *args: P.args, **fields: P.kwargs) -> Paged:
    """``build_request`` of a Put or a Get that names one page per key (the daemon refuses any
    other count); InvalidArgumentError before it is sent otherwise."""
    request = build_request(message, *args, **fields)
    nkeys, npages = len(request.keys), len(request.pages)
    if npages != nkeys:
        call = request.DESCRIPTOR.name.removesuffix("Request")
        raise InvalidArgumentError(f"{call}: {npages} pages for {nkeys} keys")
    return request


def layout_to_pb(layout: PoolLayout) -> pb.PoolLayout:
    if not isinstance(layout.dtype, str) or layout.dtype not in _DTYPES:  # a list: unhashable
        raise InvalidArgumentError(
            f"RegisterPool: layout: unknown dtype {shown(layout.dtype)}; one of {sorted(_DTYPES)}"
        )
    return build_request(
        pb.PoolLayout,
        layers=[
            build_request(
                pb.LayerLayout,
                offset=layer.offset,
                kv_count=layer.kv_count,
                kv_stride=layer.kv_stride,
                page_stride=layer.page_stride,
                chunk_bytes=layer.chunk_bytes,
            )
            for layer in layout.layers
        ],
        num_pages=layout.num_pages,
        block_tokens=layout.block_tokens,
        dtype=_DTYPES[layout.dtype],
    )


def tier_value(tier: Tier | int | str) -> pb.Tier:
    """A tier given as ``Tier``, its wire number or its label (``"L1"``), for an Evict; one
    that names no tier is refused here (the daemon refuses it too, but the client can tell)."""
    if isinstance(tier, str):
        for t in Tier:
            if t.label == tier.upper() and t != Tier.ABSENT:
                return tier_enum(int(t))
        raise InvalidArgumentError(f"Evict: tier: unknown tier {tier!r}; one of L0, L1, L2, L3")
    number = checked_int(tier, "Evict: tier")
    if number not in _TIER_BY_VALUE or number == Tier.ABSENT:
        raise InvalidArgumentError(
            f"Evict: tier: unknown tier {shown(number)}; one of L0, L1, L2, L3"
        )
    return tier_enum(number)


# --------------------------------------------------------------------- responses


_TIER_BY_VALUE = {int(t): t for t in Tier}
_PUT_BY_VALUE = {int(s): s for s in PutStatus}


def lookup_result(resp: pb.LookupResponse) -> LookupResult:
    # A dict lookup per key: constructing enum members one by one costs ~1 us each.
    return LookupResult(resp.prefix_len, [_TIER_BY_VALUE[t] for t in resp.tiers], resp.lease_id)


def put_result(resp: pb.PutResponse) -> PutResult:
    persisted = list(resp.persisted) if len(resp.persisted) else None
    return PutResult([_PUT_BY_VALUE[s] for s in resp.results], resp.stored, persisted)


def get_result(resp: pb.GetResponse) -> GetResult:
    return GetResult(list(resp.loaded), resp.prefix_len)


def prefetch_result(resp: pb.PrefetchResponse) -> PrefetchResult:
    return PrefetchResult(resp.resident, resp.scheduled, resp.missing)


def delete_result(resp: pb.DeleteResponse) -> DeleteResult:
    return DeleteResult(resp.deleted, resp.missing, resp.busy)


def evict_result(resp: pb.EvictResponse) -> EvictResult:
    return EvictResult(resp.evicted, resp.missing, resp.busy)


def check_result(resp: pb.CheckResponse) -> CheckResult:
    details = [
        CheckDetail(d.problem, list(d.keys), list(d.slots), d.keys_total, d.slots_total)
        for d in resp.details
    ]
    return CheckResult(
        list(resp.problems),
        resp.strict,
        resp.blocks,
        resp.sessions,
        resp.leases,
        resp.pools,
        details,
    )


def drain_result(resp: pb.DrainResponse) -> DrainResult:
    return DrainResult(resp.draining, resp.sessions)


def quarantine_result(resp: pb.QuarantineResponse) -> QuarantineResult:
    return QuarantineResult(
        [
            QuarantinedSlot(q.slot, q.slot_bytes, q.file, q.offset, q.reason, q.at, q.tried)
            for q in resp.held
        ],
        list(resp.released),
        resp.held_count,
        resp.held_bytes,
        resp.untried_count,
        list(resp.deferred),
    )


def stats_result(resp: pb.StatsResponse) -> Stats:
    return Stats(
        tiers=[
            TierStats(Tier(t.tier), t.capacity_bytes, t.used_bytes, t.blocks, t.state)
            for t in resp.tiers
        ],
        counters=dict(resp.counters),
        gauges=dict(resp.gauges),
        uptime_s=resp.uptime_s,
        version=resp.version,
        tenants=[
            TenantStats(
                t.tenant,
                t.sessions,
                [
                    TenantTierStats(Tier(u.tier), u.used_bytes, u.quota_bytes, u.blocks)
                    for u in t.tiers
                ],
            )
            for t in resp.tenants
        ],
        addresses=list(resp.addresses),
        metrics_url=resp.metrics_url,
    )
