"""The L3 tier's own settings, independent of the daemon's config loader.

``tiers/`` never imports ``daemon/``: the daemon's ``tiers.l3`` section (``L3Config``) is
turned into a ``RemoteOptions`` by ``L3Config.tier_options()``, field for field (a test keeps
the two in step). This module imports no redis: it is safe to load where the ``redis`` extra
is not installed.

The password never appears here, on a command line or in a URL: only the path of a file that
holds it (``password_file``), read when the tier starts.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvtier.paths import link_problem

MODES = ("single", "cluster")
SCHEMES = ("redis", "rediss")
# A password file holds one line; a file of more is not one (``/dev/zero`` was read until the
# memory ran out).
MAX_PASSWORD_FILE_BYTES = 64 << 10


class RemoteOptionsError(ValueError):
    """Options that cannot describe a reachable store (bad URL, missing field)."""


def read_password(path: str) -> tuple[str, bool] | None:
    """The password in ``path`` (one line of UTF-8; the trailing newline ignored) and whether
    every user may read the file, or None without a path. RemoteOptionsError, naming the
    file, when it cannot be read, is reached through a link of another user's
    (``link_problem``) or holds no such line. The one reading of the tier's start
    and of the daemon's preflight (``--check-config``)."""
    if not path:
        return None
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer; refused below.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise RemoteOptionsError(f"password_file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RemoteOptionsError(f"password_file {path} is not a regular file")
        if (problem := link_problem(path, os.geteuid(), st)) is not None:
            raise RemoteOptionsError(f"password_file {path} {problem}")
        data = os.read(fd, MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as e:
        raise RemoteOptionsError(f"password_file {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteOptionsError(f"password_file {path} is not UTF-8 text") from None
    password = text.rstrip("\r\n")
    if len(data) > MAX_PASSWORD_FILE_BYTES or not password or "\n" in password:
        raise RemoteOptionsError(f"password_file {path} must hold the password on one line")
    return password, bool(st.st_mode & stat.S_IROTH)


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    tls: bool


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """Thread-safety: immutable."""

    urls: tuple[str, ...] = ("redis://127.0.0.1:6379",)
    mode: str = "single"  # "single": one server (or a proxy); "cluster": Redis Cluster
    key_prefix: str = "kvtier:"
    username: str = ""
    password_file: str = ""
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    ttl_s: int = 3600  # 0: no expiry (the server's maxmemory policy evicts)
    max_value_bytes: int = 64 << 20
    pool_size: int = 16
    connect_timeout_s: float = 1.0
    op_timeout_s: float = 2.0
    probe_deadline_ms: float = 50.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    write_bytes_s: int = 0  # 0: unlimited
    # Where the tier keeps the removals the store has not confirmed across restarts (its own
    # small SQLite file, ``journal.RemovalFile``); "": where the daemon gives it, if anywhere.
    removals_file: str = ""

    def endpoints(self) -> list[Endpoint]:
        """The parsed URLs; raises RemoteOptionsError naming the bad one."""
        if not self.urls:
            raise RemoteOptionsError("no URL given")
        out = []
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in SCHEMES:
                raise RemoteOptionsError(f"URL {url!r}: scheme must be redis:// or rediss:// (TLS)")
            if parts.password is not None or parts.username is not None:
                # Named without them: the error reaches the terminal and the journal.
                shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
                raise RemoteOptionsError(
                    f"URL {shown!r} carries credentials (left out here); give username and "
                    "password_file instead"
                )
            if parts.path not in ("", "/", "/0"):
                raise RemoteOptionsError(f"URL {url!r}: only database 0 is supported")
            if parts.query or parts.fragment:
                raise RemoteOptionsError(f"URL {url!r}: options belong in the config, not the URL")
            try:
                port = parts.port or 6379
            except ValueError:
                raise RemoteOptionsError(f"URL {url!r}: bad port") from None
            if not parts.hostname:
                raise RemoteOptionsError(f"URL {url!r} names no host")
            out.append(Endpoint(parts.hostname, port, self.tls or parts.scheme == "rediss"))
        if len({e.tls for e in out}) > 1:
            raise RemoteOptionsError("mixing redis:// and rediss:// URLs")
        return out

    def check(self) -> None:
        """Raise RemoteOptionsError for options no store can satisfy."""
        if self.mode not in MODES:
            raise RemoteOptionsError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        endpoints = self.endpoints()
        if self.mode == "single" and len(endpoints) != 1:
            raise RemoteOptionsError(
                f"mode single takes exactly one URL, got {len(endpoints)}; use mode cluster "
                "for a Redis Cluster"
            )
        if "{" in self.key_prefix or "}" in self.key_prefix:
            # A hash tag in the prefix would put every block of the tier in one cluster slot.
            raise RemoteOptionsError("key_prefix must not contain '{' or '}' (a hash tag)")
        if (self.tls_cert_file == "") != (self.tls_key_file == ""):
            raise RemoteOptionsError("tls_cert_file and tls_key_file go together")
        if self.pool_size < 2:
            raise RemoteOptionsError("pool_size must be at least 2 (probes keep one connection)")
        if self.backoff_initial_s > self.backoff_max_s:
            raise RemoteOptionsError("backoff_initial_s exceeds backoff_max_s")
        for name in ("connect_timeout_s", "op_timeout_s", "probe_deadline_ms"):
            if getattr(self, name) <= 0:
                raise RemoteOptionsError(f"{name} must be positive")
