"""Acting as another user in tests: a forked child that drops to a uid and gid.

The child only makes plain system calls (sockets, files) and reports a JSON value back; it
never touches gRPC, which does not survive fork. It needs root to change uid, which is how
the project's CI runs; elsewhere these tests are skipped with that reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest

NOBODY = 65534
NOGROUP = 65534


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("acting as another uid needs root (CI runs as root)")


def run_as(uid: int, gid: int, fn: Callable[[], Any], *, groups: Sequence[int] = ()) -> Any:
    """``fn()`` in a child running as ``uid``/``gid`` with supplementary ``groups``; its
    return value (JSON) or, if it raised, ``{"error": "<Type>: <message>"}``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            out: Any = {"value": fn()}
        except BaseException as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks) or b'{"error": "the child died"}')
    return result.get("value", result)
