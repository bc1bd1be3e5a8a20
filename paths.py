"""Where the daemon listens by default, and where a client looks for it: one rule for both.

The client may not import the daemon (nor the daemon the client), so the rule lives here, in a
module that imports nothing of kvtier. Every path is absolute, so a client started in any
directory finds a daemon started in any other.

The rule:

- a **system service** (systemd sets ``$RUNTIME_DIRECTORY`` for ``RuntimeDirectory=kvtier``; a
  daemon running as root, as in a container, counts too) listens on
  ``/run/kvtier/kvtierd.sock`` (``$RUNTIME_DIRECTORY/kvtierd.sock`` under systemd);
- a daemon run by a user listens on ``$XDG_RUNTIME_DIR/kvtier/kvtierd.sock``, or
  ``/tmp/kvtier-$UID/kvtierd.sock`` where no ``$XDG_RUNTIME_DIR`` is set;
- a client with no address (and no ``$KVTIER_ADDRESS``) connects to the first of those two
  sockets (its own user's first, unless it runs as root) that exists, and otherwise names the
  one its own daemon would use. Its own user's socket counts only in a folder that user (or
  root) owns: anyone may make ``/tmp/kvtier-$UID`` first and listen there, and that user's
  daemon would refuse such a folder too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

ADDRESS_ENV = "KVTIER_ADDRESS"
SOCKET_NAME = "kvtierd.sock"
SYSTEM_SOCKET = "/run/kvtier/" + SOCKET_NAME


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


def foreign_folder(path: str, uid: int) -> int | None:
    """The owner of ``path``'s folder when that is neither ``uid`` nor root (None otherwise,
    and when there is no folder)."""
    try:
        owner = os.stat(os.path.dirname(path)).st_uid
    except OSError:
        return None
    return None if owner in (0, uid) else owner


def default_client_socket(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The first candidate that is a socket, leaving out the user's own in another user's
    folder; else the first candidate not left out."""
    uid = os.geteuid() if uid is None else uid
    mine = user_socket(env, uid)
    candidates = [
        path
        for path in client_candidates(env, uid)
        if path != mine or foreign_folder(path, uid) is None
    ]
    for path in candidates:
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return path
        except OSError:
            continue
    return candidates[0]
