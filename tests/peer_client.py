"""A real kvtier client in its own process, acting as another user, driven line by line.

``PeerClient(address, uid, gid)`` starts ``python peer_client.py`` as root; the child imports
everything it needs, then drops to ``uid``/``gid`` (so the checkout and the venv need not be
readable by that user) and serves JSON commands on stdin, one per line, answering one JSON
line each. It holds one ``kvtier.client.Client`` and one registered memfd pool; keys travel
as hex, a page's bytes as the hex of its SHA-256 (and its first byte).

A command is ``{"op": NAME, ...}``; errors come back as ``{"error": "<Type>", "details": ...}``
(the client's typed errors), so the test sees exactly what the daemon answered.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

# Imported before the privileges are dropped: afterwards the files may be unreadable.
import grpc  # noqa: F401
import numpy as np

from kvtier.client import Client, KvtierError, PoolLayout, SharedMemoryPool
from kvtier.client.types import Tier

LAYOUT = PoolLayout.staging(num_layers=2, num_pages=32, block_tokens=4, chunk_bytes=4096)


def drop_privileges(uid: int, gid: int) -> None:
    if os.getuid() == uid and os.getgid() == gid:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


class Peer:
    """The child's side: one client, one pool."""

    def __init__(self, address: str, namespace: str, token: str) -> None:
        self.client = Client(address, namespace=namespace, token=token or None, timeout_s=20)
        self.shm = SharedMemoryPool.for_layout(LAYOUT)
        self.pool = self.client.register_pool(self.shm, LAYOUT)
        self.pages = self.shm.array().reshape(LAYOUT.num_pages, -1)

    def page_digest(self, page: int) -> list[Any]:
        data = self.pages[page]
        return [hashlib.sha256(data.tobytes()).hexdigest(), int(data[0])]

    def run(self, cmd: dict[str, Any]) -> Any:
        op = cmd["op"]
        keys = [bytes.fromhex(k) for k in cmd.get("keys", [])]
        pages = cmd.get("pages", [])
        ns = cmd.get("namespace")
        c = self.client
        if op == "whoami":
            return {"tenant": c.tenant, "admin": c.admin}
        if op == "fill":  # each page filled with one byte value
            for page, value in zip(pages, cmd["values"], strict=True):
                self.pages[page] = value
            return [self.page_digest(p) for p in pages]
        if op == "put":
            r = c.put(self.pool.pool_id, keys, pages, namespace=ns)
            return [int(s) for s in r.statuses]
        if op == "get":
            r = c.get(self.pool.pool_id, keys, pages, lease_id=cmd.get("lease_id", 0), namespace=ns)
            return {"loaded": r.loaded, "pages": [self.page_digest(p) for p in pages]}
        if op == "lookup":
            r = c.lookup(keys, pin=cmd.get("pin", False), namespace=ns)
            return {"prefix": r.prefix_len, "tiers": [int(t) for t in r.tiers], "lease": r.lease_id}
        if op == "release":
            c.release(cmd["lease_id"])
            return None
        if op == "prefetch":
            r = c.prefetch(keys, namespace=ns)
            return [r.resident, r.scheduled, r.missing]
        if op == "delete":
            r = c.delete(keys, namespace=ns, tenant=cmd.get("tenant", ""))
            return [r.deleted, r.missing, r.busy]
        if op == "evict":
            r = c.evict(keys, Tier(cmd["tier"]), namespace=ns, tenant=cmd.get("tenant", ""))
            return [r.evicted, r.missing, r.busy]
        if op == "check":
            return c.check().problems
        if op == "drain":
            return c.drain(resume=cmd.get("resume", False)).draining
        if op == "stats":
            s = c.stats()
            return [
                {
                    "tenant": t.tenant,
                    "sessions": t.sessions,
                    "tiers": {
                        u.tier.name: [u.used_bytes, u.quota_bytes, u.blocks] for u in t.tiers
                    },
                }
                for t in s.tenants
            ]
        if op == "daemon_stats":  # what the rest of the answer shows this tenant
            s = c.stats()
            return {
                "tiers": {u.tier.name: [u.used_bytes, u.blocks] for u in s.tiers},
                "counters": dict(s.counters),
                "gauges": dict(s.gauges),
            }
        raise ValueError(f"unknown op {op}")


def serve_tickets() -> None:
    """``--tickets``: answer "session" with a session ticket and "pool" with a pool ticket
    for a fresh memfd of ``LAYOUT``'s size, both as this user (hex, one line each)."""
    from kvtier.client import credentials as cred

    path, uid, gid = sys.argv[2:5]
    drop_privileges(int(uid), int(gid))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "session":
            print(cred.session_ticket(path).hex(), flush=True)
        else:
            fd = os.memfd_create("kvtier-peer", os.MFD_CLOEXEC)
            os.posix_fallocate(fd, 0, int(line.split()[1]))  # registered only if allocated
            print(cred.pool_ticket(path, fd).hex(), flush=True)
            os.close(fd)


class TicketPeer:
    """Credential tickets of another user, from a process of that user (no fork of this
    process, whose gRPC threads a fork would break)."""

    def __init__(self, cred_path: str, uid: int, gid: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--tickets", cred_path, str(uid), str(gid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._ask(None) == "ready"

    def _ask(self, line: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"the ticket peer exited with {self.proc.wait()}")
        return answer

    def session_ticket(self) -> bytes:
        return bytes.fromhex(self._ask("session"))

    def pool_ticket(self, size_bytes: int) -> bytes:
        """The ticket of a memfd of ``size_bytes`` this user made and handed over."""
        return bytes.fromhex(self._ask(f"pool {size_bytes}"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve() -> None:
    address, uid, gid, namespace, token = sys.argv[1:6]
    drop_privileges(int(uid), int(gid))
    try:
        peer: Peer | None = Peer(address, namespace, token)
        print(json.dumps({"value": "ready"}), flush=True)
    except KvtierError as e:
        peer = None
        print(json.dumps({"error": type(e).__name__, "details": e.details}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit" or peer is None:
            break
        try:
            out: dict[str, Any] = {"value": peer.run(cmd)}
        except KvtierError as e:
            out = {"error": type(e).__name__, "details": e.details}
        print(json.dumps(out), flush=True)


class PeerError(Exception):
    def __init__(self, kind: str, details: str) -> None:
        super().__init__(f"{kind}: {details}")
        self.kind = kind
        self.details = details


class PeerClient:
    """The test's side: a client process of ``uid``/``gid`` (the caller must be root to
    change uid)."""

    def __init__(
        self, address: str, uid: int, gid: int, *, namespace: str = "", token: str = ""
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, address, str(uid), str(gid), namespace, token],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = self._read()
        if "error" in first:
            self.close()
            raise PeerError(first["error"], first["details"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer client exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def __call__(self, op: str, **kwargs: Any) -> Any:
        """Run one command; raises PeerError with the daemon's answer on an error."""
        if "keys" in kwargs:
            kwargs["keys"] = [k.hex() for k in kwargs["keys"]]
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise PeerError(out["error"], out["details"])
        return out["value"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def page_digest_of(data: np.ndarray) -> list[Any]:
    return [hashlib.sha256(data.tobytes()).hexdigest(), int(data[0])]


if __name__ == "__main__":
    if sys.argv[1] == "--tickets":
        serve_tickets()
    else:
        serve()
