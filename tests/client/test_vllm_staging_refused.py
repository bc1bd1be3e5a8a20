"""The vLLM connector when the daemon refuses a worker's staging pool for a limit or a layout
that waiting does not change (``server.max_pool_bytes_per_tenant`` below the pool's size):
one ERROR naming both sides' settings, no new staging region per ``retry_after_s`` (tries
back off exponentially), loads failed at once without promising hits, and kvtier used again
once the daemon takes the pool. A real daemon; the worker side driven by hand, as vLLM's
model runner calls it (``tests/integrations/vllm/test_worker_side.py`` does the same under
vLLM). Without vLLM installed, the two empty base classes the connector's metadata derive
from are provided by ``conftest.vllm_modules``; nothing else of vLLM is used.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.client.errors import ResourceExhaustedError
from kvtier.client.integrations import staging
from kvtier.client.integrations.staging import REFUSED_RETRY_MAX_S, RegistrationRefusals
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.sync import Client

LAYERS = ["layer.0", "layer.1"]
BLOCKS = 8
BLOCK_SHAPE = (2, 4, 2)  # 64 bytes per layer block (float32): a staging pool of 8 pages is 1 KiB


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll ``predicate`` until it holds; it returns as soon as it does."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def identity(mods: SimpleNamespace) -> Any:
    return mods.identity("staging-refused")  # two layers: LAYERS


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def regions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the shared-memory regions staging pools made, in order."""
    made: list[int] = []

    class Counted(SharedMemoryPool):
        def __init__(self, size: int, **kwargs: Any) -> None:
            made.append(size)
            super().__init__(size, **kwargs)

    monkeypatch.setattr(staging, "SharedMemoryPool", Counted)
    return made


def make_worker(mods: SimpleNamespace, address: str, clock: Clock, **options: Any) -> Any:
    """A worker whose refusals run on ``clock``; ``retry_after_s`` so short that, without
    the back-off, every step would try (and make a region) again."""
    config = mods.config.ConnectorConfig(
        address=address, layer_groups=1, retry_after_s=1e-6, **options
    )
    side = mods.worker.WorkerSide(config, identity(mods), LAYERS, BLOCKS, tp_rank=0, pp_rank=0)
    side.refusals = RegistrationRefusals(config.retry_after_s, clock=clock)
    kv = [torch.zeros((BLOCKS, *BLOCK_SHAPE), dtype=torch.float32) for _ in LAYERS]
    side.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    return side


def run_step(mods: SimpleNamespace, side: Any, keys: list[bytes]) -> tuple[set[int], Any]:
    """One step that loads two blocks and stores two: the blocks to recompute, and the
    worker's metadata for the scheduler side."""
    meta = mods.meta.KVTierConnectorMetadata(
        loads=[mods.meta.LoadSpec("load", [0, 1], {0: keys[:2]})],
        saves=[mods.meta.SaveSpec("save", [2, 3], {0: keys[2:4]}, {0: b""})],
    )
    side.start_load_kv(meta)
    for name, kv in zip(LAYERS, side.kv, strict=True):
        side.wait_for_layer_load(name)
        side.save_kv_layer(name, kv, meta)
    side.wait_for_save(meta)
    side.get_finished(set())
    return side.get_block_ids_with_load_errors(), side.build_connector_worker_meta()


def test_a_staging_pool_over_the_tenants_bytes_is_refused_once_loudly_and_not_remade_each_period(
    vllm_modules, daemon_factory, regions, caplog
):
    """Regression: with server.max_pool_bytes_per_tenant below the worker's staging pool, the
    worker warned at every retry_after_s and made a new staging region (hundreds of MiB in a
    real engine) at each try, its start-up line reported the pool, and the scheduler side
    kept promising hits. Now: one ERROR naming the daemon's key and value and the
    connector's staging_bytes and the pool's size; the start-up line says REFUSED; steps
    make no region until the back-off ends (1x, then 2x retry_after_s...); loads fail at
    once (recomputed, nothing waited for) and nothing is stored; every step tells the
    scheduler side the pool is refused."""
    mods = vllm_modules
    daemon = daemon_factory("server.max_pool_bytes_per_tenant=512")
    clock = Clock()
    keys = mods.config.KeyChain(identity(mods).namespace(0, 0)).extend(list(range(16)), 4, None)
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        side = make_worker(mods, daemon.address, clock)
        try:
            assert regions == [1024]
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 1
            text = errors[0].getMessage()
            for named in (
                "server.max_pool_bytes_per_tenant",
                " 512 ",  # the daemon's value
                "staging_bytes=536870912",  # the connector's option and value
                "staging pool of 1024 bytes",
                "ResourceExhaustedError",
            ):
                assert named in text, named
            started = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
            assert len(started) == 1 and "REFUSED by the daemon" in started[0]
            assert not side.staging_registered()

            caplog.clear()
            for _ in range(10):
                invalid, meta = run_step(mods, side, keys)
                assert invalid == {0, 1}
                assert meta is not None and meta.staging_refused is True
                assert meta.failed_loads == {"load"}
            assert regions == [1024]  # no new region while the refusal stands
            assert side.stats["save_blocks"] == 0 and side.stats["load_blocks_failed"] == 20
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

            # The back-off: 1 ms (the floor of a try's wait), then 2 ms, 4 ms...
            clock.now += 0.001
            run_step(mods, side, keys)
            assert len(regions) == 2
            clock.now += 0.001
            run_step(mods, side, keys)
            assert len(regions) == 2
            clock.now += 0.001
            run_step(mods, side, keys)
            assert len(regions) == 3
            # Refused again for the same reason: no second ERROR.
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert side.refusals.count == 3
            with Client(daemon.address) as other:
                other.health()  # the daemon serves others meanwhile
        finally:
            side.shutdown()


def test_a_refused_pool_is_used_once_the_daemon_takes_it_and_the_scheduler_is_told(
    vllm_modules, daemon_factory, regions, caplog
):
    """The tenant's bytes are taken by another client's pool, so the worker's is refused;
    once that pool is unregistered, the worker's next due try (at the step's end, though the
    step had nothing to load or store) registers it: the metadata says False once, then
    nothing, and loads and saves go through it."""
    mods = vllm_modules
    daemon = daemon_factory("server.max_pool_bytes_per_tenant=1536")
    clock = Clock()
    keys = mods.config.KeyChain(identity(mods).namespace(0, 0)).extend(list(range(16)), 4, None)
    with Client(daemon.address) as other, SharedMemoryPool(1024) as shm:
        layout = staging.layer_major_layout(1, 16, 4, 64, "float32")
        held = other.register_pool(shm, layout)
        caplog.set_level(logging.INFO, logger="kvtier")
        side = make_worker(mods, daemon.address, clock)
        try:
            assert side.refusals.refused and not side.staging_registered()
            assert side.build_connector_worker_meta().staging_refused is True
            other.unregister_pool(held.binding.pool_id)

            def retried() -> bool:
                clock.now += 3600.0
                side.build_connector_worker_meta()
                return side.staging_registered()

            assert wait_until(retried)
            assert "took the staging pool after" in caplog.text
            meta = side.build_connector_worker_meta()
            assert meta is None or meta.staging_refused is False
            assert side.build_connector_worker_meta() is None  # said once

            run_step(mods, side, keys)
            assert wait_until(lambda: side.saves_in_flight() == 0)
            assert side.stats["save_blocks"] == 2
            assert side.client.lookup(keys[2:4]).prefix_len == 2
        finally:
            side.shutdown()


def test_the_scheduler_side_offers_no_hit_while_a_worker_says_its_pool_is_refused(
    vllm_modules, daemon
):
    """No lookup (so no hit, no pin, no hint) and no save planned while the workers' metadata
    says a staging pool is refused; both again once they say it is not. Workers' metadata
    aggregate to refused if any is."""
    mods = vllm_modules
    meta = mods.meta.KVTierWorkerMetadata
    assert meta(staging_refused=True).aggregate(meta(staging_refused=False)).staging_refused
    assert (
        meta(staging_refused=None).aggregate(meta(staging_refused=False)).staging_refused is False
    )
    assert meta().aggregate(meta()).staging_refused is None

    config = mods.config.ConnectorConfig(address=daemon.address, layer_groups=1)
    side = mods.scheduler.SchedulerSide(config, identity(mods), BLOCKS)
    try:
        request = SimpleNamespace(
            request_id="r", all_token_ids=list(range(17)), num_tokens=17, num_prompt_tokens=17
        )

        def output(refused: bool | None) -> SimpleNamespace:
            return SimpleNamespace(
                finished_recving=None, kv_connector_worker_meta=meta(staging_refused=refused)
            )

        side.update_connector_output(output(True))
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        assert side.stats["lookups"] == 0
        side.update_connector_output(output(None))  # no news: still refused
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        assert side.stats["lookups"] == 0
        side.update_connector_output(output(False))
        side.get_num_new_matched_tokens(request, 0)
        assert side.stats["lookups"] == 1
    finally:
        side.shutdown()


def test_refused_tries_back_off_exponentially_up_to_the_cap():
    clock = Clock()
    refusals = RegistrationRefusals(5.0, clock=clock)
    assert refusals.due() and not refusals.refused
    waits = [refusals.refuse(ResourceExhaustedError("full")) for _ in range(9)]
    assert waits == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert REFUSED_RETRY_MAX_S == 300
    assert refusals.refused and not refusals.due()
    clock.now += 299.0
    assert not refusals.due()
    clock.now += 1.0
    assert refusals.due()
    assert refusals.accepted() == 9
    assert not refusals.refused and refusals.due()
    assert refusals.refuse(ResourceExhaustedError("full")) == 5


def test_a_refused_staging_region_is_given_back_not_held_by_the_kept_refusal(
    vllm_modules, daemon_factory, monkeypatch
):
    """Regression: the worker kept the daemon's refusal (``RegistrationRefusals.error``) with
    its traceback, whose frames held the half-made StagingPool and so its whole region (the
    size of the staging pool, hundreds of MiB of shared or GPU memory in an engine) for as
    long as the refusal stood, although the region is meant to be given back at once."""
    mods = vllm_modules
    daemon = daemon_factory("server.max_pool_bytes_per_tenant=512")
    made: list[weakref.ref[SharedMemoryPool]] = []

    class Tracked(SharedMemoryPool):
        def __init__(self, size: int, **kwargs: Any) -> None:
            super().__init__(size, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(staging, "SharedMemoryPool", Tracked)
    side = make_worker(mods, daemon.address, Clock())
    try:
        assert side.refusals.refused and len(made) == 1
        gc.collect()
        assert made[0]() is None, "the refused region is still alive"
        assert isinstance(side.refusals.error, ResourceExhaustedError)
    finally:
        side.shutdown()


def test_a_refusal_that_stands_for_days_keeps_its_wait_at_the_cap():
    """Regression: the wait was retry_after_s * 2.0 ** refusals, and a float power past
    2 ** 1023 raises OverflowError: after 1,024 refusals (about 85 hours of a limit left as
    it was, at the 300 s cap) the worker's next try raised it out of the connector into
    vLLM's model runner."""
    clock = Clock()
    refusals = RegistrationRefusals(5.0, clock=clock)
    waits = [refusals.refuse(ResourceExhaustedError("full")) for _ in range(1100)]
    assert waits[:7] == [5, 10, 20, 40, 80, 160, 300]
    assert set(waits[6:]) == {300}
    assert refusals.count == 1100


def test_a_staging_region_that_cannot_be_made_stops_the_start_clearly_and_later_pauses_kvtier(
    vllm_modules, daemon_factory, monkeypatch, caplog
):
    """/dev/shm too small or full: making the staging region raises OSError. At start that
    is a setting to change (a RuntimeError naming staging_bytes and /dev/shm, as for a GPU
    without room); at a later try (here: the retry after a refusal) it reached vLLM's step
    uncaught; now kvtier pauses for that worker and the step's loads are recomputed."""
    mods = vllm_modules
    full = OSError(28, "No space left on device")

    class Full(SharedMemoryPool):
        def __init__(self, size: int, **kwargs: Any) -> None:
            raise full

    with monkeypatch.context() as patched:
        patched.setattr(staging, "SharedMemoryPool", Full)
        with pytest.raises(RuntimeError, match=r"staging_bytes lower.*/dev/shm.*No space left"):
            make_worker(mods, daemon_factory().address, Clock())

    daemon = daemon_factory("server.max_pool_bytes_per_tenant=512")
    clock = Clock()
    keys = mods.config.KeyChain(identity(mods).namespace(0, 0)).extend(list(range(16)), 4, None)
    side = make_worker(mods, daemon.address, clock)
    try:
        assert side.refusals.refused
        monkeypatch.setattr(staging, "SharedMemoryPool", Full)
        clock.now += 1.0  # the refused pool's next try is due: its region cannot be made
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            invalid, _ = run_step(mods, side, keys)
        assert invalid == {0, 1} and side.breaker.trips >= 1  # paused (here for 1 us)
        assert "No space left on device" in caplog.text
    finally:
        side.shutdown()
