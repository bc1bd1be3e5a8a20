"""Daemon configuration: embedded defaults, a YAML file, and ``section.key=value`` overrides.

The defaults are the dataclass defaults below; ``deploy/kvtier.yaml`` spells every one of them
out (a test keeps the two equal). Loading is strict: an unknown key, a value of the wrong type
or out of range, or settings for a tier that runs only when enabled without its ``enabled``,
stops the daemon with a ConfigError that names the key or section. Relative paths are
relative to the daemon's working directory.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import grp
import math
import os
import pwd
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier import paths
from kvtier.daemon.errors import ConfigError, UnknownName
from kvtier.daemon.loops import EVENT_LOOPS
from kvtier.tiers.sizes import POWERS, format_size

# ASCII digits only: Python's \d (and float) take any script's digits.
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])(i)?B?|(B))?\s*", re.IGNORECASE | re.ASCII)


def parse_size(value: object) -> int:
    """Bytes from an int or a string: ``"64MiB"``/``"64Mi"`` are binary (2**20), ``"2GB"``/
    ``"2G"`` decimal (10**9), as in Kubernetes quantities; case does not matter."""
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m:
            number, prefix, binary, _ = m.groups()
            scale = 1
            if prefix:
                power = POWERS[prefix.upper()]
                scale = 1 << (10 * power) if binary else 10 ** (3 * power)
            return int(float(number) * scale)
    raise ValueError(f"expected a size such as 1073741824, '1GiB', '1Gi' or '1G', got {value!r}")


# The longest any duration in the config may be (a year), whatever its own maximum: a value
# past it is a typo or a stand-in for "never" (a key that means never says so with 0), and
# values such as 1e300 were accepted and then overflowed the timers, deadlines and service
# manager messages they reach.
MAX_DURATION_S = 365 * 86400
# The most a config file may hold (a config is a few KiB; thousands of tenants fit well
# within it): read whole, ``--config /dev/zero`` (or a log passed by mistake) took memory
# until the kernel killed kvtierd, and a SIGHUP would do so to a running daemon.
MAX_CONFIG_FILE_BYTES = 16 << 20
# A number PyYAML reads as a string: in exponent notation without a dot and a signed exponent
# (1e3 and 5e-1, but not 1.0e+3), or a signed fraction without a whole part (+.5, -.5; .5 is a
# number): each would be refused as "not a number", the fraction told that it was quoted. Only
# written plain (``_PlainNumber``): quoted, it is a string, as a quoted "30" is.
# ASCII digits only: Python's \d (and float) take any script's digits, such as "1e\u0663".
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+\Z|[-+]\.\d+\Z", re.ASCII)
# Text that would be a number written without quotes (what a refused string is told).
_NUMBER_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", re.ASCII)
# A number written plain with a leading zero (0100), which YAML 1.1 reads as octal (64) where
# most readers see a hundred: `admin_uids: [0100]` made uid 64 an admin, `max_pools: 0100`
# allowed 64. Kept as written (``_LeadingZero``): permission bits take it as octal, as meant,
# text keys as the text, and every key that takes a number or an id refuses it where the octal
# reading is not the number written (``_number_as_written``).
_LEADING_ZERO_RE = re.compile(r"[-+]?0[0-9_]+\Z", re.ASCII)
# What of it YAML 1.1 reads as an octal number; the rest (08) it reads as text.
_YAML_OCTAL_RE = re.compile(r"[-+]?0[0-7_]+\Z", re.ASCII)
# An integer YAML 1.1 reads from another form than decimal digits (0x1F, 0b101, 1_000, 1:30 in
# base 60), which a text key in a file took as its decimal text ('31', as 0123 was '83') where
# its variable takes the text as written. Kept as written (``_IntAsWritten``): the number
# where a key takes one.
_INT_AS_WRITTEN_RE = re.compile(
    r"[-+]?(0b[01_]+|0x[0-9a-fA-F_]+|[1-9][0-9_]*(:[0-5]?[0-9])+|[1-9][0-9]*_[0-9_]*)\Z", re.ASCII
)
_UNIT_S = {"s": 1, "ms": 1000}  # a duration's unit (its key ends with it): how many a second
# The shortest period of the L2 index watch other than 0 (off): shorter only spins a thread.
MIN_INDEX_WATCH_S = 0.05


def _opt(
    kind: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[str, ...] | None = None,
    doc: str = "",
    record: Any = None,
    unit: str = "",
) -> dict[str, Any]:
    """A key's metadata. ``record``: for kind ``records`` (a list of mappings), the dataclass
    each mapping is built into, as strictly as a section. ``unit``: a duration's (``s``,
    ``ms``); its maximum is at most ``MAX_DURATION_S``."""
    if unit:
        longest = MAX_DURATION_S * _UNIT_S[unit]
        hi = longest if hi is None else min(hi, longest)
    return {
        "kind": kind,
        "lo": lo,
        "hi": hi,
        "choices": choices,
        "doc": doc,
        "record": record,
        "unit": unit,
    }


AUTO_SOCKET = "auto"
# In server.shm_share: a client of any uid may use the owner's objects.
ANY_PEER = -1
# What a request of N keys takes at most on the wire: a key is 34 bytes with its tag and
# length, its page number up to 10 (a varint) plus one for the packed list, rounded up; the
# base covers every other field (an OpenSession may carry up to 64 KiB). For the config's
# check that ``server.max_message_bytes`` holds the largest batch.
MESSAGE_BYTES_PER_KEY = 48
MESSAGE_BYTES_BASE = 128 << 10


@dataclass(frozen=True)
class ServerConfig:
    socket: str = field(
        default=AUTO_SOCKET,
        metadata=_opt(
            "str",
            doc="Unix socket path of the gRPC API; 'auto' follows kvtier.paths (the path the "
            "client looks for); empty disables it. The credential socket is the same path "
            "plus '.cred'",
        ),
    )
    socket_mode: str = field(
        default="0660",
        metadata=_opt("mode", doc="permission bits (octal) of both Unix sockets"),
    )
    socket_group: str = field(
        default="",
        metadata=_opt(
            "ident",
            doc="group (name or gid) of both Unix sockets, whose members may connect; "
            "empty: the daemon's own group",
        ),
    )
    tcp_address: str = field(
        default="",
        metadata=_opt("str", doc="host:port for gRPC over TCP; empty (the default) disables TCP"),
    )
    max_batch_blocks: int = field(default=4096, metadata=_opt("int", lo=1, hi=1 << 20))
    max_message_bytes: int = field(
        default=4 << 20,
        metadata=_opt(
            "size",
            lo=1 << 20,
            # gRPC's message limits are C ints: 2GiB overflows them (the start failed).
            hi=(1 << 31) - 1,
            doc="largest gRPC message either way; a larger one is refused before it is parsed "
            "(it is parsed on the event loop: keep it near what max_batch_blocks needs)",
        ),
    )
    max_pools_per_session: int = field(
        default=64, metadata=_opt("int", lo=1, hi=1 << 16, doc="registered pools per session")
    )
    max_pools: int = field(
        default=16384,
        metadata=_opt(
            "int",
            lo=1,
            hi=1 << 20,
            doc="host memory pools (shared memory, memfd) the daemon maps at once, every "
            "tenant's together, registrations being mapped or unmapped included: each is one "
            "memory mapping, and past vm.max_map_count the daemon's own allocations fail",
        ),
    )
    max_pools_per_tenant: int = field(
        default=1024,
        metadata=_opt(
            "int",
            lo=1,
            hi=1 << 20,
            doc="host memory pools one tenant (without tenants configured: one peer uid) may "
            "have mapped at once, registrations being mapped or unmapped included: without "
            "it one tenant could take every one of server.max_pools and refuse all others",
        ),
    )
    max_pool_bytes_per_tenant: int = field(
        default=1 << 40,
        metadata=_opt(
            "size",
            lo=1,
            hi=1 << 62,
            doc="bytes of host memory pools (shared memory, memfd) one tenant (without "
            "tenants configured: one peer uid) may have mapped in the daemon at once, "
            "registrations being mapped or unmapped included; every registration counts its "
            "whole size, however often the same memory is registered",
        ),
    )
    max_leases_per_session: int = field(
        default=16384,
        metadata=_opt("int", lo=1, hi=1 << 24, doc="live leases (Lookup(pin=true)) per session"),
    )
    max_lease_bytes_per_tenant: int = field(
        default=64 << 20,
        metadata=_opt(
            "size",
            lo=1 << 10,
            hi=1 << 40,
            doc="memory the live leases of one tenant's sessions (without tenants configured: "
            "one peer uid's) may hold in the daemon together, each lease counted as 512 bytes "
            "plus 8 per block it pins; server.max_leases_per_session bounds one session, "
            "this the sum of all of a tenant's sessions",
        ),
    )
    max_sessions_per_tenant: int = field(
        default=256,
        metadata=_opt(
            "int",
            lo=1,
            hi=1 << 20,
            doc="open sessions per tenant (without tenants configured: per peer uid)",
        ),
    )
    max_namespaces_per_tenant: int = field(
        default=1024,
        metadata=_opt(
            "int",
            lo=1,
            hi=1 << 20,
            doc="namespaces one tenant may hold blocks in at once (each is recorded durably; "
            "one left empty stops counting)",
        ),
    )
    admin_uids: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "idents",
            doc="users (names or uids) whose sessions may use the admin calls (check, "
            "drain, delete and evict in any tenant), besides root, the daemon's own user "
            "and the members of admin tenants",
        ),
    )
    lease_default_ms: int = field(default=30_000, metadata=_opt("int", unit="ms", lo=1))
    lease_max_ms: int = field(default=600_000, metadata=_opt("int", unit="ms", lo=1))
    session_ping_s: int = field(default=10, metadata=_opt("int", unit="s", lo=1, hi=3600))
    copy_threads: int = field(default=2, metadata=_opt("int", lo=1, hi=64))
    shm_dir: str = field(
        default="/dev/shm", metadata=_opt("str", doc="where POSIX shared-memory objects live")
    )
    shm_share: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "strs",
            doc="CLIENT=OWNER pairs (user names or uids): a session of CLIENT may register "
            "named shared-memory objects OWNER owns; CLIENT 'any' is every peer. Without a "
            "pair, only the owner may register an object",
        ),
    )
    bad_request_log_interval_s: float = field(
        default=10.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=0.0,
            hi=86400.0,
            doc="malformed requests and unexpected errors log one line per kind this often; 0 "
            "logs every one (no rate limit: a client sending garbage can then flood the log)",
        ),
    )
    drain_timeout_s: float = field(
        default=10.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=0,
            hi=86400.0,
            doc="on SIGTERM, how long requests in progress may take to finish (then the "
            "flush at stop, tiers.l2.flush_timeout_s, after which those still running are "
            "cancelled)",
        ),
    )
    stop_grace_s: float = field(
        default=10.0,
        metadata=_opt(
            "float",
            unit="s",
            # Not 0: the stop's own steps past the drain and the flush (the pools' and the
            # tiers' close) take time that no other budget counts, and a bound of 0 (no
            # drain, no flush) abandoned every stop, an idle daemon's too, before its first.
            lo=1.0,
            hi=86400.0,
            doc="on SIGTERM, how long the stop may run past server.drain_timeout_s plus the "
            "flush's tiers.l2.flush_timeout_s (for writes and requests still running: a disk "
            "that stops answering would hold it until the service manager kills it); then "
            "the daemon logs the blocks it abandons, none acknowledged durable, and exits "
            "with status 3. At least 1 s, for the stop's own steps (closing the pools and "
            "the tiers). Keep the three below what the service manager waits (the unit's "
            "TimeoutStopSec, a pod's terminationGracePeriodSeconds)",
        ),
    )
    idle_connection_s: float = field(
        default=60.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=1.0,
            hi=86400.0,
            doc="a connection with no call open for this long is closed (an engine's client "
            "keeps its session's call open, and a client whose idle connection was closed "
            "connects again on its next call): connections left open by clients that "
            "forgot them, or opened and never used, give their file descriptor back",
        ),
    )

    max_connections: int = field(
        default=4096,
        metadata=_opt(
            "int",
            lo=1,
            hi=1 << 20,
            doc="gRPC connections open at once, every client's together; one more is closed as "
            "it is accepted. Each holds a file descriptor; server.idle_connection_s bounds how "
            "long an idle one is held, not how many are open: without this bound, connections "
            "opened faster than they idled out took every descriptor the daemon may open, and "
            "it accepted no one, not even on its credential socket. Keep it well below the "
            "daemon's RLIMIT_NOFILE",
        ),
    )
    max_health_watches: int = field(
        default=256,
        metadata=_opt(
            "int",
            lo=1,
            hi=1 << 16,
            doc="health watches (grpc.health.v1.Health/Watch streams) open at once, every "
            "client's together; one more is RESOURCE_EXHAUSTED. A watch needs no session (over "
            "TCP no token either) and holds memory for as long as it stays open; probes use "
            "Check",
        ),
    )
    max_health_watches_per_peer: int = field(
        default=32,
        metadata=_opt(
            "int",
            lo=1,
            hi=1 << 16,
            doc="health watches open at once from one TCP client host, so that one host cannot "
            "take every watch; one more is RESOURCE_EXHAUSTED. gRPC does not say who is at the "
            "other end of a Unix socket connection: watches there count toward "
            "server.max_health_watches only",
        ),
    )

    event_loop: str = field(
        default="uvloop",
        metadata=_opt(
            "str",
            choices=EVENT_LOOPS,
            doc="the event loop the daemon runs on: uvloop (libuv, the loop in C: less CPU "
            "per request) or asyncio (the standard library's); a restart applies a change",
        ),
    )
    memory_trim_bytes: int = field(
        default=64 << 20,
        metadata=_opt(
            "size",
            lo=0,
            hi=1 << 62,
            doc="when the C allocator holds more than this in freed memory (checked every "
            "5 s), the daemon gives it back to the system (glibc's malloc_trim): a burst of "
            "calls leaves no lasting growth; 0 turns it off",
        ),
    )

    def check(self) -> None:
        if not self.socket and not self.tcp_address:
            raise ConfigError(
                "server.socket and server.tcp_address are both empty: nothing to listen on"
            )
        if "," in (path := os.path.abspath(self.socket) if self.socket else ""):
            # gRPC binds it, but reads a client's address as a list split at its commas (%2C
            # too): no client could reach the socket (kvtier.client's checked_address).
            raise ConfigError(
                f"config key 'server.socket': {path!r} holds a comma, which gRPC reads in an "
                "address as the start of another socket path: no client could reach it; "
                "choose a path without one"
            )
        if self.tcp_address:
            try:
                if ":" not in self.tcp_address:
                    raise ValueError(f"{self.tcp_address!r} is not host:port")
                split_host_port(self.tcp_address)
            except ValueError as e:
                raise ConfigError(f"config key 'server.tcp_address': {e}") from None
        if self.lease_default_ms > self.lease_max_ms:
            raise ConfigError("server.lease_default_ms exceeds server.lease_max_ms")
        if self.max_health_watches_per_peer > self.max_health_watches:
            raise ConfigError(
                f"server.max_health_watches_per_peer ({self.max_health_watches_per_peer}) "
                f"exceeds server.max_health_watches ({self.max_health_watches}): one host "
                "could take every watch"
            )
        if not os.path.isabs(self.shm_dir):
            raise ConfigError(
                f"config key 'server.shm_dir': {self.shm_dir!r} is not an absolute path (the "
                "daemon resolves shared-memory names there whatever its working folder)"
            )
        need = self.max_batch_blocks * MESSAGE_BYTES_PER_KEY + MESSAGE_BYTES_BASE
        if self.max_message_bytes < need:
            raise ConfigError(
                f"server.max_message_bytes ({self.max_message_bytes}) is too small for "
                f"requests of server.max_batch_blocks={self.max_batch_blocks} keys: raise it "
                f"to at least {need}"
            )
        self.socket_gid()
        self.shm_share_pairs()
        self.admin_uid_set()

    def admin_uid_set(self) -> frozenset[int]:
        return _resolve_ids("server.admin_uids", self.admin_uids, user=True)

    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)

    def socket_gid(self) -> int | None:
        """The sockets' group id, or None to leave the daemon's own group."""
        if not self.socket_group:
            return None
        try:
            return _resolve_id(self.socket_group, "group")
        except KeyError:
            raise UnknownName(
                f"config key 'server.socket_group': no group {self.socket_group!r} on this host"
            ) from None

    def shm_share_pairs(self) -> frozenset[tuple[int, int]]:
        """``(client uid or ANY_PEER, owner uid)`` pairs from ``shm_share``."""
        pairs = set()
        for item in self.shm_share:
            client, sep, owner = item.strip().partition("=")
            if not sep or not client or not owner:
                raise ConfigError(
                    f"config key 'server.shm_share': {item!r} is not of the form CLIENT=OWNER"
                )
            try:
                owner_uid = _resolve_id(owner, "user")
                client_uid = ANY_PEER if client == "any" else _resolve_id(client, "user")
            except KeyError as e:
                raise UnknownName(
                    f"config key 'server.shm_share': no user {e.args[0]!r} on this host"
                ) from None
            pairs.add((client_uid, owner_uid))
        return frozenset(pairs)


# While set (``ids_from``): the uids and gids names resolve to, by ("user" or "group", name).
# A name found here is not looked up on the host; one looked up is added.
_KNOWN_IDS: contextvars.ContextVar[dict[tuple[str, str], int] | None] = contextvars.ContextVar(
    "kvtier_known_ids", default=None
)


@contextlib.contextmanager
def ids_from(known: dict[tuple[str, str], int]) -> Iterator[None]:
    """Resolve the config's user and group names through ``known`` inside: a name it holds
    gives its id without asking the host, one it lacks is looked up and added. ``kvtierd``
    loads its config at start with an empty book and reloads with a copy of that book: a
    name the running config has resolves as it did at start (the daemon runs with those ids),
    even once the host has lost it (a group deleted, a directory service unreachable),
    which refused every reload; a name the reload brings in is looked up as at start."""
    token = _KNOWN_IDS.set(known)
    try:
        yield
    finally:
        _KNOWN_IDS.reset(token)


def _resolve_id(name: str, kind: str) -> int:
    """A uid (``kind`` "user") or gid ("group") from a number or a name (KeyError(name) when
    the name is unknown)."""
    if name.isascii() and name.isdigit():  # isdigit alone takes any script's digits
        return int(name)
    known = _KNOWN_IDS.get()
    if known is not None and (kind, name) in known:
        return known[kind, name]
    try:
        found = pwd.getpwnam(name).pw_uid if kind == "user" else grp.getgrnam(name).gr_gid
    except KeyError:
        raise KeyError(name) from None
    if known is not None:
        known[kind, name] = found
    return int(found)


def _resolve_ids(key: str, names: tuple[str, ...], *, user: bool) -> frozenset[int]:
    """uids (``user``) or gids from names or numbers; an unknown name is a ConfigError."""
    kind = "user" if user else "group"
    out = set()
    for name in names:
        try:
            out.add(_resolve_id(name, kind))
        except KeyError:
            raise UnknownName(f"config key '{key}': no {kind} {name!r} on this host") from None
    return frozenset(out)


def _tier_policy() -> Any:
    return field(
        default="",
        metadata=_opt("str", doc="this tier's eviction policy; empty takes policy.name"),
    )


def _rate(what: str) -> Any:
    return field(
        default=0,
        metadata=_opt("size", lo=0, doc=f"bandwidth limit of {what}, bytes/s; 0 is unlimited"),
    )


def _check_tier(label: str, tier: Any) -> None:
    if tier.segment_bytes % 4096:
        raise ConfigError(f"tiers.{label}.segment_bytes must be a multiple of 4096")
    if tier.capacity_bytes < tier.segment_bytes:
        raise ConfigError(
            f"tiers.{label}.capacity_bytes is smaller than tiers.{label}.segment_bytes"
        )
    if tier.low_watermark > tier.high_watermark:
        raise ConfigError(f"tiers.{label}.low_watermark exceeds tiers.{label}.high_watermark")
    if tier.policy:
        _check_policy(f"tiers.{label}.policy", tier.policy)


def _check_policy(key: str, name: str) -> None:
    from kvtier.daemon.policy.registry import policy_names

    live = policy_names(live=True)
    if name not in live:
        raise ConfigError(f"config key '{key}': {name!r} is not one of {', '.join(live)}")


@dataclass(frozen=True)
class L0Config:
    enabled: bool = field(
        default=False,
        metadata=_opt("bool", doc="run the GPU tier (needs CUDA); CUDA IPC pools need it"),
    )
    device: int = field(
        default=0, metadata=_opt("int", lo=0, hi=1023, doc="CUDA device index of the arena")
    )
    capacity_bytes: int = field(
        default=4 << 30,
        metadata=_opt("size", lo=1 << 20, doc="device arena, allocated once at start"),
    )
    segment_bytes: int = field(
        default=64 << 20,
        metadata=_opt("size", lo=4096, doc="slab segment; also the largest block the tier takes"),
    )
    streams: int = field(
        default=2,
        metadata=_opt("int", lo=1, hi=16, doc="CUDA streams for copies with engine pools"),
    )
    gds: str = field(
        default="auto",
        metadata=_opt(
            "str",
            choices=("auto", "true", "false"),
            doc="L2 <-> L0 through GPUDirect Storage (kvikio): auto = when usable",
        ),
    )
    high_watermark: float = field(default=0.95, metadata=_opt("float", lo=0.05, hi=1.0))
    low_watermark: float = field(default=0.90, metadata=_opt("float", lo=0.0, hi=1.0))
    policy: str = _tier_policy()

    def check(self) -> None:
        _check_tier("l0", self)


@dataclass(frozen=True)
class L1Config:
    capacity_bytes: int = field(default=1 << 30, metadata=_opt("size", lo=1 << 20))
    segment_bytes: int = field(
        default=64 << 20,
        metadata=_opt("size", lo=4096, doc="slab segment; also the largest block the tier takes"),
    )
    high_watermark: float = field(default=0.95, metadata=_opt("float", lo=0.05, hi=1.0))
    low_watermark: float = field(default=0.90, metadata=_opt("float", lo=0.0, hi=1.0))
    pin_memory: str = field(default="auto", metadata=_opt("str", choices=("auto", "true", "false")))
    prefault: str = field(
        default="background",
        metadata=_opt(
            "str",
            choices=("background", "none"),
            doc="fault the arena's pages in on a thread once the daemon serves (background), "
            "or leave each to its first write (none); a page-locked arena is faulted in anyway",
        ),
    )
    policy: str = _tier_policy()

    def check(self) -> None:
        _check_tier("l1", self)


@dataclass(frozen=True)
class L2Config:
    enabled: bool = field(default=False, metadata=_opt("bool", doc="run the disk tier"))
    path: str = field(
        default="var/l2", metadata=_opt("str", doc="directory of the data files and index")
    )
    capacity_bytes: int = field(default=8 << 30, metadata=_opt("size", lo=1 << 20))
    segment_bytes: int = field(default=64 << 20, metadata=_opt("size", lo=4096))
    file_bytes: int = field(
        default=4 << 30, metadata=_opt("size", lo=4096, doc="size of each preallocated data file")
    )
    io_threads: int = field(default=4, metadata=_opt("int", lo=1, hi=64))
    direct_io: bool = field(
        default=True,
        metadata=_opt("bool", doc="O_DIRECT where the filesystem allows; buffered I/O elsewhere"),
    )
    admission: str = field(
        default="",
        metadata=_opt(
            "str",
            doc="which blocks L2 takes: always, second_hit, tinylfu; empty = second_hit for "
            "selective, else the eviction policy's default",
        ),
    )
    write_policy: str = field(
        default="write_back",
        metadata=_opt("str", choices=("write_back", "write_through", "selective")),
    )
    high_watermark: float = field(default=0.95, metadata=_opt("float", lo=0.05, hi=1.0))
    low_watermark: float = field(default=0.90, metadata=_opt("float", lo=0.0, hi=1.0))
    flush_on_stop: bool = field(
        default=True,
        metadata=_opt("bool", doc="on SIGTERM, write every block only in L1 to L2 before exiting"),
    )
    flush_timeout_s: float = field(
        default=60.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=0.0,
            hi=86400.0,
            doc="the flush at stop starts no write after this long (blocks not written by "
            "then are lost, L2 stays consistent; under write_bytes_s it goes in groups of an "
            "eighth of what that limit lets through in this time, so the part that fits is "
            "written); keep server.drain_timeout_s plus this "
            "below what the service manager waits for kvtierd to exit (the unit's "
            "TimeoutStopSec, a pod's terminationGracePeriodSeconds)",
        ),
    )
    enospc_retry_s: float = field(default=30.0, metadata=_opt("float", unit="s", lo=0.1))
    index_watch_s: float = field(
        default=2.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=0.0,
            hi=3600.0,
            doc="how often the index files are checked between commits (a stat of two files): "
            "an index.sqlite3 or -wal removed while the daemon runs is written back or "
            "checkpointed within this time, not only at the next commit, so a crash after "
            "it loses no block; the same thread ends a full disk's or a lock's fault where "
            "no write came in enospc_retry_s (it commits one page); 0 checks only at commits "
            "and at the stop, and those faults end only with a write",
        ),
    )
    read_bytes_s: int = _rate("reads from this tier")
    write_bytes_s: int = _rate("writes into this tier")
    policy: str = _tier_policy()

    def check(self) -> None:
        _check_tier("l2", self)
        if self.enabled and not self.path:
            raise ConfigError("tiers.l2.path is empty")
        if 0 < self.index_watch_s < MIN_INDEX_WATCH_S:
            raise ConfigError(
                f"config key 'tiers.l2.index_watch_s': {self.index_watch_s:g} is below "
                f"{MIN_INDEX_WATCH_S:g} s; 0 turns the watch off"
            )
        from kvtier.daemon.policy.admission import admission_names

        usable = [n for n in admission_names() if n != "belady"]  # belady needs the future
        if self.admission and self.admission not in usable:
            raise ConfigError(
                f"config key 'tiers.l2.admission': {self.admission!r} is not one of "
                f"{', '.join(usable)}"
            )


@dataclass(frozen=True)
class L3Config:
    """The cluster tier on Redis / Valkey. Every key but ``enabled``, ``admission`` and
    ``known_s`` (the daemon's own) is a field of the tier's own ``RemoteOptions`` (``tier_options()``; a test keeps them equal)."""

    enabled: bool = field(default=False, metadata=_opt("bool", doc="run the cluster tier"))
    urls: tuple[str, ...] = field(
        default=("redis://127.0.0.1:6379",),
        metadata=_opt(
            "strs",
            doc="redis:// or rediss:// (TLS) URLs: the server, or any nodes of a cluster",
        ),
    )
    mode: str = field(default="single", metadata=_opt("str", choices=("single", "cluster")))
    key_prefix: str = field(
        default="kvtier:", metadata=_opt("str", doc="prefix of every key the tier writes")
    )
    username: str = field(default="", metadata=_opt("str", doc="ACL user; empty: default"))
    password_file: str = field(
        default="",
        metadata=_opt("str", doc="file holding the password (never on a command line or URL)"),
    )
    tls: bool = field(default=False, metadata=_opt("bool", doc="TLS (also implied by rediss://)"))
    tls_ca_file: str = field(default="", metadata=_opt("str", doc="CA bundle; empty: system"))
    tls_cert_file: str = field(default="", metadata=_opt("str", doc="client certificate"))
    tls_key_file: str = field(default="", metadata=_opt("str", doc="client certificate's key"))
    ttl_s: int = field(
        default=3600,
        metadata=_opt(
            "int",
            unit="s",
            lo=0,
            doc="expiry of every block written, s; 0: never expires. A block also held "
            "locally is written again at an access half of it after it was written there",
        ),
    )
    max_value_bytes: int = field(
        default=64 << 20,
        metadata=_opt("size", lo=4096, hi=512 << 20, doc="largest value (header + block)"),
    )
    pool_size: int = field(
        default=16, metadata=_opt("int", lo=2, hi=1024, doc="connections per server")
    )
    connect_timeout_s: float = field(
        default=1.0, metadata=_opt("float", unit="s", lo=0.001, hi=600)
    )
    op_timeout_s: float = field(
        default=2.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=0.001,
            hi=600,
            doc="longest wait for one batch; then the tier is DOWN (a cluster: that master lost)",
        ),
    )
    probe_deadline_ms: float = field(
        default=50.0,
        metadata=_opt(
            "float", unit="ms", lo=0.01, hi=60_000, doc="a Lookup waits this long for L3"
        ),
    )
    backoff_initial_s: float = field(
        default=0.5, metadata=_opt("float", unit="s", lo=0.001, hi=3600)
    )
    backoff_max_s: float = field(default=30.0, metadata=_opt("float", unit="s", lo=0.001, hi=3600))
    write_bytes_s: int = field(
        default=0,
        metadata=_opt("size", lo=0, doc="write budget, bytes/s; writes beyond it are dropped"),
    )
    removals_file: str = field(
        default="",
        metadata=_opt(
            "str",
            doc="small SQLite file that keeps the removals (Deletes) L3 has not confirmed "
            "across restarts, one daemon's own (locked while it runs: a second daemon given "
            "it does not start; those L2's index kept are moved into it at start); empty: in "
            "L2's index when L2 is enabled, else nowhere (a restart forgets them)",
        ),
    )
    admission: str = field(
        default="second_hit",
        metadata=_opt("str", doc="which blocks are written to L3: always, second_hit, tinylfu"),
    )
    known_s: float = field(
        default=30.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=1.0,
            hi=86400.0,
            doc="how long the node trusts that L3 still holds a block it holds nowhere else, "
            "from when L3 last confirmed it (written, found by a lookup, read); then a lookup "
            "of it asks L3 again, and the node forgets it once unconfirmed for twice as long; "
            "at most ttl_s when ttl_s > 0",
        ),
    )

    def known_limit_s(self) -> float:
        """``known_s``, capped at ``ttl_s`` (when blocks expire): past that the store may have
        dropped the block on its own."""
        return min(self.known_s, float(self.ttl_s)) if self.ttl_s > 0 else self.known_s

    def forget_after_s(self) -> float:
        """How long a row held only in L3 may go unconfirmed before the node forgets it:
        twice ``known_limit_s``. A lookup confirms the rows of its chain unconfirmed for
        ``known_limit_s`` (it asks L3 again), so every row a lookup answers stays for
        ``known_limit_s`` at least after it: the Get that follows finds it (a Get does not
        ask L3). Rows no lookup asks about only take memory, which forgetting them bounds."""
        return 2 * self.known_limit_s()

    def stale_after_s(self) -> float:
        """How long the node trusts the L3 copy of a block it also holds locally: half
        ``ttl_s`` from when it was written there, by this node or by another (a copy found
        there for a block not held here then: dated from its expiry, ``KeyTier.value_ages``;
        its expiry runs from its write, which a later read or probe that finds it does not
        renew), never when blocks do not expire. Then the copy is dropped from the
        table, and the block is written to L3 again at its next access L3's admission
        takes."""
        return self.ttl_s / 2 if self.ttl_s > 0 else float("inf")

    def tier_options(self) -> Any:
        """The tier's ``RemoteOptions`` (imported here: ``tiers/`` never imports the
        daemon's config)."""
        from kvtier.tiers.remote.options import RemoteOptions

        names = {f.name for f in dataclasses.fields(RemoteOptions)}
        return RemoteOptions(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})

    def check(self) -> None:
        from kvtier.daemon.policy.admission import admission_names
        from kvtier.tiers.remote.options import RemoteOptionsError

        usable = [n for n in admission_names() if n != "belady"]  # belady needs the future
        if self.admission not in usable:
            raise ConfigError(
                f"config key 'tiers.l3.admission': {self.admission!r} is not one of "
                f"{', '.join(usable)}"
            )
        if not self.enabled:
            return
        try:
            self.tier_options().check()
        except RemoteOptionsError as e:
            raise ConfigError(f"tiers.l3: {e}") from None


@dataclass(frozen=True)
class TiersConfig:
    """One subsection per tier kind, fastest first. L1 always runs; the others when enabled."""

    l0: L0Config = field(default_factory=L0Config)
    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)
    l3: L3Config = field(default_factory=L3Config)

    def check(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).check()


@dataclass(frozen=True)
class MoverConfig:
    workers: int = field(
        default=2,
        metadata=_opt("int", lo=1, hi=64, doc="background transfers that may run at once"),
    )
    batch_bytes: int = field(
        default=64 << 20,
        metadata=_opt(
            "size",
            lo=4096,
            doc="most bytes in one transfer between tiers (on the disk tier at most one "
            "fdatasync and one index commit each; transfers finishing together share them)",
        ),
    )
    batch_blocks: int = field(
        default=4096,
        metadata=_opt("int", lo=1, hi=65536, doc="most blocks in one transfer between tiers"),
    )
    balance_interval_s: float = field(
        default=0.1,
        metadata=_opt("float", unit="s", lo=0.001, hi=60, doc="how often watermarks are checked"),
    )

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class PolicyConfig:
    name: str = field(
        default="heat",
        metadata=_opt("str", doc="eviction policy by name (heat, density, lru, arc)"),
    )
    protect_s: float = field(
        default=2.0,
        metadata=_opt(
            "float", unit="s", lo=0, doc="a block just written or read is not evicted for this long"
        ),
    )
    warmup_s: float = field(
        default=0.0,
        metadata=_opt(
            "float", unit="s", lo=0, doc="after start, evict only at the hard capacity limit"
        ),
    )
    readahead_blocks: int = field(
        default=4,
        metadata=_opt(
            "int", lo=0, hi=1024, doc="reading block i of a chain prefetches i+1..i+k from L2"
        ),
    )
    half_life_s: float = field(
        default=30.0,
        metadata=_opt(
            "float", unit="s", lo=0.001, doc="heat half-life: how fast past accesses fade"
        ),
    )
    hint_max_s: float = field(
        default=60.0,
        metadata=_opt(
            "float",
            unit="s",
            lo=0,
            hi=3600,
            doc="a Prefetch deadline protects the blocks it names from eviction until then, "
            "for at most this long (0: Prefetch protects nothing)",
        ),
    )
    hint_max_share: float = field(
        default=0.5,
        metadata=_opt(
            "float",
            lo=0,
            hi=1,
            doc="where tenants are configured, the blocks one tenant's hints and pins "
            "(Lookup(pin=true)) protect at once hold at most this share of the top tier's "
            "capacity, each block counted once, as the slot it takes there (without "
            "tenants, no limit); a hint's blocks "
            "past it are promoted, not protected, and a pin past it is RESOURCE_EXHAUSTED",
        ),
    )
    hint_max_total_share: float = field(
        default=0.8,
        metadata=_opt(
            "float",
            lo=0,
            hi=1,
            doc="where tenants are configured, the blocks every tenant's hints and pins "
            "protect at once hold at most this share of the top tier's capacity together (the "
            "rest of the tier stays open to eviction, so puts find room); without tenants, no "
            "limit",
        ),
    )
    history_factor: float = field(
        default=2.0,
        metadata=_opt(
            "float",
            lo=0,
            hi=64,
            doc="the policies remember dropped blocks (the few values of their policy state "
            "that make up a block's history and the key's identity: about 60 bytes each) up "
            "to this many times the blocks held, so a block that returns is known; 0 forgets "
            "a block as it goes",
        ),
    )

    def check(self) -> None:
        _check_policy("policy.name", self.name)
        if self.hint_max_share > self.hint_max_total_share:
            raise ConfigError(
                f"policy.hint_max_share ({self.hint_max_share:g}) exceeds "
                f"policy.hint_max_total_share ({self.hint_max_total_share:g}): one tenant's "
                "bound would be above every tenant's together"
            )


@dataclass(frozen=True)
class LoggingConfig:
    level: str = field(
        default="INFO", metadata=_opt("str", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    )
    format: str = field(default="text", metadata=_opt("str", choices=("text", "json")))

    def check(self) -> None:
        pass


def split_host_port(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or a bare port (on ``default_host``); port 0 takes
    any free port."""
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = default_host, address
    host = host.strip("[]") or default_host
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port or a port number")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``split_host_port``'s inverse)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_url(host: str, port: int, path: str) -> str:
    """``http://host:port/path``, an IPv6 host in brackets."""
    return f"http://{join_host_port(host, port)}{path}"


@dataclass(frozen=True)
class MetricsConfig:
    address: str = field(
        default="",
        metadata=_opt(
            "str",
            doc="where Prometheus scrapes /metrics (and probes ask /healthz and /readyz): "
            "host:port, or a port on 127.0.0.1; empty (the default) serves neither",
        ),
    )
    token_file: str = field(
        default="",
        metadata=_opt(
            "str",
            doc="file holding a bearer token (readable by its owner only) that every scrape "
            "must present, read again at SIGHUP; empty: anyone who reaches the address may "
            "scrape",
        ),
    )

    def check(self) -> None:
        if self.address:
            try:
                split_host_port(self.address)
            except ValueError as e:
                raise ConfigError(f"config key 'metrics.address': {e}") from None


TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# The tenant of an admin peer (root, the daemon's user, server.admin_uids) that belongs to no
# configured tenant; no configured tenant may take the name.
ADMIN_TENANT = "admin"
# The one tenant of a daemon without tenants configured: every local peer belongs to it.
DEFAULT_TENANT = "default"


def _quota(label: str) -> Any:
    return field(
        default=0,
        metadata=_opt("size", lo=0, doc=f"bytes the tenant may hold on {label}; 0: no quota"),
    )


@dataclass(frozen=True)
class QuotaConfig:
    """Bytes per tier (slot tiers only: L3 keeps its own index and expires by TTL)."""

    l0: int = _quota("the GPU tier")
    l1: int = _quota("the host tier")
    l2: int = _quota("the disk tier")

    def check(self) -> None:
        pass

    def by_label(self) -> dict[str, int]:
        """``{"L1": bytes, ...}`` for the tiers with a quota."""
        return {
            f.name.upper(): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name)
        }


@dataclass(frozen=True)
class TenantConfig:
    """Who belongs to a tenant: processes of its uids, of its gids (the primary group the
    kernel reports), or holding its token."""

    name: str = field(default="", metadata=_opt("str", doc="letters, digits, '.', '_', '-'"))
    uids: tuple[str, ...] = field(
        default=(), metadata=_opt("idents", doc="users (names or uids) of the tenant")
    )
    gids: tuple[str, ...] = field(
        default=(), metadata=_opt("idents", doc="groups (names or gids) of the tenant")
    )
    token_file: str = field(
        default="",
        metadata=_opt(
            "str",
            doc="file holding the tenant's secret token (readable by its owner only), read "
            "again at SIGHUP; a session that presents it belongs to the tenant (required over "
            "TCP)",
        ),
    )
    admin: bool = field(
        default=False, metadata=_opt("bool", doc="the tenant's sessions may use admin calls")
    )
    quotas: QuotaConfig = field(default_factory=QuotaConfig)

    def check(self) -> None:
        pass

    def uid_set(self, where: str) -> frozenset[int]:
        return _resolve_ids(f"{where}.uids", self.uids, user=True)

    def gid_set(self, where: str) -> frozenset[int]:
        return _resolve_ids(f"{where}.gids", self.gids, user=False)


@dataclass(frozen=True)
class SharedNamespaceConfig:
    """A namespace that several tenants use together ("shared:NAME" in requests)."""

    name: str = field(default="", metadata=_opt("str", doc="letters, digits, '.', '_', '-'"))
    tenants: tuple[str, ...] = field(
        default=(), metadata=_opt("strs", doc="the tenants that may use it")
    )
    quotas: QuotaConfig = field(default_factory=QuotaConfig)

    def check(self) -> None:
        pass


def _check_access(config: Config) -> None:
    """Tenants and shared namespaces, across records: names, overlaps, references."""
    names: set[str] = set()
    owner_of_uid: dict[int, str] = {}
    owner_of_gid: dict[int, str] = {}
    for i, tenant in enumerate(config.tenants):
        where = f"tenants[{i}]"
        if not TENANT_NAME.fullmatch(tenant.name):
            raise ConfigError(
                f"config key '{where}.name': {tenant.name!r} is not 1-64 letters, digits, "
                "'.', '_' or '-' (starting with a letter or digit)"
            )
        if tenant.name == ADMIN_TENANT:
            raise ConfigError(
                f"config key '{where}.name': {ADMIN_TENANT!r} is reserved for admin peers "
                "that belong to no tenant"
            )
        if tenant.name in names:
            raise ConfigError(f"config key '{where}.name': tenant {tenant.name!r} appears twice")
        names.add(tenant.name)
        if not (tenant.uids or tenant.gids or tenant.token_file):
            raise ConfigError(
                f"config key '{where}': tenant {tenant.name!r} names no uids, gids or "
                "token_file, so no session could ever belong to it"
            )
        for kind, ids, seen in (
            ("uid", tenant.uid_set(where), owner_of_uid),
            ("gid", tenant.gid_set(where), owner_of_gid),
        ):
            for n in sorted(ids):
                if n in seen:
                    raise ConfigError(
                        f"config key '{where}.{kind}s': {kind} {n} is already tenant "
                        f"{seen[n]!r}'s; a peer belongs to one tenant"
                    )
                seen[n] = tenant.name
    quotas: list[tuple[str, QuotaConfig]] = [
        *((f"tenants[{i}]", t.quotas) for i, t in enumerate(config.tenants)),
        *((f"shared_namespaces[{i}]", s.quotas) for i, s in enumerate(config.shared_namespaces)),
    ]
    for where, quota in quotas:
        for tier in ("l0", "l2"):
            if getattr(quota, tier) and not getattr(config.tiers, tier).enabled:
                raise ConfigError(
                    f"config key '{where}.quotas.{tier}': tiers.{tier} is not enabled"
                )
    shared: set[str] = set()
    for i, space in enumerate(config.shared_namespaces):
        where = f"shared_namespaces[{i}]"
        if not TENANT_NAME.fullmatch(space.name):
            raise ConfigError(
                f"config key '{where}.name': {space.name!r} is not 1-64 letters, digits, "
                "'.', '_' or '-' (starting with a letter or digit)"
            )
        if space.name in shared:
            raise ConfigError(f"config key '{where}.name': {space.name!r} appears twice")
        shared.add(space.name)
        for t in space.tenants:
            if t not in names:
                raise ConfigError(f"config key '{where}.tenants': no tenant {t!r} is configured")
    if config.server.tcp_address and not any(t.token_file for t in config.tenants):
        raise ConfigError(
            "config key 'server.tcp_address': TCP peers have no credentials, so sessions over "
            "TCP need a tenant token; configure a tenant with a token_file"
        )


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    mover: MoverConfig = field(default_factory=MoverConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tenants: tuple[TenantConfig, ...] = field(
        default=(),
        metadata=_opt(
            "records",
            record=TenantConfig,
            doc="who may use the daemon, as which tenant; empty: every local peer is the "
            "tenant 'default'",
        ),
    )
    shared_namespaces: tuple[SharedNamespaceConfig, ...] = field(
        default=(),
        metadata=_opt(
            "records",
            record=SharedNamespaceConfig,
            doc="namespaces that several tenants use together",
        ),
    )

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def printable(self) -> dict[str, Any]:
        """``as_dict`` with sizes in units (``1GiB``), as ``--print-config`` shows it; loading
        it back gives the same config."""
        return _printable(self)


def _printable(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _printable(value)
        elif f.metadata and f.metadata["kind"] == "records":
            out[f.name] = [_printable(record) for record in value]
        elif f.metadata and f.metadata["kind"] in ("strs", "idents"):
            out[f.name] = list(value)
        elif f.metadata and f.metadata["kind"] == "size":
            out[f.name] = format_size(value)
        else:
            out[f.name] = value
    return out


def config_keys(cls: Any = None, prefix: str = "") -> list[str]:
    """Every key's dotted path (``tiers.l1.capacity_bytes``), in declaration order."""
    keys: list[str] = []
    for f in dataclasses.fields(cls or Config):
        where = f"{prefix}{f.name}"
        if _is_section(f):
            keys += config_keys(f.default_factory, where + ".")
        else:
            keys.append(where)
    return keys


ENV_PREFIX = "KVTIER_"


def env_name(key: str) -> str:
    """The environment variable of a config key: ``tiers.l1.capacity_bytes`` is
    ``KVTIER_TIERS_L1_CAPACITY_BYTES``."""
    return ENV_PREFIX + key.upper().replace(".", "_")


def env_overrides(environ: Mapping[str, str]) -> list[str]:
    """``section.key=value`` overrides from ``KVTIER_*`` variables. A variable under a
    section's prefix (``KVTIER_TIERS_...``) that names no key, a section's own
    (``KVTIER_SERVER``), or a top-level list's in another case or under its prefix
    (``KVTIER_tenants``, ``KVTIER_TENANTS_0``) is an error saying what it names
    (``_env_hint``), as an unknown key in the file is; other ``KVTIER_*`` variables
    (``KVTIER_ADDRESS``, the client's) are not config."""
    names = {env_name(k): k for k in config_keys()}
    out = []
    for var, value in sorted(environ.items()):
        if var in names:
            out.append(f"{names[var]}={value}")
        # The hint's search (0.1 ms) only for ours: a pod's environment holds hundreds.
        elif (
            var[: len(ENV_PREFIX)].upper() == ENV_PREFIX
            and (hint := _env_hint(var, names)) is not None
        ):
            raise ConfigError(f"environment variable {var} names no config key {hint}")
    return out


def _env_hint(var: str, names: Mapping[str, str]) -> str | None:
    """What ``var``, the variable of no key in ``names``, names instead: a section; else the
    nearest key's variable in the deepest section whose prefix it has, else that section's
    keys, as the file's error lists them; None under no section (not config). Read in
    capitals (``KVTIER_server_socket`` was skipped and the config taken without it), and
    only the section's keys are near: over every key, ``KVTIER_TIERS_L1_`` was pointed at
    tiers.l3.tls and ``KVTIER_SERVER_X...`` at tiers.l1.capacity_bytes."""
    upper = var.upper()
    sections = {env_name(k[:i]): k[:i] for k in names.values() for i, c in enumerate(k) if c == "."}
    if (section := sections.get(upper.rstrip("_"))) is not None:
        # No value sets a whole section (``KVTIER_SERVER``, ``KVTIER_TIERS_L1``).
        first = next(k for k in names.values() if k.startswith(section + "."))
        return (
            f"but the section {section} (a key's variable names the key too: "
            f"{env_name(first)} is {first}'s)"
        )
    within = max(
        (s for s in sections.values() if upper.startswith(env_name(s) + "_")), key=len, default=""
    )
    if not within:
        # The top level's keys are lists (``tenants``), each set whole by its own variable:
        # in another case (``KVTIER_tenants``) too, which was skipped, the tenants with it.
        lists = [
            k
            for k in names.values()
            if "." not in k and (upper + "_").startswith(env_name(k) + "_")
        ]
        if not lists:
            return None
        return f"(the variable of {lists[0]} is {env_name(lists[0])}, for its whole list as YAML)"
    keys = [k for k in names.values() if k.startswith(within + ".")]
    # Only what follows the section's prefix is compared: the prefix every candidate shares
    # made any variable of the section near one (KVTIER_SERVER_ZZZZZZZZ: server.socket).
    prefix = env_name(within) + "_"
    close = difflib.get_close_matches(
        upper[len(prefix) :], [env_name(k)[len(prefix) :] for k in keys], n=1
    )
    if close:
        return f"(did you mean {prefix + close[0]}, the variable of {names[prefix + close[0]]}?)"
    known = dict.fromkeys(k[len(within) + 1 :].split(".")[0] for k in keys)
    return f"(known in {within}: {', '.join(known)})"


def not_rereadable(path: str | Path) -> str | None:
    """Why the config file ``path`` cannot be read again as it was at start (it is a pipe, a
    FIFO or a device, not a regular file), or None; a file that cannot be opened is for
    ``load_config`` to name."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return (
        f"config file {path} is not a regular file (a pipe, a FIFO or a device): it was read "
        "once at start and cannot be read again; restart kvtierd to change its config"
    )


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The effective config: defaults, then the file, then ``KVTIER_*`` variables of
    ``environ`` (none unless given), then ``section.key=value`` overrides."""
    if environ is not None:
        overrides = [*env_overrides(environ), *overrides]
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_CONFIG_FILE_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        if len(data) > MAX_CONFIG_FILE_BYTES:
            raise ConfigError(
                f"config file {path} holds more than {MAX_CONFIG_FILE_BYTES >> 20} MiB; a "
                "config is a few KiB: is it the right file?"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                f"{e.start})"
            ) from None
        try:
            loaded = _load_yaml(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
        except RecursionError:
            raise ConfigError(f"config file {path} nests too deeply to be a config") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        raw = loaded or {}
    lists = {f.name for f in dataclasses.fields(Config) if not _is_section(f)}
    for item in overrides:
        key, sep, value = item.partition("=")
        path_parts = key.strip().split(".")
        if sep and len(path_parts) == 1 and path_parts[0] in lists:
            pass  # a top-level list (tenants=[...]), as YAML
        elif not sep or len(path_parts) < 2 or not all(path_parts):
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        node = raw
        for depth, part in enumerate(path_parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"'{'.'.join(path_parts[: depth + 1])}' must be a mapping")
        node[path_parts[-1]] = _override_value(key.strip(), value, _key_meta(path_parts))
    return build_config(raw)


def _key_meta(path_parts: list[str]) -> Mapping[str, Any] | None:
    """The metadata (``_opt``) of the key ``path_parts`` names, or None where it names no key
    (``build_config`` says so)."""
    cls: Any = Config
    for depth, part in enumerate(path_parts):
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if f is None:
            return None
        if not _is_section(f):
            return f.metadata if f.metadata and depth == len(path_parts) - 1 else None
        cls = f.default_factory
    return None


def _override_value(key: str, text: str, meta: Mapping[str, Any] | None = None) -> Any:
    """A ``--set`` or environment value, read as YAML (``true``, ``2``, ``0.5``); text YAML
    cannot read (``[::1]:5000``) stays the string given, but a mapping in it that names a key
    twice is refused as a file's is (taken as a string, it was refused as not a mapping). A
    string key (``meta`` of kind ``str``) takes the text as written unless it is quoted (read
    as YAML) or a list or mapping in brackets (refused, naming the key): YAML reads
    ``kvtier:`` as a mapping, ``no`` as false and ``0123`` as the octal 83, so the default
    ``tiers.l3.key_prefix`` was refused and ``0123`` became ``83``, a prefix no other node's
    file would give; and it drops `` # ...`` as a comment, which a path may hold. A key of
    choices (words) reads it as YAML, as a file's: ``off`` is false, which
    ``tiers.l1.pin_memory`` takes as its choice ``false``."""
    stripped = text.strip()
    if not stripped:
        return ""
    free_text = meta is not None and meta["kind"] == "str" and meta["choices"] is None
    if free_text and not stripped.startswith(("'", '"', "[", "{")):
        return stripped
    try:
        return _load_yaml(text)
    except _RepeatedKey as e:
        raise ConfigError(f"config key '{key}': {e.problem}") from None
    except (yaml.YAMLError, RecursionError):
        return text


def _yaml_problem(error: yaml.YAMLError) -> str:
    """One line for what YAML could not read, with where: PyYAML's own text spans lines (the
    spot quoted under a caret), and a reload's error is one line of the daemon's log."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return " ".join(str(error).split())
    mark = error.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = f" ({error.context})" if error.context else ""
    return f"{where}{error.problem or 'not YAML'}{context}"


class _RepeatedKey(yaml.constructor.ConstructorError):
    """A key given twice in one mapping (``_StrictLoader``)."""


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: plain
    YAML keeps the last value, so a key repeated further down a long file (or a section
    repeated, which replaces every key of the first) would silently undo what the operator
    sees written above it. Merge keys (``<<: *base``) are not repeats."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    line = first.get(key)
                except TypeError:
                    continue  # unhashable: the base constructor says so
                if line is not None:
                    raise _RepeatedKey(
                        None,
                        None,
                        f"key {key!r} appears twice in one mapping (first on line {line + 1}); "
                        "YAML would silently keep only the last",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        """A value YAML takes for a type it then cannot build (a date 2001-13-01, ``!!int x``)
        is a YAML error at its place: YAML's constructors raise ValueError (AttributeError
        for ``!!timestamp x``), which escaped the load, stopping kvtierd with a traceback and
        a SIGHUP's reload before the token files were read again."""
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, AttributeError, OverflowError) as e:
            shown = f" {node.value!r}" if isinstance(node, yaml.ScalarNode) else ""
            what = node.tag.rpartition(":")[2]
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read{shown} as YAML's {what}: {e}", node.start_mark
            ) from None


class _PlainNumber(str):
    """A scalar written without quotes as a number PyYAML reads as a string
    (``_PLAIN_NUMBER_RE``): a number where a key takes one, else the text it is."""


def _read_as(
    kind: type[str], name: str, pattern: re.Pattern[str], first: str, *, ahead: bool
) -> None:
    """Have ``_StrictLoader`` read a plain scalar (a quoted one keeps its string tag) that
    matches ``pattern`` as ``kind`` (its text): with ``ahead``, before YAML's own resolvers
    for the same first characters (its int resolver would match first), else after them."""
    tag = f"tag:kvtier,2026:{name}"
    _StrictLoader.add_implicit_resolver(tag, pattern, list(first))
    if ahead:
        for ch in first:
            resolvers = _StrictLoader.yaml_implicit_resolvers[ch]
            resolvers.insert(0, resolvers.pop())

    def construct(loader: _StrictLoader, node: yaml.ScalarNode) -> str:
        return kind(loader.construct_scalar(node))

    _StrictLoader.add_constructor(tag, construct)


_read_as(_PlainNumber, "plain-number", _PLAIN_NUMBER_RE, "-+.0123456789", ahead=False)


class _LeadingZero(str):
    """A scalar written without quotes as digits with a leading zero (``_LEADING_ZERO_RE``),
    which YAML 1.1 reads as an octal number."""


_read_as(_LeadingZero, "leading-zero", _LEADING_ZERO_RE, "-+0", ahead=True)


class _IntAsWritten(str):
    """A scalar written without quotes as an integer in another form than decimal digits
    (``_INT_AS_WRITTEN_RE``): the integer YAML 1.1 reads (``_int_as_written``) where a key
    takes a number or an id, else the text it is."""


_read_as(_IntAsWritten, "int-as-written", _INT_AS_WRITTEN_RE, "-+0123456789", ahead=True)


def _int_as_written(value: _IntAsWritten) -> int:
    """The integer YAML 1.1 reads from ``value``."""
    try:
        return int(yaml.safe_load(str(value)))
    except ValueError:  # no digit (0x_): YAML's own reading fails
        raise ValueError(f"{str(value)!r} is not a number") from None


def _yaml_octal(value: _LeadingZero) -> int | None:
    """YAML 1.1's octal reading of ``value``, or None where YAML reads it as text (``08``)."""
    if not _YAML_OCTAL_RE.match(value):
        return None
    return int(value.replace("_", ""), 8)


def _number_as_written(value: Any) -> Any:
    """``value`` as YAML 1.1 reads it, for a key that takes a number or an id (``0x1F`` is
    31). A number written with a leading zero is refused where its octal reading is not the
    number written (``0100`` is 64); where it is (``07``) it is that number, and ``08`` (no
    octal) stays the text YAML reads, which ids and sizes take as decimal digits: both loaded
    so before, and ``--print-config`` writes an id given as ``"0800"`` plain, which must load
    back."""
    if isinstance(value, _IntAsWritten):
        return _int_as_written(value)
    if not isinstance(value, _LeadingZero):
        return value
    octal = _yaml_octal(value)
    if octal is None:
        return value
    if octal != int(value.replace("_", "")):
        raise ValueError(
            f"{str(value)!r} is written with a leading zero, which YAML reads as the octal "
            f"number {octal}: write it without the leading zero"
        )
    return octal


def _quoted(value: object) -> str:
    """What a number written in quotes is told: it was read as a string."""
    if type(value) is str and _NUMBER_RE.fullmatch(value):
        return " (quoted, it is a string: write the number without quotes)"
    return ""


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds plain data only


# Sections that moved; naming the new place beats "unknown section".
_MOVED = {"l0": "tiers.l0", "l1": "tiers.l1", "l2": "tiers.l2"}


def build_config(raw: dict[str, Any]) -> Config:
    for old, new in _MOVED.items():
        if old in raw:
            raise ConfigError(f"config section '{old}' is now '{new}' (see deploy/kvtier.yaml)")
    config = _build_section("", Config, raw)
    if config.server.socket == AUTO_SOCKET:
        socket = paths.daemon_socket()
        if "," in socket:
            # Said here, where the path's origin is known: the check below names only the key.
            raise ConfigError(
                f"config key 'server.socket': auto chose {socket!r} (under $RUNTIME_DIRECTORY "
                "or $XDG_RUNTIME_DIR, else /tmp), which holds a comma: gRPC reads one in an "
                "address as the start of another socket path, so no client could reach it; "
                "set server.socket to a path without one"
            )
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, socket=socket)
        )
    check_config(config)
    _check_enabled_said(raw.get("tiers"))
    return config


def _check_enabled_said(tiers: Any) -> None:
    """A tier that runs only when enabled, given settings but not ``enabled``, is refused: the
    operator who wrote them (``tiers: l2: path: ...``) means it to run, and would otherwise find
    it off with nothing said. ``enabled: false`` keeps settings for later, as
    deploy/kvtier.yaml does. Run after the values' own checks, which name a bad value first."""
    for name, tier in dataclasses.asdict(TiersConfig()).items():
        given = tiers.get(name) if isinstance(tiers, dict) else None
        if "enabled" in tier and given and "enabled" not in given:
            raise ConfigError(
                f"config section 'tiers.{name}' sets {', '.join(map(str, given))} but not "
                f"'enabled', and this tier runs only when enabled: add 'tiers.{name}.enabled: "
                "true' to run it, or 'enabled: false' to keep it off"
            )


def check_config(config: Config) -> None:
    """Every check across keys (each section's, then tenants and shared namespaces); a
    ConfigError names the key at fault. ``build_config`` runs it, and a reload runs it again on
    the config it would run with, which mixes new live keys with running ones."""
    for f in dataclasses.fields(Config):
        if _is_section(f):
            getattr(config, f.name).check()
    _check_access(config)


def _is_section(f: dataclasses.Field[Any]) -> bool:
    factory = f.default_factory
    return factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory)


def _build_section(section: str, cls: Any, values: Any) -> Any:
    """Build ``cls`` from a mapping; fields that are dataclasses are nested sections."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"config section '{section}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = f"{section}.{key}" if section else str(key)
        if key not in fields:
            what = "key" if section else "section"
            raise ConfigError(f"unknown config {what} '{where}'; known: {', '.join(fields)}")
        f = fields[key]
        if _is_section(f):
            kwargs[key] = _build_section(where, f.default_factory, value)
        elif not f.metadata:
            raise ConfigError(f"config key '{where}' must be a mapping of keys")
        else:
            kwargs[key] = _coerce(where, value, f.metadata)
    return cls(**kwargs)


def _canonical_choice(value: str, choices: tuple[str, ...] | None) -> str:
    """Choices match whatever their case (``debug`` is ``DEBUG``)."""
    for choice in choices or ():
        if choice.lower() == value.lower():
            return choice
    return value


def _coerce(where: str, value: Any, meta: Any) -> Any:
    kind = meta["kind"]
    try:
        if kind in ("size", "int", "float", "ident"):
            value = _number_as_written(value)
        if kind == "size":
            out: Any = parse_size(value)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"expected an integer, got {value!r}{_quoted(value)}")
            out = value
        elif kind == "float":
            written = value
            if isinstance(value, _PlainNumber):
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"expected a number, got {value!r}{_quoted(value)}")
            out = float(value)
            if not math.isfinite(out):
                # NaN passes every range check (each comparison is false) and then turns
                # watermarks, timeouts and decay into nonsense; infinity is no better.
                raise ValueError(f"expected a finite number, got {written!r}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            out = value
        elif kind == "strs":
            # A list of strings; one string is a list of one.
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise ValueError(f"expected a string or a list of strings, got {value!r}")
            out = tuple(str(v) for v in items)  # plain str, not _PlainNumber
        elif kind == "idents":
            # Users or groups by name or number; one is a list of one.
            items = [value] if isinstance(value, (str, int)) else value
            if not isinstance(items, list) or not all(
                isinstance(v, (str, int)) and not isinstance(v, bool) for v in items
            ):
                raise ValueError(f"expected a list of names or numbers, got {value!r}")
            items = [_number_as_written(v) for v in items]
            if any(isinstance(v, int) and v < 0 for v in items):
                raise ValueError(f"ids are not negative, got {value!r}")
            out = tuple(str(v) for v in items)
        elif kind == "records":
            if value is None:
                value = []
            if not isinstance(value, list):
                raise ValueError(f"expected a list of mappings, got {value!r}")
            out = tuple(
                _build_section(f"{where}[{i}]", meta["record"], item)
                for i, item in enumerate(value)
            )
        elif kind == "mode":
            # YAML reads 0660 as the octal number 432 (kept as written: ``_LeadingZero``); a
            # string "0660" stays a string.
            if isinstance(value, _LeadingZero) and (octal := _yaml_octal(value)) is not None:
                value = octal
            elif isinstance(value, _IntAsWritten):
                value = _int_as_written(value)
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"expected octal permission bits such as 0660, got {value!r}")
            text = value.removeprefix("0o") if isinstance(value, str) else ""
            if isinstance(value, str) and not re.fullmatch(r"[0-7]{1,4}", text):
                raise ValueError(f"{value!r} is not octal permission bits such as 0660")
            bits = value if isinstance(value, int) else int(text, 8)
            if not 0 <= bits <= 0o777:
                raise ValueError(
                    f"permission bits {value!r} are not within 0000-0777 "
                    "(YAML reads 660 as decimal: write 0660 or '0660')"
                )
            out = f"{bits:04o}"
        elif kind == "ident":
            # A user or group given by name, or by number (which YAML reads as an int).
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"expected a name or a number, got {value!r}")
            if isinstance(value, int) and value < 0:
                raise ValueError(f"ids are not negative, got {value}")
            out = str(value)
        elif kind == "str":
            if (
                isinstance(value, bool)
                and meta["choices"]
                and str(value).lower() in meta["choices"]
            ):
                value = str(value).lower()
            if isinstance(value, int) and not isinstance(value, bool):
                value = str(value)  # a bare port, as YAML reads it
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            out = _canonical_choice(str(value), meta["choices"])
        else:
            raise AssertionError(f"unknown option kind {kind}")
    except ConfigError:
        raise  # from a record inside a list: it names its own key
    except ValueError as e:
        raise ConfigError(f"config key '{where}': {e}") from None
    texts = (out,) if isinstance(out, str) else out if kind in ("strs", "idents") else ()
    if any("\0" in text for text in texts):
        # No key takes one: a path holding it ended the host checks in a traceback ('embedded
        # null byte'), a name the OS's lookups; and a socket path starting with one is Linux's
        # abstract namespace, which no file's mode or folder guards (anyone may take the name).
        raise ConfigError(
            f"config key '{where}': {value!r} holds a NUL byte, which no key takes (a socket is "
            "a path: abstract-namespace sockets are not supported)"
        )
    if meta["choices"] is not None and out not in meta["choices"]:
        raise ConfigError(
            f"config key '{where}': {out!r} is not one of {', '.join(meta['choices'])}"
        )
    if meta["lo"] is not None and out < meta["lo"]:
        raise ConfigError(f"config key '{where}': {out} is below the minimum {meta['lo']}")
    if meta["hi"] is not None and out > meta["hi"]:
        raise ConfigError(f"config key '{where}': {out} is above the maximum {meta['hi']}")
    return out
