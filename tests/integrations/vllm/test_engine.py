"""kvtier behind real vLLM engines (vLLM's CPU build, a tiny random Llama, token-id prompts).

Six engine processes run one after the other against one kvtierd, each a fresh vLLM
(``engine_run.py``):

1. ``reference``: model A, no connector: the outputs every other run must reproduce. Each
   group of prompts runs twice: ``cold`` computes everything, ``warm`` finds the shared
   prefix in vLLM's own prefix cache. Both are vLLM's own answers, and they may differ in a
   near-tie (a whole-prompt prefill and a suffix-only prefill round differently in bf16), so
   a run is compared with the reference that took the same path: an engine that computed a
   prefix with ``cold``, one that loaded it from kvtier with ``warm`` (a loaded prefix must
   act exactly like vLLM's own cached one).
2. ``other``: model B (model A's config with another ``rope_theta``) with the connector: it
   stores the same token prefixes under model B's namespace.
3. ``first``: model A with the connector, on that daemon: it must load nothing (d), produce
   the reference outputs (a), and store its blocks.
4. ``small_staging``: model A with async loads and 6 staging blocks for loads, on two
   prompts of different prefixes (one of each group) that find 5 and 3 blocks in kvtier:
   a hit that comes while another load holds the pages must be cut to the pages left
   (before, its load failed, and vLLM queued the request to ask again) (e).
5. ``lossy``: model A with async loads through a connector whose every load misses (the
   daemon seems to have lost what its index lists): each request whose load failed is
   recomputed, once (before, vLLM queued it again, the same hit came back, and the engine
   went round for good) (f).
6. ``second``: model A again, after ``first`` exited: it loads the shared prefixes from
   kvtier, vLLM's and kvtier's counters agree on how many tokens (b), and outputs match
   (a); then the daemon is killed mid-phase and later requests still complete with the
   reference outputs (c).

Every engine with the connector reports its counters through vLLM's KV-connector stats: its
stats line and its ``vllm:kvtier_*`` Prometheus counters (g).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import DaemonFactory
from vllm_harness import BLOCK_BYTES, BLOCK_TOKENS, make_checkpoint, prompts, run_engine

pytestmark = pytest.mark.timeout(2400)

FIRST = 3  # prompts of the "first" group share a 640-token (5-block) prefix
SHARED = prompts(1, 640, [30, 47, 61, 25, 90])
GROUP_FIRST, GROUP_AFTER = SHARED[:FIRST], SHARED[FIRST:]
GROUP_KILL = prompts(2, 384, [20, 33, 41, 55])
MIXED = [GROUP_FIRST[0], GROUP_KILL[0]]  # 5 and 3 blocks in kvtier once `first` ran
STAGING_BLOCKS = 6


def _phase(name: str, group: list[list[int]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "prompts": group, "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work: Path = tmp_path_factory.mktemp("vllm-engines")
    model_a = make_checkpoint(work / "model-a")
    model_b = make_checkpoint(work / "model-b", rope_theta=20000.0)
    factory = DaemonFactory(work)
    try:
        daemon = factory(l1_bytes="512MiB")
        connector = {
            "address": daemon.address,
            "lookup_timeout_s": 1.0,
            "load_timeout_s": 5.0,
            "retry_after_s": 2.0,
        }
        out: dict[str, Any] = {"daemon": daemon}
        out["reference"] = run_engine(
            work,
            "reference",
            {
                "model": str(model_a),
                "connector": None,
                "phases": [
                    _phase("first", GROUP_FIRST, 16),
                    _phase("first_warm", GROUP_FIRST, 16),
                    _phase("kill", GROUP_KILL, 48),
                    _phase("kill_warm", GROUP_KILL, 48),
                    _phase("after", GROUP_AFTER, 16),
                ],
            },
        )
        out["other"] = run_engine(
            work,
            "other",
            {
                "model": str(model_b),
                "connector": connector,
                "phases": [_phase("first", GROUP_FIRST, 16), _phase("kill", GROUP_KILL, 16)],
            },
        )
        out["first"] = run_engine(
            work,
            "first",
            {
                "model": str(model_a),
                "connector": connector,
                "phases": [_phase("first", GROUP_FIRST, 16), _phase("kill", GROUP_KILL, 48)],
            },
        )
        out["small_staging"] = run_engine(
            work,
            "small_staging",
            {
                "model": str(model_a),
                "connector": {
                    **connector,
                    "load_mode": "async",
                    # Half the pool is for saves.
                    "staging_bytes": 2 * STAGING_BLOCKS * BLOCK_BYTES,
                },
                "phases": [_phase("mixed", MIXED, 16)],
            },
            timeout_s=300,
        )
        out["lossy"] = run_engine(
            work,
            "lossy",
            {
                "model": str(model_a),
                "connector": {**connector, "load_mode": "async"},
                "connector_class": ["lossy_connector", "LossyConnector"],
                "phases": [_phase("first", GROUP_FIRST, 16)],
            },
            timeout_s=300,
        )
        assert daemon.proc is not None
        out["second"] = run_engine(
            work,
            "second",
            {
                "model": str(model_a),
                "connector": connector,
                "phases": [
                    _phase("first", GROUP_FIRST, 16),
                    _phase("kill", GROUP_KILL, 48, kill_pid=daemon.proc.pid, kill_after_s=0.05),
                    _phase("after", GROUP_AFTER, 16),
                ],
            },
        )
        yield out
    finally:
        factory.close()


def _outputs(run: dict[str, Any], phase: str) -> list[list[int]]:
    return run["phases"][phase]["outputs"]


def _delta(run: dict[str, Any], phase: str, before: str | None, key: str) -> float:
    after = run["phases"][phase]["metrics"].get(key, 0.0)
    start = run["phases"][before]["metrics"].get(key, 0.0) if before else 0.0
    return after - start


def test_a_outputs_with_the_connector_equal_outputs_without_it(runs):
    ref = runs["reference"]
    # An engine with the connector that loaded nothing computes what plain vLLM computes.
    for phase in ("first", "kill"):
        assert _outputs(runs["first"], phase) == _outputs(ref, phase), phase
    # Prefixes loaded from kvtier act exactly like vLLM's own cached prefixes.
    assert _outputs(runs["second"], "first") == _outputs(ref, "first_warm")
    assert _outputs(runs["second"], "after") == _outputs(ref, "after")
    # The reference is not degenerate: outputs differ between prompts.
    assert len({tuple(o) for o in _outputs(ref, "first")}) == FIRST


def test_d_another_model_config_never_loads(runs):
    other, first = runs["other"], runs["first"]
    # Model B stored the same token prefixes (under its own namespace) ...
    assert other["phases"]["kill"]["kvtier"]["blocks"] > 0
    stored_by_b = other["phases"]["kill"]["kvtier"]
    # ... and model A looked them up, found none and loaded none.
    phase = first["phases"]["first"]
    assert phase["kvtier"]["lookup_keys"] > stored_by_b.get("lookup_keys", 0)
    assert phase["kvtier"].get("get_blocks_loaded", 0) == 0
    assert _delta(first, "first", None, "vllm:external_prefix_cache_hits") == 0
    assert phase["cached_tokens"][0] == 0  # nothing came from anywhere for the first prompt
    # Model B's outputs really differ (its KV would have been wrong for model A).
    assert _outputs(other, "first") != _outputs(runs["reference"], "first")


def test_b_a_second_engine_loads_the_shared_prefix_from_kvtier(runs):
    second = runs["second"]
    # The daemon's counters when the run before `second` ended.
    before = runs["lossy"]["phases"]["first"]["kvtier"]
    phase = second["phases"]["first"]
    loaded_blocks = phase["kvtier"]["get_blocks_loaded"] - before.get("get_blocks_loaded", 0)
    external_tokens = _delta(second, "first", None, "vllm:external_prefix_cache_hits")
    # Both sides saw the same loads: vLLM counted the tokens, kvtierd the blocks it copied.
    assert loaded_blocks > 0
    assert external_tokens == loaded_blocks * BLOCK_TOKENS
    # The first prompt's whole 5-block prefix came from kvtier (no local cache yet).
    assert phase["cached_tokens"][0] >= 5 * BLOCK_TOKENS
    assert _outputs(second, "first") == _outputs(runs["reference"], "first")


def test_c_a_daemon_killed_mid_run_costs_no_request(runs):
    second = runs["second"]
    kill = second["phases"]["kill"]
    assert kill["killed_at_s"] is not None and kill["killed_at_s"] < kill["elapsed_s"]
    assert not runs["daemon"].running()
    assert kill["kvtier"] is None and second["phases"]["after"]["kvtier"] is None
    # Whether a request's prefix was loaded before the kill or recomputed after it, its
    # output is vLLM's own for that path.
    ref = runs["reference"]
    for i, got in enumerate(_outputs(second, "kill")):
        assert got in (_outputs(ref, "kill")[i], _outputs(ref, "kill_warm")[i]), i
    assert _outputs(second, "after") == _outputs(ref, "after")
    assert "kvtier" in second["log"] and "failed" in second["log"]


def test_e_async_hits_are_cut_to_the_staging_pages_left(runs):
    """vLLM's engine core usually schedules the first prompt before the second arrives: the
    second's hit comes while the first's 5-block load holds 5 of the 6 pages, and is cut to
    one block; were the first load done by then, the second gets all 3 blocks. Either way
    every block promised to vLLM loads, once. Before, the second load found no pages and
    failed (vLLM queued the request and asked again: 11 blocks' tokens promised, 8 loaded);
    the MiniEngine tests pin the hits of one step, which never ended in async mode."""
    run = runs["small_staging"]
    phase = run["phases"]["mixed"]
    before = runs["first"]["phases"]["kill"]["kvtier"]
    loaded_blocks = phase["kvtier"]["get_blocks_loaded"] - before.get("get_blocks_loaded", 0)
    external_tokens = _delta(run, "mixed", None, "vllm:external_prefix_cache_hits")
    assert external_tokens == loaded_blocks * BLOCK_TOKENS
    assert "did not load" not in run["log"]
    first_hit, second_hit = phase["cached_tokens"]
    assert first_hit == 5 * BLOCK_TOKENS and second_hit in (BLOCK_TOKENS, 3 * BLOCK_TOKENS)
    assert loaded_blocks == (first_hit + second_hit) // BLOCK_TOKENS
    ref = runs["reference"]
    # The first prompt loaded its whole prefix, as vLLM's own cache would have held it.
    first, kill = _outputs(run, "mixed")
    assert first == _outputs(ref, "first_warm")[0]
    assert kill in (_outputs(ref, "kill")[0][:16], _outputs(ref, "kill_warm")[0][:16])


def _kv_transfer_lines(run: dict[str, Any]) -> list[dict[str, int]]:
    """vLLM's ``KV Transfer metrics: a=1, b=2`` log lines, one per phase that had any."""
    lines = []
    for line in run["log"].splitlines():
        _, found, rest = line.partition("KV Transfer metrics: ")
        if found:
            pairs = (item.split("=") for item in rest.strip().split(", "))
            lines.append({k: int(v) for k, v in pairs})
    return lines


def test_g_the_connectors_counters_reach_vllms_stats_log_and_prometheus(runs):
    """Both sides' counters go through vLLM's KV-connector stats: the scheduler's (lookups,
    hits) and the worker's (loads, saves) show in vLLM's stats line and as
    ``vllm:kvtier_*`` Prometheus counters, with the values the workload implies."""
    second = runs["second"]
    metrics = second["phases"]["first"]["metrics"]
    before = runs["lossy"]["phases"]["first"]["kvtier"]
    loaded = second["phases"]["first"]["kvtier"]["get_blocks_loaded"] - before.get(
        "get_blocks_loaded", 0
    )
    # The second engine's hits: what kvtierd copied out, what vLLM counted as external.
    assert loaded > 0
    assert metrics["vllm:kvtier_hit_blocks"] == loaded
    assert metrics["vllm:kvtier_load_blocks"] == loaded
    assert metrics["vllm:external_prefix_cache_hits"] == loaded * BLOCK_TOKENS
    assert metrics["vllm:kvtier_lookups"] >= 1
    assert metrics["vllm:kvtier_load_blocks_failed"] == 0
    assert metrics["vllm:kvtier_lookup_errors"] == 0
    first_line = _kv_transfer_lines(second)[0]  # the "first" phase's
    assert first_line["hit_blocks"] == first_line["load_blocks"] == loaded
    assert first_line["lookups"] == metrics["vllm:kvtier_lookups"]
    # The engine that stored them: its worker handed the daemon the shared 5-block prefix
    # at least, and dropped nothing.
    stored = runs["first"]["phases"]["kill"]["metrics"]
    assert stored["vllm:kvtier_hit_blocks"] == 0
    assert stored["vllm:kvtier_save_blocks"] >= 5
    assert stored["vllm:kvtier_save_blocks_dropped"] == 0
    assert stored["vllm:kvtier_save_jobs_failed"] == 0
    assert any(line.get("save_blocks", 0) >= 5 for line in _kv_transfer_lines(runs["first"]))
    # The lossy engine: every load it was offered failed, and each was reported.
    lossy = runs["lossy"]["phases"]["first"]["metrics"]
    assert lossy["vllm:kvtier_load_blocks_failed"] == lossy["vllm:kvtier_load_blocks"] > 0
    assert lossy["vllm:kvtier_failed_load_requests"] >= 1


def test_f_a_request_whose_async_load_failed_is_recomputed_once(runs):
    """Every load of the ``lossy`` run misses; each request that was offered a hit recomputes
    after its one failed load, with vLLM's own outputs, and the run ends."""
    run = runs["lossy"]
    phase = run["phases"]["first"]
    before = runs["small_staging"]["phases"]["mixed"]["kvtier"]
    assert phase["kvtier"]["get_blocks_loaded"] == before.get("get_blocks_loaded", 0)
    assert "did not load" in run["log"]
    ref = runs["reference"]
    for i, got in enumerate(_outputs(run, "first")):
        assert got in (_outputs(ref, "first")[i], _outputs(ref, "first_warm")[i]), i
