"""The replay of a cluster: which node serves each request (routing rules), and the L3 that
every node shares (``SharedStore``). ``kvtier.sim.engine`` runs one tier stack per node.

What the model takes from the daemon and from Redis (README, "The cluster tier (L3)"):

- **One entry per block.** L3 keys are (tenant namespace, block key), and every node derives
  the same key for the same tokens, so a block computed on two nodes is one entry; here the
  trace's block id is that key.
- **Writes** are ``SET ... EX ttl_s``: a write (a rewrite too) sets the entry's expiry to
  ``ttl_s`` after it; 0 is no expiry. **Reads** are ``GET``: they do not extend the expiry but
  make the entry recently used for ``maxmemory`` eviction. The daemon's probes (``GETRANGE``
  of a header) do so too; the model has no probes (``holds`` changes nothing).
- **Finite memory** is ``maxmemory`` with ``allkeys-lru``, as the README advises: a write to
  a full store evicts the least recently read or written entry. Redis approximates LRU by
  sampling and frees expired entries lazily and by sampling; the model is exact LRU and frees
  an entry the moment it expires.

Thread-safety: none needed; a replay is a single-threaded batch job.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.daemon.policy.admission import admission_names
from kvtier.sim.trace import Trace

# L3's default admission and TTL in the daemon (``tiers.l3`` in ``daemon/config.py``).
DAEMON_L3_ADMISSION = "second_hit"
DAEMON_L3_TTL_S = 3600.0

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def l3_admission_names() -> list[str]:
    """The admission rules ``tiers.l3.admission`` accepts (``belady`` needs the future)."""
    return [n for n in admission_names() if n != "belady"]


def _round_robin(trace: Trace, nodes: int, seed: int) -> np.ndarray:
    return np.arange(trace.requests, dtype=np.int64) % nodes


def _random(trace: Trace, nodes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, nodes, size=trace.requests, dtype=np.int64)


def _prefix(trace: Trace, nodes: int, seed: int) -> np.ndarray:
    """By a hash of the request's first block: every turn of a conversation starts with the
    same block, and so does every request behind one shared system prompt."""
    lo, hi = trace.offsets[:-1], trace.offsets[1:]
    out = _round_robin(trace, nodes, seed)  # a request with no cacheable block: no matter
    has = hi > lo
    if has.any():
        first = trace.blocks[lo[has]].astype(np.uint64)
        out[has] = ((first * _GOLDEN) >> np.uint64(32)) % np.uint64(nodes)
    return out


_ROUTES: dict[str, Callable[[Trace, int, int], np.ndarray]] = {
    "prefix": _prefix,
    "round-robin": _round_robin,
    "random": _random,
}
ROUTES = tuple(_ROUTES)
ROUTE_DOCS = {
    "prefix": "by a hash of the request's first block: a conversation's turns, and requests "
    "behind one shared prompt, go to one node (prefix affinity)",
    "round-robin": "request i to node i mod N (no affinity)",
    "random": "each request to a node drawn at random (--route-seed)",
}


MAX_NODES = 4096
"""Most nodes a replay models: it builds every node's tiers and scans the routing once per
node, so a count far past any cluster's (--nodes 1000000000) ran without end, and one past
a C long ended in an OverflowError."""


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How many nodes replay the trace, how requests reach them, and the L3 they share.

    ``l3_blocks`` 0: no L3 (the nodes share nothing). ``l3_ttl_s`` 0: entries never expire.
    ``l3_admission``: each node's rule for offering a block to L3 (the daemon's, per node).
    """

    nodes: int = 1
    route: str = "prefix"
    route_seed: int = 0
    l3_blocks: int = 0
    l3_ttl_s: float = DAEMON_L3_TTL_S
    l3_admission: str = DAEMON_L3_ADMISSION

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1 to {MAX_NODES}, got {self.nodes}")
        if self.route not in _ROUTES:
            raise ValueError(f"unknown route {self.route!r}; one of {', '.join(ROUTES)}")
        if self.route_seed < 0:
            raise ValueError("route_seed must not be negative")
        if self.l3_blocks < 0:
            raise ValueError("l3_blocks must not be negative")
        if not self.l3_ttl_s >= 0 or not math.isfinite(self.l3_ttl_s):
            raise ValueError("l3_ttl_s must be a finite number >= 0")
        if self.l3_admission not in l3_admission_names():
            raise ValueError(
                f"unknown L3 admission {self.l3_admission!r}; one of "
                f"{', '.join(l3_admission_names())}"
            )

    @property
    def single(self) -> bool:
        """One node and no L3: the replay of one daemon."""
        return self.nodes == 1 and self.l3_blocks == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "route": self.route,
            "route_seed": self.route_seed,
            "l3_blocks": self.l3_blocks,
            "l3_ttl_s": self.l3_ttl_s,
            "l3_admission": self.l3_admission,
        }


def route_requests(trace: Trace, config: ClusterConfig) -> np.ndarray:
    """The node of each request of ``trace`` (int64, one per request)."""
    if config.nodes == 1:
        return np.zeros(trace.requests, dtype=np.int64)
    return _ROUTES[config.route](trace, config.nodes, config.route_seed)


@dataclass(frozen=True, slots=True)
class L3Stats:
    writes: int  # SETs, rewrites of a present entry included
    reads: int  # GETs that found the entry: L3 hits, and prefetches of queue hints
    evictions: int  # entries dropped for room (allkeys-lru)
    expiries: int  # entries dropped by their TTL
    held: int  # entries at the end of the replay

    def as_dict(self) -> dict[str, int]:
        return {
            "writes": self.writes,
            "reads": self.reads,
            "evictions": self.evictions,
            "expiries": self.expiries,
            "held": self.held,
        }


class SharedStore:
    """The shared L3 (see the module docstring): at most ``capacity_blocks`` entries, each
    expiring ``ttl_s`` after its last write (0: never).

    Calls carry the trace time of the node that makes them; the store keeps the latest it
    saw, so its clock never goes back when a trace's timestamps do.
    """

    def __init__(self, capacity_blocks: int, ttl_s: float) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.now = -math.inf
        # Entry -> its expiry, least recently read or written first (allkeys-lru order).
        self._lru: OrderedDict[int, float] = OrderedDict()
        # The same entries, earliest expiry first: with one TTL for all, the order of their
        # last writes. Empty without a TTL.
        self._expiring: OrderedDict[int, float] = OrderedDict()
        self.writes = self.reads = self.evictions = self.expiries = 0

    def __len__(self) -> int:
        return len(self._lru)

    def holds(self, block: int, now: float) -> bool:
        """Whether the entry is there (nothing changes)."""
        self._advance(now)
        return block in self._lru

    def read(self, block: int, now: float) -> bool:
        """``GET``: True and the entry is now the most recently used, or False: absent."""
        self._advance(now)
        if block not in self._lru:
            return False
        self._lru.move_to_end(block)
        self.reads += 1
        return True

    def write(self, block: int, now: float) -> None:
        """``SET ... EX``: store or overwrite the entry, evicting the least recently used
        one when the store is full."""
        self._advance(now)
        expiry = self.now + self.ttl_s if self.ttl_s else math.inf
        lru = self._lru
        if block in lru:
            lru.move_to_end(block)
        elif len(lru) >= self.capacity_blocks:
            victim, _ = lru.popitem(last=False)
            self._expiring.pop(victim, None)
            self.evictions += 1
        lru[block] = expiry
        if self.ttl_s:
            self._expiring[block] = expiry
            self._expiring.move_to_end(block)
        self.writes += 1

    def stats(self) -> L3Stats:
        return L3Stats(self.writes, self.reads, self.evictions, self.expiries, len(self._lru))

    def _advance(self, now: float) -> None:
        """Move the clock to ``now`` and drop what expired by then (an entry lives through
        the instant of its expiry, as in Redis)."""
        if now > self.now:
            self.now = now
        expiring = self._expiring
        while expiring:
            block, expiry = next(iter(expiring.items()))
            if expiry >= self.now:
                break
            del expiring[block]
            del self._lru[block]
            self.expiries += 1
