"""L3: blocks in a remote key-value store (Redis, Valkey, Redis Cluster).

- ``options``: the tier's settings (``RemoteOptions``); no redis import.
- ``codec``: key naming and the value header (magic, version, length, checksum, key tag).
- ``state``: reachability with backoff, the write budget; pure, ``now`` as an argument.
- ``tier``: ``RemoteTier``, the ``KeyTier`` on redis-py's asyncio client (needs the
  ``redis`` extra; imported on its own so that the rest loads without it).
"""

from __future__ import annotations

from kvtier.tiers.remote.options import RemoteOptions, RemoteOptionsError

__all__ = ["RemoteOptions", "RemoteOptionsError"]
