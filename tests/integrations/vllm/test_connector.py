"""The connector's protocol with vLLM's real scheduler and a real daemon, in one process.

``MiniEngine`` (see its docstring) runs vLLM's ``Scheduler`` and block manager with the
connector loaded by vLLM's factory, over real CPU KV tensors; only the model is absent. Every
test checks the KV that ends up in vLLM's blocks token by token, so a block loaded from the
wrong key, layer or page, or computed with a missing prefix, fails it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mini_engine import BLOCK, MiniEngine, wait_until
from prometheus_client import CollectorRegistry, multiprocess
from vllm.lora.request import LoRARequest
from vllm.v1.request import RequestStatus
from vllm_harness import make_checkpoint, prompts

from kvtier.client.errors import ResourceExhaustedError
from kvtier.client.integrations.staging import layer_major_layout
from kvtier.client.integrations.vllm import KVTierConnector
from kvtier.client.integrations.vllm_config import ConnectorConfig
from kvtier.client.integrations.vllm_stats import COUNTERS
from kvtier.client.jobs import JobState, LoadSegment
from kvtier.client.pool import SharedMemoryPool

pytestmark = pytest.mark.timeout(600)

PROMPT = prompts(5, 3 * BLOCK, [50])[0]  # 3 full blocks and 50 more tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _options(daemon, **extra):
    return {
        "address": daemon.address,
        "lookup_timeout_s": 0.5,
        "load_timeout_s": 2.0,
        "retry_after_s": 1.0,
        **extra,
    }


def _reader_loads(model_dir, daemon, prompt, blocks: int, req_id: str = "r"):
    """Another engine, asked ``prompt``, loads its first ``blocks`` blocks from kvtier, none
    failing, and they hold the right KV (what a later hit gets); its first step's output."""
    reader = MiniEngine(model_dir, _options(daemon))
    try:
        reader.add(req_id, prompt, max_tokens=2)
        out = reader.step()
        assert out.num_scheduled_tokens[req_id] == len(prompt) - blocks * BLOCK
        assert reader.invalid_reported == set()
        assert reader.blocks_hold_their_prefix(req_id, len(prompt))
        return out
    finally:
        reader.close()


def _store_prompt(model_dir, daemon, prompt=PROMPT) -> None:
    """A first engine computes ``prompt`` and stores its full blocks."""
    engine = MiniEngine(model_dir, _options(daemon))
    try:
        engine.add("r", prompt, max_tokens=2)
        engine.run()
    finally:
        engine.close()
    with daemon.client() as client:
        assert wait_until(lambda: client.stats().counter("put_blocks", result="stored") >= 3)


def _counters(daemon) -> dict[str, float]:
    with daemon.client() as client:
        stats = client.stats()
    return {
        **stats.counters,
        **stats.gauges,
        "get_blocks_loaded": stats.counter("get_blocks", result="loaded"),
        "get_blocks_missing": stats.counter("get_blocks", result="missing"),
    }


# ------------------------------------------------------------------- options


def test_options_are_checked_by_name():
    assert ConnectorConfig.from_extra_config({}).save == "all"
    cfg = ConnectorConfig.from_extra_config(
        {"save": "prompt", "load_tiers": ["L1"], "namespace": {"tenant": "t"}}
    )
    assert cfg.load_tiers == ("l1",) and cfg.namespace.tenant == "t"
    for bad, word in (
        ({"adress": "x"}, "adress"),
        ({"save": "sometimes"}, "save"),
        ({"load_timeout_s": 0}, "load_timeout_s"),
        ({"layer_groups": "4"}, "layer_groups"),
        ({"namespace": {"model": 3}}, "namespace.model"),
        ({"namespace": {"colour": "x"}}, "colour"),
        ({"load_tiers": ["l9"]}, "load_tiers"),
    ):
        with pytest.raises(ValueError, match=word):
            ConnectorConfig.from_extra_config(bad)


def test_the_namespace_binds_model_config_and_ranks(model_dir, tmp_path, daemon):
    other_dir = make_checkpoint(tmp_path / "other", rope_theta=20000.0)
    a = MiniEngine(model_dir, _options(daemon))
    a2 = MiniEngine(model_dir, _options(daemon))
    b = MiniEngine(other_dir, _options(daemon))
    try:
        ida, ida2, idb = a.connector.identity, a2.connector.identity, b.connector.identity
        assert ida == ida2 and ida.namespace(0, 0).seed() == ida2.namespace(0, 0).seed()
        assert ida.namespace(0, 0).seed() != idb.namespace(0, 0).seed()
        assert "isa=" in ida.kv_layout and ida.kv_dtype == "bfloat16" and ida.block_tokens == BLOCK
        assert (
            ida.namespace(0, 0).seed()
            != ida.namespace(0, 0)
            .__class__(**{**ida.namespace(0, 0).__dict__, "tp_rank": 1, "tp_size": 2})
            .seed()
        )
    finally:
        for e in (a, a2, b):
            e.close()


def test_lora_adapters_are_keyed_by_their_files_not_the_engines_int_id(model_dir, tmp_path, daemon):
    """Engines number their LoRA adapters themselves: another engine (or this one after a
    restart) may give the same name and ``lora_int_id`` to another adapter, whose requests
    must never load the blocks computed with the first; the same adapter under another
    number must."""
    folders = {}
    for name, weights in (("a", b"\x01" * 4096), ("b", b"\x01" * 4095 + b"\x02")):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "adapter_config.json").write_text('{"r": 8}')
        (folders[name] / "adapter_model.safetensors").write_bytes(weights)
    writer = MiniEngine(model_dir, _options(daemon))
    try:
        writer.add("r", PROMPT, max_tokens=1, lora=LoRARequest("tuned", 1, str(folders["a"])))
        writer.run()
    finally:
        writer.close()
    with daemon.client() as client:
        assert wait_until(lambda: client.stats().counter("put_blocks", result="stored") >= 3)
    reader = MiniEngine(model_dir, _options(daemon))
    side = reader.connector.scheduler_side
    try:
        other = reader.add("b", PROMPT, 1, lora=LoRARequest("tuned", 1, str(folders["b"])))
        assert side.get_num_new_matched_tokens(other, 0) == (0, False)
        same = reader.add("a", PROMPT, 1, lora=LoRARequest("tuned", 7, str(folders["a"])))
        assert side.get_num_new_matched_tokens(same, 0) == (3 * BLOCK, False)
        plain = reader.add("p", PROMPT, 1)
        assert side.get_num_new_matched_tokens(plain, 0) == (0, False)
        # A hub id's files are vLLM's download: its requests are not even looked up.
        lookups = side.stats["lookups"]
        hub = reader.add("h", PROMPT, 1, lora=LoRARequest("hub", 2, "some-org/some-adapter"))
        assert side.get_num_new_matched_tokens(hub, 0) == (0, False)
        assert side.stats["lookups"] == lookups
    finally:
        reader.close()


# ------------------------------------------------------------- loads, saves


def test_a_second_engine_loads_what_the_first_stored(model_dir, daemon):
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon))
    try:
        request = engine.add("r", PROMPT, max_tokens=4)
        out = engine.step()
        (load,) = out.kv_connector_metadata.loads
        assert len(load.block_ids) == 3 and load.leases
        # Only the 50 tokens past the loaded blocks were computed ...
        assert out.num_scheduled_tokens["r"] == len(PROMPT) - 3 * BLOCK
        # ... and every slot holds the KV of its own prefix: the loaded ones included.
        assert engine.blocks_hold_their_prefix("r", len(PROMPT))
        assert engine.invalid_reported == set()
        assert engine.connector.scheduler_side.stats["hit_blocks"] == 3
        assert request.num_computed_tokens == len(PROMPT)
        # The worker reported the lease done and the scheduler released it (from a thread
        # of its own, waited for before the next step is planned).
        engine.step()
        assert _counters(daemon)["leases"] == 0
        engine.run()
        assert len(engine.outputs["r"]) == 4
    finally:
        engine.close()
    counters = _counters(daemon)
    assert counters["get_blocks_loaded"] == 3 and counters["get_blocks_missing"] == 0


def test_regression_vllms_thread_waited_for_the_daemon_to_answer_a_release(model_dir, daemon):
    """The scheduler side released a load's lease on vLLM's thread, in the step that took in
    the worker's report, and vLLM returned that step's outputs only once the daemon had
    answered: 1-4 ms of every hit's time to first token on a busy 2-core host (``bench
    vllm``), a whole timeout for a daemon that does not answer. The Release goes from a
    thread of the side's own, and the next step waits for it. Here the daemon answers
    nothing (SIGSTOP) from the load's end until vLLM has taken in the step's output; a
    watchdog resumes it after 10 s should the step wait for it (it did: until the watchdog)."""
    _store_prompt(model_dir, daemon)
    assert daemon.proc is not None
    pid = daemon.proc.pid
    resumed = threading.Event()

    def resume() -> None:
        resumed.set()
        os.kill(pid, signal.SIGCONT)

    watchdog = threading.Timer(10.0, resume)
    engine = MiniEngine(model_dir, _options(daemon, lookup_timeout_s=30.0))
    try:
        engine.add("r", PROMPT, max_tokens=4)

        def stop() -> None:
            os.kill(pid, signal.SIGSTOP)
            watchdog.start()

        first, _ = engine.overlapped_steps(between=stop)  # the second takes in the first's
        assert not resumed.is_set()
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
        (load,) = first.kv_connector_metadata.loads
        assert load.leases and engine.invalid_reported == set()
        engine.step()  # waits for the Release
        assert _counters(daemon)["leases"] == 0
        engine.run()
        assert len(engine.outputs["r"]) == 4
    finally:
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
        engine.close()


def test_regression_releases_to_a_hung_daemon_cost_one_timeout_each(model_dir, daemon):
    """A Release the daemon left unanswered tripped nothing: the releasing thread sent the
    step's other Releases one after another, each waiting the client's whole timeout, and
    the next step's build_connector_meta waited for all of them (here three hits: three
    timeouts of 4 s on vLLM's thread, past the watchdog's 10 s). The first one unanswered
    now trips the breaker, as a lookup does, and the others are not sent (the daemon
    expires their leases)."""
    texts = [prompts(40 + i, 3 * BLOCK, [50])[0] for i in range(3)]
    writer = MiniEngine(model_dir, _options(daemon))
    try:
        for i, text in enumerate(texts):
            writer.add(f"w{i}", text, max_tokens=2)
        writer.run()
    finally:
        writer.close()
    with daemon.client() as client:
        assert wait_until(lambda: client.stats().counter("put_blocks", result="stored") >= 9)
    assert daemon.proc is not None
    pid = daemon.proc.pid
    resumed = threading.Event()

    def resume() -> None:
        resumed.set()
        os.kill(pid, signal.SIGCONT)

    watchdog = threading.Timer(10.0, resume)
    engine = MiniEngine(model_dir, _options(daemon, lookup_timeout_s=4.0, retry_after_s=60.0))
    side = engine.connector.scheduler_side
    try:
        for i, text in enumerate(texts):
            engine.add(f"r{i}", text, max_tokens=4)

        def stop() -> None:
            os.kill(pid, signal.SIGSTOP)
            watchdog.start()

        first, _ = engine.overlapped_steps(between=stop)
        assert len(first.kv_connector_metadata.loads) == 3
        assert all(load.leases for load in first.kv_connector_metadata.loads)
        assert engine.invalid_reported == set()
        engine.step()  # waits for the Releases the first step's output asked for
        assert not resumed.is_set()
        assert side.breaker.probing  # kvtier is off until the daemon answers again
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
        engine.run()
        assert [len(engine.outputs[f"r{i}"]) for i in range(3)] == [4, 4, 4]
    finally:
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
        engine.close()


def test_a_pin_refused_for_a_limit_loads_unpinned_and_keeps_kvtier_on(model_dir, daemon_factory):
    """The daemon refuses a pinning Lookup past a limit (here one live lease a session; with
    tenants also what a tenant may protect, policy.hint_max_share) with RESOURCE_EXHAUSTED.
    That is not a fault: the second hit of the step loads unpinned. Before, it tripped the
    breaker: the hit was loaded anyway, but every later lookup ran without kvtier for
    retry_after_s."""
    daemon = daemon_factory("server.max_leases_per_session=1")
    first, second, third = (prompts(40 + i, 3 * BLOCK, [20])[0] for i in range(3))
    for p in (first, second, third):
        _store_prompt(model_dir, daemon, p)
    engine = MiniEngine(model_dir, _options(daemon, retry_after_s=600.0))
    side = engine.connector.scheduler_side
    try:
        engine.add("a", first, max_tokens=2)
        engine.add("b", second, max_tokens=2)
        out = engine.step()
        assert {r: out.num_scheduled_tokens[r] for r in "ab"} == {"a": 20, "b": 20}
        assert side.stats["pin_refused"] == 1 and side.stats["pin_errors"] == 0
        assert sorted(len(load.leases) for load in out.kv_connector_metadata.loads) == [0, 1]
        assert engine.blocks_hold_their_prefix("a", len(first))
        assert engine.blocks_hold_their_prefix("b", len(second))
        assert engine.invalid_reported == set()
        engine.run()
        # kvtier is still on: the next request is looked up and gets its hit.
        request = engine.add("c", third, max_tokens=1)
        assert side.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
    finally:
        engine.close()
    assert _counters(daemon)["leases"] == 0


def test_a_staging_pool_the_daemon_refuses_stops_hits_until_it_is_taken(
    model_dir, daemon_factory, caplog
):
    """The daemon refuses the worker's staging pool for a limit (here the tenant's one pool,
    held by another client): one ERROR names the daemon's key and the connector's
    staging_bytes; the hit the scheduler side offered before it heard fails and is
    recomputed (the request's output is right), and once the worker's metadata has said so
    no request is looked up. The other pool goes: the worker's next try (backing off from
    retry_after_s) takes the pool, vLLM's scheduler hears it, and the next request gets
    its hit. Before, the scheduler side kept offering hits (and pinning them) that every
    step failed."""
    daemon = daemon_factory("server.max_pools_per_tenant=1")
    other = prompts(6, 3 * BLOCK, [50])[0]
    storer = MiniEngine(model_dir, _options(daemon))
    try:
        storer.add("a", PROMPT, max_tokens=2)
        storer.add("b", other, max_tokens=2)
        storer.run()
    finally:
        storer.close()
    with daemon.client() as client:
        assert wait_until(lambda: client.stats().counter("put_blocks", result="stored") >= 6)
    caplog.set_level(logging.INFO, logger="kvtier")
    with daemon.client() as holder, SharedMemoryPool(4096) as shm:
        layout = layer_major_layout(1, 1, BLOCK, 64, "float32")
        held = []

        def hold() -> bool:  # once the first engine's pool is unmapped
            try:
                held.append(holder.register_pool(shm, layout))
            except ResourceExhaustedError:
                return False
            return True

        assert wait_until(hold)
        engine = MiniEngine(model_dir, _options(daemon, retry_after_s=0.05))
        side = engine.connector.scheduler_side
        try:
            refused = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(refused) == 1
            assert "server.max_pools_per_tenant" in refused[0] and "staging_bytes=" in refused[0]
            engine.add("r", PROMPT, max_tokens=2)
            engine.run()
            assert engine.invalid_reported  # the hit offered before the scheduler heard
            assert len(engine.outputs["r"]) == 2 and side.staging_refused
            lookups = side.stats["lookups"]
            request = engine.add("s", PROMPT, max_tokens=40)
            assert side.get_num_new_matched_tokens(request, 0) == (0, False)
            assert side.stats["lookups"] == lookups

            holder.unregister_pool(held[0].binding.pool_id)
            assert wait_until(lambda: not (engine.step() and side.staging_refused))
            assert "took the staging pool after" in caplog.text
            request = engine.add("t", other, max_tokens=2)
            assert side.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
            failed = set(engine.invalid_reported)
            out = engine.step()
            assert [len(load.block_ids) for load in out.kv_connector_metadata.loads] == [3]
            assert engine.invalid_reported == failed  # loaded this time
            assert engine.blocks_hold_their_prefix("t", len(other))
            engine.run()
            assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
        finally:
            engine.close()


def test_lookup_is_side_effect_free(model_dir, daemon):
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon))
    try:
        request = engine.add("r", PROMPT, max_tokens=1)
        side = engine.connector.scheduler_side
        answers = [side.get_num_new_matched_tokens(request, 0) for _ in range(3)]
        assert answers == [(3 * BLOCK, False)] * 3
        # A prefix vLLM holds itself is not asked again; a hit never covers the last token.
        assert side.get_num_new_matched_tokens(request, 2 * BLOCK) == (BLOCK, False)
        short = engine.add("s", PROMPT[: 3 * BLOCK], max_tokens=1)
        assert side.get_num_new_matched_tokens(short, 0) == (2 * BLOCK, False)
        counters = _counters(daemon)
        assert counters["leases"] == 0 and counters["blocks_pinned"] == 0
    finally:
        engine.close()


def test_blocks_that_fail_to_load_are_reported_and_recomputed(model_dir, daemon):
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon))
    try:
        request = engine.add("r", PROMPT, max_tokens=3)
        # The daemon dies after vLLM scheduled the load and before the worker runs it.
        out = engine.step(before_forward=lambda out: daemon.kill())
        (load,) = out.kv_connector_metadata.loads
        assert engine.invalid_reported == set(load.block_ids)
        # vLLM rewound the request to its first failed block and schedules it again.
        assert request.num_computed_tokens == 0 and engine.outputs["r"] == []
        again = engine.step()
        assert again.num_scheduled_tokens["r"] == len(PROMPT)
        assert engine.blocks_hold_their_prefix("r", len(PROMPT))
        engine.run()
        assert len(engine.outputs["r"]) == 3
    finally:
        engine.close()


def _losing_the_loads(engine: MiniEngine, keys: list[bytes]):
    """A ``before_forward`` hook that makes the daemon lose the blocks this step loads: their
    leases released and the blocks deleted between the lookup and the load (their keys go
    into ``keys``)."""
    side = engine.connector.scheduler_side

    def lose(out):
        for spec in out.kv_connector_metadata.loads:
            for lease in spec.leases.values():
                side.client.release(lease)
            keys.extend(spec.keys[0])
        assert side.client.delete(keys) is not None
        assert side.client.lookup(keys).prefix_len == 0

    return lose


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_blocks_that_failed_to_load_are_stored_once_recomputed(model_dir, daemon, load_mode):
    """The daemon loses a request's hit between the lookup and the load (evicted; or unreadable,
    which it drops): the load fails, vLLM recomputes the blocks, and the connector stores them
    again. Regression (layer-wise): the blocks of a hit were never stored by the request that
    was offered it, so they stayed lost, and every later request recomputed them."""
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon, load_mode=load_mode))
    keys: list[bytes] = []
    lose = _losing_the_loads(engine, keys)

    try:
        engine.add("r", PROMPT, max_tokens=2)
        engine.step(before_forward=lose)
        assert len(keys) == 3
        for _ in range(100):
            if not engine.scheduler.has_requests():
                break
            engine.step()
            time.sleep(0.005)  # async loads finish in the daemon meanwhile
        assert engine.worker.stats["load_blocks_failed"] == 3
    finally:
        engine.close()  # waits for its saves
    with daemon.client() as client:
        assert client.lookup(keys).prefix_len == 3
    # What was stored again is the right KV: another engine loads and checks it.
    _reader_loads(model_dir, daemon, PROMPT, 3)


def test_blocks_computed_over_a_failed_load_are_not_stored(model_dir, daemon):
    """A layer-wise load fails in the step that also computes the rest of the prompt: that
    step's KV was computed with attention over the failed blocks (wrong), so its blocks are
    not stored then; they are stored once vLLM has recomputed them. Regression: they were
    stored from the failing step, and the recomputed ones, being already held, were not,
    so every later hit on them loaded wrong KV."""
    _store_prompt(model_dir, daemon)
    longer = PROMPT[: 3 * BLOCK] + prompts(6, 0, [BLOCK + 50])[0]  # 4 full blocks, 3 stored
    engine = MiniEngine(model_dir, _options(daemon))
    keys: list[bytes] = []
    lose = _losing_the_loads(engine, keys)

    try:
        engine.add("r", longer, max_tokens=2)
        out = engine.step(before_forward=lose)
        assert len(keys) == 3 and out.num_scheduled_tokens["r"] == len(longer) - 3 * BLOCK
        assert engine.worker.stats["save_blocks_withheld"] == 1  # the 4th block, computed then
        engine.run()
        assert engine.worker.stats["load_blocks_failed"] == 3
    finally:
        engine.close()  # waits for its saves
    _reader_loads(model_dir, daemon, longer, 4)


def test_blocks_computed_over_another_requests_failed_load_are_not_stored(model_dir, daemon):
    """Request "a" loads a stored prefix layer by layer and request "b", scheduled in the
    same step, shares those blocks through vLLM's own prefix cache (it gets them from "a"'s
    allocation) and computes its next block over them. The load fails: vLLM rewinds both, and
    neither stores the block it computed over the failed ones then. Regression: "b"'s was
    stored (only the request whose load failed was withheld), and being already held, its
    recomputed KV never was, so a later hit on it loaded wrong KV."""
    _store_prompt(model_dir, daemon)
    shared = PROMPT[: 3 * BLOCK]
    a, b = (shared + p for p in prompts(7, 0, [BLOCK + 50, BLOCK + 60]))
    engine = MiniEngine(model_dir, _options(daemon))
    keys: list[bytes] = []
    lose = _losing_the_loads(engine, keys)
    try:
        engine.add("a", a, max_tokens=2)
        engine.add("b", b, max_tokens=2)
        out = engine.step(before_forward=lose)
        assert len(keys) == 3  # only "a" loads; "b" finds the blocks in vLLM's cache
        assert out.num_scheduled_tokens["b"] == len(b) - 3 * BLOCK
        assert engine.worker.stats["save_blocks_withheld"] == 2  # each one's 4th block
        engine.run()
    finally:
        engine.close()  # waits for its saves
    _reader_loads(model_dir, daemon, b, 4, "b")


def _lose_blocks(monkeypatch, worker):
    """The daemon has lost the data of every block the worker loads while its index still
    lists them (lookups find them): each load's keys are swapped for keys it never held."""
    submit = worker.client.submit_load

    def lost(pool, segments, **kwargs):
        gone = [LoadSegment([os.urandom(32) for _ in s.keys], s.pages) for s in segments]
        return submit(pool, gone, **kwargs)

    monkeypatch.setattr(worker.client, "submit_load", lost)


def test_a_request_whose_async_load_failed_is_not_offered_its_hit_again(
    model_dir, daemon, monkeypatch
):
    """Regression: a failed async load puts the request back in vLLM's queue with nothing
    computed, vLLM asks the connector again, and the same hit came back: a load that kept
    failing went round forever (50 MiniEngine steps without an end, one failed load each).
    The worker now names the request whose load failed, and the scheduler offers it no hit
    again, so it recomputes after one failure; other requests are still offered theirs."""
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon, load_mode="async"))
    side = engine.connector.scheduler_side
    _lose_blocks(monkeypatch, engine.worker)
    try:
        request = engine.add("r", PROMPT, max_tokens=2)
        loads = _run_checking_kv(engine, {"r": PROMPT}, max_steps=50)
        assert [step for step in loads if step] == [{"r": 3}]
        assert engine.worker.stats["load_blocks_failed"] == 3 and len(engine.invalid_reported) == 3
        assert side.stats["failed_load_requests"] == 1
        assert len(engine.outputs["r"]) == 2 and request.num_computed_tokens > len(PROMPT)
        # The hit is the request's to lose, not the prefix's.
        other = engine.add("s", PROMPT, max_tokens=1)
        assert side.get_num_new_matched_tokens(other, 0) == (3 * BLOCK, True)
        engine.scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    finally:
        engine.close()


def _lose_first_load(monkeypatch, worker):
    """As ``_lose_blocks``, for the worker's first load only; later loads find their data."""
    submit = worker.client.submit_load
    calls = [0]

    def lost_once(pool, segments, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            segments = [LoadSegment([os.urandom(32) for _ in s.keys], s.pages) for s in segments]
        return submit(pool, segments, **kwargs)

    monkeypatch.setattr(worker.client, "submit_load", lost_once)


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_a_preempted_request_whose_load_failed_is_offered_its_hit_again(
    model_dir, daemon, monkeypatch, load_mode
):
    """Regression: a request whose load had failed was offered no hit for the rest of its
    life, so after a preemption (vLLM frees its blocks and asks the connector again) it
    recomputed what kvtier held. A layer-wise failure never puts the request back in vLLM's
    queue (vLLM recomputes the failed blocks in place), and an async one only until it runs
    again; a preemption is not a retry of the failed load, so it is answered afresh, as
    vLLM's own offloading connector answers every ask."""
    a, b = prompts(11, 3 * BLOCK, [10])[0], prompts(12, 3 * BLOCK, [2])[0]
    _store_prompt(model_dir, daemon, b)
    # Both fit when admitted (8 of 9 usable blocks); growing to 6 + 6 blocks they do not, so
    # vLLM preempts "b", the later one.
    engine = MiniEngine(model_dir, _options(daemon, load_mode=load_mode), num_blocks=10)
    side = engine.connector.scheduler_side
    _lose_first_load(monkeypatch, engine.worker)
    try:
        engine.add("a", a, max_tokens=300)
        engine.add("b", b, max_tokens=300)
        loads_b: list[tuple[bool, int]] = []  # (after a preemption of "b", blocks)
        preempted = False
        for _ in range(1000):
            if not engine.scheduler.has_requests():
                break
            out = engine.step()
            preempted |= "b" in out.preempted_req_ids
            loads_b += [
                (preempted, len(s.block_ids))
                for s in out.kv_connector_metadata.loads
                if s.req_id == "b"
            ]
            if load_mode == "async":
                time.sleep(0.005)  # async loads finish in the daemon meanwhile
            # Each step's saves end before the next step's start: with saves of earlier steps
            # still holding the saves' staging share (5 pages here), a later save of "b" was
            # cut, its chain had a gap, and whether "b" had blocks past vLLM's own cache to be
            # offered after its preemption depended on the daemon's speed.
            assert wait_until(lambda: engine.worker.saves_in_flight() == 0)
        assert preempted
        assert engine.worker.stats["save_blocks_dropped"] == 0
        assert loads_b[0] == (False, 3)  # its first load: lost, so recomputed
        assert engine.worker.stats["load_blocks_failed"] == 3
        assert side.stats["failed_load_requests"] == 1
        # After its preemption, "b" was offered a hit again, and what it loaded was right.
        assert any(after and n for after, n in loads_b), loads_b
        assert engine.worker.stats["load_blocks_failed"] == 3
        assert len(engine.outputs["a"]) == 300 and len(engine.outputs["b"]) == 300
    finally:
        engine.close()


def test_a_hung_daemon_costs_one_timeout_then_is_skipped(model_dir, daemon):
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon, load_timeout_s=1.0, retry_after_s=30.0))
    side = engine.connector.scheduler_side
    assert daemon.proc is not None
    try:
        engine.add("r", PROMPT, max_tokens=2)
        # The daemon hangs after vLLM scheduled the load: the worker gives up at its load
        # deadline, reports the blocks, and retires its staging pool (a late copy into it
        # can never reach a block).
        out = engine.step(before_forward=lambda out: os.kill(daemon.proc.pid, signal.SIGSTOP))
        (load,) = out.kv_connector_metadata.loads
        assert engine.invalid_reported == set(load.block_ids)
        assert engine.worker.stats["staging_retired"] == 1
        # The scheduler side's next calls, the lookup of s and the Release of r's lease
        # (on a thread of its own, at once), time out once: s is looked up unless the
        # Release timed out first; after that the side does not ask at all.
        engine.add("s", prompts(6, 2 * BLOCK, [10])[0], max_tokens=1)
        lookups = side.stats["lookups"]
        assert not engine.step().kv_connector_metadata.loads
        assert side.breaker.probing
        asked = side.stats["lookups"] - lookups
        assert asked <= 1 and side.stats["lookup_errors"] == asked
        engine.add("u", prompts(7, 2 * BLOCK, [10])[0], max_tokens=1)
        assert not engine.step().kv_connector_metadata.loads
        assert side.stats["lookups"] == lookups + asked
        engine.run()
        assert [len(engine.outputs[r]) for r in "rsu"] == [2, 1, 1]
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        engine.close()


def test_a_daemon_hung_past_several_retry_periods_is_asked_again_only_off_the_engine(
    model_dir, daemon
):
    """Before, each pause ended after retry_after_s and vLLM's own threads asked the hung
    daemon again: the scheduler's next lookup paid its timeout, and the worker registered a
    new staging pool, which waited the whole client timeout (5 s a try with a real vLLM,
    every ~10 s). Now a probe off vLLM's threads asks, and kvtier comes back once it
    answers."""
    later = prompts(9, 3 * BLOCK, [20])[0]  # loaded once the daemon is back
    _store_prompt(model_dir, daemon)
    _store_prompt(model_dir, daemon, later)
    engine = MiniEngine(model_dir, _options(daemon, load_timeout_s=1.0, retry_after_s=0.2))
    side, worker = engine.connector.scheduler_side, engine.worker
    assert daemon.proc is not None
    stopped = True
    try:
        engine.add("r", PROMPT, max_tokens=2)
        out = engine.step(before_forward=lambda out: os.kill(daemon.proc.pid, signal.SIGSTOP))
        (load,) = out.kv_connector_metadata.loads
        assert engine.invalid_reported == set(load.block_ids)
        engine.run()
        engine.add("s", prompts(6, 2 * BLOCK, [10])[0], max_tokens=1)
        engine.run()
        lookups = side.stats["lookups"]
        # One call of the scheduler side paid its timeout: the Release of r's lease (sent
        # first), so s was not looked up.
        assert side.breaker.trips == 1 and side.stats["lookup_errors"] == 0
        # Probes keep failing for several retry periods; vLLM's threads call nothing.
        assert wait_until(lambda: side.breaker.probes >= 3 and worker.breaker.probes >= 3)
        for i in range(3):
            engine.add(f"u{i}", prompts(20 + i, 3 * BLOCK, [10])[0], max_tokens=1)
            engine.run()
        assert side.stats["lookups"] == lookups and side.breaker.trips == 1
        assert worker.staging_generation == 1  # no pool registered meanwhile
        os.kill(daemon.proc.pid, signal.SIGCONT)
        stopped = False
        assert wait_until(lambda: side.breaker.ok() and worker.breaker.ok())
        engine.invalid_reported.clear()
        engine.add("v", later, max_tokens=2)
        out = engine.step()
        assert out.num_scheduled_tokens["v"] == len(later) - 3 * BLOCK
        assert engine.blocks_hold_their_prefix("v", len(later))
        assert engine.invalid_reported == set() and worker.staging_generation == 2
        engine.run()
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        engine.close()


def test_no_daemon_at_all_is_no_cache(model_dir, tmp_path):
    engine = MiniEngine(model_dir, {"address": f"unix:{tmp_path}/none.sock"})
    try:
        request = engine.add("r", PROMPT, max_tokens=2)
        t = time.monotonic()
        out = engine.step()
        assert time.monotonic() - t < 2.0
        assert not out.kv_connector_metadata.loads
        assert out.num_scheduled_tokens["r"] == len(PROMPT)
        assert engine.blocks_hold_their_prefix("r", len(PROMPT))
        engine.run()
        assert len(engine.outputs["r"]) == 2 and request.num_computed_tokens > 0
    finally:
        engine.close()


def test_async_load_mode_waits_outside_the_batch(model_dir, daemon):
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon, load_mode="async"))
    try:
        request = engine.add("r", PROMPT, max_tokens=2)
        first = engine.step()
        assert first.kv_connector_metadata.loads and "r" not in first.num_scheduled_tokens
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        for _ in range(50):
            out = engine.step()
            if "r" in out.num_scheduled_tokens:
                break
            time.sleep(0.01)
        assert out.num_scheduled_tokens["r"] == len(PROMPT) - 3 * BLOCK
        assert engine.blocks_hold_their_prefix("r", len(PROMPT))
        engine.run()
        assert len(engine.outputs["r"]) == 2
    finally:
        engine.close()


STAGED = [prompts(21 + i, 3 * BLOCK, [10])[0] for i in range(3)]  # 3-block hits each
LAYER_BLOCK_BYTES = 2 * BLOCK * 2 * 64 * 2  # MiniEngine: K and V, 2 heads of 64, bf16


def _small_staging_engine(model_dir, daemon, load_mode, pages=4):
    """An engine whose workers keep ``pages`` staging pages for loads (and as many for saves)."""
    for prompt in STAGED:
        _store_prompt(model_dir, daemon, prompt)
    staging_bytes = 2 * pages * 4 * LAYER_BLOCK_BYTES
    engine = MiniEngine(
        model_dir, _options(daemon, load_mode=load_mode, staging_bytes=staging_bytes)
    )
    assert (engine.worker.staging_pages.loads, engine.worker.staging_pages.saves) == (pages, pages)
    return engine


def _hold_saves(monkeypatch, worker):
    """The worker's save jobs look in flight to it (the daemon stores them at once) until the
    returned function is called."""
    held = [True]
    submit = worker.client.submit_save

    class Held:
        def __init__(self, job):
            self.job = job

        def poll(self):
            status = self.job.poll()
            return dataclasses.replace(status, state=JobState.RUNNING) if held[0] else status

        def wait(self, timeout_s=None):
            return self.poll() if held[0] else self.job.wait(timeout_s)

        def done(self):
            return not held[0] and self.job.done()

        def cancel(self):
            self.job.cancel()

    monkeypatch.setattr(worker.client, "submit_save", lambda *a, **kw: Held(submit(*a, **kw)))
    return lambda: held.__setitem__(0, False)


def _run_checking_kv(engine, prompts_by_id, max_steps=200):
    """Step until every request has finished; each request's KV is checked once it has
    computed its whole prompt. Returns the loads each step planned."""
    checked: set[str] = set()
    loads = []
    for _ in range(max_steps):
        if not engine.scheduler.has_requests():
            return loads
        out = engine.step()
        loads.append({spec.req_id: len(spec.block_ids) for spec in out.kv_connector_metadata.loads})
        for req_id, prompt in prompts_by_id.items():
            request = engine.scheduler.requests.get(req_id)
            if req_id in checked or request is None:
                continue
            if request.num_computed_tokens >= len(prompt) and req_id in out.num_scheduled_tokens:
                assert engine.blocks_hold_their_prefix(req_id, len(prompt)), req_id
                checked.add(req_id)
        time.sleep(0.005)  # async loads finish in the daemon meanwhile
    raise AssertionError(f"requests still running after {max_steps} steps: {loads[-3:]}")


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_hits_of_one_step_never_need_more_staging_pages_than_the_pool_has(
    model_dir, daemon, load_mode
):
    """Two requests with 3-block hits arrive together at a worker that keeps 4 staging pages
    for loads. Each hit fits alone; together they do not, and the worker takes a step's pages
    all at once or not at all. Before, both hits were reported: layer-wise, all 6 blocks
    failed to load and were recomputed; async, both loads failed, vLLM put both requests
    back in the queue, the same hits were reported again, and so on forever. Now the second
    hit is cut to the page left (4 blocks load, none fails)."""
    engine = _small_staging_engine(model_dir, daemon, load_mode)
    try:
        engine.add("a", STAGED[0], max_tokens=2)
        engine.add("b", STAGED[1], max_tokens=2)
        loads = _run_checking_kv(engine, {"a": STAGED[0], "b": STAGED[1]})
        assert loads[0] == {"a": 3, "b": 1}
        assert engine.invalid_reported == set()
        assert engine.worker.stats["load_blocks_failed"] == 0
        assert engine.connector.scheduler_side.stats["hit_blocks"] == 4
        assert [len(engine.outputs[r]) for r in "ab"] == [2, 2]
        # Every page is free again: a later request gets its whole hit.
        engine.add("c", STAGED[2], max_tokens=1)
        loads = _run_checking_kv(engine, {"c": STAGED[2]})
        assert loads[0] == {"c": 3} and engine.invalid_reported == set()
    finally:
        engine.close()


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_saves_in_flight_never_take_the_pages_of_a_load_the_scheduler_admitted(
    model_dir, daemon, load_mode, monkeypatch
):
    """Regression: the scheduler cut hits to the staging pages it counted free, while saves of
    earlier steps, still running in the background, held pages it did not count. With a
    4-block save in flight on an 8-page pool, 3- and 3-block hits were admitted and the step's
    loads found 4 free pages: layer-wise all 6 blocks failed and were recomputed; async both
    loads failed and vLLM queued both requests again. Now saves have a share of the pool of
    their own (4 of the 8 pages) and loads the rest, whatever the saves in flight hold."""
    engine = _small_staging_engine(model_dir, daemon, load_mode)
    release = _hold_saves(monkeypatch, engine.worker)
    try:
        engine.add("w", prompts(31, 4 * BLOCK, [10])[0], max_tokens=1)
        engine.step()
        assert engine.worker.saves_in_flight() == 1  # its 4 blocks' pages
        engine.add("a", STAGED[0], max_tokens=2)
        engine.add("b", STAGED[1], max_tokens=2)
        loads = _run_checking_kv(engine, {"a": STAGED[0], "b": STAGED[1]})
        assert engine.worker.saves_in_flight() == 1  # held throughout
        assert engine.invalid_reported == set()
        assert engine.worker.stats["load_blocks_failed"] == 0
        assert loads[0] == {"a": 3, "b": 1}
        assert [len(engine.outputs[r]) for r in "ab"] == [2, 2]
    finally:
        release()
        engine.close()


def test_a_prompt_larger_than_the_saves_share_stores_its_first_blocks(model_dir, daemon):
    """A 6-block prompt computed in one step by a worker with 4 staging pages for saves: the
    first 4 blocks are stored (before, the whole save was dropped and nothing was), and a
    second engine loads those 4 with the right KV and computes the rest."""
    prompt = prompts(41, 6 * BLOCK, [10])[0]
    staging_bytes = 2 * 4 * 4 * LAYER_BLOCK_BYTES
    writer = MiniEngine(model_dir, _options(daemon, staging_bytes=staging_bytes))
    try:
        assert writer.worker.staging_pages.saves == 4
        writer.add("w", prompt, max_tokens=2)
        writer.run()
        assert writer.worker.stats["save_blocks"] == 4
        assert writer.worker.stats["save_blocks_dropped"] == 2
    finally:
        writer.close()
    out = _reader_loads(model_dir, daemon, prompt, 4)
    assert [len(spec.block_ids) for spec in out.kv_connector_metadata.loads] == [4]


def test_an_aborted_async_load_holds_its_pages_until_the_worker_lets_them_go(model_dir, daemon):
    """vLLM may abort a request whose async load is in flight; the worker still holds its
    staging pages until the load ends, so they stay counted until the worker reports the
    request in finished_recving, and are free for the next hit after that."""
    engine = _small_staging_engine(model_dir, daemon, "async")
    side = engine.connector.scheduler_side
    try:
        engine.add("a", STAGED[0], max_tokens=2)

        def abort(out):
            assert [s.req_id for s in out.kv_connector_metadata.loads] == ["a"]
            engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
            # Still held: a hit asked for now gets the one page left.
            late = engine.add("b", STAGED[1], max_tokens=1)
            assert side.get_num_new_matched_tokens(late, 0) == (BLOCK, True)
            engine.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)

        engine.step(before_forward=abort)
        for _ in range(100):
            if "a" not in engine.scheduler.requests:
                break
            engine.step()
            time.sleep(0.01)
        assert "a" not in engine.scheduler.requests  # vLLM freed it: the worker reported it
        engine.add("c", STAGED[2], max_tokens=1)
        loads = _run_checking_kv(engine, {"c": STAGED[2]})
        assert loads[0] == {"c": 3} and engine.invalid_reported == set()
    finally:
        engine.close()


def test_blocks_not_saved_in_time_are_saved_when_the_request_finishes(model_dir, daemon):
    """A daemon hiccup pauses saves while a prompt is computed; when the request finishes,
    its computed blocks are saved then, and vLLM keeps them until the worker has copied
    them (``request_finished`` returns True; ``finished_sending`` releases them)."""
    assert daemon.proc is not None
    engine = MiniEngine(model_dir, _options(daemon, retry_after_s=30.0))
    try:
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            engine.add("r", PROMPT, max_tokens=2)
            out = engine.step()  # the lookup times out: the scheduler pauses kvtier
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert out.num_scheduled_tokens["r"] == len(PROMPT)
        assert not out.kv_connector_metadata.saves  # paused: nothing planned
        held = False
        for _ in range(100):
            out = engine.step()
            finish = [s for s in out.kv_connector_metadata.saves if s.at_finish]
            if finish:
                assert len(finish[0].block_ids) == 3
                assert "r" in engine.finished_sending  # copied in this step, then released
                break
            request = engine.scheduler.requests.get("r")
            # Finished, yet vLLM keeps it (and its blocks) until the worker reports it.
            held = held or (request is not None and request.is_finished())
        assert held
        engine.run()
        assert "r" not in engine.scheduler.requests
    finally:
        engine.close()
    with daemon.client() as client:
        assert wait_until(lambda: client.stats().counter("put_blocks", result="stored") >= 3)
    # What was saved at the finish is the right KV: another engine loads and checks it.
    _reader_loads(model_dir, daemon, PROMPT, 3)


def test_the_counters_reach_vllms_scheduler_stats_each_increment_once(model_dir, daemon):
    """Each step vLLM's scheduler hands its front end the worker's connector stats with the
    scheduler side's (``get_kv_connector_stats`` on both, added up by vLLM): summed as
    vLLM's stats logger sums them, they are both sides' counters, every increment once, and
    a prompt another engine stored shows as a hit of its 3 blocks, loaded."""
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon))
    side, worker = engine.connector.scheduler_side, engine.worker
    try:
        engine.add("r", PROMPT, max_tokens=2)
        engine.run()
        total = KVTierConnector.build_kv_connector_stats()
        for data in engine.connector_stats:
            total = total.aggregate(KVTierConnector.build_kv_connector_stats(data))
        got = total.reduce()
        assert got["hit_blocks"] == got["load_blocks"] == 3 and got["lookups"] == 1
        assert "load_blocks_failed" not in got and "lookup_errors" not in got
        counters = {k: v for k, v in {**side.stats, **worker.stats}.items() if v}
        assert {k: v for k, v in got.items() if k in COUNTERS} == counters
        # Every counter of either side has a Prometheus name and a meaning.
        assert set(side.stats) | set(worker.stats) == set(COUNTERS)
    finally:
        engine.close()


# A vLLM front end's Prometheus side: the connector's metrics as vLLM registers them
# (``KVConnectorProm``, through ``build_prom_metrics``), recording one step's stats.
_FRONT_END = """
import sys
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
config = VllmConfig(kv_transfer_config=KVTransferConfig(
    kv_connector="KVTierConnector",
    kv_connector_module_path="kvtier.client.integrations.vllm",
    kv_role="kv_both",
))
prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
prom.observe({"lookups": int(sys.argv[1]), "save_jobs_behind": int(sys.argv[2])}, 0)
"""


def test_the_save_jobs_gauge_is_one_series_across_vllm_front_end_processes(tmp_path):
    """With several API servers (``--api-server-count``) vLLM keeps its Prometheus metrics in
    multiprocess mode, and each step's stats are recorded by whichever front-end process
    gets them. The connector's in-flight gauge had no multiprocess mode: each process
    exported a series of its own (a ``pid`` label), and one that last saw 3 saves in
    flight showed 3 for good. As vLLM's own gauges, it now exports one series, the most
    recent value; its counters add up over the processes."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for lookups, in_flight in ((2, 3), (3, 0)):  # two front ends, one step each
        subprocess.run(
            [sys.executable, "-c", _FRONT_END, str(lookups), str(in_flight)],
            env=env,
            check=True,
            timeout=300,
        )
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    series = [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples]
    labels = {"model_name": "tiny", "engine": "0"}
    gauge = [(ls, v) for name, ls, v in series if name == "vllm:kvtier_save_jobs_behind"]
    assert gauge == [(labels, 0.0)]
    lookups = [(ls, v) for name, ls, v in series if name == "vllm:kvtier_lookups_total"]
    assert lookups == [(labels, 5.0)]


def test_a_preempted_request_resumes_with_the_right_kv(model_dir, daemon):
    """Two requests outgrow a small KV cache: vLLM preempts one, frees its blocks, and later
    resumes it; whatever it then finds (its own freed blocks, its saved blocks in kvtier, or
    nothing) must be its own KV."""
    engine = MiniEngine(model_dir, _options(daemon), num_blocks=8)
    # Both fit when admitted (5 of 7 usable blocks); growing to 6 + 4 blocks they do not.
    a, b = prompts(11, 3 * BLOCK, [10])[0], prompts(12, BLOCK, [2])[0]
    try:
        engine.add("a", a, max_tokens=300)
        engine.add("b", b, max_tokens=300)
        preempted = resumed = False
        for _ in range(1000):
            if not engine.scheduler.has_requests():
                break
            out = engine.step()
            preempted |= bool(out.preempted_req_ids)
            back = "b" in out.scheduled_cached_reqs.resumed_req_ids or any(
                n.req_id == "b" for n in out.scheduled_new_reqs
            )
            if preempted and back and not resumed:
                resumed = True
                request = engine.request("b")
                assert engine.blocks_hold_their_prefix("b", request.num_computed_tokens)
        assert preempted and resumed
        # On resuming, part of its prefix came from kvtier (vLLM had reused the rest).
        assert engine.connector.scheduler_side.stats["hit_blocks"] >= 1
        assert len(engine.outputs["a"]) == 300 and len(engine.outputs["b"]) == 300
        assert engine.invalid_reported == set()
    finally:
        engine.close()


def test_a_request_left_waiting_has_its_hit_protected_until_it_runs(model_dir, daemon):
    """vLLM asks about a waiting request again at every step: from the second time on the
    request is queued, and the connector hints its hit once (a Prefetch with a deadline)."""
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon), num_blocks=8)
    side = engine.connector.scheduler_side
    try:
        # "x" takes 5 of the 7 usable blocks; "r" (4 blocks) waits until it finishes.
        engine.add("x", prompts(13, 4 * BLOCK, [10])[0], max_tokens=20)
        engine.step()
        engine.add("r", PROMPT, max_tokens=2)
        waited = 0
        while engine.request("r").status == RequestStatus.WAITING:
            engine.step()
            waited += 1
        assert waited >= 2
        assert (side.stats["hints"], side.stats["hint_blocks"]) == (1, 3)
        assert _counters(daemon)["hinted_blocks"] == 3
        # It ran with its hit loaded from kvtier.
        assert side.stats["hit_blocks"] == 3
        assert engine.blocks_hold_their_prefix("r", len(PROMPT))
        engine.run()
    finally:
        engine.close()


def test_a_request_that_skips_cached_kv_is_neither_looked_up_nor_hinted(model_dir, daemon):
    """vLLM computes the whole prompt of a request that must not read cached KV (prompt
    logprobs, or ``skip_reading_prefix_cache``), whatever the connector answers. Before, the
    connector looked it up at every ask and, as it waited, hinted its hit: the daemon kept
    3 blocks from eviction for a request that never loads them."""
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon), num_blocks=8)
    side = engine.connector.scheduler_side
    try:
        # "x" takes 5 of the 7 usable blocks; "r" (4 blocks) waits until it finishes.
        engine.add("x", prompts(13, 4 * BLOCK, [10])[0], max_tokens=20)
        engine.step()
        lookups = side.stats["lookups"]
        engine.add("r", PROMPT, max_tokens=2, skip_reading_prefix_cache=True)
        waited = 0
        while engine.request("r").status == RequestStatus.WAITING:
            out = engine.step()
            waited += 1
        assert waited >= 2
        assert out.num_scheduled_tokens["r"] == len(PROMPT)
        assert not out.kv_connector_metadata.loads
        assert side.stats["lookups"] == lookups and side.stats["hints"] == 0
        assert _counters(daemon).get("hinted_blocks", 0) == 0
        assert engine.blocks_hold_their_prefix("r", len(PROMPT))
        engine.run()
    finally:
        engine.close()


def test_an_engine_keeps_working_across_a_daemon_restart(model_dir, daemon_factory, tmp_path):
    """The daemon restarts under a running engine: its session, its pools and L1 are gone,
    the blocks survive on L2. The next request reconnects, stages through a fresh pool (the
    old one's name was dropped once mapped, so it cannot be registered again), and loads."""
    daemon = daemon_factory(
        "tiers.l2.enabled=true", "tiers.l2.capacity_bytes=256Mi", f"tiers.l2.path={tmp_path / 'l2'}"
    )
    _store_prompt(model_dir, daemon)
    engine = MiniEngine(model_dir, _options(daemon))
    try:
        engine.add("warm", prompts(8, BLOCK, [5])[0], max_tokens=1)
        engine.run()
        # The restart comes after "warm"'s save: a save cut by it would pause kvtier for
        # retry_after_s (the daemon was down), which is the breaker's test, not this one.
        assert wait_until(lambda: engine.worker.saves_in_flight() == 0)
        daemon.restart()
        assert wait_until(lambda: not engine.worker.staging_registered())
        engine.add("r", PROMPT, max_tokens=2)
        out = engine.step()
        assert out.num_scheduled_tokens["r"] == len(PROMPT) - 3 * BLOCK
        assert engine.blocks_hold_their_prefix("r", len(PROMPT))
        assert engine.invalid_reported == set() and engine.worker.staging_generation == 2
        engine.run()
    finally:
        engine.close()


def test_a_step_scheduled_before_a_failed_loads_output_stores_nothing_of_it(model_dir, daemon):
    """vLLM's async scheduling (its default) schedules and runs a step before it has seen the
    previous step's output. Request "a" loads a stored prefix layer by layer and computes the
    first chunk of the rest of its prompt; the load fails, and the step after it (already
    running when vLLM learns of the failure and rewinds "a") computes the next chunk over the
    failed blocks too. Regression: that chunk's block was stored, and being already held, its
    recomputed KV never was, so a later hit on it loaded wrong KV."""
    _store_prompt(model_dir, daemon)
    a = PROMPT[: 3 * BLOCK] + prompts(8, 0, [2 * BLOCK + 50])[0]
    engine = MiniEngine(model_dir, _options(daemon), max_num_batched_tokens=BLOCK)
    keys: list[bytes] = []
    try:
        engine.add("a", a, max_tokens=2)
        first, second = engine.overlapped_steps(before_forward=_losing_the_loads(engine, keys))
        assert len(keys) == 3
        assert first.num_scheduled_tokens["a"] == BLOCK  # the 4th block, over the failed ones
        assert second.num_scheduled_tokens["a"] == BLOCK  # the 5th, scheduled before the failure
        assert engine.worker.stats["save_blocks_withheld"] == 2
        engine.run()
    finally:
        engine.close()  # waits for its saves
    _reader_loads(model_dir, daemon, a, 5, "a")


def test_a_request_scheduled_before_a_failed_load_was_seen_stores_nothing_over_it(
    model_dir, daemon
):
    """Request "c" arrives while "a"'s failing layer-wise load runs, and async scheduling
    plans it before vLLM has seen the failure, with "a"'s blocks from vLLM's own prefix cache
    (a layer-wise load caches them at allocation). vLLM never rewinds "c" (its output is
    computed over the failed blocks: vLLM's own doing), and the connector stores nothing of
    it since; "a" stores its blocks once recomputed. Regression: "c"'s next block was stored,
    and a later hit on it loaded wrong KV."""
    _store_prompt(model_dir, daemon)
    a = PROMPT[: 3 * BLOCK] + prompts(8, 0, [BLOCK + 50])[0]
    c = a[: 4 * BLOCK] + prompts(9, 0, [BLOCK + 10])[0]
    engine = MiniEngine(model_dir, _options(daemon), max_num_batched_tokens=2 * BLOCK)
    keys: list[bytes] = []
    try:
        engine.add("a", a, max_tokens=2)
        _, second = engine.overlapped_steps(
            before_forward=_losing_the_loads(engine, keys),
            between=lambda: engine.add("c", c, max_tokens=2),
        )
        assert len(keys) == 3
        # "c" computes its 5th block over "a"'s four, found in vLLM's cache.
        assert dict(second.num_scheduled_tokens) == {"c": len(c) - 4 * BLOCK}
        engine.run()
    finally:
        engine.close()  # waits for its saves
    # "a"'s four blocks, recomputed, and nothing of "c"'s own.
    _reader_loads(model_dir, daemon, a, 4, "a")
    _reader_loads(model_dir, daemon, c, 4, "c")
