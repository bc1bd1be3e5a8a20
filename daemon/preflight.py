"""Checks that a config can run on this host, made before the daemon allocates anything.

``kvtierd --check-config`` prints them, and ``kvtierd`` runs the same checks before it
pre-faults its L1 arena or preallocates L2 files, so a config that cannot run fails in
milliseconds with the key at fault named, not after minutes of page faults (but for an L2
index another process holds locked: its read waits for the lock as the tier's open would, up
to the busy timeout, then the start is refused naming the holder, the tier's refusal).

Each check reads the host (``/proc/meminfo``, the cgroup's memory limit, ``statvfs``, the
socket's path, the L2 index's geometry through a read-only connection) and changes nothing
the daemon keeps: no socket is left bound, no data file or index created (reading a WAL index
leaves SQLite's empty ``-wal`` and ``-shm`` beside it, as any reader does).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import resource
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier.daemon import loops
from kvtier.daemon.config import Config, http_url, split_host_port
from kvtier.daemon.credentials import CRED_SUFFIX, is_memory_backed
from kvtier.daemon.unixsock import (
    BIND_SUFFIX,
    folder_problem,
    in_use,
    lock_file_problem,
    lock_path,
)
from kvtier.tiers.base import TierUnavailable
from kvtier.tiers.disk.files import DATA_GLOB, LOCK_NAME, probe_lock
from kvtier.tiers.disk.index import INDEX_NAME, RESTORE_SUFFIX
from kvtier.tiers.disk.tier import owner_problem, space_needed, space_shortfall
from kvtier.tiers.remote.options import RemoteOptionsError, read_password
from kvtier.tiers.sizes import format_size

# Unix socket paths hold at most 107 bytes and a terminating NUL.
MAX_SOCKET_PATH = 107
# Left to the rest of the process and the system when sizing L1 against free memory.
MEMORY_HEADROOM_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Problem:
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the checks read from the host; tests pass their own."""

    mem_available_bytes: int | None
    mem_limit_bytes: int | None  # the smaller of the machine's memory and the cgroup's limit
    memlock_limit_bytes: int | None  # None: unlimited


def read_host() -> HostFacts:
    meminfo = _meminfo()
    total = meminfo.get("MemTotal")
    available = meminfo.get("MemAvailable")
    limit, used = _cgroup_memory()
    if limit is not None:
        total = min(total, limit) if total is not None else limit
        if used is not None:
            headroom = max(0, limit - used)
            available = min(available, headroom) if available is not None else headroom
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = None if soft == resource.RLIM_INFINITY else int(soft)
    return HostFacts(available, total, memlock)


def check(config: Config, host: HostFacts | None = None) -> list[Problem]:
    """Every problem found; empty when the config can run here."""
    host = read_host() if host is None else host
    # The disk checks run first, listed after the memory checks: where another process holds
    # the L2 index locked, reading the size its data files keep waits for it (the busy timeout,
    # as the tier's open) and the lock is named, and the check of an L2 in memory, which reads
    # the index too, is left out rather than wait as long again.
    try:
        disk, l2_locked = _disk(config), False
    except TierUnavailable as e:
        disk, l2_locked = [Problem("tiers.l2.path", str(e))], True
    return [
        *_memory(config, host, l2=not l2_locked),
        *disk,
        *_socket(config),
        *_socket_group(config),
        *_tcp(config),
        *_shm(config),
        *_metrics(config),
        *_tokens(config),
        *_l3_client(config),
        *_torch(config),
        *_l3_password(config),
        *_l3_removals_file(config),
        *_event_loop(config),
    ]


def summary(config: Config, host: HostFacts | None = None) -> list[str]:
    """What the config will take, in one line per resource (for ``--check-config``)."""
    host = read_host() if host is None else host
    l1 = config.tiers.l1.capacity_bytes
    avail = host.mem_available_bytes
    lines = [
        f"L1: {format_size(l1)} of host memory"
        + (f" ({_gib(avail)} available)" if avail is not None else "")
    ]
    l2 = config.tiers.l2
    if l2.enabled:
        lines.append(f"L2: {format_size(l2.capacity_bytes)} in {os.path.abspath(l2.path)}")
    else:
        lines.append("L2: off")
    l3 = config.tiers.l3
    lines.append(f"L3: {l3.mode} at {', '.join(l3.urls)}" if l3.enabled else "L3: off")
    if config.server.socket:
        lines.append(f"socket: {os.path.abspath(config.server.socket)}")
    if config.server.tcp_address:
        lines.append(f"tcp: {config.server.tcp_address}")
    if not loops.problem(config.server.event_loop):
        lines.append(f"event loop: {loops.describe(config.server.event_loop)}")
    if config.metrics.address:
        lines.append("metrics: " + http_url(*split_host_port(config.metrics.address), "/metrics"))
    else:
        lines.append("metrics: off")
    return lines


# ------------------------------------------------------------------------ memory


def _memory(config: Config, host: HostFacts, l2: bool = True) -> list[Problem]:
    """The memory L1 takes, with L2's files where they are in memory too (unless ``l2`` is
    False), and the page-locking it asks for."""
    l1 = config.tiers.l1
    out: list[Problem] = []
    key = "tiers.l1.capacity_bytes"
    if host.mem_limit_bytes is not None and l1.capacity_bytes > host.mem_limit_bytes:
        out.append(
            Problem(
                key,
                f"{format_size(l1.capacity_bytes)} is more than this host's memory limit of "
                f"{_gib(host.mem_limit_bytes)}",
            )
        )
    elif (
        host.mem_available_bytes is not None
        and l1.capacity_bytes + MEMORY_HEADROOM_BYTES > host.mem_available_bytes
    ):
        out.append(
            Problem(
                key,
                f"{format_size(l1.capacity_bytes)} (plus {MEMORY_HEADROOM_BYTES >> 20} MiB for "
                f"the rest of the daemon) is more than the {_gib(host.mem_available_bytes)} of "
                "memory available now; the arena is pre-faulted at start and would push the "
                "host into swap or the OOM killer",
            )
        )
    elif l2 and (in_memory := _l2_in_memory(config, host)) is not None:
        out.append(in_memory)
    if (
        l1.pin_memory == "true"
        and host.memlock_limit_bytes is not None
        and os.geteuid() != 0
        and l1.capacity_bytes > host.memlock_limit_bytes
    ):
        out.append(
            Problem(
                "tiers.l1.pin_memory",
                f"page-locking {format_size(l1.capacity_bytes)} exceeds RLIMIT_MEMLOCK "
                f"({format_size(host.memlock_limit_bytes)}); raise it (LimitMEMLOCK= in the "
                "systemd unit) or set tiers.l1.pin_memory=auto",
            )
        )
    return out


def _l2_in_memory(config: Config, host: HostFacts) -> Problem | None:
    """An L2 folder on a tmpfs takes memory, not disk: its files, preallocated at start, come
    out of the memory that L1's arena is checked against (the tmpfs's own size, which the
    disk check reads, may be far beyond what is free)."""
    l2 = config.tiers.l2
    if not l2.enabled or host.mem_available_bytes is None:
        return None
    directory = Path(os.path.abspath(l2.path))
    if _blocked(directory) is not None or not _memory_backed(_nearest_existing(directory)):
        return None
    try:
        l2_bytes = space_needed(directory, l2.capacity_bytes, l2.segment_bytes, l2.file_bytes)
    except (OSError, TierUnavailable):
        return None  # the disk checks name what is wrong with the folder (or its index)
    l1_bytes = config.tiers.l1.capacity_bytes
    if l1_bytes + l2_bytes + MEMORY_HEADROOM_BYTES <= host.mem_available_bytes:
        return None
    return Problem(
        "tiers.l2.path",
        f"{directory} is in memory (a tmpfs), so L2's files ({format_size(l2_bytes)} still to "
        f"allocate) take the host's memory beside L1's {format_size(l1_bytes)} (plus "
        f"{MEMORY_HEADROOM_BYTES >> 20} MiB for the rest of the daemon): more than the "
        f"{_gib(host.mem_available_bytes)} available now; put L2 on a disk",
    )


def _memory_backed(folder: Path | str) -> bool | None:
    """Whether files made in ``folder`` are memory (a tmpfs): an unnamed file made there tells,
    as the daemon tells a pool's (F_GET_SEALS), and leaves nothing behind; None where it cannot
    be made (this user may not write there, or no O_TMPFILE)."""
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        return is_memory_backed(fd)
    finally:
        os.close(fd)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup; None where there is no limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hier, _, path = line.partition("::")
        if hier == "0" and path:  # cgroup v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            return _read_int(base / "memory.max"), _read_int(base / "memory.current")
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if "memory" in controllers.split(","):  # cgroup v1
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit = _read_int(base / "memory.limit_in_bytes")
            # v1 reports "no limit" as a huge number.
            if limit is not None and limit >= 1 << 60:
                limit = None
            return limit, _read_int(base / "memory.usage_in_bytes")
    return None, None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


# -------------------------------------------------------------------------- disk


def _disk(config: Config) -> list[Problem]:
    """What keeps the disk tier from starting in its folder. Raises TierUnavailable where
    another process holds its index locked past the busy timeout (``space_shortfall``), as
    the tier's start is refused."""
    l2 = config.tiers.l2
    if not l2.enabled:
        return []
    directory = Path(os.path.abspath(l2.path))
    if (blocked := _blocked(directory)) is not None:
        return [Problem("tiers.l2.path", f"cannot create or open {directory}: {blocked}")]
    if directory.exists() and not directory.is_dir():
        return [Problem("tiers.l2.path", f"{directory} exists and is not a directory")]
    if directory.is_symlink() and not directory.exists():
        # The tier would not make the folder it names (mkdir: File exists, naming no key).
        return [
            Problem(
                "tiers.l2.path",
                f"{directory} is a symbolic link to {os.readlink(directory)}, which does not "
                "exist: make that folder, or set tiers.l2.path to one",
            )
        ]
    if (untrusted := _l2_writers(directory)) is not None:
        return [Problem("tiers.l2.path", untrusted)]
    existing = _nearest_existing(directory)
    if not os.access(existing, os.W_OK | os.X_OK):
        return [
            Problem(
                "tiers.l2.path",
                f"{directory} cannot be created or written: {_not_writable(existing)}",
            )
        ]
    if (odd := _not_a_file(directory)) is not None:
        return [Problem("tiers.l2.path", odd)]
    if (in_use := _locked(directory / LOCK_NAME)) is not None:
        return [Problem("tiers.l2.path", f"L2 directory {directory} is in use: {in_use}")]
    shortfall = space_shortfall(directory, l2.capacity_bytes, l2.segment_bytes, l2.file_bytes)
    if shortfall is not None and shortfall.refuses_start:
        # Short only of the index's room, the tier starts degraded by the full disk.
        return [Problem("tiers.l2.capacity_bytes", str(shortfall))]
    return []


def _l2_writers(directory: Path) -> str | None:
    """Why users other than root and the daemon's could plant links in the L2 folder, or
    None: its owner (``owner_problem``), or a folder above it that other users may write,
    unless sticky, which lets them rename the L2 folder away and put one of their own in its
    place."""
    for above in reversed(directory.parents):
        try:
            st = above.stat()
        except FileNotFoundError:
            break  # the rest is created by the tier, owned by the daemon
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return (
                f"the L2 folder's parent {above} (mode {stat.S_IMODE(st.st_mode):04o}) is "
                f"writable by other users, who could replace {directory}; use a folder whose "
                "parents only root and the daemon may write (or that are sticky, as /tmp)"
            )
    try:
        owner = directory.stat().st_uid
    except FileNotFoundError:
        return None  # created by the tier, owned by the daemon
    return owner_problem(directory, owner)


def _not_a_file(directory: Path) -> str | None:
    """Why the disk tier could not open one of its own files in ``directory`` (its lock, index
    or a data file is there as something else, a folder say), or None."""
    if not directory.is_dir():
        return None
    # SQLite's rollback journal too: the switch to WAL opens it, and a folder there failed a
    # healthy index's open (SQLITE_IOERR), which the tier then moved aside as damaged. The
    # last item: a write-back of the index cut short, which the open moves into place.
    index = (
        INDEX_NAME,
        *(f"{INDEX_NAME}-{end}" for end in ("wal", "shm", "journal")),
        INDEX_NAME + RESTORE_SUFFIX,
    )
    for path in [*(directory / n for n in (LOCK_NAME, *index)), *directory.glob(DATA_GLOB)]:
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"L2 file {path} cannot be examined: {e.strerror}"
        if stat.S_ISLNK(mode):
            # Followed, the tier would preallocate, chmod and write blocks into whatever it
            # names: a link planted while the folder was open to others reaches any file.
            return (
                f"L2 file {path} is a symbolic link; the disk tier keeps its lock, index and "
                f"data files in {directory} as files of its own and follows no link: remove it"
            )
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            return (
                f"L2 file {path} is {kind}; the disk tier keeps its lock, index and data files "
                f"in {directory} as regular files: move it away"
            )
    return None


def _locked(lock: Path) -> str | None:
    """Why a tier could not lock ``lock`` now (another daemon holds it), or None.
    Only a shared lock is taken, and let go at once, on an existing file only: nothing is
    created, and a daemon opening the directory meanwhile is not refused (``probe_lock``)."""
    try:
        held = probe_lock(lock)
    except OSError:
        return None  # absent (a new directory) or unreadable: the daemon's own open says
    if held is not None:
        return f"another process holds its lock (a kvtierd running?): {held.strerror}"
    return None


def _blocked(path: Path) -> str | None:
    """What keeps this user from reaching ``path`` or the folders it would be made in: a
    folder on the way it may not search, or a file where a folder must be; None when nothing
    does (the rest of the path is absent, to be created). The checks after this one examine
    the path with calls that raise on either (a traceback, not a problem named)."""
    for each in [*reversed(path.parents), path]:
        try:
            # The path itself as it is (a link there is the later checks' to judge).
            mode = (os.lstat if each == path else os.stat)(each).st_mode
        except FileNotFoundError:
            return None
        except PermissionError:
            # Every folder before ``each`` was found: its own folder denies the search.
            return f"uid {os.geteuid()} may not search {each.parent}"
        except OSError as e:
            return f"{each} cannot be examined: {e.strerror}"
        if each != path and not stat.S_ISDIR(mode):
            return f"{each} is not a directory"
    return None


def _not_writable(folder: Path) -> str:
    """Why this user may not write ``folder`` (``os.access`` said so): a read-only filesystem,
    as a systemd unit's ``ProtectSystem=strict`` makes every folder outside its
    ``ReadWritePaths=`` (the error said "not writable by uid N" there, sending the operator to
    the folder's owner and mode, which were right), or its permissions."""
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return (
            f"{folder} is on a read-only filesystem (under systemd, ProtectSystem=strict leaves "
            "only ReadWritePaths= writable: add the folder there, in a drop-in)"
        )
    return f"{folder} is not writable by uid {os.geteuid()}"


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# ------------------------------------------------------------------------ socket


def _socket(config: Config) -> list[Problem]:
    """The gRPC socket and the credential socket beside it (the same path plus ``.cred``),
    by the rules the daemon applies when it binds them (``daemon/unixsock.py``), and the
    name gRPC binds the first at before it is renamed to the path (plus ``.new``)."""
    if not config.server.socket:
        return []
    path = os.path.abspath(config.server.socket)
    key = "server.socket"
    cred = path + CRED_SUFFIX
    if len(path.encode()) > MAX_SOCKET_PATH:
        return [
            Problem(key, f"{path} is longer than the {MAX_SOCKET_PATH} bytes Unix sockets allow")
        ]
    if len(cred.encode()) > MAX_SOCKET_PATH:
        return [
            Problem(
                key,
                f"the credential socket {cred} (the path plus {CRED_SUFFIX!r}) is longer than "
                f"the {MAX_SOCKET_PATH} bytes Unix sockets allow: keep server.socket within "
                f"{MAX_SOCKET_PATH - len(CRED_SUFFIX)} bytes",
            )
        ]
    if (blocked := _blocked(Path(path))) is not None:
        return [Problem(key, f"cannot create {path}: {blocked}")]
    # Before anything in it is opened: in a folder others may write, the lock file may be
    # anyone's (a FIFO held the check, and the start, until a writer came; one flocked with
    # a pid in it had the check name that pid as a kvtierd serving there).
    folder = Path(path).parent
    if folder.is_dir() and (problem := folder_problem(str(folder), folder.stat())) is not None:
        return [Problem(key, problem)]
    if (problem := lock_file_problem(path)) is not None:
        return [Problem(key, problem)]
    with contextlib.suppress(OSError):  # absent or unreadable: the start's own lock says
        if probe_lock(Path(lock_path(path))) is not None:
            return [Problem(key, in_use(path))]
    for each in (path, path + BIND_SUFFIX, cred):
        try:
            mode = os.lstat(each).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(mode):
            return [Problem(key, f"{each} exists and is not a socket; refusing to replace it")]
        if _listening(each):
            return [Problem(key, f"another process is listening on {each} (a kvtierd running?)")]
    parent = _nearest_existing(folder)
    if not os.access(parent, os.W_OK | os.X_OK):
        return [
            Problem(
                key,
                f"cannot create {path}: {_not_writable(parent)} (run as that directory's "
                "owner, or choose another server.socket)",
            )
        ]
    return []


def _socket_group(config: Config) -> list[Problem]:
    """``server.socket_group``, which the daemon gives its sockets (``unixsock.apply_access``):
    a group other than its own needs membership or CAP_CHOWN, unless the socket's folder is
    set-group-ID of that group. Root without capabilities (a container that drops them all)
    passed the checks, then the start opened L1 and L2 before it stopped on the group."""
    if not config.server.socket:
        return []
    gid = config.server.socket_gid()
    if gid is None or gid == os.getegid() or gid in os.getgroups() or _may_chown():
        return []
    if _folder_group(Path(os.path.abspath(config.server.socket)).parent) == gid:
        return []
    return [
        Problem(
            "server.socket_group",
            f"the daemon is no member of group {gid} and lacks CAP_CHOWN, so it cannot give "
            "its sockets that group: add its user to the group (in a pod: the pod's "
            "securityContext.supplementalGroups), or leave the key empty",
        )
    ]


def _folder_group(folder: Path) -> int | None:
    """The group a socket made in ``folder`` takes without a chown where a set-group-ID
    folder gives it (``folder`` or, not made yet, the nearest above it: a folder made in one
    is one too, of its group), else None: the daemon changes the group of a socket only
    when it differs (``unixsock.apply_access``)."""
    try:
        st = os.stat(_nearest_existing(folder))
    except OSError:
        return None
    return st.st_gid if st.st_mode & stat.S_ISGID else None


def _may_chown() -> bool:
    """Whether this process holds CAP_CHOWN (bit 0 of its effective set)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & 1)
    except (OSError, ValueError, IndexError):
        pass
    # Unknown: root is taken to hold it, as it does outside containers.
    return os.geteuid() == 0


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _shm(config: Config) -> list[Problem]:
    shm = config.server.shm_dir
    if not os.path.isdir(shm):
        return [Problem("server.shm_dir", f"{shm} is not a directory (is /dev/shm mounted?)")]
    # Pools there must be memory (a tmpfs): RegisterPool refuses any other file, so a folder
    # on a disk would start a daemon that refuses every named pool. Where that cannot be told,
    # nothing is said.
    if _memory_backed(shm) is False:
        return [
            Problem(
                "server.shm_dir",
                f"{shm} is not in memory (not a tmpfs): every pool named there would be "
                "refused; use /dev/shm or another tmpfs",
            )
        ]
    return []


def _metrics(config: Config) -> list[Problem]:
    from kvtier.daemon.tenants import read_token_file

    out = _tcp_port("metrics.address", config.metrics.address)
    if config.metrics.address and config.metrics.token_file:
        try:
            read_token_file(config.metrics.token_file)
        except OSError as e:
            out.append(Problem("metrics.token_file", str(e)))
    return out


def _tcp(config: Config) -> list[Problem]:
    return _tcp_port("server.tcp_address", config.server.tcp_address)


def _tcp_port(key: str, address: str) -> list[Problem]:
    """Whether a TCP listener can bind ``address`` now (the probe binds and lets go)."""
    if not address:
        return []
    host, port = split_host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return [Problem(key, f"cannot resolve {host}: {e.strerror}")]
    family, kind, proto, _, addr = infos[0]
    probe = socket.socket(family, kind, proto)
    # As the daemon's servers bind: a connection of the last daemon's lingering in TIME_WAIT
    # (after a scrape) does not keep it from listening, only a live listener does.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(addr)
    except OSError as e:
        why = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror
        return [Problem(key, f"cannot listen on {address}: {why}")]
    finally:
        probe.close()
    return []


def _tokens(config: Config) -> list[Problem]:
    """Every tenant's token file can be read, is private to its owner and holds a token, and
    no two tenants' files hold the same one (such a token would bind neither)."""
    from kvtier.daemon.tenants import read_token_file

    out = []
    owner_of: dict[bytes, str] = {}
    for i, tenant in enumerate(config.tenants):
        if tenant.token_file:
            try:
                token = read_token_file(tenant.token_file)
            except OSError as e:
                out.append(Problem(f"tenants[{i}].token_file", str(e)))
                continue
            if (other := owner_of.setdefault(token, tenant.name)) != tenant.name:
                out.append(
                    Problem(
                        f"tenants[{i}].token_file",
                        f"{tenant.token_file} holds the same token as tenant {other!r}'s "
                        "token file; give each tenant a token of its own",
                    )
                )
    return out


def _l3_client(config: Config) -> list[Problem]:
    """redis-py, which the L3 tier talks through: it is the ``redis`` extra, which ``make run``
    does not install, so an enabled L3 there passed --check-config ('config ok') and the
    start then ended with an ImportError traceback."""
    if not config.tiers.l3.enabled:
        return []
    try:
        import redis.asyncio  # noqa: F401
    except ImportError as e:
        return [
            Problem(
                "tiers.l3.enabled",
                f"the L3 tier needs redis-py, which this Python lacks ({e}): "
                "pip install 'kvtier[redis]'",
            )
        ]
    return []


def _torch(config: Config) -> list[Problem]:
    """torch, through which L1 is page-locked and the GPU tier runs: it is the ``torch``
    extra, which the image and ``make run`` do not install, so either setting there passed
    --check-config ('config ok') and the start ended with an ImportError traceback. Only
    looked for: importing it takes a second or two."""
    keys = [
        key
        for key, wanted in (
            ("tiers.l0.enabled", config.tiers.l0.enabled),
            ("tiers.l1.pin_memory", config.tiers.l1.pin_memory == "true"),
        )
        if wanted
    ]
    if not keys or importlib.util.find_spec("torch") is not None:
        return []
    return [
        Problem(key, "needs torch, which this Python lacks: pip install 'kvtier[torch]'")
        for key in keys
    ]


def _l3_password(config: Config) -> list[Problem]:
    """The L3 password file, read as the tier reads it at start: one that is not UTF-8 text
    stopped the start with a traceback, after --check-config said 'config ok'."""
    l3 = config.tiers.l3
    if not l3.enabled:
        return []
    try:
        read_password(l3.password_file)
    except RemoteOptionsError as e:
        return [Problem("tiers.l3.password_file", str(e))]
    return []


def _l3_removals_file(config: Config) -> list[Problem]:
    """The L3 removals_file, which the tier opens (or makes) at start, its SQLite journal
    files beside it: one it could not open stopped the start (naming it) after
    --check-config said 'config ok'. Its folder is not made: it must be there already."""
    l3 = config.tiers.l3
    if not l3.enabled or not l3.removals_file:
        return []
    key = "tiers.l3.removals_file"
    path = Path(os.path.abspath(l3.removals_file))
    if (blocked := _blocked(path)) is not None:
        return [Problem(key, f"cannot create or open {path}: {blocked}")]
    # The tier opens (or makes) the file a link names, and SQLite makes its files beside it.
    target = Path(os.path.realpath(path))
    if target != path and (blocked := _blocked(target)) is not None:
        return [Problem(key, f"cannot create or open {path} (a link to {target}): {blocked}")]
    folder = target.parent
    if not folder.is_dir():
        return [Problem(key, f"cannot create {path}: its folder {folder} does not exist")]
    if not os.access(folder, os.W_OK | os.X_OK):
        # SQLite makes its -wal and -shm files there, for a file that exists too.
        return [
            Problem(
                key,
                f"cannot create or open {path}: its folder {_not_writable(folder)}",
            )
        ]
    if path.exists() and not path.is_file():
        return [Problem(key, f"{path} exists and is not a file")]
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return [
            Problem(key, f"cannot open {path}: not readable and writable by uid {os.geteuid()}")
        ]
    # The tier locks the file itself (one daemon's own), as the disk tier its directory.
    if (in_use := _locked(target)) is not None:
        return [Problem(key, f"{path} is in use: {in_use}")]
    return []


def _event_loop(config: Config) -> list[Problem]:
    why = loops.problem(config.server.event_loop)
    return [Problem("server.event_loop", why)] if why else []


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
