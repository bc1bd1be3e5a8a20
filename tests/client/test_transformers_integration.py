"""Prefix reuse with a real transformers model (a tiny random-init Llama with GQA).

The reference for every comparison is transformers' own ``generate`` on the whole prompt with
no kvtier involved: tokens must be identical and the first token's logits within 1e-4.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from harness import DaemonFactory, DaemonProcess, NamespacedDaemon
from hf_models import tiny_llama

from kvtier.client import Client, Tier
from kvtier.client.integrations.transformers import KVTierPrefixCache

BLOCK = 16
NEW_TOKENS = 8
LOGITS_ATOL = 1e-4
TESTS_DIR = Path(__file__).resolve().parents[1]


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-step logits of transformers' generate, without kvtier."""
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), out.logits[0][0]


def _assert_matches_reference(kv: KVTierPrefixCache, prompt: list[int], reused: int) -> None:
    tokens, logits = _reference(kv.model, prompt)
    first_logits, _, got_reused = kv.prefill(prompt, store=False)
    assert got_reused == reused
    assert torch.allclose(first_logits[0], logits, atol=LOGITS_ATOL, rtol=0)
    generation = kv.generate(prompt, NEW_TOKENS, store=False)
    assert generation.reused_tokens == reused
    assert generation.tokens == tokens


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny models' matrices are far too small to share out: torch's intra-op threads
    only wait for each other, and for other processes on a loaded machine (these tests ran
    3-5 times slower with the default count). One thread in this module, the count put
    back after it; the reference and kvtier's run compute alike either way."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture
def daemon(namespaced_daemon: NamespacedDaemon) -> NamespacedDaemon:
    """The module's tests share one daemon, each in a namespace of its own (no block of
    another test is found, no pool of another is registered); a test that kills or restarts
    its daemon takes ``own_daemon``."""
    return namespaced_daemon


@pytest.fixture
def own_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory()


# ------------------------------------------------------------------- (a) same process


def test_loaded_prefix_generates_exactly_what_recompute_does(daemon, model):
    prompt = _prompt(100)  # 6 full blocks and 4 tokens
    with daemon.client() as client:
        with KVTierPrefixCache(model, client, block_tokens=BLOCK) as writer:
            assert writer.prefill(prompt).reused_tokens == 0
            assert writer.stats()["stored_blocks"] == 6
        with KVTierPrefixCache(model, client, block_tokens=BLOCK) as reader:
            _assert_matches_reference(reader, prompt, reused=96)
            assert reader.stats()["computed_tokens"] == 2 * 4


@pytest.mark.parametrize(
    "shape",
    [
        {"num_key_value_heads": 4},  # multi-head attention: one KV head per query head
        {"num_key_value_heads": 1, "head_dim": 32},  # multi-query, head_dim != hidden / heads
    ],
    ids=["mha", "mqa-wide-heads"],
)
def test_other_attention_shapes_round_trip(daemon, shape):
    other = tiny_llama(**shape)
    prompt = _prompt(100)
    with daemon.client() as client, KVTierPrefixCache(other, client, block_tokens=BLOCK) as kv:
        assert kv.geometry.num_kv_heads == shape["num_key_value_heads"]
        assert kv.geometry.head_dim == shape.get("head_dim", 16)
        kv.prefill(prompt)
        _assert_matches_reference(kv, prompt, reused=96)


def test_fully_stored_prompt_still_computes_its_last_block(daemon, model):
    prompt = _prompt(4 * BLOCK)
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        kv.prefill(prompt)
        _assert_matches_reference(kv, prompt, reused=3 * BLOCK)


def test_prompt_longer_than_the_staging_pool_moves_in_chunks(daemon, model):
    prompt = _prompt(7 * BLOCK + 5)
    with (
        daemon.client() as client,
        KVTierPrefixCache(model, client, block_tokens=BLOCK, staging_tokens=2 * BLOCK) as kv,
    ):
        assert kv.num_pages == 2
        kv.prefill(prompt)
        assert kv.stats()["stored_blocks"] == 7
        _assert_matches_reference(kv, prompt, reused=7 * BLOCK)


def test_shared_prefix_is_reused_up_to_the_first_differing_block(daemon, model):
    first = _prompt(90, seed=1)
    second = first[:50] + _prompt(40, seed=2)  # differs from token 50, inside block 3
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        kv.prefill(first)
        _assert_matches_reference(kv, second, reused=3 * BLOCK)


def test_generated_blocks_are_stored_for_the_next_turn(daemon, model):
    prompt = _prompt(40)
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        answer = kv.generate(prompt, 30).tokens
        # The cache held 40 + 29 tokens: 4 full blocks, 2 of them from the prompt.
        assert kv.stats()["stored_blocks"] == 4
        follow_up = prompt + answer + _prompt(10, seed=3)
        _assert_matches_reference(kv, follow_up, reused=4 * BLOCK)


# ---------------------------------------------------------------- (b) second process


@pytest.mark.slow  # a second Python process loads the model, ~5 s: `make test-slow`
def test_prefix_stored_by_another_process_is_reused(own_daemon, model):
    daemon = own_daemon  # the child calls in the default namespace
    prompt = _prompt(100)
    child = subprocess.run(
        [
            sys.executable,
            str(TESTS_DIR / "hf_models.py"),
            daemon.address,
            str(BLOCK),
            ",".join(map(str, prompt)),
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *_pythonpath()])},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["reused"] == 0 and report["stored_blocks"] == 6
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        _assert_matches_reference(kv, prompt, reused=96)


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


# -------------------------------------------------------- (c) L2 after a daemon restart


def test_prefix_survives_a_restart_through_l2(daemon_factory, model, tmp_path):
    l2_dir = tmp_path / "l2"
    l2_dir.mkdir()
    daemon = daemon_factory(
        "tiers.l2.enabled=true", f"tiers.l2.path={l2_dir}", "tiers.l2.capacity_bytes=256MiB"
    )
    prompt = _prompt(100)
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        kv.prefill(prompt)
        assert kv.stats()["stored_blocks"] == 6
    daemon.stop()  # graceful: write-back blocks are flushed to L2
    daemon.restart()
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        keys = kv.pool.keys(prompt)
        found = client.lookup(keys)
        assert found.prefix_len == 6
        assert found.tiers == [Tier.L2_DISK] * 6
        _assert_matches_reference(kv, prompt, reused=96)


def test_daemon_restart_under_a_live_integration_is_a_miss_not_an_error(own_daemon, model):
    daemon = own_daemon
    prompt = _prompt(70)
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        kv.prefill(prompt)
        # A crash and restart (L1 only): the blocks are gone, the pool must be re-registered.
        daemon.kill()
        daemon.start()
        assert kv.prefill(prompt).reused_tokens == 0
        assert kv.stats().get("load_errors", 0) == 0
        _assert_matches_reference(kv, prompt, reused=4 * BLOCK)


class _DeadlineExceeded(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "the daemon did not answer in time"


class _FirstPutAnsweredLate:
    """The client's stub, except that the first Put reaches the daemon only when the test
    sends it (``late()``), after its caller got DEADLINE_EXCEEDED: what a daemon that was
    paused or overloaded does with a request the client gave up on."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.late: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Put(self, request: Any, timeout: float | None = None) -> Any:
        if self.late is not None:
            return self._stub.Put(request, timeout=timeout)
        self.late = lambda: self._stub.Put(request, timeout=timeout)
        raise _DeadlineExceeded()


def test_a_store_answered_after_its_timeout_never_stores_another_prompts_kv(daemon, model):
    """A Put that timed out can still copy from the staging pages later. The integration
    reused those pages for the next store, so the late Put stored the second prompt's KV under
    the first prompt's keys, and a later prefill of the first prompt loaded it: silently wrong
    KV. A transfer that ended without an answer now moves the integration to fresh memory."""
    first, second = _prompt(100, seed=4), _prompt(100, seed=5)
    with (
        daemon.client() as client,
        KVTierPrefixCache(model, client, block_tokens=BLOCK, retry_after_s=0.05) as kv,
    ):
        stub = _FirstPutAnsweredLate(client._stub)
        client._stub = stub
        kv.prefill(first)
        assert kv.stats()["store_errors"] == 1 and stub.late is not None
        _wait_until_kvtier_is_used_again(kv)
        kv.prefill(second)
        assert kv.stats()["stored_blocks"] == 6
        with contextlib.suppress(grpc.RpcError):
            stub.late()  # the first prompt's Put, copying from the pages it was given
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        tokens, logits = _reference(model, first)
        first_logits, _, _ = kv.prefill(first, store=False)
        assert torch.allclose(first_logits[0], logits, atol=LOGITS_ATOL, rtol=0)
        assert kv.generate(first, NEW_TOKENS, store=False).tokens == tokens


def test_unreachable_daemon_degrades_to_recompute(own_daemon, model):
    daemon = own_daemon
    prompt = _prompt(40)
    with (
        daemon.client(timeout_s=5.0) as client,
        KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv,
    ):
        daemon.kill()
        _assert_matches_reference(kv, prompt, reused=0)
        kv.prefill(prompt)
        # The failed Lookup paused kvtier: nothing more was asked of the daemon.
        stats = kv.stats()
        assert stats["load_errors"] == 1 and stats.get("store_errors", 0) == 0
        assert stats["skipped_loads"] == 2 and stats["skipped_stores"] == 1


def test_regression_a_hung_daemon_cost_every_call_its_timeouts(own_daemon, model):
    """A daemon that does not answer (stopped, overloaded) cost every prefill a Lookup's
    timeout and every store a Put's: three client timeouts per ``generate``, call after call.
    One failure now pauses kvtier until a health check finds the daemon serving again; the
    tokens are the reference's throughout."""
    daemon = own_daemon
    prompt = _prompt(100)
    tokens, _ = _reference(model, prompt)
    with (
        daemon.client(timeout_s=1.0) as client,
        KVTierPrefixCache(model, client, block_tokens=BLOCK, retry_after_s=0.2) as kv,
    ):
        kv.prefill(prompt)
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(2):
                generation = kv.generate(prompt, NEW_TOKENS)
                assert generation.tokens == tokens and generation.reused_tokens == 0
            stats = kv.stats()
            # The first Lookup waited out its timeout; nothing else was sent.
            assert stats["load_errors"] == 1 and stats.get("store_errors", 0) == 0
            assert stats["skipped_loads"] == 1 and stats["skipped_stores"] == 4
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        _wait_until_kvtier_is_used_again(kv)
        assert kv.prefill(prompt).reused_tokens == 96


def test_regression_close_waited_for_a_hung_daemon_the_failure_had_paused(own_daemon, model):
    """After a failure that paused kvtier (a daemon that did not answer), ``close()`` still
    waited for the pool's UnregisterPool: one more client timeout, on the thread that shuts
    the engine down. It now sends it without waiting (the daemon unregisters the pool once it
    answers again). The client's timeout is long by then: a close that waited for it waited
    for the watchdog, which resumes the daemon after 30 s."""
    daemon = own_daemon
    assert daemon.proc is not None
    prompt = _prompt(100)
    with daemon.client(timeout_s=1.0) as client:
        kv = KVTierPrefixCache(model, client, block_tokens=BLOCK, retry_after_s=60.0)
        kv.prefill(prompt)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        watchdog = threading.Timer(30.0, os.kill, args=(daemon.proc.pid, signal.SIGCONT))
        try:
            kv.prefill(prompt)
            assert kv.stats()["load_errors"] == 1 and not kv.breaker.ok()
            client.timeout_s = 600.0
            watchdog.start()
            kv.close()
            assert watchdog.is_alive(), "close() waited until the watchdog resumed the daemon"
        finally:
            watchdog.cancel()
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30.0
        while client.stats().gauges["pools"]:
            assert time.monotonic() < deadline, "the pool still registered after 30 s"
            time.sleep(0.02)


def _wait_until_kvtier_is_used_again(kv: KVTierPrefixCache) -> None:
    """Until the health check that a failure started finds the daemon serving."""
    deadline = time.monotonic() + 30.0
    while not kv.breaker.ok():
        assert time.monotonic() < deadline, "kvtier still paused after 30 s"
        time.sleep(0.02)


# ---------------------------------------------------------------- (d) namespaces


@pytest.mark.parametrize(
    ("what", "other_model", "other_block"),
    [
        ("config", lambda: tiny_llama(intermediate_size=192), BLOCK),
        ("weights", lambda: tiny_llama(seed=7), BLOCK),
        ("dtype", lambda: tiny_llama(dtype=torch.bfloat16), BLOCK),
        ("block size", lambda: tiny_llama(), BLOCK // 2),
    ],
)
def test_prefix_of_another_model_dtype_or_block_size_is_never_loaded(
    daemon, model, what, other_model, other_block
):
    prompt = _prompt(100)
    with daemon.client() as client:
        with KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
            kv.prefill(prompt)
            stored_ns = kv.namespace
        with KVTierPrefixCache(other_model(), client, block_tokens=other_block) as other:
            assert other.namespace.seed() != stored_ns.seed(), what
            assert other.prefill(prompt).reused_tokens == 0
            assert other.stats().get("found_l1_host_blocks", 0) == 0
            # Its own blocks are reused as usual.
            assert other.prefill(prompt).reused_tokens > 0


def test_same_model_built_twice_shares_one_namespace(model):
    from kvtier.client.integrations.transformers import namespace_for

    assert namespace_for(tiny_llama(), BLOCK) == namespace_for(model, BLOCK)


# ------------------------------------------------------------- key compatibility


def _spec_keys(ns: object, tokens: list[int]) -> list[bytes]:
    """Block keys written from the README's key spec, independently of kvtier.client.keys."""

    def u32(x: int) -> bytes:
        return struct.pack("<I", x)

    def text(s: str) -> bytes:
        data = s.encode("utf-8")
        return u32(len(data)) + data

    n = ns.block_tokens  # type: ignore[attr-defined]
    fields = [ns.model, ns.revision, ns.kv_dtype, ns.kv_layout]  # type: ignore[attr-defined]
    seed_input = b"kvtier-namespace-v1" + b"".join(text(f) for f in fields)
    seed_input += b"".join(u32(x) for x in (n, ns.tp_rank, ns.tp_size, ns.pp_rank, ns.pp_size))  # type: ignore[attr-defined]
    seed_input += text(ns.tenant) + text(ns.extra)  # type: ignore[attr-defined]
    key = hashlib.sha256(seed_input).digest()
    keys = []
    for i in range(len(tokens) // n):
        block = tokens[i * n : (i + 1) * n]
        data = b"kvtier-block-v1" + key + u32(n) + b"".join(u32(t) for t in block) + u32(0)
        key = hashlib.sha256(data).digest()
        keys.append(key)
    return keys


def test_stored_keys_follow_the_readme_key_spec(daemon, model):
    prompt = _prompt(100)
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        kv.prefill(prompt)
        assert kv.namespace.kv_layout == "HND"
        spec = _spec_keys(kv.namespace, prompt)
        assert len(spec) == 6
        assert client.lookup(spec).prefix_len == 6
        # A different token in block 2 changes that key and every later one.
        changed = [*prompt[:40], (prompt[40] + 1) % 256, *prompt[41:]]
        assert client.lookup(_spec_keys(kv.namespace, changed)).prefix_len == 2


# ------------------------------------------------------------------------- guards


def test_batches_of_more_than_one_sequence_are_refused(daemon, model):
    with daemon.client() as client, KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
        with pytest.raises(ValueError, match="batch size 2"):
            kv.prefill(torch.zeros((2, 10), dtype=torch.long))
        with pytest.raises(ValueError, match="empty"):
            kv.prefill([])


def test_sliding_window_models_are_refused(daemon):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
    )
    with daemon.client() as client, pytest.raises(ValueError, match="DynamicLayer"):
        KVTierPrefixCache(MistralForCausalLM(config), client, block_tokens=BLOCK)


def test_closing_releases_the_pool(daemon, model):
    with daemon.client() as client:
        kv = KVTierPrefixCache(model, client, block_tokens=BLOCK)
        shm = kv.pool.binding.shm
        fd = shm.fd
        assert shm.path is None and fd >= 0  # a memfd: no name to leave behind
        assert client.stats().gauges["pools"] == 1
        kv.close()
        kv.close()
        assert client.stats().gauges["pools"] == 0
        assert shm.fd == -1
        # The descriptor is closed (its number may have been reused for something else).
        with contextlib.suppress(FileNotFoundError):
            assert shm.name not in os.readlink(f"/proc/self/fd/{fd}")
        with pytest.raises(RuntimeError, match="closed"):
            kv.prefill(_prompt(40))


def test_client_is_usable_after_the_integration(daemon, model):
    with daemon.client() as client:
        with KVTierPrefixCache(model, client, block_tokens=BLOCK) as kv:
            kv.prefill(_prompt(40))
        assert isinstance(client, Client) and client.health()


def test_regression_an_integration_dropped_unclosed_kept_probing_a_daemon_that_went(
    own_daemon, model
):
    """An instance dropped without ``close()`` after the daemon went away kept its breaker's
    health check asking the daemon every ``retry_after_s`` as long as the process lived, on a
    thread that held the breaker and the client; with the client closed, its probe failed at
    once, so it never ended. The instance and its probing thread now go together."""
    daemon = own_daemon
    with daemon.client(timeout_s=5.0) as client:
        kv = KVTierPrefixCache(model, client, block_tokens=BLOCK, retry_after_s=0.05)
        daemon.kill()
        # Unlogged: pytest keeps a test's log records, and the failure's record would keep
        # the instance (its traceback holds the frames of the call that failed).
        logging.disable(logging.WARNING)
        try:
            kv.prefill(_prompt(40))
        finally:
            logging.disable(logging.NOTSET)
        assert kv.breaker.probing
        breaker = weakref.ref(kv.breaker)
        del kv
    gc.collect()
    deadline = time.monotonic() + 30.0
    while breaker() is not None or any(
        t.name == "kvtier-prefix cache-probe" for t in threading.enumerate()
    ):
        assert time.monotonic() < deadline, "the probing thread outlived its integration"
        time.sleep(0.02)
