"""Tenants: who a session belongs to, what it may do, and the namespaces it may address.

A session is bound to exactly one tenant when it opens, from what the server itself knows:
the peer's uid and gid (read by the kernel, through the credential socket's ticket), or a
tenant's secret token. The namespace of every request is derived here from that tenant and
the name the client declares inside it, so no client can name another tenant's namespace,
whatever keys it sends.

Rules:
- Without tenants configured, every local peer belongs to the tenant ``default`` (the
  daemon then behaves as one shared cache); sessions are limited per peer uid.
- With tenants configured, a peer belongs to the tenant listing its uid, else the one listing
  its (primary) gid; a uid or gid is listed by one tenant at most (the config checks it). A
  peer that matches none is refused, unless it is an admin peer, which then gets the tenant
  ``admin``.
- A token binds the session to the tenant whose token it is (compared in constant time
  against every tenant's); one that is more than one tenant's binds none. Over TCP a token is
  the only way in. On the Unix socket the token's tenant must be one the peer may use: its
  own, or a tenant that lists no uids and gids.
- Admin rights: the sessions of an ``admin: true`` tenant, and of root, the daemon's own user
  and ``server.admin_uids`` (root and the daemon's user could read the daemon's memory
  anyway). Admins may check, drain, and delete or evict in any tenant's namespace; they read
  no one's blocks.
- Namespace ids are 64-bit BLAKE2b hashes of (owner, declared name), where the owner is
  ``tenant:<name>`` or ``shared:<name>``: the same on every daemon with the same tenant names
  (a shared remote tier), and the same after a restart (blocks recovered from disk keep their
  tenant). The default tenant's unnamed namespace is 0, the id every block had before
  tenants existed, so an older disk index keeps serving.

- Tokens are read from their files at start and again at each SIGHUP (``set_tokens``): a
  replaced file's token binds new sessions from then on and the old one no longer does;
  sessions already open stay bound (but those whose token is now another tenant's or more
  than one's, which the reload ends, see ``rebind``). A SIGHUP that changes the tenants,
  shared namespaces or admin uids replaces them (``reloaded``, ``replace_with``); the reload
  then ends the open sessions that would not be bound as they are (``rebind``,
  daemon/reload.py).

Thread-safety: the event loop only (``set_tokens`` and ``replace_with`` are the changes after
construction).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvtier.daemon.config import ADMIN_TENANT, DEFAULT_TENANT, TENANT_NAME, Config
from kvtier.daemon.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvtier.daemon.sessions import PeerCred
from kvtier.paths import link_problem
from kvtier.tiers.base import TierKind
from kvtier.tiers.sizes import format_size

SHARED_PREFIX = "shared:"
# Namespace 0: the default tenant's unnamed namespace (see the module docstring).
DEFAULT_NAMESPACE = 0
MAX_NAMESPACE_BYTES = 200
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096
# A token file: the token and the whitespace around it (a newline, a CRLF).
MAX_TOKEN_FILE_BYTES = MAX_TOKEN_BYTES + 64
_PERSON = b"kvtier-ns-v1"


def _field(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def namespace_id(owner: str, name: str) -> int:
    """The namespace id of ``name`` inside ``owner`` (``tenant:<t>`` or ``shared:<s>``)."""
    if owner == f"tenant:{DEFAULT_TENANT}" and name == "":
        return DEFAULT_NAMESPACE
    h = hashlib.blake2b(_field(owner) + _field(name), digest_size=8, person=_PERSON)
    return int.from_bytes(h.digest(), "little") or 1  # 0 is the default's


class TokenFileError(OSError):
    """A token file that must not be used (readable by others, too short)."""


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(b"kvtier-token-v1" + token).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    token_digest: bytes = b""  # SHA-256 of the secret; empty: no token
    admin: bool = False
    quotas: Mapping[TierKind, int] = field(default_factory=dict)

    @property
    def by_credentials(self) -> bool:
        return bool(self.uids or self.gids)


@dataclass(frozen=True, slots=True)
class SharedSpace:
    name: str
    tenants: frozenset[str]
    quotas: Mapping[TierKind, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return SHARED_PREFIX + self.name


@dataclass(frozen=True, slots=True)
class Binding:
    """What a session is bound to when it opens."""

    tenant: str
    admin: bool
    # What the per-tenant session limit counts: the tenant, or the uid without tenants.
    limit_key: str
    # The digest of the token it was bound by (empty: by the peer's credentials), which a
    # reload binds it by again (``rebind``).
    token_digest: bytes = b""


@dataclass(frozen=True, slots=True)
class Space:
    """A namespace a request addresses: its id and the owner label its blocks count against
    (the tenant, or ``shared:<name>``)."""

    ns: int
    owner: str
    name: str


_SPACES_KEPT = 4096


class TenantDirectory:
    def __init__(
        self,
        tenants: Iterable[Tenant] = (),
        shared: Iterable[SharedSpace] = (),
        admin_uids: Iterable[int] = (),
    ) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.shared = {s.name: s for s in shared}
        self.admin_uids = frozenset(admin_uids)
        self._index()
        # Namespaces already resolved (each costs a hash and checks per request otherwise);
        # emptied when it reaches _SPACES_KEPT entries.
        self._spaces: dict[tuple[str, str, bool], Space] = {}

    def _index(self) -> None:
        self._by_uid = {uid: t for t in self.tenants.values() for uid in t.uids}
        self._by_gid = {gid: t for t in self.tenants.values() for gid in t.gids}
        self._tokens = [t for t in self.tenants.values() if t.token_digest]

    @property
    def configured(self) -> bool:
        return bool(self.tenants)

    def set_tokens(self, digests: Mapping[str, bytes]) -> list[str]:
        """Give each tenant named in ``digests`` that token digest (its token file, read
        again); returns the names whose token changed. Open sessions stay bound."""
        changed = []
        for name, digest in digests.items():
            tenant = self.tenants[name]
            if tenant.token_digest != digest:
                self.tenants[name] = dataclasses.replace(tenant, token_digest=digest)
                changed.append(name)
        if changed:
            self._index()
        return changed

    def token_clashes(self) -> list[list[str]]:
        """The names of the tenants that share a token, in groups (a token of more than one
        tenant binds none of them)."""
        by_digest: dict[bytes, list[str]] = {}
        for t in self._tokens:
            by_digest.setdefault(t.token_digest, []).append(t.name)
        return [names for names in by_digest.values() if len(names) > 1]

    @classmethod
    def from_config(cls, config: Config, read: bool = True) -> TenantDirectory:
        """The directory of a (checked) config; ``read``: read the token files (raises
        OSError when one cannot be used, see ``read_token_file``)."""
        tenants = []
        for i, tc in enumerate(config.tenants):
            where = f"tenants[{i}]"
            digest = _digest(read_token_file(tc.token_file)) if tc.token_file and read else b""
            tenants.append(
                Tenant(
                    tc.name,
                    tc.uid_set(where),
                    tc.gid_set(where),
                    digest,
                    tc.admin,
                    _quotas(tc.quotas.by_label()),
                )
            )
        shared = [
            SharedSpace(s.name, frozenset(s.tenants), _quotas(s.quotas.by_label()))
            for s in config.shared_namespaces
        ]
        admins = {0, os.geteuid(), *config.server.admin_uid_set()}
        return cls(tenants, shared, admins)

    def reloaded(self, running: Config, config: Config) -> TenantDirectory:
        """The directory of ``config`` for a reload from ``running`` (this directory's
        config): a tenant whose token file is the one it had keeps the token read before
        (the reload reads every token file again after, as for any reload); an added tenant's
        file, or a tenant's new path, is read now, and raises OSError when it cannot be used
        (``read_token_file``)."""
        fresh = TenantDirectory.from_config(config, read=False)
        paths = {tc.name: tc.token_file for tc in running.tenants}
        for tc in config.tenants:
            if not tc.token_file:
                continue
            before = self.tenants.get(tc.name)
            if paths.get(tc.name) == tc.token_file and before is not None and before.token_digest:
                digest = before.token_digest
            else:
                digest = _digest(read_token_file(tc.token_file))
            fresh.tenants[tc.name] = dataclasses.replace(
                fresh.tenants[tc.name], token_digest=digest
            )
        fresh._index()
        return fresh

    # --------------------------------------------------------------- binding

    def bind(self, peer: PeerCred | None, token: bytes) -> Binding:
        """The tenant of a new session (see the module rules); raises Unauthenticated or
        PermissionDenied with what to do about it."""
        if token:
            return self._bind_token(peer, token)
        if peer is None:
            raise Unauthenticated(
                "a session without peer credentials (over TCP) needs a tenant token "
                "(OpenSessionRequest.token, the content of the tenant's token_file)"
            )
        admin = peer.uid in self.admin_uids
        if not self.configured:
            return Binding(DEFAULT_TENANT, admin, f"uid:{peer.uid}")
        tenant = self._by_uid.get(peer.uid) or self._by_gid.get(peer.gid)
        if tenant is not None:
            return Binding(tenant.name, tenant.admin or admin, tenant.name)
        if admin:
            return Binding(ADMIN_TENANT, True, ADMIN_TENANT)
        raise PermissionDenied(
            f"uid {peer.uid} (gid {peer.gid}) belongs to no tenant: list it in a tenant's uids "
            "or gids in the daemon's config, or present a tenant token"
        )

    def _bind_token(self, peer: PeerCred | None, token: bytes) -> Binding:
        if len(token) > MAX_TOKEN_BYTES:
            raise Unauthenticated(f"the token is longer than {MAX_TOKEN_BYTES} bytes")
        digest = _digest(token)
        matches = self._token_owners(digest)
        if not matches:
            raise Unauthenticated("the token is not any tenant's")
        (found,) = matches
        return self._token_binding(found, peer, digest)

    def _token_owners(self, digest: bytes) -> list[Tenant]:
        """The tenant whose token has ``digest`` (none, or one); Unauthenticated when the
        token is more than one tenant's."""
        matches = [
            tenant
            for tenant in self._tokens  # every one compared, whichever matches
            if hmac.compare_digest(digest, tenant.token_digest)
        ]
        if len(matches) > 1:
            raise Unauthenticated(
                "the token is more than one tenant's (their token files hold the same "
                "secret), so it binds none: the daemon's operator must give each its own"
            )
        return matches

    def _token_binding(self, found: Tenant, peer: PeerCred | None, digest: bytes) -> Binding:
        """The binding of a session of ``peer`` (None over TCP) that presented ``found``'s
        token (of ``digest``)."""
        admin = found.admin
        if peer is not None:
            if found.by_credentials and peer.uid not in found.uids and peer.gid not in found.gids:
                raise PermissionDenied(
                    f"the token is tenant {found.name!r}'s, whose uids and gids do not include "
                    f"this peer (uid {peer.uid}, gid {peer.gid})"
                )
            admin = admin or peer.uid in self.admin_uids
        return Binding(found.name, admin, found.name, token_digest=digest)

    def rebind(self, peer: PeerCred | None, tenant: str, token_digest: bytes) -> Binding:
        """What an open session (of ``peer``, bound to ``tenant``, by the token of
        ``token_digest`` or, when empty, by its credentials) would be bound to now: after a
        reload changed the tenants, a session whose binding differs ends. A token-bound
        session is bound by its token again where that is a tenant's now (another tenant's,
        when token files moved between tenants); a token no tenant has now (rotated, see
        ``set_tokens``) leaves it bound to its tenant as that stands, while it has a token.
        Raises as ``bind`` does when it would bind none."""
        if not token_digest:
            return self.bind(peer, b"")
        owners = self._token_owners(token_digest)
        found = owners[0] if owners else self.tenants.get(tenant)
        if found is None or not found.token_digest:
            raise Unauthenticated(f"tenant {tenant!r} has no token any more (or is gone)")
        return self._token_binding(found, peer, token_digest)

    def replace_with(self, other: TenantDirectory) -> None:
        """Take ``other``'s tenants, shared namespaces and admin uids (a reload that changed
        them); the namespaces resolved so far are resolved again."""
        self.tenants, self.shared, self.admin_uids = other.tenants, other.shared, other.admin_uids
        self._index()
        self._spaces.clear()

    # ------------------------------------------------------------ namespaces

    def space(self, tenant: str, declared: str, *, admin: bool = False) -> Space:
        """The namespace ``declared`` names for a session of ``tenant``: ``NAME`` inside the
        tenant, or ``shared:SPACE[/NAME]`` inside a configured shared namespace the tenant
        may use (an admin may name any)."""
        key = (tenant, declared, admin)
        space = self._spaces.get(key)
        if space is None:
            space = self._resolve(tenant, declared, admin)
            if len(self._spaces) >= _SPACES_KEPT:
                self._spaces.clear()
            self._spaces[key] = space
        return space

    def _resolve(self, tenant: str, declared: str, admin: bool) -> Space:
        if len(declared.encode("utf-8")) > MAX_NAMESPACE_BYTES:
            raise InvalidArgument(
                f"namespace names are at most {MAX_NAMESPACE_BYTES} bytes; this one has "
                f"{len(declared.encode('utf-8'))}"
            )
        if not declared.startswith(SHARED_PREFIX):
            return Space(namespace_id(f"tenant:{tenant}", declared), tenant, declared)
        space_name, _, name = declared[len(SHARED_PREFIX) :].partition("/")
        space = self.shared.get(space_name)
        if space is None or not (admin or tenant in space.tenants):
            # A name that is no shared namespace's is not echoed (it is the client's text).
            shown = repr(space_name) if TENANT_NAME.fullmatch(space_name) else "of that name"
            raise PermissionDenied(
                f"tenant {tenant!r} may use no shared namespace {shown} (shared_namespaces "
                "in the daemon's config lists who may use which)"
            )
        return Space(namespace_id(space.label, name), space.label, declared)

    def describe(self) -> str:
        """One log line: who may connect as what."""
        if not self.configured:
            return "tenants: none configured; every local peer is tenant 'default'"
        parts = []
        for t in self.tenants.values():
            how = [f"uids {sorted(t.uids)}"] if t.uids else []
            how += [f"gids {sorted(t.gids)}"] if t.gids else []
            how += ["token"] if t.token_digest else []
            how += ["admin"] if t.admin else []
            how += [f"quotas {_shown(t.quotas)}"] if t.quotas else []
            parts.append(f"{t.name} ({'; '.join(how)})")
        shared = [
            f"{s.label} ({', '.join(sorted(s.tenants))}"
            + (f"; quotas {_shown(s.quotas)})" if s.quotas else ")")
            for s in self.shared.values()
        ]
        return (
            "tenants: "
            + ", ".join(parts)
            + ("; shared namespaces: " + ", ".join(shared) if shared else "")
        )

    # ------------------------------------------------------------ accounting

    def labels(self) -> list[str]:
        """Every owner label the config knows: tenants, then shared namespaces."""
        names = list(self.tenants) or [DEFAULT_TENANT]
        return names + [s.label for s in self.shared.values()]

    def quotas(self) -> list[tuple[str, TierKind, int]]:
        """(owner label, tier, bytes) of every configured quota."""
        out = [(t.name, k, b) for t in self.tenants.values() for k, b in t.quotas.items()]
        out += [(s.label, k, b) for s in self.shared.values() for k, b in s.quotas.items()]
        return out

    def visible_to(self, tenant: str, admin: bool) -> list[str] | None:
        """The owner labels a session's stats show: its tenant and the shared namespaces it
        may use; None (all) for an admin."""
        if admin:
            return None
        return [tenant] + [s.label for s in self.shared.values() if tenant in s.tenants]


def _quotas(by_label: Mapping[str, int]) -> dict[TierKind, int]:
    return {TierKind.from_label(label): nbytes for label, nbytes in by_label.items()}


def _shown(quotas: Mapping[TierKind, int]) -> str:
    """``"L1 8GiB, L2 100GiB"``: sizes as the config spells them."""
    return ", ".join(f"{kind.label} {format_size(nbytes)}" for kind, nbytes in quotas.items())


def read_token_digests(config: Config) -> tuple[dict[str, bytes], list[str]]:
    """The token digest of every tenant of ``config`` with a token file that can be used,
    and a line for each that cannot (see ``read_token_file``)."""
    digests: dict[str, bytes] = {}
    problems = []
    for tc in config.tenants:
        if not tc.token_file:
            continue
        try:
            digests[tc.name] = _digest(read_token_file(tc.token_file))
        except OSError as e:
            problems.append(f"tenant {tc.name!r}: {e}")
    return digests, problems


def read_token_file(path: str) -> bytes:
    """A tenant's secret: the file's content without surrounding whitespace. The file (the
    one a link names: a Kubernetes Secret volume gives each key as a link to the current
    version's file; only root's links and the daemon's user's, see ``link_problem``) must be
    a regular file that only its owner may read or write, and the secret ``MIN_TOKEN_BYTES``
    to ``MAX_TOKEN_BYTES`` long; otherwise TokenFileError (or another OSError when it cannot
    be read)."""
    try:
        # O_NONBLOCK: opening a FIFO for reading waits for a writer, and the daemon (or
        # --check-config) hung at start on one; it is refused below as not a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise TokenFileError(f"cannot read token file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000):
            raise TokenFileError(f"token file {path} is not a regular file")
        if (problem := link_problem(path, os.geteuid(), st)) is not None:
            raise TokenFileError(f"token file {path} {problem}")
        if st.st_mode & 0o077:
            raise TokenFileError(
                f"token file {path} has mode {st.st_mode & 0o777:04o}: others may read it; "
                "make it readable by its owner only (chmod 600)"
            )
        # One byte past the bound tells a longer file: one cut at the bound gave a token no
        # session can present (a longer one is refused at binding).
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    token = data.strip()
    if len(data) > MAX_TOKEN_FILE_BYTES or len(token) > MAX_TOKEN_BYTES:
        raise TokenFileError(
            f"token file {path} holds more than {MAX_TOKEN_BYTES} bytes; a token has at most "
            f"{MAX_TOKEN_BYTES}: is it the right file?"
        )
    if len(token) < MIN_TOKEN_BYTES:
        raise TokenFileError(
            f"token file {path} holds {len(token)} bytes; a token has at least "
            f"{MIN_TOKEN_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
        )
    return token
