"""A kvtier connector whose workers' loads all fail, for ``test_engine``'s ``lossy`` run:
the daemon seems to have lost the data of every block its index lists, so lookups find a
hit and every load of it misses. vLLM imports it by name in its engine processes
(``kv_connector_module_path="lossy_connector"``; ``engine_run.py``'s folder is on their path).
"""

from __future__ import annotations

import os
from typing import Any

from kvtier.client.integrations.vllm import KVTierConnector
from kvtier.client.jobs import LoadSegment


class LossyConnector(KVTierConnector):
    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        client = self.worker_side.client
        submit = client.submit_load

        def lost(pool: Any, segments: Any, **kwargs: Any) -> Any:
            gone = [LoadSegment([os.urandom(32) for _ in s.keys], s.pages) for s in segments]
            return submit(pool, gone, **kwargs)

        client.submit_load = lost  # type: ignore[method-assign]
