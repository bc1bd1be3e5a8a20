"""The vLLM connector's scheduler side while its daemon does not answer (stopped with
SIGSTOP): the breaker's invariant, that nothing is sent while it is open, holds for lease
releases too, so a hung daemon costs vLLM's scheduler thread one lookup timeout, not one
more per lease that a worker reports done or that shutdown gives back. A real daemon; vLLM's
base classes as ``conftest.vllm_modules`` provides them."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace
from typing import Any

BLOCKS = 8


def test_leases_are_not_released_over_rpc_while_the_daemon_does_not_answer(vllm_modules, daemon):
    """Regression: with the daemon hung, each lease a worker reported done, and each one
    shutdown gave back, was released by an RPC on vLLM's scheduler thread that waited the
    whole lookup timeout, while the breaker was open (the daemon expires them after
    lease_ms in any case)."""
    mods = vllm_modules
    identity = mods.identity("hung-daemon")
    config = mods.config.ConnectorConfig(
        address=daemon.address, layer_groups=1, lookup_timeout_s=0.3, retry_after_s=0.05
    )
    side = mods.scheduler.SchedulerSide(config, identity, BLOCKS)
    request = SimpleNamespace(
        request_id="r", all_token_ids=list(range(17)), num_tokens=17, num_prompt_tokens=17
    )
    released: list[int] = []
    release = side.client.release

    def counted(lease: int) -> Any:
        released.append(lease)
        return release(lease)

    side.client.release = counted  # type: ignore[method-assign]
    assert daemon.proc is not None
    stopped = False
    try:
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # a miss: it serves
        assert side.stats["lookups"] == 1 and side.breaker.ok()
        side._lease_owner.update({7: "r", 8: "r"})
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        stopped = True
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        assert side.stats["lookup_errors"] == 1 and side.breaker.probing

        meta = mods.meta.KVTierWorkerMetadata(done_leases={7})
        side.update_connector_output(
            SimpleNamespace(finished_recving=None, kv_connector_worker_meta=meta)
        )
        assert 7 not in side._lease_owner
        side.shutdown()
        assert released == []
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        side.shutdown()
