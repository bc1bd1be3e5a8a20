"""kvtier behind a busy real vLLM engine: more requests than KV blocks, chunked prefill,
aborts while loads run.

Two engine processes (``engine_run.py``; each holds vLLM's scheduler, its worker and both
halves of the connector), run side by side, with the same small setup: 20 KV blocks (the
scheduler preempts and recomputes), a 256-token step budget (prompts prefill in chunks),
float32:

1. ``plain``: no connector: the outputs the busy engine must reproduce.
2. ``busy``: the connector with async loads and 4 staging pages for loads, on one kvtierd.
   ``seed`` stores three blocks that ``abort`` loads (preemption has evicted them from vLLM's
   cache by then) while two of its requests are aborted after the first step; ``pre`` runs
   eight requests of 380-token prompts (three blocks and four tokens short of a fourth) and
   24 tokens out (preemptions), ``pre2`` the same again, now loading what ``pre`` stored
   (hits cut to the pages left), ``edge`` prompts shorter than a block, of exactly one and
   two blocks, and a token more, ``long`` a 1500-token prompt (six chunks), then ``edge2``
   the edge prompts again.

Outputs must be token-identical. The engines run in float32 because in bf16 a prefix
computed in other chunks (the busy engine's schedule differs: loads, other preemptions)
rounds differently from the plain engine's, and greedy choices at near ties of its logits
flip without any wrong KV (vLLM's own prefix cache does the same against a cold run); in
float32 those differences are some 1e-6 of a logit, while one wrong or stale block moves the
next token's logits by far more than the gaps between the tiny model's choices.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from harness import DaemonFactory
from vllm_harness import BLOCK_TOKENS, block_bytes, make_checkpoint, prompts, run_engine

pytestmark = pytest.mark.timeout(1800)

TOP = 5
ABORTED = [1, 3]
ENGINE = {
    "num_gpu_blocks_override": 20,
    "max_num_batched_tokens": 256,
    "dtype": "float32",
    # The scheduler and the worker in one process: each process of an engine spends most of
    # the engine's start importing vLLM.
    "distributed_executor_backend": "uni",
}
# Without a worker process of its own vLLM binds no OpenMP threads: one thread each, so that
# the two engines running side by side do not spin against each other for the cores.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
STAGING_BLOCKS = 4  # for loads; as many again for saves


def groups(seed: int) -> dict[str, tuple[list[list[int]], int]]:
    """Each phase group's prompts (from ``seed``) and its tokens out."""
    rng = random.Random(seed)
    edge = [[rng.randrange(3, 1000) for _ in range(n)] for n in (100, 128, 129, 256, 257)]
    return {
        "seed": (prompts(seed + 1, 384, [10, 20, 30, 40]), 4),
        "pre": (prompts(seed + 2, 256, [124] * 3) + prompts(seed + 3, 0, [380] * 5), 24),
        "long": (prompts(seed + 4, 1500, [3]), 8),
        "edge": (edge, 8),
    }


def phases(seed: int) -> list[dict[str, Any]]:
    group = groups(seed)

    def phase(name: str, of: str, **extra: Any) -> dict[str, Any]:
        group_prompts, max_tokens = group[of]
        return {"name": name, "prompts": group_prompts, "max_tokens": max_tokens, **extra}

    return [
        phase("seed", "seed"),
        phase("pre", "pre", logprobs=TOP),
        phase("abort", "seed", logprobs=TOP, abort=ABORTED, abort_after_steps=1),
        phase("pre2", "pre", logprobs=TOP),
        phase("edge", "edge", logprobs=TOP),
        phase("long", "long", logprobs=TOP),
        phase("edge2", "edge", logprobs=TOP),
    ]


def run_pair(work: Path, model: Path, address: str, seed: int = 7) -> dict[str, Any]:
    """The plain and the busy engine on the phases of ``seed``, side by side."""
    connector = {
        "address": address,
        "lookup_timeout_s": 2.0,
        "load_timeout_s": 10.0,
        "retry_after_s": 2.0,
        "load_mode": "async",
        "staging_bytes": 2 * STAGING_BLOCKS * block_bytes(4),
    }
    spec = {"model": str(model), "phases": phases(seed), "engine_args": ENGINE, "env": IN_PROCESS}
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(run_engine, work, "plain", {**spec, "connector": None})
        busy = pool.submit(run_engine, work, "busy", {**spec, "connector": connector})
        return {"plain": plain.result(), "busy": busy.result()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work: Path = tmp_path_factory.mktemp("vllm-busy")
    model = make_checkpoint(work / "model")
    factory = DaemonFactory(work)
    try:
        yield run_pair(work, model, factory(l1_bytes="256MiB").address)
    finally:
        factory.close()


def differences(pair: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Each output of the busy engine that is not the plain engine's: the phase, the request,
    the first token that differs, the plain engine's top logprobs there and the request's
    cached tokens."""
    plain, busy = pair["plain"]["phases"], pair["busy"]["phases"]
    found = []
    for name, phase in busy.items():
        for i, got in enumerate(phase["outputs"]):
            want = plain[name]["outputs"][i]
            if name == "abort" and i in ABORTED:
                assert got is None
                continue
            at = next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
            if at is not None:
                top = plain[name]["logprobs"][i][at]
                found.append((name, i, at, got[at], top, phase["cached_tokens"][i]))
    return found


def test_outputs_equal_plain_vllms(runs):
    assert differences(runs) == []


def test_the_engine_was_busy_and_loaded_what_it_was_promised(runs):
    busy = runs["busy"]["phases"]
    # More requests than blocks: vLLM preempted.
    assert busy["pre"]["metrics"]["vllm:num_preemptions"] > 0
    # Loads ran, each promised block loaded once, none failed: the aborted requests' and the
    # preempted ones' too, which vLLM leaves out of its external hits (so fewer there).
    last = busy["edge2"]
    loaded = last["kvtier"]["get_blocks_loaded"]
    assert busy["abort"]["kvtier"]["get_blocks_loaded"] > busy["pre"]["kvtier"]["get_blocks_loaded"]
    metrics = last["metrics"]
    assert metrics["vllm:kvtier_hit_blocks"] == metrics["vllm:kvtier_load_blocks"] == loaded
    assert 0 < metrics["vllm:external_prefix_cache_hits"] <= loaded * BLOCK_TOKENS
    assert metrics["vllm:kvtier_load_blocks_failed"] == 0
    assert "did not load" not in runs["busy"]["log"]
    # A prompt of one block plus a token loads its block; shorter ones load nothing.
    cached = busy["edge2"]["cached_tokens"]
    assert cached[0] == 0 and cached[2] >= BLOCK_TOKENS and cached[4] >= 2 * BLOCK_TOKENS


def test_no_lease_pin_or_fd_is_left_when_idle(runs):
    busy = runs["busy"]["phases"]
    for name, phase in busy.items():
        assert phase["kvtier"]["leases"] == 0, name
        assert phase["kvtier"]["blocks_pinned"] == 0, name
    # The engine holds the same fds after the aborts and loads as before them.
    first, last = (busy[name]["processes"] for name in ("pre", "edge2"))
    assert {pid: fds for pid, (_, fds) in first.items()} == {
        pid: fds for pid, (_, fds) in last.items()
    }
