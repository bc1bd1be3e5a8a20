"""Where the daemon listens by default, and where a client looks for it: one rule for both.

The client may not import the daemon (nor the daemon the client), so the rule lives here, in a
module that imports nothing of kvtier. Every path is absolute, so a client started in any
directory finds a daemon started in any other. The rule for links on the way to a secret
(``link_problem``) lives here too: the daemon's token files and L3's password file (``tiers/``,
which may not import the daemon) share it.

The rule:

- a **system service** (systemd sets ``$RUNTIME_DIRECTORY`` for ``RuntimeDirectory=kvtier``; a
  daemon running as root, as in a container, counts too) listens on
  ``/run/kvtier/kvtierd.sock`` (``$RUNTIME_DIRECTORY/kvtierd.sock`` under systemd);
- a daemon run by a user listens on ``$XDG_RUNTIME_DIR/kvtier/kvtierd.sock``, or
  ``/tmp/kvtier-$UID/kvtierd.sock`` where no ``$XDG_RUNTIME_DIR`` is set;
- a client with no address (and no ``$KVTIER_ADDRESS``) connects to the first of those two
  sockets (its own user's first, unless it runs as root) that exists, else the first behind a
  folder it may not enter (the connection then says so), and otherwise names the one its own
  daemon would use. Its own user's socket counts only in a folder no one but that
  user and root may write (``writers_problem``): anyone may make ``/tmp/kvtier-$UID`` first
  and listen there, and that user's daemon would refuse such a folder too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

ADDRESS_ENV = "KVTIER_ADDRESS"
SOCKET_NAME = "kvtierd.sock"
SYSTEM_SOCKET = "/run/kvtier/" + SOCKET_NAME
# As the kernel's limit (ELOOP past it).
_MAX_LINKS = 40


def unix_address(path: str) -> str:
    """The "unix:" address that gRPC reads as the socket path ``path``: gRPC decodes %XX
    escapes in it and ends it at a "?" or "#", so those three characters are written as
    escapes (``kvtier.client.types.unix_socket_path`` reads it back); so are the bytes of a
    path that is no UTF-8 (``os.fsdecode``'s surrogates), which no address may hold raw. A
    comma it cannot write: gRPC binds a path with one as written, but reads a client's
    address as a list split at its commas (%2C too), so the daemon's config refuses such a
    socket and the client's ``checked_address`` such an address."""
    text = path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")
    return "unix:" + "".join(
        f"%{ord(c) - 0xDC00:02X}" if "\udc80" <= c <= "\udcff" else c for c in text
    )


def user_socket(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The socket of a daemon a user runs: under ``$XDG_RUNTIME_DIR``, else a per-user /tmp
    folder."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "kvtier", SOCKET_NAME)
    return f"/tmp/kvtier-{os.getuid() if uid is None else uid}/{SOCKET_NAME}"


def daemon_socket(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The socket ``server.socket: auto`` resolves to for this process."""
    env = os.environ if env is None else env
    uid = os.geteuid() if uid is None else uid
    # systemd's RuntimeDirectory= sets it (several are separated by ':'; ours is the first).
    runtime = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, SOCKET_NAME)
    if uid == 0:
        return SYSTEM_SOCKET
    return user_socket(env, uid)


def client_candidates(env: Mapping[str, str] | None = None, uid: int | None = None) -> list[str]:
    """The sockets a client without an address looks for, in order."""
    uid = os.geteuid() if uid is None else uid
    mine = user_socket(env, uid)
    order = [SYSTEM_SOCKET, mine] if uid == 0 else [mine, SYSTEM_SOCKET]
    return list(dict.fromkeys(order))


def writers_problem(st: os.stat_result, owner: int) -> str | None:
    """Why users other than root and ``owner`` may write the folder ``st`` describes, and so
    replace a socket in it, or None. The daemon keeps its sockets only in a folder without
    one (``owner``: its own uid); a client trusts sockets only there (``owner``: theirs)."""
    if st.st_uid not in (0, owner):
        return f"belongs to uid {st.st_uid}, who could replace the socket"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"(mode {stat.S_IMODE(st.st_mode):04o}) is writable by other users, who could "
            "replace the socket"
        )
    return None


def untrusted_folder(path: str, uid: int) -> str | None:
    """``writers_problem`` of ``path``'s folder for sockets of ``uid`` (None where there is no
    folder)."""
    try:
        st = os.stat(os.path.dirname(path))
    except OSError:
        return None
    return writers_problem(st, uid)


def link_problem(path: str, owner: int, opened: os.stat_result) -> str | None:
    """Why the file opened from ``path`` (``opened``: its fstat) is not to be trusted, or None.
    A link on the way (at the file or at a folder) of a user other than root and ``owner``
    (the reader's uid) is not: that user could point it at any file, one they may not read
    included (another tenant's token). Root's are followed: a Kubernetes Secret volume gives
    each key as a link of root's to the current version's file. Looked at after the file was
    opened, so a link moved meanwhile shows as ``path`` leading to another file."""
    resolved = "/"
    parts = [p for p in os.path.join(os.getcwd(), path).split("/") if p not in ("", ".")]
    st = os.lstat(resolved)
    links = 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            resolved = os.path.dirname(resolved)  # free of links: its parent is its folder
            continue
        here = os.path.join(resolved, name)
        try:
            st = os.lstat(here)
            if not stat.S_ISLNK(st.st_mode):
                resolved = here
                continue
            target = os.readlink(here)
        except OSError as e:
            return f"changed while it was read ({here}: {e.strerror}); try again"
        if st.st_uid not in (0, owner):
            return (
                f"is reached through {here}, a link of uid {st.st_uid}, who could point it at "
                "any file: only root's links and this user's are followed"
            )
        links += 1
        if links > _MAX_LINKS:
            return "is reached through too many links"
        if target.startswith("/"):
            resolved = "/"
        parts[:0] = [p for p in target.split("/") if p not in ("", ".")]
    if (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino):
        return "changed while it was read (a link on the way moved); try again"
    return None


def default_client_socket(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The first candidate that is a socket, leaving out the user's own in a folder others
    may write; else the first behind a folder this user may not enter; else the first
    candidate not left out."""
    uid = os.geteuid() if uid is None else uid
    mine = user_socket(env, uid)
    candidates = [
        path
        for path in client_candidates(env, uid)
        if path != mine or untrusted_folder(path, uid) is None
    ]
    closed = None
    for path in candidates:
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return path
        except PermissionError:
            # A folder on the way keeps this user out (a system service's /run/kvtier, 0750,
            # to a user not in its group): the daemon may listen there, and a connection to
            # it says that this user may not, where the user's own socket is only absent.
            closed = closed or path
        except OSError:
            continue
    return closed or candidates[0]
