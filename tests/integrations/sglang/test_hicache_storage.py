"""kvtier's SGLang HiCache storage backend against SGLang's real classes and a real kvtierd.

SGLang's ``StorageBackendFactory`` builds the backend from the dynamic-backend extra config,
its real MHA and MLA host pools (CPU, shared-memory or plain allocator) hold the pages, and
its cache controller's own storage code computes page hashes and calls the backend.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import DaemonFactory, DaemonProcess
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang_harness import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    ControllerCalls,
    attach,
    fill,
    mha_host_pool,
    mla_host_pool,
    page_hashes,
    page_starts,
    pages_bytes,
    storage_config,
)

from kvtier.client.integrations.sglang import KVTierHiCacheStorage
from kvtier.client.integrations.staging import RegistrationRefusals, layer_major_layout
from kvtier.client.pool import SharedMemoryPool

HERE = Path(__file__).resolve().parent
PAGE = 4


def tokens(n_pages: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30_000, (n_pages * PAGE,), generator=g).tolist()


def rpc_count(daemon: DaemonProcess, method: str) -> int:
    with daemon.client() as c:
        return c.stats().counter("rpc_seconds_count", method=method)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("allocator", ["shm", "default"])
@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_mha_pages_round_trip_through_the_factory_built_backend(
    shared_daemon: DaemonProcess, layout: str, allocator: str
) -> None:
    host = mha_host_pool(layout, allocator)
    backend = attach(host, storage_config(shared_daemon.address))
    try:
        assert isinstance(backend, KVTierHiCacheStorage)
        # The shared-memory allocator's host pool is registered itself; the default one
        # (private memory) goes through a staging pool.
        assert backend.mode == ("direct" if allocator == "shm" else "staged")
        keys = [f"{layout}-{allocator}-{i}" for i in range(5)]
        src = host.alloc(5 * PAGE)
        stored = fill(host, src, seed=1)
        assert backend.batch_set_v1(keys, src) == [True] * 5
        assert backend.batch_exists(keys) == 5

        dst = host.alloc(5 * PAGE)
        assert pages_bytes(host, dst) != stored
        assert backend.batch_get_v1(keys, dst) == [True] * 5
        assert pages_bytes(host, dst) == stored
        assert backend.counters["pages_loaded"] == 5
        assert backend.counters["pages_stored"] == 5
        metrics = backend.get_stats()
        assert metrics.prefetch_pgs == [5] and metrics.backup_pgs == [5]
    finally:
        backend.close()


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_round_trip_and_are_shared_by_tp_ranks(
    shared_daemon: DaemonProcess, layout: str
) -> None:
    host = mla_host_pool(layout)
    rank0 = attach(host, storage_config(shared_daemon.address, mla=True, tp_size=2))
    other = mla_host_pool(layout, "default")
    rank1 = attach(other, storage_config(shared_daemon.address, mla=True, tp_rank=1, tp_size=2))
    try:
        assert rank0.mode == "direct" and rank1.mode == "staged"
        keys = [f"mla-{layout}-{i}" for i in range(3)]
        src = host.alloc(3 * PAGE)
        stored = fill(host, src, seed=2)
        assert rank0.batch_set_v1(keys, src) == [True] * 3
        # MLA's KV is the same on every TP rank (SGLang writes it from rank 0 only), so
        # every rank reads rank 0's pages.
        dst = other.alloc(3 * PAGE)
        assert rank1.batch_exists(keys) == 3
        assert rank1.batch_get_v1(keys, dst) == [True] * 3
        assert pages_bytes(other, dst) == stored
    finally:
        rank0.close()
        rank1.close()


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_direct_and_staged_transfers_store_the_same_blocks(
    shared_daemon: DaemonProcess, layout: str
) -> None:
    # A block is SGLang's flat data page whichever way it travelled: pages stored straight
    # from a shared-memory host pool load through staging into a private one, and back.
    shm_host, plain_host = mha_host_pool(layout, "shm"), mha_host_pool(layout, "default")
    direct = attach(shm_host, storage_config(shared_daemon.address))
    staged = attach(plain_host, storage_config(shared_daemon.address))
    try:
        assert (direct.mode, staged.mode) == ("direct", "staged")
        for writer, w_host, reader, r_host, tag in (
            (direct, shm_host, staged, plain_host, "d2s"),
            (staged, plain_host, direct, shm_host, "s2d"),
        ):
            keys = [f"same-{layout}-{tag}-{i}" for i in range(4)]
            src = w_host.alloc(4 * PAGE)
            stored = fill(w_host, src, seed=3)
            assert writer.batch_set_v1(keys, src) == [True] * 4
            dst = r_host.alloc(4 * PAGE)
            assert reader.batch_get_v1(keys, dst) == [True] * 4
            assert pages_bytes(r_host, dst) == stored
    finally:
        direct.close()
        staged.close()


def test_sglang_controller_backup_then_prefetch_with_its_own_page_hashes(
    shared_daemon: DaemonProcess,
) -> None:
    # SGLang's controller code computes the page hashes from token ids, writes back through
    # batch_set_v1 and prefetches through batch_exists + batch_get_v1.
    host = mha_host_pool("page_first")
    backend = attach(host, storage_config(shared_daemon.address))
    try:
        calls = ControllerCalls(backend, host)
        seq = tokens(6, seed=10)
        src = host.alloc(6 * PAGE)
        stored = fill(host, src, seed=4)
        assert calls.backup(seq, src) == 6 * PAGE

        # A request sharing the first 4 pages, then diverging.
        other = seq[: 4 * PAGE] + tokens(3, seed=11)
        hashes, hit_tokens = calls.hit_query(other)
        assert hit_tokens == 4 * PAGE and hashes == page_hashes(seq, PAGE)[:4]
        dst = host.alloc(7 * PAGE)
        assert calls.prefetch(other, dst) == 4
        assert pages_bytes(host, dst[: 4 * PAGE]) == stored[:4]
    finally:
        backend.close()


def test_sglang_controller_legacy_calls_round_trip(shared_daemon: DaemonProcess) -> None:
    # Without "interface_v1" SGLang's controller passes flat data pages (batch_set) and
    # fills dummy pages (batch_get); the backend stages them.
    host = mha_host_pool("layer_first")
    backend = attach(host, storage_config(shared_daemon.address, interface_v1=False))
    try:
        calls = ControllerCalls(backend, host, zero_copy=False)
        seq = tokens(3, seed=20)
        src = host.alloc(3 * PAGE)
        stored = fill(host, src, seed=5)
        assert calls.backup(seq, src) == 3 * PAGE
        dst = host.alloc(3 * PAGE)
        assert calls.prefetch(seq, dst) == 3
        assert pages_bytes(host, dst) == stored
        # The single-key calls.
        key = page_hashes(seq, PAGE)[0]
        assert backend.exists(key)
        page = backend.get(key, host.get_dummy_flat_data_page())
        assert page is not None
        assert bytes(page.view(torch.uint8).numpy()) == stored[0]
        assert backend.get("absent", host.get_dummy_flat_data_page()) is None
    finally:
        backend.close()


def test_batch_exists_is_the_present_prefix_in_one_lookup(shared_daemon: DaemonProcess) -> None:
    host = mha_host_pool("page_first_direct")
    backend = attach(host, storage_config(shared_daemon.address))
    try:
        keys = [f"prefix-{i}" for i in range(8)]
        src = host.alloc(8 * PAGE)
        fill(host, src, seed=6)
        # Pages 0..3 and 5..7 stored, page 4 not.
        assert backend.batch_set_v1(keys[:4], src[: 4 * PAGE]) == [True] * 4
        assert backend.batch_set_v1(keys[5:], src[5 * PAGE :]) == [True] * 3
        before = rpc_count(shared_daemon, "Lookup")
        assert backend.batch_exists(keys) == 4
        assert rpc_count(shared_daemon, "Lookup") == before + 1
        assert backend.batch_exists(keys[4:]) == 0
        assert backend.batch_exists(keys[5:]) == 3
        assert backend.batch_exists([]) == 0
        assert not backend.exists(keys[4]) and backend.exists(keys[0])
        # A load stops where the stored prefix stops: SGLang uses the leading run.
        dst = host.alloc(8 * PAGE)
        assert backend.batch_get_v1(keys, dst)[:5] == [True] * 4 + [False]
    finally:
        backend.close()


def test_a_store_continues_the_chain_sglang_passes(shared_daemon: DaemonProcess) -> None:
    # With hicache_storage_pass_prefix_keys SGLang passes the hashes before a batch; the
    # backend hands the daemon the chain's parent (the daemon evicts a chain from its leaf).
    host = mha_host_pool("page_first")
    backend = attach(host, storage_config(shared_daemon.address))
    try:
        keys = [f"chain-{i}" for i in range(4)]
        src = host.alloc(4 * PAGE)
        fill(host, src, seed=7)
        assert backend.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True, True]
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
        assert backend.batch_set_v1(keys[2:], src[2 * PAGE :], info) == [True, True]
        assert backend.batch_exists(keys) == 4
    finally:
        backend.close()


def test_another_process_reads_what_one_stored(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory()
    seq = tokens(5, seed=30)
    spec = {"address": daemon.address, "tokens": seq, "layout": "page_first", "seed": 8}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = subprocess.run(
        [sys.executable, str(HERE / "store_pages.py"), str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    written = json.loads(out.stdout.strip().splitlines()[-1])
    assert written["stored_tokens"] == 5 * PAGE and written["mode"] == "direct"

    # This process: another host pool (private memory: staged), a new backend, a new session.
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(daemon.address))
    try:
        calls = ControllerCalls(backend, host)
        dst = host.alloc(5 * PAGE)
        assert calls.prefetch(seq, dst) == 5
        assert [p.hex() for p in pages_bytes(host, dst)] == written["pages"]
    finally:
        backend.close()


def _sglang_running(model_dir: Path, **server_args: Any) -> Any:
    """SGLang's runtime context as its scheduler process publishes it (where the cache
    controller builds the backend), for a model run with these server arguments."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(model_dir), device="cpu", skip_tokenizer_init=True, **server_args
    )
    return use_context(create_context(args, role="scheduler"))


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


def _checkpoint(folder: Path, config: dict, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.bin").write_bytes(weights)
    return folder


def test_regression_fp8_caches_of_either_format_shared_blocks(
    shared_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """SGLang holds an FP8 KV cache as uint8 whichever format it is, so the host pool's
    dtype (the namespace's kv_dtype) was uint8 for e4m3 and e5m2 alike: an engine run with
    --kv-cache-dtype fp8_e4m3 found, and loaded, the pages one with fp8_e5m2 stored (a
    restart with the other format, say), every value decoded wrongly. The format is bound
    from SGLang's setting now; where it cannot be read, the engine stops at start unless
    namespace.extra binds it."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    seq = tokens(3, seed=53)
    engines = {}
    for fmt, dtype in (("fp8_e5m2", torch.float8_e5m2), ("fp8_e4m3", torch.float8_e4m3fn)):
        host = mha_host_pool("page_first", dtype=dtype)
        with _sglang_running(model_dir, kv_cache_dtype=fmt):
            backend = attach(host, storage_config(shared_daemon.address, model="fp8-model"))
        engines[fmt] = ControllerCalls(backend, host)
    e5m2, e4m3 = engines["fp8_e5m2"], engines["fp8_e4m3"]
    try:
        src = e5m2.storage_host_pool.alloc(3 * PAGE)
        fill(e5m2.storage_host_pool, src, seed=53)
        assert e5m2.backup(seq, src) == 3 * PAGE
        assert e5m2.hit_query(seq)[1] == 3 * PAGE
        assert e4m3.hit_query(seq)[1] == 0
    finally:
        e5m2.storage_backend.close()
        e4m3.storage_backend.close()
    fp8_host = mha_host_pool("page_first", dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        attach(fp8_host, storage_config(shared_daemon.address))
    bound = {"extra": "fp8_e5m2"}
    attach(fp8_host, storage_config(shared_daemon.address, namespace=bound)).close()


def test_regression_engines_whose_packed_drafts_differ_shared_blocks(
    shared_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """SGLang packs an MTP draft's layers into the KV host pool after the target's
    (HiCacheDraftMode.PACKED), so a stored page holds the draft's KV too; the namespace
    bound the layer count only, and an engine whose draft was another checkpoint of that
    shape found, and loaded, pages with KV its draft never computed. The draft is bound
    now (by its folder's last component and weight files: the same files at another path
    share blocks); a pool without packed draft layers keeps its namespace."""
    model_dir = _checkpoint(tmp_path / "model", TINY_LLAMA, b"target")
    draft_config = {**TINY_LLAMA, "num_hidden_layers": 1}
    drafts = {
        "a": _checkpoint(tmp_path / "one" / "mtp-draft", draft_config, b"draft a"),
        "a elsewhere": _checkpoint(tmp_path / "two" / "mtp-draft", draft_config, b"draft a"),
        "b": _checkpoint(tmp_path / "three" / "mtp-draft", draft_config, b"draft b"),
    }
    seq = tokens(3, seed=55)
    engines = {}
    for name, draft in drafts.items():
        host = mha_host_pool("page_first", draft_layers=1)
        with _sglang_running(
            model_dir, speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft)
        ):
            backend = attach(host, storage_config(shared_daemon.address, model="mtp-model"))
        engines[name] = ControllerCalls(backend, host)
    with _sglang_running(model_dir):
        plain = attach(mha_host_pool("page_first"), storage_config(shared_daemon.address))
    try:
        writer = engines["a"]
        src = writer.storage_host_pool.alloc(3 * PAGE)
        fill(writer.storage_host_pool, src, seed=55)
        assert writer.backup(seq, src) == 3 * PAGE
        assert engines["a elsewhere"].hit_query(seq)[1] == 3 * PAGE
        assert engines["b"].hit_query(seq)[1] == 0
        assert "draft=" in writer.storage_backend.namespace.extra
        assert "draft=" not in plain.namespace.extra
    finally:
        plain.close()
        for calls in engines.values():
            calls.storage_backend.close()
    # Without SGLang's settings the draft cannot be named: SGLang stops, unless
    # namespace.extra binds it.
    packed = mha_host_pool("page_first", draft_layers=1)
    with pytest.raises(ValueError, match="draft"):
        attach(packed, storage_config(shared_daemon.address))
    attach(packed, storage_config(shared_daemon.address, namespace={"extra": "d"})).close()


def test_regression_the_targets_own_folder_with_a_trailing_slash_was_another_draft(
    shared_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A draft whose weights are the target's own checkpoint (MTP layers bundled with it)
    is bound as ``target``; it was told from the model path by string, so the target's
    folder given with a trailing slash, or through a symlink, was taken for another draft
    folder: another namespace (its engines shared no block with those given the folder as
    the model path) and the target's weight files read a second time at start."""
    model_dir = _checkpoint(tmp_path / "model", TINY_LLAMA, b"target")
    (tmp_path / "link").symlink_to(model_dir)
    extras = []
    for draft in (model_dir, f"{model_dir}/", tmp_path / "link"):
        host = mha_host_pool("page_first", draft_layers=1)
        with _sglang_running(
            model_dir, speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft)
        ):
            backend = attach(host, storage_config(shared_daemon.address, model="mtp-model"))
        extras.append(backend.namespace.extra)
        backend.close()
    assert "draft=" in extras[0]
    assert extras[1] == extras[0] and extras[2] == extras[0]


def test_regression_a_drafts_own_host_pool_registered_later_is_refused(
    shared_daemon: DaemonProcess,
) -> None:
    """SGLang registers an EAGLE or standalone draft's own host pool (a sidecar) once the
    backend is attached (HybridCacheController.register_host_pool_entry), through
    register_mem_host_pool_v2 alone; the backend refused other pools only in
    on_host_pools_registered, so it accepted the draft's, and SGLang then sent every store
    and lookup through the v2 calls, which raised NotImplementedError. Refused now, when
    SGLang registers it (the engine stops at start)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    host = mha_host_pool("page_first")
    backend = attach(host, storage_config(shared_daemon.address))
    try:
        kv = PoolEntry(PoolName.KV, host, None, lambda layer: layer, is_primary_index_anchor=True)
        controller = SimpleNamespace(
            mem_pool_host=HostPoolGroup([kv]),
            extra_host_mem_release_queues={},
            enable_storage=True,
            storage_backend=backend,
        )
        backend.register_mem_host_pool_v2(host, PoolName.KV)  # the KV pool's entry: accepted
        draft = PoolEntry(PoolName.DRAFT, mha_host_pool("page_first"), None, lambda x: x)
        with pytest.raises(ValueError, match="'draft'") as refused:
            HybridCacheController.register_host_pool_entry(controller, draft)
        # The refusal says how to start: another draft, no speculation, or no kvtier.
        assert "MTP draft" in str(refused.value)
        assert "without speculative decoding" in str(refused.value)
        assert "--hicache-storage-backend" in str(refused.value)
    finally:
        backend.close()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "another-model"},
        {"dtype": torch.bfloat16},
        {"layout": "layer_first"},
        {"tp_rank": 1, "tp_size": 2},
        {"page": 8},
        {"heads": 4},
        {"tenant": "other"},
        {"revision": "v2"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_another_namespace_never_matches(shared_daemon: DaemonProcess, change: dict) -> None:
    seq = tokens(4, seed=40)
    host = mha_host_pool("page_first")
    backend = attach(host, storage_config(shared_daemon.address, model="ns-model"))
    pool_args = {k: change[k] for k in ("dtype", "page", "heads") if k in change}
    other_host = mha_host_pool(change.get("layout", "page_first"), **pool_args)
    config_args = {k: change[k] for k in ("tp_rank", "tp_size") if k in change}
    namespace = {k: change[k] for k in ("tenant", "revision") if k in change}
    other = attach(
        other_host,
        storage_config(
            shared_daemon.address,
            model=change.get("model", "ns-model"),
            namespace=namespace,
            **config_args,
        ),
    )
    try:
        src = host.alloc(4 * PAGE)
        fill(host, src, seed=9)
        assert ControllerCalls(backend, host).backup(seq, src) == 4 * PAGE
        # The same SGLang page hashes, under another namespace: nothing matches.
        other_calls = ControllerCalls(other, other_host)
        assert (
            other_calls.hit_query(seq[: len(seq) // other_host.page_size * other_host.page_size])[1]
            == 0
        )
        keys = page_hashes(seq, PAGE)
        assert other.batch_exists(keys) == 0
        if other_host.page_size == PAGE:
            assert other.batch_get_v1(keys, other_host.alloc(4 * PAGE)) == [False] * 4
        # The writer's own namespace still holds them.
        assert backend.batch_exists(keys) == 4
    finally:
        backend.close()
        other.close()


def test_a_down_daemon_is_a_miss_never_an_error(tmp_path: Path) -> None:
    host = mha_host_pool("page_first")
    config = storage_config(f"unix:{tmp_path}/absent.sock", retry_after_s=60)
    backend = attach(host, config)  # the daemon is not contacted at start
    try:
        keys = ["a", "b"]
        idx = host.alloc(2 * PAGE)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, idx) == [False, False]
        assert backend.batch_get_v1(keys, idx) == [False, False]
        assert backend.batch_get(keys, [host.get_dummy_flat_data_page()] * 2) == [None, None]
        assert backend.batch_set(keys, [host.get_data_page(int(idx[0]))] * 2) is False
        assert not backend.exists("a") and backend.get("a") is None
        # The first failure opened the breaker: the rest never reached for the daemon.
        assert backend.counters["failures"] == 1 and backend.counters["skipped"] >= 5
        assert backend.breaker.trips == 1
    finally:
        backend.close()


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_a_hung_daemon_costs_one_bounded_wait_then_misses(
    daemon_factory: DaemonFactory, allocator: str
) -> None:
    daemon = daemon_factory()
    host = mha_host_pool("page_first", allocator)
    options = {
        "lookup_timeout_s": 0.5,
        "io_timeout_s": 1.0,
        "retry_after_s": 0.5,
        "late_copy_grace_s": 0.2,
    }
    backend = attach(host, storage_config(daemon.address, **options))
    assert daemon.proc is not None
    try:
        keys = [f"hung-{allocator}-{i}" for i in range(3)]
        src = host.alloc(3 * PAGE)
        stored = fill(host, src, seed=11)
        assert backend.batch_set_v1(keys, src) == [True] * 3  # session and pool set up
        staging = backend._staging

        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert backend.batch_get_v1(keys, host.alloc(3 * PAGE)) == [False] * 3
            assert backend.batch_exists(keys) == 0
            assert backend.batch_set_v1(keys, src) == [False] * 3
            elapsed = time.monotonic() - t0
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        # One transfer timeout, then the breaker answers at once (bounded, not a speed
        # claim: generous for a loaded machine).
        assert elapsed < options["io_timeout_s"] + options["late_copy_grace_s"] + 5.0
        assert backend.counters["failures"] == 1 and backend.counters["skipped"] == 2
        if allocator == "default":
            # The daemon may still copy into that staging pool: it takes no more transfers.
            assert staging is not None and staging.retired

        # Once the pause has passed, kvtier is asked again and answers.
        time.sleep(options["retry_after_s"])
        deadline = time.monotonic() + 30
        while backend.batch_exists(keys) != 3:
            assert time.monotonic() < deadline, "the backend never recovered"
            time.sleep(options["retry_after_s"])
        dst = host.alloc(3 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert pages_bytes(host, dst) == stored
        if allocator == "default":
            assert backend._staging is not staging and not backend._staging.retired
    finally:
        backend.close()


def _said_once(caplog: pytest.LogCaptureFixture, *named: str) -> None:
    """One ERROR, naming each of ``named``, and no WARNING: a refusal is said once."""
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    for name in named:
        assert name in errors[0], name
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def _backs_off(
    backend: Any,
    daemon: DaemonProcess,
    clock: Clock,
    keys: list[str],
    pages: Any,
    registrations: int,
    counter: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a first refusal at ``registrations + 1`` RegisterPools: the next try comes
    retry_after_s (0.01 s of ``clock``) after it, the one after that twice as late, each
    refused quietly (``counter`` counts them; still one ERROR)."""
    clock.now += 0.015
    assert backend.batch_set_v1(keys, pages) == [False] * 3
    assert rpc_count(daemon, "RegisterPool") == registrations + 2
    clock.now += 0.015  # 0.015 s since that try: short of twice retry_after_s
    assert backend.batch_set_v1(keys, pages) == [False] * 3
    assert rpc_count(daemon, "RegisterPool") == registrations + 2
    assert backend.counters[counter] == 2
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_a_staging_pool_the_daemon_refuses_is_said_once_and_tried_again_backing_off(
    daemon_factory: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the daemon refused the staging pool (the tenant's pool bytes taken), and
    the backend paused for retry_after_s, then made a new pool (a region of staging_bytes)
    at its next call, and again after every pause, warning each time. Now: one ERROR naming
    the daemon's key and the backend's staging_bytes; no new pool (RegisterPool) until the
    back-off ends (retry_after_s, then twice that...); meanwhile lookups answer 0 without a
    Lookup (every transfer is staged: no hit that no load could fill) and the breaker stays
    closed (the daemon answers); once the tenant has room, the next try takes the pool."""
    daemon = daemon_factory("server.max_pool_bytes_per_tenant=262144")
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.01))
    clock = Clock()
    backend.refusals = RegistrationRefusals(0.01, clock=clock)
    pool_bytes = 256 * host.get_dummy_flat_data_page().numel() * 2  # 196,608: 256 pages
    keys = [f"refused-{i}" for i in range(3)]
    src = host.alloc(3 * PAGE)
    stored = fill(host, src, seed=13)
    try:
        with daemon.client() as holder, SharedMemoryPool(128 << 10) as shm:
            # 128 KiB of the tenant's 256 KiB held: the backend's 192 KiB pool does not fit.
            held = holder.register_pool(shm, layer_major_layout(1, 128, PAGE, 1024, "float32"))
            caplog.set_level(logging.INFO, logger="kvtier")
            registrations = rpc_count(daemon, "RegisterPool")
            lookups = rpc_count(daemon, "Lookup")
            for _ in range(5):
                assert backend.batch_set_v1(keys, src) == [False] * 3
                assert backend.batch_exists(keys) == 0
                time.sleep(0.02)  # past retry_after_s: each pause's end made a new pool
            assert rpc_count(daemon, "RegisterPool") == registrations + 1
            assert rpc_count(daemon, "Lookup") == lookups
            _said_once(
                caplog,
                "server.max_pool_bytes_per_tenant",
                f"staging pool of {pool_bytes} bytes",
                "staging_bytes=268435456",
                "ResourceExhaustedError",
                "kvtier is off for this rank",
            )
            assert backend.counters["staging_refusals"] == 1
            assert backend.counters["failures"] == 0 and backend.breaker.trips == 0

            _backs_off(backend, daemon, clock, keys, src, registrations, "staging_refusals", caplog)
            holder.unregister_pool(held.binding.pool_id)

        deadline = time.monotonic() + 30
        while backend.batch_set_v1(keys, src) != [True] * 3:
            assert time.monotonic() < deadline, "the pool was never taken"
            clock.now += 3600.0
            time.sleep(0.05)
        assert "the daemon took the staging pool after" in caplog.text
        assert backend.batch_exists(keys) == 3
        dst = host.alloc(3 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert pages_bytes(host, dst) == stored
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()


def test_a_host_pool_the_daemon_refuses_is_said_once_and_tried_again_backing_off(
    daemon_factory: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: in zero-copy mode the daemon refused SGLang's host pool itself (the
    tenant's server.max_pool_bytes_per_tenant below what it needs), and the breaker tripped,
    warned and registered the pool again after every retry_after_s pause, while lookups
    went on offering hits that every load then missed. Now: one ERROR naming the daemon's
    key, the pool's size and what the operator can change (it is not switched to staged
    transfers behind their back); no registration until the back-off ends; meanwhile
    lookups answer 0 without a Lookup and the breaker stays closed (the daemon answers);
    once the tenant has room, the next try takes the pool and zero-copy transfers work."""
    daemon = daemon_factory("server.max_pool_bytes_per_tenant=262144")
    # Another engine (staged, a 4-page staging pool) stores the pages the refused one asks for.
    writer_host = mha_host_pool("page_first", "default")
    page_bytes = writer_host.get_dummy_flat_data_page().numel() * 2
    writer = attach(writer_host, storage_config(daemon.address, staging_bytes=4 * page_bytes))
    host = mha_host_pool("page_first", "shm")
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.01))
    clock = Clock()
    backend.host_pool_refusals = RegistrationRefusals(0.01, clock=clock)
    keys = [f"host-refused-{i}" for i in range(3)]
    try:
        assert backend.mode == "direct"
        assert backend._direct_shm is not None
        host_bytes = backend._direct_shm.size_bytes  # its memory file (102,400 bytes here)
        wsrc = writer_host.alloc(3 * PAGE)
        stored = fill(writer_host, wsrc, seed=17)
        assert writer.batch_set_v1(keys, wsrc) == [True] * 3
        dst = host.alloc(3 * PAGE)
        with daemon.client() as holder, SharedMemoryPool(192 << 10) as shm:
            # 192 KiB of the tenant's 256 KiB held (and the writer's pool): no room for it.
            held = holder.register_pool(shm, layer_major_layout(1, 192, PAGE, 1024, "float32"))
            caplog.set_level(logging.INFO, logger="kvtier")
            registrations = rpc_count(daemon, "RegisterPool")
            lookups = rpc_count(daemon, "Lookup")
            assert backend.batch_get_v1(keys, dst) == [False] * 3
            for _ in range(5):
                time.sleep(0.02)  # past retry_after_s: each pause's end registered it again
                assert backend.batch_exists(keys) == 0  # not the writer's 3: no load fills them
                assert backend.batch_get_v1(keys, dst) == [False] * 3
                assert backend.batch_set_v1(keys, dst) == [False] * 3
            assert rpc_count(daemon, "RegisterPool") == registrations + 1
            assert rpc_count(daemon, "Lookup") == lookups
            _said_once(
                caplog,
                "server.max_pool_bytes_per_tenant",
                f"host pool of {host_bytes} bytes",
                "ResourceExhaustedError",
                "kvtier is off for this rank",
                "does not switch to staged transfers",
                '"register_host_pool": false',
                "--hicache-ratio",
            )
            assert backend.counters["host_pool_refusals"] == 1
            assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
            assert backend.mode == "direct" and backend._staging is None

            _backs_off(
                backend, daemon, clock, keys, dst, registrations, "host_pool_refusals", caplog
            )
            holder.unregister_pool(held.binding.pool_id)

        deadline = time.monotonic() + 30
        while backend.batch_get_v1(keys, dst) != [True] * 3:
            assert time.monotonic() < deadline, "the host pool was never taken"
            clock.now += 3600.0
            time.sleep(0.05)
        assert pages_bytes(host, dst) == stored
        assert "the daemon took SGLang's host pool after" in caplog.text
        assert backend.batch_exists(keys) == 3
        more = [f"host-refused-more-{i}" for i in range(2)]
        src = host.alloc(2 * PAGE)
        fill(host, src, seed=18)
        assert backend.batch_set_v1(more, src) == [True] * 2
        assert writer.batch_exists(more) == 2
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
        assert backend.mode == "direct" and backend._staging is None
    finally:
        backend.close()
        writer.close()


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_a_lookup_once_a_refusals_back_off_ends_offers_no_hit_the_next_load_misses(
    daemon_factory: DaemonFactory, allocator: str
) -> None:
    """Regression: once a refusal's back-off was due, lookups offered hits again before any
    transfer had tried the registration: the daemon, refusing the pool again, made the load
    that followed miss every page it had offered. Now a lookup whose loads' pool (SGLang's
    host pool in zero-copy mode, else the staging pool) was refused tries that registration
    first: refused again, it answers 0 and the back-off doubles; taken, it answers the hit,
    which the load then fills without another registration. (Answering 0 until a
    transfer tried it instead would leave a rank that stores nothing, an MLA replica, off
    for good: SGLang offers it no load without a hit.)"""
    daemon = daemon_factory("server.max_pool_bytes_per_tenant=262144")
    writer_host = mha_host_pool("page_first", "default")
    page_bytes = writer_host.get_dummy_flat_data_page().numel() * 2
    writer = attach(writer_host, storage_config(daemon.address, staging_bytes=4 * page_bytes))
    host = mha_host_pool("page_first", allocator)
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.01))
    clock = Clock()
    backend.refusals = RegistrationRefusals(0.01, clock=clock)
    backend.host_pool_refusals = RegistrationRefusals(0.01, clock=clock)
    counter = "host_pool_refusals" if allocator == "shm" else "staging_refusals"
    keys = [f"lookup-after-back-off-{allocator}-{i}" for i in range(3)]
    try:
        wsrc = writer_host.alloc(3 * PAGE)
        stored = fill(writer_host, wsrc, seed=29)
        assert writer.batch_set_v1(keys, wsrc) == [True] * 3
        dst = host.alloc(3 * PAGE)
        with daemon.client() as holder, SharedMemoryPool(192 << 10) as shm:
            # 192 KiB of the tenant's 256 KiB held: no room for the host or staging pool.
            held = holder.register_pool(shm, layer_major_layout(1, 192, PAGE, 1024, "float32"))
            assert backend.batch_get_v1(keys, dst) == [False] * 3
            assert backend.counters[counter] == 1
            registrations = rpc_count(daemon, "RegisterPool")

            clock.now += 0.015  # the back-off is due; the daemon still refuses the pool
            assert backend.batch_exists(keys) == 0
            assert rpc_count(daemon, "RegisterPool") == registrations + 1
            assert backend.counters[counter] == 2
            assert backend.batch_get_v1(keys, dst) == [False] * 3  # backing off: not asked
            assert rpc_count(daemon, "RegisterPool") == registrations + 1
            holder.unregister_pool(held.binding.pool_id)

        clock.now += 3600.0
        assert backend.batch_exists(keys) == 3
        assert rpc_count(daemon, "RegisterPool") == registrations + 2
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert rpc_count(daemon, "RegisterPool") == registrations + 2
        assert pages_bytes(host, dst) == stored
        assert backend.counters[counter] == 2
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()
        writer.close()


def _restarted_with_less_room(
    daemon: DaemonProcess,
    backend: Any,
    host: Any,
    keys: list[str],
    counter: str,
    caplog: pytest.LogCaptureFixture,
) -> tuple[list[str], Any]:
    """Restart ``daemon`` (its blocks kept in L2) with a tenant's pool bytes below the
    backend's pool: three loads and lookups of ``keys`` then miss without a Lookup, the pool's
    one registration in the new session refused (one ERROR naming the limit, counted in
    ``counter``), the breaker untouched. Returns the daemon's overrides from before, and
    the host pages the loads used."""
    overrides = list(daemon.overrides)
    daemon.overrides += ["--set", "server.max_pool_bytes_per_tenant=65536"]
    daemon.restart()
    caplog.set_level(logging.INFO, logger="kvtier")
    registrations = rpc_count(daemon, "RegisterPool")
    lookups = rpc_count(daemon, "Lookup")
    dst = host.alloc(3 * PAGE)
    for _ in range(3):
        assert backend.batch_get_v1(keys, dst) == [False] * 3
        assert backend.batch_exists(keys) == 0
        time.sleep(0.02)  # past retry_after_s
    assert rpc_count(daemon, "RegisterPool") == registrations + 1
    assert rpc_count(daemon, "Lookup") == lookups
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "server.max_pool_bytes_per_tenant" in errors[0]
    assert backend.counters[counter] == 1
    assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    return overrides, dst


def test_a_host_pool_refused_when_registered_again_after_a_restart_backs_off_too(
    daemon_factory: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the host pool was registered, then the daemon restarted with a limit
    below it, and its registration again in the new session (the client's, at the next
    transfer) tripped the breaker and was tried again every retry_after_s, as the first
    registration's refusal was. Now it is the same refusal: said once, backing off, lookups
    answering 0 meanwhile; once the daemon allows the pool again, zero copy resumes."""
    daemon = daemon_factory("tiers.l2.enabled=true", "tiers.l2.capacity_bytes=64MiB")
    host = mha_host_pool("page_first", "shm")
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.01))
    clock = Clock()
    backend.host_pool_refusals = RegistrationRefusals(0.01, clock=clock)
    keys = [f"host-refused-restart-{i}" for i in range(3)]
    try:
        src = host.alloc(3 * PAGE)
        stored = fill(host, src, seed=19)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        overrides, dst = _restarted_with_less_room(
            daemon, backend, host, keys, "host_pool_refusals", caplog
        )

        daemon.overrides = overrides
        daemon.restart()
        clock.now += 3600.0
        assert backend.batch_exists(keys) == 3
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert pages_bytes(host, dst) == stored
        assert "the daemon took SGLang's host pool after 1 refusals" in caplog.text
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_a_new_host_pool_is_registered_at_once_after_the_old_ones_refusal(
    daemon_factory: DaemonFactory, allocator: str
) -> None:
    """Regression: ``register_mem_pool_host`` called again, with a new host pool, kept the
    refusals of the old one's registrations (its host pool in zero-copy mode, its staging
    pool otherwise): the new pool was not registered until the old refusal's back-off
    ended, and its transfers and lookups missed meanwhile. A refusal is of the pool it
    refused: the new pool is registered at its first transfer."""
    daemon = daemon_factory("server.max_pool_bytes_per_tenant=262144")
    host = mha_host_pool("page_first", allocator)
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.01))
    clock = Clock()  # never moved: the old refusal's back-off runs throughout
    backend.refusals = RegistrationRefusals(0.01, clock=clock)
    backend.host_pool_refusals = RegistrationRefusals(0.01, clock=clock)
    counter = "host_pool_refusals" if allocator == "shm" else "staging_refusals"
    keys = [f"new-host-pool-{allocator}-{i}" for i in range(3)]
    try:
        with daemon.client() as holder, SharedMemoryPool(192 << 10) as shm:
            # 192 KiB of the tenant's 256 KiB held: no room for the host or staging pool.
            held = holder.register_pool(shm, layer_major_layout(1, 192, PAGE, 1024, "float32"))
            assert backend.batch_set_v1(keys, host.alloc(3 * PAGE)) == [False] * 3
            assert backend.counters[counter] == 1
            holder.unregister_pool(held.binding.pool_id)

        new_host = mha_host_pool("page_first", allocator)
        backend.register_mem_pool_host(new_host)
        registrations = rpc_count(daemon, "RegisterPool")
        src = new_host.alloc(3 * PAGE)
        stored = fill(new_host, src, seed=25)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        assert rpc_count(daemon, "RegisterPool") == registrations + 1
        assert backend.batch_exists(keys) == 3
        dst = new_host.alloc(3 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert pages_bytes(new_host, dst) == stored
        assert backend.counters[counter] == 1
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()


def _store_held_in_its_copy(backend: Any, host: Any, keys: list[str], src: Any) -> Any:
    """Start a staged store of ``keys`` on another thread, held while it copies its first
    page into the staging pool. Returns (go_on, the thread, its results)."""
    copying, go_on = threading.Event(), threading.Event()
    page_of = host.get_data_page

    def held_page(start: int, flat: bool = True) -> torch.Tensor:
        if not copying.is_set():
            copying.set()
            assert go_on.wait(60)
        return page_of(start, flat=flat)

    host.get_data_page = held_page
    stored: list[list[bool]] = []
    storer = threading.Thread(target=lambda: stored.append(backend.batch_set_v1(keys, src)))
    storer.start()
    assert copying.wait(60)
    return go_on, storer, stored


def test_closing_the_backend_during_a_staged_copy_is_a_miss_not_a_crash(
    shared_daemon: DaemonProcess,
) -> None:
    """Regression: ``close()`` unmapped the staging pool while a store on another SGLang
    thread was copying a page into it: the copy wrote into unmapped memory and the engine
    died (SIGSEGV). The pool is retired instead, unmapped once the transfers holding it
    have ended; the store misses."""
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(shared_daemon.address))
    src = host.alloc(PAGE)
    fill(host, src, seed=26)
    assert backend.batch_set_v1(["closed-mid-copy-0"], src) == [True]
    staging = backend._staging
    assert staging is not None
    go_on, storer, stored = _store_held_in_its_copy(backend, host, ["closed-mid-copy-1"], src)
    try:
        backend.close()
        assert not staging.closed  # the store holds a page
    finally:
        go_on.set()
        storer.join(60)
    assert stored == [[False]]
    assert staging.closed


def test_a_transfer_of_the_old_host_pool_does_not_hold_back_the_new_ones_staging_pool(
    shared_daemon: DaemonProcess,
) -> None:
    """Regression: a staged store was copying a page into the staging pool when
    ``register_mem_pool_host`` registered a new host pool and unmapped the old staging
    pool: the copy crashed the engine (SIGSEGV), and, had it not, the store's Put would
    have registered the unmapped pool again, been refused it as closed, and counted that
    as the daemon's refusal of the staging pool, holding back the new host pool's. Now the
    old pool is retired: the store ends with the page it copied, and the new host pool's
    first transfer makes a staging pool of its own."""
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(shared_daemon.address))
    keys = [f"old-host-pool-transfer-{i}" for i in range(2)]
    try:
        src = host.alloc(2 * PAGE)
        fill(host, src, seed=27)
        assert backend.batch_set_v1(keys[:1], src[:PAGE]) == [True]
        old = backend._staging
        assert old is not None
        go_on, storer, stored = _store_held_in_its_copy(backend, host, keys[1:], src[PAGE:])
        new_host = mha_host_pool("page_first", "default")
        try:
            backend.register_mem_pool_host(new_host)
            assert not old.closed  # the store holds a page
        finally:
            go_on.set()
            storer.join(60)
        assert stored == [[True]]
        assert old.closed
        assert backend.counters["staging_refusals"] == 0
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0

        more = [f"old-host-pool-transfer-more-{i}" for i in range(2)]
        new_src = new_host.alloc(2 * PAGE)
        written = fill(new_host, new_src, seed=28)
        assert backend.batch_set_v1(more, new_src) == [True] * 2
        assert backend._staging is not None and backend._staging is not old
        dst = new_host.alloc(2 * PAGE)
        assert backend.batch_get_v1(more, dst) == [True] * 2
        assert pages_bytes(new_host, dst) == written
    finally:
        backend.close()


def test_a_zero_copy_transfer_of_the_old_host_pool_is_a_miss_not_a_pause(
    shared_daemon: DaemonProcess,
) -> None:
    """Regression: a zero-copy store had its host pool's id when ``register_mem_pool_host``
    registered a new host pool and unregistered the old one; its Put then named a pool the
    daemon no longer had (NOT_FOUND), which the backend took for a failing daemon and
    tripped the breaker: the new host pool, and kvtier, went unused for ``retry_after_s``.
    A transfer whose host pool was replaced meanwhile misses, as one of a retired staging
    pool does, and the new host pool's first transfer stores."""
    host = mha_host_pool("page_first", "shm")
    backend = attach(host, storage_config(shared_daemon.address))
    assert backend.mode == "direct"
    src = host.alloc(PAGE)
    fill(host, src, seed=30)
    named, go_on = threading.Event(), threading.Event()
    put = backend._put

    def held_put(pool_id: int, *args: Any, **kwargs: Any) -> tuple[list[bool], bool]:
        named.set()
        assert go_on.wait(60)
        return put(pool_id, *args, **kwargs)

    backend._put = held_put
    stored: list[list[bool]] = []
    storer = threading.Thread(
        target=lambda: stored.append(backend.batch_set_v1(["replaced-mid-put-0"], src))
    )
    try:
        storer.start()
        assert named.wait(60)
        unregistered = rpc_count(shared_daemon, "UnregisterPool")
        new_host = mha_host_pool("page_first", "shm")
        try:
            backend.register_mem_pool_host(new_host)
            deadline = time.monotonic() + 60
            while rpc_count(shared_daemon, "UnregisterPool") == unregistered:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            go_on.set()
            storer.join(60)
        assert stored == [[False]]
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
        backend._put = put
        new_src = new_host.alloc(PAGE)
        written = fill(new_host, new_src, seed=31)
        assert backend.batch_set_v1(["replaced-mid-put-1"], new_src) == [True]
        dst = new_host.alloc(PAGE)
        assert backend.batch_get_v1(["replaced-mid-put-1"], dst) == [True]
        assert pages_bytes(new_host, dst) == written
    finally:
        backend.close()


def test_threads_that_register_the_host_pool_again_at_once_ask_the_daemon_once(
    daemon_factory: DaemonFactory,
) -> None:
    """Regression: after a daemon restart with a limit below SGLang's host pool, two SGLang
    threads (prefetch and backup) that found it not registered in the new session each
    registered it: the second RegisterPool, made while the first was under way, was refused
    again and counted as a second refusal, doubling the back-off before the next try (one
    more per thread). Now one thread registers it again and the others wait for its answer:
    one RegisterPool, one refusal, both transfers missing without a failure."""
    daemon = daemon_factory("tiers.l2.enabled=true", "tiers.l2.capacity_bytes=64MiB")
    host = mha_host_pool("page_first", "shm")
    backend = attach(host, storage_config(daemon.address, io_timeout_s=30.0))
    keys = [f"host-again-at-once-{i}" for i in range(2)]
    try:
        src = host.alloc(2 * PAGE)
        fill(host, src, seed=24)
        assert backend.batch_set_v1(keys, src) == [True] * 2
        daemon.overrides += ["--set", "server.max_pool_bytes_per_tenant=65536"]
        daemon.restart()  # no session, and no room for the host pool
        assert daemon.proc is not None
        results: list[list[bool]] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(backend.batch_get_v1(keys, host.alloc(2 * PAGE)))
            )
            for _ in range(2)
        ]
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # both registrations are under way at once
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while not all(_registering(t) for t in threads):
                assert time.monotonic() < deadline, "the threads never registered the pool"
                time.sleep(0.01)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(60)
        assert results == [[False, False]] * 2
        assert rpc_count(daemon, "RegisterPool") == 1
        assert backend.counters["host_pool_refusals"] == 1
        assert backend.host_pool_refusals.count == 1
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()


def _registering(thread: threading.Thread) -> bool:
    """Whether ``thread`` is in the backend's registration of its host pool (waiting for the
    daemon, or for another thread doing so)."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name in ("pool_id_of", "_host_pool_id"):
            return True
        frame = frame.f_back
    return False


def test_a_busy_staging_pool_is_a_miss_not_a_daemon_that_does_not_answer(
    shared_daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a transfer that waited io_timeout_s for the staging pool (both halves
    held by two other transfers, e.g. long ones to a slow daemon) counted as a daemon that
    did not answer: it tripped the breaker, which probed the daemon and turned SGLang's
    calls away meanwhile. A busy local pool is a miss counted apart (staging_busy), warned
    once; the daemon answers, so the next call goes through. (The vLLM connector likewise
    fails a load that finds no free staging page without pausing.)"""
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(shared_daemon.address, io_timeout_s=1.0))
    caplog.set_level(logging.INFO, logger="kvtier")
    try:
        keys = [f"busy-{i}" for i in range(2)]
        src = host.alloc(2 * PAGE)
        stored = fill(host, src, seed=14)
        dst = host.alloc(2 * PAGE)
        with backend._staging_half(), backend._staging_half():  # two transfers hold it
            assert backend.batch_set_v1(keys, src) == [False, False]
            assert backend.batch_get_v1(keys, dst) == [False, False]
        assert backend.breaker.trips == 0 and backend.breaker.ok()
        assert backend.counters["staging_busy"] == 2 and backend.counters["failures"] == 0
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "staging pool stayed busy" in warnings[0]

        assert backend.batch_set_v1(keys, src) == [True, True]
        assert backend.batch_exists(keys) == 2
        assert backend.batch_get_v1(keys, dst) == [True, True]
        assert pages_bytes(host, dst) == stored
        assert backend.counters["skipped"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_sglang_threads_share_one_backend(shared_daemon: DaemonProcess, allocator: str) -> None:
    # SGLang's prefetch, prefetch-I/O and backup threads call one backend at once. A staging
    # pool of 4 pages makes every staged call take turns and split into 2-page pieces.
    host = mha_host_pool("page_first_direct", allocator)
    page_bytes = host.get_dummy_flat_data_page().numel() * 2
    backend = attach(host, storage_config(shared_daemon.address, staging_bytes=4 * page_bytes))
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for round_ in range(6):
                keys = [f"threads-{allocator}-{w}-{round_}-{i}" for i in range(5)]
                src = host.alloc(5 * PAGE)
                stored = fill(host, src, seed=100 * w + round_)
                assert backend.batch_set_v1(keys, src) == [True] * 5
                assert backend.batch_exists(keys) == 5
                dst = host.alloc(5 * PAGE)
                assert backend.batch_get_v1(keys, dst) == [True] * 5
                assert pages_bytes(host, dst) == stored
                host.free(src)
                host.free(dst)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        assert backend.counters["failures"] == 0 and backend.counters["pages_loaded"] == 90
    finally:
        backend.close()


def test_blocks_survive_a_daemon_restart_and_the_host_pool_is_registered_again(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory("tiers.l2.enabled=true", "tiers.l2.capacity_bytes=64MiB")
    host = mha_host_pool("page_first_direct")
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.2))
    try:
        keys = [f"restart-{i}" for i in range(4)]
        src = host.alloc(4 * PAGE)
        stored = fill(host, src, seed=12)
        assert backend.batch_set_v1(keys, src) == [True] * 4
        daemon.restart()  # SIGTERM flushes L1 to L2; the new daemon has no session or pool

        deadline = time.monotonic() + 30
        while backend.batch_exists(keys) != 4:
            assert time.monotonic() < deadline, "the backend never found its blocks again"
            time.sleep(0.2)
        dst = host.alloc(4 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        assert pages_bytes(host, dst) == stored
        assert backend.mode == "direct"
        with daemon.client() as c:
            assert c.stats().gauges["pools"] == 1  # the host pool, registered again
    finally:
        backend.close()


@pytest.mark.parametrize("tiers", ["l2", "l1"])
def test_a_staged_backend_registers_its_staging_pool_again_after_a_daemon_restart(
    daemon_factory: DaemonFactory, tiers: str
) -> None:
    """Guards the staged path across a daemon restart, as the vLLM worker's is guarded: the
    new daemon has no session and no pool, and the same backend object's next transfers
    register its staging pool again in a new session and go through, without a failure or
    a pause. On the same L2 the pages stored before load back byte for byte; with L1 only
    they are gone (a miss, not a failure). Either way a store after the restart loads."""
    overrides = ["tiers.l2.enabled=true", "tiers.l2.capacity_bytes=64MiB"] if tiers == "l2" else []
    daemon = daemon_factory(*overrides)
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.2))
    try:
        assert backend.mode == "staged"
        before = [f"staged-restart-{tiers}-{i}" for i in range(4)]
        src = host.alloc(4 * PAGE)
        stored = fill(host, src, seed=15)
        assert backend.batch_set_v1(before, src) == [True] * 4
        staging = backend._staging
        assert staging is not None and staging.registered()
        daemon.restart()  # SIGTERM (L1 flushed to L2 when there is one); no session or pool

        dst = host.alloc(4 * PAGE)
        if tiers == "l2":
            assert backend.batch_exists(before) == 4
            assert backend.batch_get_v1(before, dst) == [True] * 4
            assert pages_bytes(host, dst) == stored
        else:
            assert backend.batch_exists(before) == 0
            assert backend.batch_get_v1(before, dst) == [False] * 4
        after = [f"staged-restart-{tiers}-after-{i}" for i in range(4)]
        src2 = host.alloc(4 * PAGE)
        stored2 = fill(host, src2, seed=16)
        assert backend.batch_set_v1(after, src2) == [True] * 4
        assert backend.batch_exists(after) == 4
        dst2 = host.alloc(4 * PAGE)
        assert backend.batch_get_v1(after, dst2) == [True] * 4
        assert pages_bytes(host, dst2) == stored2
        # SGLang's legacy calls (no "interface_v1") go through the same staging pool.
        legacy = [f"staged-restart-{tiers}-legacy-{i}" for i in range(2)]
        values = [host.get_data_page(start, flat=True) for start in page_starts(host, src2)[:2]]
        assert backend.batch_set(legacy, values) is True
        got = backend.batch_get(legacy)
        assert [bytes(t.contiguous().view(torch.uint8).numpy()) for t in got] == stored2[:2]
        assert backend._staging is staging and staging.registered()
        with daemon.client() as c:
            assert c.stats().gauges["pools"] == 1  # the staging pool, registered again
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
        assert backend.counters["skipped"] == 0
    finally:
        backend.close()


def test_a_staging_pool_refused_when_registered_again_after_a_restart_backs_off_too(
    daemon_factory: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the staging pool was registered, then the daemon restarted with a limit
    below it, and its registration again in the new session (the client's, at the next
    staged transfer) tripped the breaker and was tried again every retry_after_s. Now it
    is the refusal a new staging pool gets: said once, the pool's memory given back, tries
    backing off, lookups answering 0 meanwhile (every transfer is staged); once the daemon
    allows the pool again, a new one is made and staged transfers resume."""
    daemon = daemon_factory("tiers.l2.enabled=true", "tiers.l2.capacity_bytes=64MiB")
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(daemon.address, retry_after_s=0.01))
    clock = Clock()
    backend.refusals = RegistrationRefusals(0.01, clock=clock)
    keys = [f"staging-refused-restart-{i}" for i in range(3)]
    try:
        src = host.alloc(3 * PAGE)
        stored = fill(host, src, seed=20)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        staging = backend._staging
        assert staging is not None
        overrides, dst = _restarted_with_less_room(
            daemon, backend, host, keys, "staging_refusals", caplog
        )
        assert staging.closed  # its memory given back, not held while refused
        # Said once, as the ERROR: no WARNING that its retirement makes "a fresh one replace
        # it" (none does while the refusal stands).
        staging_log = "kvtier.client.integrations.staging"
        said = [r.getMessage() for r in caplog.records if r.name == staging_log]
        assert not [r for r in caplog.records if r.name == staging_log and r.levelno > logging.INFO]
        assert said and "retired" in said[0]

        daemon.overrides = overrides
        daemon.restart()
        clock.now += 3600.0
        assert backend.batch_exists(keys) == 3
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert pages_bytes(host, dst) == stored
        assert "the daemon took the staging pool after 1 refusals" in caplog.text
        assert backend._staging is not staging
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()


def test_a_transfer_between_chunks_when_another_finds_the_staging_pool_refused_is_a_miss(
    daemon_factory: DaemonFactory,
) -> None:
    """Regression: two SGLang threads share the staging pool; after a daemon restart with a
    limit below it, one thread's transfer found it refused (registered again in the new
    session) and retired it while the other was between two chunks of a longer load. That
    one's next chunk found the retired pool with no page to hand out and raised
    RuntimeError, a failure that tripped the breaker: kvtier paused with a WARNING for a
    refusal, which is said once as an ERROR and never pauses (the daemon answers). Now the
    other transfer misses too, without a failure or a pause."""
    daemon = daemon_factory("tiers.l2.enabled=true", "tiers.l2.capacity_bytes=64MiB")
    host = mha_host_pool("page_first", "default")
    page_bytes = host.get_dummy_flat_data_page().numel() * 2
    # 4 staging pages: each transfer holds at most 2 at once, so 4 pages are 2 chunks.
    backend = attach(host, storage_config(daemon.address, staging_bytes=4 * page_bytes))
    keys = [f"retired-between-chunks-{i}" for i in range(4)]
    try:
        src = host.alloc(4 * PAGE)
        fill(host, src, seed=21)
        assert backend.batch_set_v1(keys, src) == [True] * 4
        staging = backend._staging
        assert staging is not None and staging.num_pages == 4

        # The loading thread stops after its first chunk's Get, copying its first page.
        copying, go_on = threading.Event(), threading.Event()
        copy_page = host.set_from_flat_data_page

        def held_copy(start: int, page: torch.Tensor) -> None:
            if not copying.is_set():
                copying.set()
                assert go_on.wait(60)
            copy_page(start, page)

        host.set_from_flat_data_page = held_copy
        dst = host.alloc(4 * PAGE)
        loaded: list[list[bool]] = []
        loader = threading.Thread(target=lambda: loaded.append(backend.batch_get_v1(keys, dst)))
        loader.start()
        try:
            assert copying.wait(60)
            daemon.overrides += ["--set", f"server.max_pool_bytes_per_tenant={page_bytes}"]
            daemon.restart()  # no session, and no room for the staging pool
            more = [f"retired-between-chunks-more-{i}" for i in range(2)]
            assert backend.batch_set_v1(more, host.alloc(2 * PAGE)) == [False] * 2
            assert staging.retired
        finally:
            go_on.set()
            loader.join(60)
        assert loaded and loaded[0][2:] == [False, False]
        assert backend.counters["staging_refusals"] == 1
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
        assert backend.breaker.ok()
    finally:
        backend.close()


def test_a_retired_staging_pool_is_not_registered_again_for_a_transfer_that_held_it(
    daemon_factory: DaemonFactory,
) -> None:
    """Regression: two SGLang threads share the staging pool and the daemon restarts with a
    limit below it. One thread's transfer found it refused when registered again, retired
    it and backed off; the other, which had filled its pages before, then registered the
    retired pool once more for its Put: a second RegisterPool for one refusal, counted as a
    second refusal, which doubled the back-off before the next try. Now that transfer misses
    without asking the daemon: a retired pool takes no new registration."""
    daemon = daemon_factory("tiers.l2.enabled=true", "tiers.l2.capacity_bytes=64MiB")
    host = mha_host_pool("page_first", "default")
    page_bytes = host.get_dummy_flat_data_page().numel() * 2
    backend = attach(host, storage_config(daemon.address, staging_bytes=4 * page_bytes))
    keys = [f"retired-registered-{i}" for i in range(2)]
    try:
        src = host.alloc(2 * PAGE)
        fill(host, src, seed=23)
        assert backend.batch_set_v1(keys, src) == [True] * 2
        staging = backend._staging
        assert staging is not None

        # The storing thread stops while it copies its first page into the staging pool.
        copying, go_on = threading.Event(), threading.Event()
        page_of = host.get_data_page

        def held_page(start: int, flat: bool = True) -> torch.Tensor:
            if not copying.is_set():
                copying.set()
                assert go_on.wait(60)
            return page_of(start, flat=flat)

        host.get_data_page = held_page
        more = [f"retired-registered-more-{i}" for i in range(2)]
        stored: list[list[bool]] = []
        storer = threading.Thread(
            target=lambda: stored.append(backend.batch_set_v1(more, host.alloc(2 * PAGE)))
        )
        storer.start()
        try:
            assert copying.wait(60)
            daemon.overrides += ["--set", f"server.max_pool_bytes_per_tenant={page_bytes}"]
            daemon.restart()  # no session, and no room for the staging pool
            assert backend.batch_get_v1(keys, host.alloc(2 * PAGE)) == [False] * 2
            assert staging.retired
        finally:
            go_on.set()
            storer.join(60)
        assert stored == [[False, False]]
        assert rpc_count(daemon, "RegisterPool") == 1
        assert backend.counters["staging_refusals"] == 1
        assert backend.refusals.count == 1
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()


def test_a_refused_staging_pool_says_a_restart_applies_the_limit_not_a_sighup(
    daemon_factory: DaemonFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the ERROR for a refused staging pool (and for a refused host pool) told
    the operator that "a restart or SIGHUP applies" the daemon's setting. No setting that
    refuses a pool (server.max_pool_bytes_per_tenant, the pool counts, a tier's slot size,
    the GPU tier) is applied by a SIGHUP: the daemon logs the raised limit as needing a
    restart, and the backend's next try, once its back-off ended, was refused again. Now the
    ERROR says to restart the daemon (a SIGHUP does not apply it); after a restart the next
    try takes the pool."""
    config = tmp_path / "kvtier.yaml"
    limit = "server:\n  max_pool_bytes_per_tenant: {}\ntiers:\n  l1:\n    capacity_bytes: 64MiB\n"
    config.write_text(limit.format(1024))
    daemon = DaemonProcess(
        tmp_path, f"{daemon_factory._sockdir}/hup.sock", ["--config", str(config)]
    )
    daemon_factory._daemons.append(daemon)
    daemon.start()
    host = mha_host_pool("page_first", "default")
    backend = attach(host, storage_config(daemon.address))
    clock = Clock()
    backend.refusals = RegistrationRefusals(0.01, clock=clock)
    keys = [f"hup-refused-{i}" for i in range(3)]
    src = host.alloc(3 * PAGE)
    stored = fill(host, src, seed=22)
    try:
        caplog.set_level(logging.INFO, logger="kvtier")
        assert backend.batch_set_v1(keys, src) == [False] * 3
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "server.max_pool_bytes_per_tenant" in errors[0]

        config.write_text(limit.format(1 << 30))
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "need a restart" not in daemon.log():
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        assert "server.max_pool_bytes_per_tenant" in daemon.log().split("need a restart")[-1]
        registrations = rpc_count(daemon, "RegisterPool")
        clock.now += 3600.0  # the back-off is over: the next call tries again, and is refused
        assert backend.batch_set_v1(keys, src) == [False] * 3
        assert rpc_count(daemon, "RegisterPool") == registrations + 1
        assert backend.counters["staging_refusals"] == 2
        # What the ERROR told the operator to do must be what brings the pool back.
        assert "SIGHUP applies" not in errors[0]
        assert "restart the daemon (a SIGHUP does not apply it)" in errors[0]

        daemon.restart()
        clock.now += 3600.0
        assert backend.batch_set_v1(keys, src) == [True] * 3
        dst = host.alloc(3 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert pages_bytes(host, dst) == stored
        assert backend.counters["failures"] == 0 and backend.breaker.trips == 0
    finally:
        backend.close()


def test_bad_arguments_are_misses(shared_daemon: DaemonProcess) -> None:
    host = mha_host_pool("page_first")
    backend = attach(host, storage_config(shared_daemon.address, retry_after_s=0.01))
    try:
        idx = host.alloc(2 * PAGE)
        # Host slots that are not whole pages, and too few slots for the keys.
        assert backend.batch_set_v1(["x", "y"], idx.flip(0)) == [False, False]
        time.sleep(0.02)
        assert backend.batch_get_v1(["x", "y", "z"], idx) == [False] * 3
        time.sleep(0.02)
        assert backend.batch_set(["x"], [torch.zeros(3)]) is False
        time.sleep(0.02)
        # More legacy target pages than keys: it raised ValueError into SGLang.
        page = host.get_dummy_flat_data_page()
        assert backend.batch_get(["x"], [page, page.clone()]) == [None]
        assert backend.counters["failures"] == 4
    finally:
        backend.close()


def test_configuration_errors_stop_the_engine_at_start(shared_daemon: DaemonProcess) -> None:
    host = mha_host_pool("page_first")
    with pytest.raises(ValueError, match="unknown key"):
        attach(host, storage_config(shared_daemon.address, adress="typo"))
    with pytest.raises(ValueError, match="io_timeout_s"):
        attach(host, storage_config(shared_daemon.address, io_timeout_s=0))
    backend = attach(host, storage_config(shared_daemon.address))
    try:
        with pytest.raises(ValueError, match="mamba"):
            backend.register_mem_host_pool_v2(host, "mamba")
    finally:
        backend.close()
    # A layout whose pages SGLang cannot flatten (page_unified) is refused when attached.
    unified = mha_host_pool("page_unified")
    with pytest.raises(ValueError, match="page_unified"):
        attach(unified, storage_config(shared_daemon.address))


def test_the_backend_imports_nothing_of_the_daemon() -> None:
    # DESIGN.md §8, as tests/test_layering.py checks it for the rest of the client (which
    # cannot import this module: SGLang lives in this environment only).
    probe = (
        "import json, sys, torchvision_shim, kvtier.client.integrations.sglang\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvtier.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=HERE,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "kvtier.client.integrations.sglang" in loaded
    assert [
        m for m in loaded if m.startswith(("kvtier.daemon", "kvtier.tiers", "kvtier.bench"))
    ] == []
