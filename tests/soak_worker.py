"""One client process of the soak test (tests/test_soak.py).

``python soak_worker.py ADDRESS UID GID TENANT SEED SECONDS`` imports what it needs, drops to
``UID``/``GID``, then runs a random mix of operations against the daemon for ``SECONDS``:
store a chain (or its tail after its parent), load a chain (pin, get, release), get without
a lease, look up, prefetch, delete a chain, stats. Every tenant uses the same keys; a block's
bytes are derived from (tenant, key), so a load that returns anything but this tenant's bytes
for the key is counted: as a cross-tenant read when it is the other tenant's bytes, as wrong
bytes otherwise. Every error is counted by its type.

Every 0.25 s it prints one JSON line of its cumulative counts (the parent keeps the last line
of a worker it kills), and a final line when its time is up.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from collections import Counter

# Imported before the privileges are dropped (the venv may be unreadable to that user).
import numpy as np

from kvtier.client import Client, KvtierError, PoolLayout, SharedMemoryPool

CHAINS = 48
CHAIN_BLOCKS = 8
LAYOUT = PoolLayout.staging(
    num_layers=2, num_pages=64, block_tokens=16, chunk_bytes=16384, kv_count=1, dtype="uint8"
)
BLOCK = LAYOUT.block_bytes
STORE_PAGES = range(0, 32)
LOAD_PAGES = range(32, 64)
TENANTS = ("alice", "bob")


def chain_keys(chain: int) -> list[bytes]:
    """The same keys for every tenant: isolation must come from the daemon."""
    return [
        hashlib.sha256(f"soak chain {chain} block {i}".encode()).digest()
        for i in range(CHAIN_BLOCKS)
    ]


_PATTERNS: dict[tuple[str, bytes], np.ndarray] = {}


def content(tenant: str, key: bytes) -> np.ndarray:
    """The bytes of ``key``'s block when ``tenant`` stores it."""
    found = _PATTERNS.get((tenant, key))
    if found is None:
        seed = hashlib.sha256(tenant.encode() + key).digest()
        found = np.frombuffer(seed * (BLOCK // len(seed)), dtype=np.uint8)
        _PATTERNS[(tenant, key)] = found
    return found


def drop_privileges(uid: int, gid: int) -> None:
    if (os.getuid(), os.getgid()) != (uid, gid):
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


class Worker:
    def __init__(self, address: str, tenant: str, seed: int) -> None:
        self.tenant = tenant
        self.other = next(t for t in TENANTS if t != tenant)
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.client = Client(address, timeout_s=30, client_name=f"soak {tenant} {seed}")
        self.shm = SharedMemoryPool.for_layout(LAYOUT)
        self.pool = self.client.register_pool(self.shm, LAYOUT)
        self.pages = self.shm.array().reshape(LAYOUT.num_pages, BLOCK)
        self.keys = [chain_keys(c) for c in range(CHAINS)]

    def verify(self, keys: list[bytes], pages: list[int], loaded: list[bool]) -> None:
        for key, page, ok in zip(keys, pages, loaded, strict=True):
            if not ok:
                continue
            self.counts["blocks_loaded"] += 1
            got = self.pages[page]
            if np.array_equal(got, content(self.tenant, key)):
                continue
            if np.array_equal(got, content(self.other, key)):
                self.counts["cross_tenant_reads"] += 1
            else:
                self.counts["wrong_bytes_blocks"] += 1

    def poison(self, pages: list[int]) -> None:
        self.pages[pages] = 0x5A

    def step(self) -> None:
        rng = self.rng
        chain = rng.randrange(CHAINS)
        keys = self.keys[chain]
        op = rng.choices(
            ["store", "store_tail", "load", "get", "lookup", "prefetch", "delete", "stats"],
            weights=[20, 10, 30, 10, 10, 10, 8, 2],
        )[0]
        c, pid = self.client, self.pool.pool_id
        if op in ("store", "store_tail"):
            start = 0 if op == "store" else rng.randrange(1, CHAIN_BLOCKS)
            part = keys[start:]
            pages = list(STORE_PAGES[: len(part)])
            for key, page in zip(part, pages, strict=True):
                self.pages[page] = content(self.tenant, key)
            parent = keys[start - 1] if start else b""
            held = self.pool.store_keys(part, pages, parent_key=parent)
            self.counts["blocks_stored_or_held"] += held
        elif op == "load":
            pages = list(LOAD_PAGES[:CHAIN_BLOCKS])
            self.poison(pages)
            n = self.pool.load_keys(keys, pages)
            self.verify(keys[:n], pages[:n], [True] * n)
        elif op == "get":
            pages = list(LOAD_PAGES[CHAIN_BLOCKS : 2 * CHAIN_BLOCKS])
            self.poison(pages)
            got = c.get(pid, keys, pages)
            self.verify(keys, pages, got.loaded)
        elif op == "lookup":
            c.lookup(keys)
        elif op == "prefetch":
            c.prefetch(keys, deadline_ms=rng.choice([0, 50, 1000]))
        elif op == "delete":
            c.delete(keys[rng.randrange(CHAIN_BLOCKS) :])
        else:
            c.stats()
        self.counts[f"op_{op}"] += 1
        self.counts["ops"] += 1

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        next_report = 0.0
        while (now := time.monotonic()) < end:
            try:
                self.step()
            except KvtierError as e:
                self.counts[f"error_{type(e).__name__}"] += 1
                self.counts["ops"] += 1
            if now >= next_report:
                self.report()
                next_report = now + 0.25
        self.report(final=True)
        self.client.close()
        self.shm.close()

    def report(self, final: bool = False) -> None:
        print(json.dumps({"final": final, **self.counts}), flush=True)


def main() -> None:
    address, uid, gid, tenant, seed, seconds = sys.argv[1:7]
    drop_privileges(int(uid), int(gid))
    Worker(address, tenant, int(seed)).run(float(seconds))


if __name__ == "__main__":
    main()
