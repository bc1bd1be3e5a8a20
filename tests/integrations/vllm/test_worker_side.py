"""The worker side of the connector on its own, against a real daemon: no scheduler, no
engine; the metadata is built by hand so that cases vLLM rarely produces are reachable."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import torch
from mini_engine import wait_until

from kvtier.client.integrations.breaker import Breaker, daemon_answers
from kvtier.client.integrations.vllm_config import ConnectorConfig, KeyChain, ModelIdentity
from kvtier.client.integrations.vllm_meta import KVTierConnectorMetadata, LoadSpec, SaveSpec
from kvtier.client.integrations.vllm_worker import WorkerSide

LAYERS = ["layer.0", "layer.1"]
BLOCKS = 8
BLOCK_SHAPE = (2, 4, 2)  # K and V, 4 tokens, 2 values: 64 bytes per layer block (float32)
IDENTITY = ModelIdentity(
    model="worker-side",
    revision="",
    kv_dtype="float32",
    kv_layout="test",
    block_tokens=4,
    tp_size=1,
    pp_size=1,
    tenant="default",
    extra="",
    num_layers=len(LAYERS),
    layer_block_bytes=64,
)


def worker(
    address: str, blocks: int = BLOCKS, **options: Any
) -> tuple[WorkerSide, list[torch.Tensor]]:
    config = ConnectorConfig(address=address, layer_groups=1, **options)
    side = WorkerSide(config, IDENTITY, LAYERS, blocks, tp_rank=0, pp_rank=0)
    kv = [torch.zeros((blocks, *BLOCK_SHAPE), dtype=torch.float32) for _ in LAYERS]
    side.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    return side, kv


def run_step(side: WorkerSide, meta: KVTierConnectorMetadata) -> set[int]:
    """What the model runner does around one forward pass; returns the blocks to recompute."""
    side.start_load_kv(meta)
    for name, kv in zip(LAYERS, side.kv, strict=True):
        side.wait_for_layer_load(name)
        side.save_kv_layer(name, kv, meta)
    side.wait_for_save(meta)
    return side.get_block_ids_with_load_errors()


def test_a_block_without_a_key_does_not_shift_the_blocks_after_it(daemon):
    """A load spec with fewer keys than blocks (its last block has none) is followed by a
    spec whose blocks all load: each of those receives its own key's KV, or is reported for
    recompute; none keeps what it held before, unreported."""
    keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(12)), 3, None)
    saver, saved_kv = worker(daemon.address)
    loader, kv = worker(daemon.address)
    try:
        for layer, t in enumerate(saved_kv):
            for block in range(3):
                t[block] = 100 * layer + block + 1
        save = SaveSpec("stored", [0, 1, 2], {0: keys}, {0: b""}, at_finish=True)
        run_step(saver, KVTierConnectorMetadata(saves=[save]))
        saver.shutdown()  # waits for the save

        loads = [
            LoadSpec("short", [0, 1], {0: keys[:1]}),  # block 1 has no key
            LoadSpec("full", [2, 3], {0: keys[1:3]}),
        ]
        invalid = run_step(loader, KVTierConnectorMetadata(loads=loads))
        assert 1 in invalid
        # Only the request whose load failed is named to the scheduler side.
        meta = loader.build_connector_worker_meta()
        assert meta is not None and meta.failed_loads == {"short"}
        expected = {0: 0, 2: 1, 3: 2}  # engine block: the stored block its key names
        for layer, t in enumerate(kv):
            for block, source in expected.items():
                if block not in invalid:
                    assert torch.equal(t[block], saved_kv[layer][source]), (layer, block)
    finally:
        loader.shutdown()


# 8 pages of 128 bytes (2 layers of 64): 4 for loads, 4 for saves.
SMALL_STAGING = {"staging_bytes": 8 * 128, "staging_save_share": 0.5}


def _fill(kv: list[torch.Tensor], base: int) -> None:
    for layer, t in enumerate(kv):
        for block in range(BLOCKS):
            t[block] = base + 100 * layer + block + 1


def _stored(side: WorkerSide, keys: list[bytes]) -> int:
    """How many of ``keys``' first blocks the daemon holds, once the side's saves ended."""
    assert wait_until(lambda: side.saves_in_flight() == 0)
    return side.client.lookup(keys).prefix_len


def test_a_save_larger_than_the_saves_share_stores_the_head_of_its_chain(daemon):
    """A step's save of 6 blocks meets a saves' share of 4 pages: its first 4 blocks are
    stored (a chain's later blocks are useless without its first ones; before, all 6 were
    dropped), the other 2 are counted dropped, and the request's later blocks, which would
    follow the gap, are dropped too while another request's are stored. The 4 stored blocks
    hold the saver's KV: another worker loads them."""
    chain = KeyChain(IDENTITY.namespace(0, 0))
    keys = chain.extend(list(range(32)), 8, None)
    other = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(1000, 1032)), 1, None)
    saver, saved_kv = worker(daemon.address, **SMALL_STAGING)
    loader, kv = worker(daemon.address)
    try:
        assert saver.staging_pages.saves == 4
        _fill(saved_kv, 0)
        run_step(
            saver,
            KVTierConnectorMetadata(saves=[SaveSpec("r", list(range(6)), {0: keys[:6]}, {0: b""})]),
        )
        assert saver.stats["save_blocks"] == 4 and saver.stats["save_blocks_dropped"] == 2
        assert _stored(saver, keys[:6]) == 4

        later = SaveSpec("r", [6, 7], {0: keys[6:8]}, {0: keys[5]})
        another = SaveSpec("s", [6], {0: other}, {0: b""})
        run_step(saver, KVTierConnectorMetadata(saves=[later, another]))
        assert saver.stats["save_blocks"] == 5 and saver.stats["save_blocks_dropped"] == 4
        assert _stored(saver, keys[6:8]) == 0 and _stored(saver, other) == 1

        # A step whose only save is dropped counts its blocks once, not once per layer.
        run_step(saver, KVTierConnectorMetadata(saves=[later]))
        assert saver.stats["save_blocks"] == 5 and saver.stats["save_blocks_dropped"] == 6

        # Once vLLM has finished the request, its id carries no gap any more.
        saver.get_finished({"r"})
        run_step(saver, KVTierConnectorMetadata(saves=[later]))
        assert _stored(saver, keys[6:8]) == 2

        invalid = run_step(
            loader, KVTierConnectorMetadata(loads=[LoadSpec("r", [4, 5, 6, 7], {0: keys[:4]})])
        )
        assert invalid == set()
        for layer, t in enumerate(kv):
            for block, source in zip([4, 5, 6, 7], range(4), strict=True):
                assert torch.equal(t[block], saved_kv[layer][source]), (layer, block)
    finally:
        saver.shutdown()
        loader.shutdown()


def test_saves_cut_to_the_share_keep_the_head_of_each_chain_in_order(daemon):
    """Two requests' saves of 3 blocks each in one step, 4 pages: the first is stored whole,
    the second keeps its first block (its chain's head), and its last 2 are dropped. The same
    holds for requests that finish (their blocks are copied when vLLM finishes them)."""
    for round, at_finish in enumerate((False, True)):
        a = KeyChain(IDENTITY.namespace(0, 0)).extend([round] * 12, 3, None)
        b = KeyChain(IDENTITY.namespace(0, 0)).extend([round + 10] * 12, 3, None)
        saver, _ = worker(daemon.address, **SMALL_STAGING)
        try:
            specs = [
                SaveSpec("a", [0, 1, 2], {0: a}, {0: b""}, at_finish),
                SaveSpec("b", [3, 4, 5], {0: b}, {0: b""}, at_finish),
            ]
            run_step(saver, KVTierConnectorMetadata(saves=specs))
            assert (saver.stats["save_blocks"], saver.stats["save_blocks_dropped"]) == (4, 2)
            assert _stored(saver, a) == 3 and _stored(saver, b) == 1
            if at_finish:  # vLLM may free both requests' blocks: both were copied
                sending, _ = saver.get_finished({"a", "b"})
                assert sending == {"a", "b"}
        finally:
            saver.shutdown()


def test_a_save_computed_over_another_requests_failed_load_is_withheld(daemon):
    """Request A's layer-wise load of blocks 0 and 1 fails (the daemon has neither); request
    B, in the same step, shares block 0 through vLLM's prefix cache (its save says it
    ``reads`` it) and computes block 2 over it; request C reads nothing loaded. B's block is
    not stored and B is named to the scheduler side with A (vLLM rewinds both); C's is."""
    keys = KeyChain(IDENTITY.namespace(0, 0)).extend(list(range(8)), 2, None)
    b_key, c_key = (KeyChain(IDENTITY.namespace(0, 0)).extend([t] * 4, 1, None)[0] for t in (5, 6))
    side, kv = worker(daemon.address)
    try:
        _fill(kv, 0)
        meta = KVTierConnectorMetadata(
            loads=[LoadSpec("A", [0, 1], {0: keys})],
            saves=[
                SaveSpec("B", [2], {0: [b_key]}, {0: b""}, reads=[0]),
                SaveSpec("C", [3], {0: [c_key]}, {0: b""}),
            ],
        )
        assert run_step(side, meta) == {0, 1}
        worker_meta = side.build_connector_worker_meta()
        assert worker_meta is not None and worker_meta.failed_loads == {"A", "B"}
        assert side.stats["save_blocks_withheld"] == 1 and side.stats["save_blocks"] == 1
        assert _stored(side, [c_key]) == 1
        assert _stored(side, [b_key]) == 0
    finally:
        side.shutdown()


def test_a_hung_daemon_holds_no_more_than_max_save_jobs_saves_in_flight(daemon, caplog):
    """While the daemon accepts connections but answers nothing (SIGSTOP), each finished
    request's save started a job that waited its whole save_timeout_s: one more in flight per
    request for the hang's first 30 s, until the saves' share of pages was full. Now at most
    ``max_save_jobs`` are in flight; the later saves take no page, are counted dropped, and
    are warned of once. Once the daemon answers, the jobs in flight end stored and the next
    save is stored again."""
    assert daemon.proc is not None
    chain = KeyChain(IDENTITY.namespace(0, 0))
    keys = [chain.extend([i] * 4, 1, None)[0] for i in range(10)]
    side, _ = worker(daemon.address, blocks=32, max_save_jobs=3, staging_bytes=32 * 128)
    stopped = False
    try:
        assert side.staging_registered() and side.staging_pages.saves == 16
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        stopped = True
        behind = []  # the backlog gauge vLLM takes at each step's end
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            for i in range(8):  # one finished request per step, one block each
                spec = SaveSpec(f"r{i}", [i], {0: [keys[i]]}, {0: b""}, at_finish=True)
                run_step(side, KVTierConnectorMetadata(saves=[spec]))
                assert side.saves_in_flight() <= 3
                behind.append(side.take_stats().get("save_jobs_behind", 0))
        assert side.saves_in_flight() == 3
        # Each step's own save is not behind yet; the hang's grow to the bound.
        assert behind == [0, 1, 2, 3, 3, 3, 3, 3]
        assert side.stats["save_blocks"] == 3 and side.stats["save_blocks_dropped"] == 5
        assert side.stats["saves_over_limit"] == 5
        assert side._save_pages(side._arena) == 3  # the dropped saves hold no page
        warnings = [r for r in caplog.records if "max_save_jobs" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        os.kill(daemon.proc.pid, signal.SIGCONT)
        stopped = False
        assert _stored(side, keys[:3]) == 3
        assert side.breaker.ok()
        assert wait_until(lambda: side.saves_in_flight() == 0)
        assert side.take_stats()["save_jobs_behind"] == 0  # reported as it falls to 0
        spec = SaveSpec("late", [0], {0: [keys[9]]}, {0: b""}, at_finish=True)
        run_step(side, KVTierConnectorMetadata(saves=[spec]))
        # The step's own save, running or done, is no backlog: an engine that goes idle
        # now shows 0, not a save that looks stuck.
        assert side.take_stats().get("save_jobs_behind", 0) == 0
        assert _stored(side, [keys[9]]) == 1
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        side.shutdown()


def test_saves_a_hang_timed_out_reaped_together_later_cost_one_probe(daemon):
    """Regression: the save jobs a hang timed out were reaped together at the next step (the
    engine had nothing to run meanwhile) and each tripped the breaker: the first started a
    probe, and the others, counted as failures that came in while it ran, set its answer
    aside, so kvtier stayed off for another retry_after_s, and a second probe, though the
    daemon answered the first. The first answer now ends the pause, and the next step
    stores its save."""
    assert daemon.proc is not None
    chain = KeyChain(IDENTITY.namespace(0, 0))
    keys = [chain.extend([i] * 4, 1, None)[0] for i in range(10)]
    side, _ = worker(
        daemon.address,
        blocks=32,
        staging_bytes=32 * 128,
        save_timeout_s=0.5,
        retry_after_s=1.0,
    )
    probes: list[bool] = []
    health = daemon_answers(side.client)

    def counted() -> bool:
        probes.append(health())
        return probes[-1]

    side.breaker = Breaker(side.config.retry_after_s, "transfer", probe=counted)
    stopped = False
    try:
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        stopped = True
        for i in range(3):
            spec = SaveSpec(f"r{i}", [i], {0: [keys[i]]}, {0: b""}, at_finish=True)
            run_step(side, KVTierConnectorMetadata(saves=[spec]))
        assert side.saves_in_flight() == 3
        assert wait_until(lambda: side.saves_in_flight() == 0)  # timed out, not reaped
        os.kill(daemon.proc.pid, signal.SIGCONT)
        stopped = False
        time.sleep(side.config.retry_after_s)  # their pause is over when they are reaped
        spec = SaveSpec("next", [5], {0: [keys[5]]}, {0: b""}, at_finish=True)
        run_step(side, KVTierConnectorMetadata(saves=[spec]))
        # The reaped failures started a probe; the daemon serves, so it may have answered
        # already (under load it did, before this line ran).
        assert side.stats["save_jobs_failed"] == 3 and (side.breaker.probing or probes)
        assert wait_until(side.breaker.ok)
        assert probes == [True]
        spec = SaveSpec("later", [6], {0: [keys[6]]}, {0: b""}, at_finish=True)
        run_step(side, KVTierConnectorMetadata(saves=[spec]))
        assert _stored(side, [keys[6]]) == 1
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        side.shutdown()
