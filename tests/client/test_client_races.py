"""Races of the blocking client's calls and jobs with ``close()``.

Each test holds one side of the race at a fixed point, so the interleaving that once went
wrong happens on every run."""

from __future__ import annotations

import pytest

from kvtier.client import JobState, SaveSegment, SharedMemoryPool, block_keys
from kvtier.client.errors import UnavailableError
from kvtier.client.keys import Namespace
from kvtier.kernels.layout import PoolLayout

LAYOUT = PoolLayout.vllm(
    num_layers=2, num_pages=8, block_tokens=4, num_kv_heads=2, head_dim=8, dtype="float16"
)


def keys_for(n: int, tag: str) -> list[bytes]:
    ns = Namespace(model=f"races-{tag}", kv_dtype="float16", block_tokens=4)
    return block_keys(ns, list(range(n * 4)))


def test_a_job_submitted_while_the_client_closes_fails_with_a_typed_error(daemon):
    """``close()`` on another thread lands after ``submit_save`` set up the session and the
    pool but before the job sent its RPCs: the job ends FAILED with UnavailableError (it
    raised ValueError from the closed channel and stayed RUNNING, its parts never ended)."""
    client = daemon.client()
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        pool_id_of = client.pool_id_of
        calls = []

        def closing_pool_id_of(binding):
            pool_id = pool_id_of(binding)
            calls.append(pool_id)
            if len(calls) == 2:  # the job's own look-up, just before it sends
                client.close()
            return pool_id

        client.pool_id_of = closing_pool_id_of  # type: ignore[method-assign]
        job = client.submit_save(pool, [SaveSegment(keys_for(2, "close"), [0, 1])])
        status = job.wait(10)
        assert status.state is JobState.FAILED
        assert isinstance(status.error, UnavailableError)
        assert not status.done.any()


def test_calls_on_a_closed_client_raise_a_typed_error(daemon):
    """A thread still using the client after another closed it gets UnavailableError, as
    for a daemon that went away, not the channel's ValueError."""
    client = daemon.client()
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        client.close()
        with pytest.raises(UnavailableError):
            client.lookup(keys_for(1, "closed"))
        with pytest.raises(UnavailableError):
            pool.store_keys(keys_for(1, "closed"), [0])
        with pytest.raises(UnavailableError):
            client.submit_save(pool, [SaveSegment(keys_for(1, "closed"), [0])])
