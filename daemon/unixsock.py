"""Unix socket paths and who may connect to them.

Both of the daemon's sockets (gRPC and credentials) get the mode and group of
``server.socket_mode`` / ``server.socket_group``. They are applied without a window: the
socket is bound under a umask that leaves only the daemon's own uid able to connect, then
given its group and mode, and only then does it listen. Connecting to a Unix socket needs
write permission on it, so the mode is the whole access rule (plus traversal of its folders).

Invariants:
- A socket path in a folder that other users may write (sticky or not), or that belongs to
  a user other than root and the daemon's, is refused: anyone who can write there could
  replace the socket, or take its name while the daemon is stopped, and receive the clients'
  requests.
- A stale socket (nobody listening) is removed at start; a live one stops the daemon.
- One daemon per socket path: each holds an exclusive flock on ``<socket>.lock``
  (``SocketLock``) from before it examines the path until it no longer listens there, so a
  second daemon at that path stops before it binds anything (the rename that gives the
  socket gRPC bound its path, ``move_bound``, replaces what is there, a live daemon's socket
  included). A successor may start while its predecessor flushes L2 (``remove_socket``
  keeps the successor's socket), or once its socket and lock file were removed under it
  (``move_bound``: gRPC's stop unlinks the name it bound). The kernel lets go of the lock
  when its holder dies, so a lock file left by a crash never refuses a start.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.daemon.config import ServerConfig
from kvtier.paths import writers_problem
from kvtier.tiers.disk.files import lock_exclusive

log = logging.getLogger(__name__)

# sockaddr_un holds 108 bytes including the terminating NUL.
MAX_PATH_BYTES = 107
# The lock file beside the gRPC socket (``SocketLock``).
LOCK_SUFFIX = ".lock"
# How long a start refused the lock waits for its holder's pid to appear in it: the holder
# writes it just after it takes the lock (a loaded host may hold it off a while between).
HOLDER_WAIT_S = 2.0
HOLDER_RETRY_S = 0.01
# The name gRPC binds the socket at before ``move_bound`` gives it the path: no longer than
# the credentials socket's suffix, so that the path's length check covers it.
BIND_SUFFIX = ".new"


@dataclass(frozen=True, slots=True)
class SocketAccess:
    """Permission bits and group for a socket; ``gid`` None keeps the daemon's group."""

    mode: int
    gid: int | None

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> SocketAccess:
        return cls(cfg.socket_mode_bits(), cfg.socket_gid())


def folder_problem(folder: str, st: os.stat_result) -> str | None:
    """Why the daemon's sockets may not live in ``folder`` (``st``: its stat), or None. Whoever
    may write the folder can remove a socket and listen in its place, receiving the clients'
    requests and the memory files they hand the credential socket: so may its owner, whatever
    its mode, and its group or others where the mode lets them. A sticky folder (/tmp) is no
    exception: the sticky bit only keeps others from removing the daemon's sockets, and the
    daemon removes them itself when it stops, so its names are anyone's to take until it starts
    again (a squatter there also keeps it from starting)."""
    problem = writers_problem(st, os.geteuid())
    if problem is None:
        return None
    return f"the socket's folder {folder} {problem}; use a folder only the daemon may write"


def prepare_socket_path(path: str, access: SocketAccess) -> None:
    """Check the socket's folder (creating it if needed); remove a stale socket, refuse a live
    one. Raises OSError with a message that names the problem."""
    if len(path.encode()) > MAX_PATH_BYTES:
        raise OSError(
            errno.ENAMETOOLONG,
            f"socket path {path} is longer than the {MAX_PATH_BYTES} bytes Unix sockets allow",
        )
    folder, st = _prepare_folder(path, access)
    _warn_if_untraversable(path, folder, st, access)
    clear_socket_name(path)


def clear_socket_name(path: str) -> None:
    """Remove a stale socket at ``path`` (in a folder ``prepare_socket_path`` checked), refuse
    a live one or anything else there (OSError naming it)."""
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another process is listening on {path}")


def _prepare_folder(path: str, access: SocketAccess) -> tuple[str, os.stat_result]:
    """The folder of the socket ``path`` (created if needed) and its stat, once checked."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        _create_folder(folder, access)
    st = os.stat(folder)
    if (problem := folder_problem(folder, st)) is not None:
        raise OSError(errno.EPERM, problem)
    return folder, st


def lock_path(socket_path: str) -> str:
    return socket_path + LOCK_SUFFIX


class SocketLock:
    """The exclusive flock on ``<socket>.lock`` that makes a daemon the only one at its
    socket path. Its file holds the holder's pid (for the refusal's message and operators);
    it is private to the daemon's user (mode 0600, the sockets' group): anyone who may open
    a file may flock it, and so keep every daemon from starting there. Removed by
    ``release``; one a crash left is taken over. Not thread-safe (the start and the stop
    take and release it)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def take(cls, socket_path: str, access: SocketAccess) -> SocketLock:
        """Lock the socket path for this process (creating and checking its folder first).
        Raises OSError (EADDRINUSE) naming the path and the holder's pid while another
        process holds it."""
        _prepare_folder(socket_path, access)
        path = lock_path(socket_path)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                if cls._locked(fd, socket_path, path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        try:
            cls._claim(fd, path, access)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    @staticmethod
    def _locked(fd: int, socket_path: str, path: str) -> bool:
        """Whether ``fd`` holds the lock of the file now at ``path``: False when a stop
        removed (or replaced) the file this opened before it was locked, to open it again."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a regular file")
        try:
            if lock_exclusive(fd, Path(path)) is not None:
                raise OSError(errno.EADDRINUSE, in_use(socket_path))
        except FileNotFoundError:  # removed by its holder's stop (lock_exclusive's probe)
            return False
        return _names(path, fd)

    @staticmethod
    def _claim(fd: int, path: str, access: SocketAccess) -> None:
        """Give the locked file its owner's access and this process's pid."""
        st = os.fstat(fd)
        if access.gid is not None and access.gid != st.st_gid:
            try:
                os.fchown(fd, -1, access.gid)
            except PermissionError:
                raise OSError(
                    errno.EPERM,
                    f"cannot give {path} the group {access.gid} (server.socket_group): the "
                    "daemon may only choose a group it is a member of",
                ) from None
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Remove the lock file, then let go of the lock (in that order: a start that opened
        the file meanwhile finds it removed once it locks it, and opens the path again).
        Only while the path holds the file this one locked: one removed meanwhile (by hand,
        or by a cleaner of old files) may have been replaced by a successor's, which it
        holds. The identity tells: the file this one holds open keeps its inode number."""
        if self._fd < 0:
            return
        if _names(self.path, self._fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        else:
            log.warning(
                "%s was removed while this daemon ran: the socket path may hold another "
                "process's socket, left to it",
                self.path,
            )
        os.close(self._fd)
        self._fd = -1


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd``: not removed, nor replaced by
    another (whose inode differs while ``fd`` keeps this one's)."""
    mine = os.fstat(fd)
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def lock_file_problem(socket_path: str) -> str | None:
    """What keeps ``SocketLock.take`` from using ``<socket>.lock``: something other than a
    regular file there (its open fails on a directory and, never following one, on a link;
    a FIFO is refused once opened), or one of another user's, or one this user may not
    write; or None (nothing yet, or a regular file the daemon may take, as one a killed
    daemon left)."""
    path = lock_path(socket_path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    mode = st.st_mode
    if stat.S_ISREG(mode):
        uid = os.geteuid()
        # The start opens it to write and sets its mode (``_claim``), which only its owner
        # may (root as anyone): another user's, a daemon run as that user left, failed there
        # with a bare "Permission denied".
        if (st.st_uid != uid and uid != 0) or not os.access(path, os.R_OK | os.W_OK):
            return (
                f"{path} is uid {st.st_uid}'s, mode {stat.S_IMODE(mode):04o}: the daemon (uid "
                f"{uid}) keeps its lock only in a file it owns and may write: remove it"
            )
        return None
    kind = (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a symbolic link"
        if stat.S_ISLNK(mode)
        else "not a regular file"
    )
    return f"{path} is {kind}; the daemon keeps its lock there in a regular file: move it away"


def in_use(socket_path: str) -> str:
    """The refusal of a start at ``socket_path`` while another process holds its lock."""
    path = lock_path(socket_path)
    return (
        f"another kvtierd{holder_of(path)} serves {socket_path} (it holds {path}); stop it "
        "first, or give this one another server.socket"
    )


def holder_of(path: str) -> str:
    """ " (pid N)": the live process whose pid the lock file ``path`` holds, or "" when it
    holds none in ``HOLDER_WAIT_S`` (a holder between its lock and its write; a pid a crashed
    holder left, not yet overwritten)."""
    give_up = time.monotonic() + HOLDER_WAIT_S
    while True:
        with contextlib.suppress(OSError, ValueError):
            with open(path, "rb") as f:
                text = f.read(32)
            if text.endswith(b"\n") and _alive(pid := int(text)):
                return f" (pid {pid})"
        if time.monotonic() > give_up:
            return ""
        time.sleep(HOLDER_RETRY_S)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Sockets bound inside are 0600 until ``apply_access`` (umask is process-wide, so this
    only ever makes files created meanwhile more private)."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


SocketIdentity = tuple[int, int]  # (st_dev, st_ino) of a socket the daemon bound


def bound_socket(path: str) -> SocketIdentity:
    """The identity, for ``remove_socket``, of the socket the daemon has just bound at
    ``path``: taken before ``apply_access``, so that a start it fails removes the socket."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} is no longer the socket the daemon bound")
    return (st.st_dev, st.st_ino)


def apply_access(path: str, access: SocketAccess) -> None:
    """Give the socket the daemon has just bound at ``path`` (``bound_socket``) its group and
    mode, before it listens."""
    st = os.lstat(path)
    if access.gid is not None and access.gid != st.st_gid:
        try:
            os.chown(path, -1, access.gid, follow_symlinks=False)
        except PermissionError:
            raise OSError(
                errno.EPERM,
                f"cannot give {path} the group {access.gid} (server.socket_group): the daemon "
                "may only choose a group it is a member of",
            ) from None
    os.chmod(path, access.mode)


def remove_socket(path: str, identity: SocketIdentity, *, still_listening: bool = False) -> None:
    """Remove the socket the daemon bound at ``path`` (it no longer listens there), unless
    another has taken the path since: a daemon started while this one drained finds the path
    no longer listening, binds its own socket there, and must keep it when this one stops.
    The identity alone does not tell: a disk filesystem gives the successor's socket the
    inode number the stale one freed, so a socket someone listens on is kept too.
    ``still_listening``: the daemon itself still listens there, so no successor can have
    bound the path (a start that failed after gRPC bound it: gRPC listens from the bind on
    and closes the listeners of a server that never started only when the process ends)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity and (still_listening or not _listening(path)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def move_bound(bound: str, path: str) -> SocketIdentity:
    """Give the socket gRPC has just bound at ``bound`` (``path`` plus ``BIND_SUFFIX``) the
    path, and return its identity for ``remove_socket`` (``bound_socket``). gRPC unlinks the
    name it bound, whoever's socket that name holds then, as its server stops listening
    (grpc/grpc#17122); bound under a name the socket leaves at once, its stop never removes
    what the path holds (a successor's socket, where a cleaner of old files removed this
    daemon's socket and lock file and another daemon started there). A socket that a start
    killed before the rename left at ``bound`` is removed first (``clear_socket_name``), as
    anything else there refuses the start: gRPC's bind takes any socket there, a live one
    included, and fails on the rest without saying what is there."""
    identity = bound_socket(bound)
    try:
        os.rename(bound, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bound)
        raise
    return identity


def _listening(path: str) -> bool:
    """Whether a process listens on the Unix socket ``path`` (a connection is opened and
    closed at once; a full backlog counts as listening)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # EAGAIN: a full backlog; anything else: not ours to judge
            return True
    return True


def bind_unix(
    path: str, access: SocketAccess, backlog: int = 64
) -> tuple[socket.socket, SocketIdentity]:
    """A non-blocking listening Unix stream socket at ``path`` with ``access`` applied, and
    its identity for ``remove_socket``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        with private_umask():
            sock.bind(path)
    except BaseException:
        # Nothing of ours at the path: one there (EADDRINUSE) is another daemon's, bound
        # since the path was checked, and stays.
        sock.close()
        raise
    try:
        identity = bound_socket(path)
        apply_access(path, access)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return sock, identity


def _create_folder(folder: str, access: SocketAccess) -> None:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    # Set through a descriptor of the folder itself, never a link: in a folder others may
    # write (/tmp, where a user's daemon goes without $XDG_RUNTIME_DIR), a link made there
    # since the daemon found no folder had it change the mode and group of what it named.
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        if not os.path.islink(folder):  # ENOTDIR rather than ELOOP, with O_DIRECTORY
            raise
        raise OSError(
            errno.EPERM,
            f"the socket's folder {folder} became a symbolic link as the daemon made it "
            "(another user's, in a folder others may write?); not following it",
        ) from None
    try:
        # Those the socket admits must be able to reach it: traverse (x), never list or write.
        mode = 0o700
        if access.mode & 0o060:
            mode |= 0o010
        if access.mode & 0o006:
            mode |= 0o001
        if access.gid is not None:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, access.gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _warn_if_untraversable(
    path: str, folder: str, st: os.stat_result, access: SocketAccess
) -> None:
    """Warn, naming the socket ``path``, when the group its mode admits cannot traverse its
    folder (each socket is checked: the gRPC socket and its ``.cred`` credential socket)."""
    gid = access.gid if access.gid is not None else os.getegid()
    if access.mode & 0o060 and not (
        st.st_mode & stat.S_IXOTH or (st.st_mode & stat.S_IXGRP and st.st_gid == gid)
    ):
        log.warning(
            "the socket %s admits group %d but its folder %s (mode %04o, group %d) does not "
            "let that group through; its members cannot connect",
            path,
            gid,
            folder,
            stat.S_IMODE(st.st_mode),
            st.st_gid,
        )
