"""``save_durable`` through vLLM's real scheduler and the connector it loads, against a
daemon whose disk tier does not write every block it is sent (past the tenant's L2 quota):
the blocks held in memory only are counted, reach vLLM's connector stats, and are warned of.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from harness import DaemonFactory, l2_quota_args
from mini_engine import BLOCK, LAYERS, MiniEngine, wait_until
from vllm_harness import make_checkpoint, prompts

from kvtier.client.integrations import vllm_worker
from kvtier.client.integrations.vllm import KVTierConnector

pytestmark = pytest.mark.timeout(600)

BLOCK_BYTES = LAYERS * 2 * BLOCK * 2 * 64 * 2  # MiniEngine: K and V, 2 heads of 64, bf16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def run_saving(engine: MiniEngine, req_id: str, prompt: list[int]) -> None:
    """Run a request to its end, then a step once its saves are stored: that step's calls
    reap the save jobs and hand vLLM their counts."""
    engine.add(req_id, prompt, max_tokens=2)
    engine.run()
    assert wait_until(lambda: engine.worker.saves_in_flight() == 0, timeout_s=30)
    engine.step()


def vllm_stats(engine: MiniEngine) -> dict[str, int]:
    """The save counters in the connector stats vLLM's scheduler handed its front end so
    far, summed as vLLM's stats logger sums them."""
    total = KVTierConnector.build_kv_connector_stats()
    for data in engine.connector_stats:
        total = total.aggregate(KVTierConnector.build_kv_connector_stats(data))
    return {
        k: v for k, v in total.reduce().items() if k in ("save_blocks", "save_blocks_not_durable")
    }


def test_regression_save_durable_counted_blocks_its_disk_did_not_write_as_saved(
    model_dir: Path,
    daemon_factory: DaemonFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt of 4 full blocks stored with ``save_durable`` past an L2 quota of 2 blocks:
    the daemon holds all 4 and its disk wrote 2. The connector read only which blocks the
    daemon held, so vLLM's stats had 4 saved and nothing else; now the 2 others reach them
    as ``save_blocks_not_durable``, with one warning. Another prompt's 4 blocks, none
    written, are counted too, without a second warning within ``OVER_LIMIT_WARN_S`` (an hour
    here, so that no slow step lets one through)."""
    monkeypatch.setattr(vllm_worker, "OVER_LIMIT_WARN_S", 3600.0)
    daemon = daemon_factory(*l2_quota_args(tmp_path / "l2", 2 * BLOCK_BYTES))
    prompt = prompts(58, 4 * BLOCK, [10])[0]
    engine = MiniEngine(model_dir, {"address": daemon.address, "save_durable": True})
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            run_saving(engine, "r", prompt)
            assert vllm_stats(engine) == {"save_blocks": 4, "save_blocks_not_durable": 2}
            warned = [r.getMessage() for r in caplog.records if "save_durable" in r.getMessage()]
            assert len(warned) == 1 and warned[0].startswith("kvtier connector: 2 saved blocks")
            run_saving(engine, "s", prompts(59, 4 * BLOCK, [10])[0])
            assert vllm_stats(engine) == {"save_blocks": 8, "save_blocks_not_durable": 6}
            assert len([r for r in caplog.records if "save_durable" in r.getMessage()]) == 1
        with daemon.client() as client:
            assert client.stats().counter("put_blocks", result="stored") == 8
    finally:
        engine.close()
