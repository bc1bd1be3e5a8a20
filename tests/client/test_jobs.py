"""Asynchronous transfer jobs of both clients, against a real daemon; the plan's rules alone.

Also the two daemon rules engines need: a lease is usable by another session (only its own
session may release it), and a Get may copy a layer range of each block.
"""

from __future__ import annotations

import asyncio
import os
import signal
import types

import grpc
import numpy as np
import pytest
from harness import DaemonFactory, DaemonProcess, NamespacedDaemon

from kvtier.client import (
    AsyncClient,
    Client,
    JobKind,
    JobState,
    LoadSegment,
    Namespace,
    NotFoundError,
    PermissionDeniedError,
    PoolLayout,
    SaveSegment,
    SharedMemoryPool,
    UnavailableError,
    block_keys,
)
from kvtier.client.errors import DeadlineExceededError, InternalError, InvalidArgumentError
from kvtier.client.jobs import TransferPlan, layer_ranges
from kvtier.client.slots import CallSlots
from kvtier.proto import kvtier_pb2 as pb

LAYERS = 4
LAYOUT = PoolLayout.vllm(
    num_layers=LAYERS, num_pages=32, block_tokens=4, num_kv_heads=2, head_dim=8, dtype="float16"
)


def keys_for(n: int, tag: str) -> list[bytes]:
    ns = Namespace(model=f"jobs-{tag}", kv_dtype="float16", block_tokens=4)
    return block_keys(ns, list(range(n * 4)))


def layer_bytes(data: np.ndarray, page: int, layer: int) -> bytes:
    """The K and V chunks of one layer of one page."""
    lay = LAYOUT.layers[layer]
    out = b""
    for kv in range(lay.kv_count):
        start = lay.offset + kv * lay.kv_stride + page * lay.page_stride
        out += data[start : start + lay.chunk_bytes].tobytes()
    return out


def page_bytes(data: np.ndarray, page: int) -> bytes:
    return b"".join(layer_bytes(data, page, layer) for layer in range(LAYERS))


def fill(shm: SharedMemoryPool, seed: int) -> np.ndarray:
    data = shm.array()
    data[:] = np.random.default_rng(seed).integers(0, 256, len(data), dtype=np.uint8)
    return data


# ----------------------------------------------------------------- plan rules


def test_layer_ranges_split_evenly_and_check_explicit_ranges():
    assert layer_ranges(4, None) == [(0, 4)]
    assert layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layer_ranges(5, 2) == [(0, 2), (2, 5)] or layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert layer_ranges(3, 10) == [(0, 1), (1, 2), (2, 3)]
    assert layer_ranges(4, [(0, 3), (3, 4)]) == [(0, 3), (3, 4)]
    assert layer_ranges(4, np.array([[0, 3], [3, 4]])) == [(0, 3), (3, 4)]
    with pytest.raises(InvalidArgumentError, match="range 0"):
        layer_ranges(4, np.array([[0.0, 3.5], [3.5, 4.0]]))  # bounds are integers
    for bad in ([(0, 2)], [(1, 4)], [(0, 2), (3, 4)], [(0, 0), (0, 4)]):
        with pytest.raises(ValueError):
            layer_ranges(4, bad)
    with pytest.raises(ValueError):
        layer_ranges(4, 0)


def test_save_plan_stops_a_chain_at_its_first_rejection():
    """Batches of one chain go one after the other; a REJECTED_FULL ends the chain, so no
    later batch leaves a stored block after a hole. Other chains go on."""
    keys = keys_for(5, "plan")
    segs = [SaveSegment(keys[:3], [0, 1, 2]), SaveSegment(keys[3:], [3, 4])]
    plan = TransferPlan.for_save(segs, max_batch=2)
    first = plan.take_ready()
    assert [(p.chain, p.nkeys) for p in first] == [(0, 2), (1, 2)]
    assert plan.take_ready() == []  # chain 0's second batch waits for its first
    stored, full = pb.PUT_STORED, pb.PUT_REJECTED_FULL
    plan.complete(first[0], pb.PutResponse(results=[stored, full]))
    assert plan.take_ready() == []  # the chain stopped: its last batch is never sent
    plan.complete(first[1], pb.PutResponse(results=[stored, stored]))
    status = plan.status()
    assert status.state is JobState.DONE and status.kind is JobKind.SAVE
    assert status.done.tolist() == [True, False, False, True, True]
    assert status.prefix_len == 1 and status.pages_reusable


def test_a_durable_save_plan_reports_which_held_keys_are_on_disk():
    """Each Put's per-key ``persisted`` reaches the status (a key not held, or never sent
    after its chain stopped, is not on disk); a plan that is not durable reports None."""
    keys = keys_for(5, "durable")
    plan = TransferPlan.for_save([SaveSegment(keys, range(5))], max_batch=3, durable=True)
    stored, exists, full = pb.PUT_STORED, pb.PUT_EXISTS, pb.PUT_REJECTED_FULL
    (part,) = plan.take_ready()
    plan.complete(part, pb.PutResponse(results=[stored, exists, stored], persisted=[1, 0, 1]))
    (part,) = plan.take_ready()
    plan.complete(part, pb.PutResponse(results=[stored, full], persisted=[0, 0]))
    status = plan.status()
    assert status.done.tolist() == [True, True, True, True, False]
    assert status.persisted is not None
    assert status.persisted.tolist() == [True, False, True, False, False]
    plain = TransferPlan.for_save([SaveSegment(keys, range(5))], max_batch=8)
    (part,) = plain.take_ready()
    plain.complete(part, pb.PutResponse(results=[stored] * 5))
    assert plain.status().persisted is None


@pytest.mark.parametrize(
    "results, nth, after",
    [
        ([pb.PUT_STORED, pb.PUT_STORED], 1, False),  # at the part's own end, its chain popped
        ([pb.PUT_STORED, pb.PUT_REJECTED_FULL], 1, False),  # inside the stopped chain's close
        ([pb.PUT_STORED, pb.PUT_REJECTED_FULL], 2, False),
        ([pb.PUT_STORED, pb.PUT_REJECTED_FULL], 3, False),  # at its own end, the chain closed
        ([pb.PUT_STORED, pb.PUT_REJECTED_FULL], 1, True),  # a part ended, not yet taken off
    ],
    ids=["stored", "full-closing", "full-closing-midway", "full-closed", "full-closing-ended"],
)
def test_regression_a_save_part_whose_answer_an_interrupt_cut_short_never_ended(
    monkeypatch, results, nth, after
):
    """A signal handler's exception that lands in ``complete`` of a save's part before the
    part ended (injected at the ``nth`` end of a part it makes, or ``after`` it; a fuzz of
    the asyncio client's interrupts hit it in numpy's ``held.all()``, after the chain's pop)
    has both drivers ``fail`` the part. Before, that popped the chain again, taking off its
    next batch (IndexError where none was left), or found the chain's parts gone with a close
    cut short midway (KeyError once closed): those parts never ended, and the job stayed
    RUNNING for good. A part the close had ended but not taken off was ended again there,
    counted twice (the job RUNNING, its open parts below zero). Each step is now done once,
    whatever ran of it: the job ends FAILED."""
    keys = keys_for(5, "plan-interrupted")
    plan = TransferPlan.for_save([SaveSegment(keys, range(5))], max_batch=2)
    (part,) = plan.take_ready()
    end, ends = TransferPlan._end, []

    def cut_short(self: TransferPlan, ended: object) -> None:
        ends.append(ended)
        if len(ends) == nth:
            monkeypatch.setattr(TransferPlan, "_end", end)
            if after:  # the chain's close ended that part, and goes on to take it off
                end(self, ended)
            raise SignalHandlerError
        end(self, ended)

    monkeypatch.setattr(TransferPlan, "_end", cut_short)
    with pytest.raises(SignalHandlerError):
        plan.complete(part, pb.PutResponse(results=results))
    plan.fail(part, InternalError("interrupted in the client"))  # as both drivers do
    assert plan.take_ready() == []
    status = plan.status()
    assert status.finished and status.state is JobState.FAILED, status
    assert not status.done[2:].any()


def test_load_plan_tracks_layers_and_failures():
    keys = keys_for(3, "plan-load")
    plan = TransferPlan.for_load([LoadSegment(keys, [0, 1, 2])], 4, max_batch=8, groups=2)
    parts = plan.take_ready()
    assert [(p.request.layer_begin, p.request.layer_end) for p in parts] == [(0, 2), (2, 4)]
    assert not plan.layers_ready(1)
    plan.complete(parts[0], pb.GetResponse(loaded=[True, True, False]))
    assert plan.layers_ready(2) and not plan.layers_ready(3) and plan.layers_done() == 2
    assert plan.done_mask(2).tolist() == [True, True, False]
    plan.fail(parts[1], DeadlineExceededError("slow"))
    status = plan.status()
    assert status.state is JobState.FAILED and isinstance(status.error, DeadlineExceededError)
    assert status.done.tolist() == [False, False, False]  # layers 2-3 never arrived
    assert not status.pages_reusable  # the daemon may still be copying those layers


def test_regression_a_layer_wise_load_sent_one_segments_every_range_before_the_next():
    """A load of several segments (a vLLM step's requests) split into layer ranges sends
    every segment's first range before any segment's second, and so on: the client sends a
    job's parts in order, ``max_calls_open`` at a time, so ``wait_layers`` for the first
    ranges returns once their parts are in. Before, segment after segment: with 64 segments
    in 8 ranges, the first range's last part was the 505th of 512, and ``wait_layers(1)``
    returned with the whole load."""
    keys = keys_for(3, "ranges-first")
    segments = [LoadSegment(keys[:2], [0, 1]), LoadSegment(keys[2:], [2])]
    plan = TransferPlan.for_load(segments, 4, max_batch=1, groups=2)
    parts = plan.take_ready()
    assert [(p.layer_range, p.first_key) for p in parts] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert [p.index for p in parts] == list(range(6))
    assert [list(p.request.pages) for p in parts] == [[0], [1], [2]] * 2
    for part in parts[:3]:
        plan.complete(part, pb.GetResponse(loaded=[True]))
    assert plan.layers_done() == 2 and plan.done_mask(2).all() and not plan.done_mask().any()


def test_an_answer_of_the_wrong_length_fails_its_part_not_the_driver():
    """A daemon that answers a part with more or fewer results than it had keys (another
    version, or not kvtierd) fails that part with InternalError; the job ends."""
    keys = keys_for(3, "short")
    plan = TransferPlan.for_load([LoadSegment(keys, [0, 1, 2])], 4, max_batch=8)
    (part,) = plan.take_ready()
    plan.complete(part, pb.GetResponse(loaded=[True, True]))
    status = plan.status()
    assert status.state is JobState.FAILED and isinstance(status.error, InternalError)
    assert "2 results for 3 keys" in str(status.error)
    save = TransferPlan.for_save([SaveSegment(keys, [0, 1, 2])], max_batch=8)
    (part,) = save.take_ready()
    save.complete(part, pb.PutResponse(results=[pb.PUT_STORED] * 4))
    assert save.status().state is JobState.FAILED and save.status().done.sum() == 0


def test_a_plan_for_all_layers_sends_plain_gets():
    keys = keys_for(2, "plain")
    plan = TransferPlan.for_load([LoadSegment(keys, [0, 1])], 4, max_batch=8, groups=1)
    (part,) = plan.take_ready()
    assert (part.request.layer_begin, part.request.layer_end) == (0, 0)


# ----------------------------------------------------------- daemon rules


@pytest.fixture
def daemon(namespaced_daemon: NamespacedDaemon) -> NamespacedDaemon:
    """The module's tests share one daemon, each in a namespace of its own (the blocks of
    another test are not found); a test that kills, pauses or configures its daemon takes
    ``own_daemon`` or ``daemon_factory``. Counters are daemon-wide: a test reads them as
    differences from its own start."""
    return namespaced_daemon


@pytest.fixture
def own_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory()


def test_get_of_a_layer_range_copies_only_those_layers(daemon):
    with daemon.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        data = fill(shm, 1)
        pool = client.register_pool(shm, LAYOUT)
        keys = keys_for(2, "range")
        before = [page_bytes(data, p) for p in (0, 1)]
        assert client.put(pool.pool_id, keys, [0, 1]).stored == 2
        data[:] = 0
        req = pb.GetRequest(
            session_id=client.session_id,
            namespace=client.namespace,
            pool_id=pool.pool_id,
            keys=keys,
            pages=[5, 6],
            layer_begin=1,
            layer_end=3,
        )
        loaded = client.stats().counter("get_blocks", result="loaded")
        resp = client.stub.Get(req)
        assert list(resp.loaded) == [True, True]
        for src, dst in ((0, 5), (1, 6)):
            for layer in range(LAYERS):
                got = layer_bytes(data, dst, layer)
                if layer in (1, 2):
                    assert got == before[src][layer * len(got) : (layer + 1) * len(got)]
                else:
                    assert got == bytes(len(got))
        # A block counts as loaded once, by the Get that copies its layer 0.
        assert client.stats().counter("get_blocks", result="loaded") == loaded
        req.layer_begin, req.layer_end = 0, 1
        assert list(client.stub.Get(req).loaded) == [True, True]
        assert client.stats().counter("get_blocks", result="loaded") == loaded + 2


def test_a_lease_is_usable_by_another_session_and_released_by_its_own(daemon):
    with (
        daemon.client() as scheduler,
        daemon.client() as worker,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
    ):
        data = fill(shm, 2)
        pool = worker.register_pool(shm, LAYOUT)
        keys = keys_for(3, "lease")
        expect = [page_bytes(data, p) for p in (0, 1, 2)]
        worker.put(pool.pool_id, keys, [0, 1, 2])
        lease = scheduler.lookup(keys, pin=True, lease_ms=10_000).lease_id
        assert lease and scheduler.session_id != worker.session_id
        data[:] = 0
        assert worker.get(pool.pool_id, keys, [7, 8, 9], lease_id=lease).prefix_len == 3
        assert [page_bytes(data, p) for p in (7, 8, 9)] == expect
        with pytest.raises(PermissionDeniedError):
            worker.release(lease)
        assert worker.delete(keys[:1]).busy == 1  # still pinned
        scheduler.release(lease)
        assert worker.delete(keys[:1]).deleted == 1


# ------------------------------------------------------------ blocking jobs


def test_save_then_layerwise_load_job_round_trip(daemon):
    with daemon.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        data = fill(shm, 3)
        pool = client.register_pool(shm, LAYOUT)
        a, b = keys_for(4, "a"), keys_for(3, "b")
        expect = {p: page_bytes(data, p) for p in range(7)}
        save = client.submit_save(pool, [SaveSegment(a, [0, 1, 2, 3]), SaveSegment(b, [4, 5, 6])])
        assert save.kind is JobKind.SAVE
        status = client.wait(save.job_id, timeout_s=10)
        assert status.state is JobState.DONE and status.done.all() and status.pages_reusable
        with pytest.raises(NotFoundError):
            client.poll(save.job_id)  # wait handed out the final status: the id is forgotten

        data[:] = 0
        before = client.stats()
        missing = keys_for(1, "never-stored")
        load = client.submit_load(
            pool,
            [LoadSegment(a, [10, 11, 12, 13]), LoadSegment(b + missing, [14, 15, 16, 17])],
            layer_groups=LAYERS,
        )
        first = load.wait_layers(1, timeout_s=10)
        assert first is not None and first.tolist() == [True] * 7 + [False]
        status = load.wait(timeout_s=10)
        assert status.state is JobState.DONE and status.layers_done == LAYERS
        assert status.done.tolist() == [True] * 7 + [False]
        assert status.error is None and status.pages_reusable
        for dst, src in zip(range(10, 17), range(7), strict=True):
            assert page_bytes(data, dst) == expect[src]
        assert page_bytes(data, 17) == bytes(LAYOUT.block_bytes)
        # Every block counted once although it came in four layer ranges.
        stats = client.stats()
        for result, blocks in (("loaded", 7), ("missing", 1)):
            got = stats.counter("get_blocks", result=result)
            assert got - before.counter("get_blocks", result=result) == blocks, result
        assert client.poll(load.job_id).finished  # still known: nobody asked by id yet


def test_jobs_use_the_clients_namespace(daemon):
    with (
        daemon.client(namespace="llama") as client,
        daemon.client() as other,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
    ):
        data = fill(shm, 5)
        pool = client.register_pool(shm, LAYOUT)
        keys = keys_for(3, "ns")
        expect = [page_bytes(data, p) for p in range(3)]
        save = client.submit_save(pool, [SaveSegment(keys, [0, 1, 2])])
        assert client.wait(save.job_id, timeout_s=10).done.all()
        assert other.lookup(keys).prefix_len == 0  # another namespace of the tenant
        assert other.lookup(keys, namespace="llama").prefix_len == 3
        load = client.submit_load(pool, [LoadSegment(keys, [4, 5, 6])], layer_groups=LAYERS)
        assert load.wait(timeout_s=10).done.all()
        assert [page_bytes(data, p) for p in (4, 5, 6)] == expect


def test_chains_longer_than_a_batch_go_batch_after_batch(daemon):
    with daemon.client(max_batch_blocks=2) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        data = fill(shm, 5)
        pool = client.register_pool(shm, LAYOUT)
        keys = keys_for(5, "batches")
        expect = [page_bytes(data, p) for p in range(5)]
        status = client.submit_save(pool, [SaveSegment(keys, range(5))]).wait(10)
        assert status.state is JobState.DONE and status.done.all()
        assert client.lookup(keys).prefix_len == 5
        data[:] = 0
        load = client.submit_load(pool, [LoadSegment(keys, range(10, 15))], layer_groups=2)
        status = load.wait(10)
        assert status.state is JobState.DONE and status.done.all()
        assert [page_bytes(data, p) for p in range(10, 15)] == expect


def test_bad_requests_fail_the_job_with_typed_errors(daemon_factory):
    """A request only the daemon can refuse (more keys than its server.max_batch_blocks; a
    page past the pool's last the client refuses itself, at submit)."""
    daemon = daemon_factory("server.max_batch_blocks=1")
    with daemon.client() as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        keys = keys_for(2, "bad")
        job = client.submit_load(pool, [LoadSegment(keys, [0, 1])])
        status = job.wait(timeout_s=10)
        assert status.state is JobState.FAILED
        assert isinstance(status.error, InvalidArgumentError)
        assert status.error.code == grpc.StatusCode.INVALID_ARGUMENT
        # The daemon refused before copying: the pages are safe to reuse.
        assert status.pages_reusable
        with pytest.raises(ValueError):
            client.submit_load(pool, [LoadSegment(keys, [0])])


def test_cancel_ends_the_job_and_marks_its_pages_unsafe(daemon):
    big = PoolLayout.vllm(
        num_layers=2, num_pages=512, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="float16"
    )
    with daemon.client() as client, SharedMemoryPool.for_layout(big) as shm:
        pool = client.register_pool(shm, big)
        keys = keys_for(512, "cancel")
        job = client.submit_save(pool, [SaveSegment(keys, range(512))])
        status = client.cancel(job.job_id)
        if status.state is JobState.CANCELLED:
            assert not status.pages_reusable
            assert job.wait(timeout_s=0).state is JobState.CANCELLED
        else:  # the daemon answered before the cancel: nothing was in flight
            assert status.state is JobState.DONE and status.pages_reusable
        with pytest.raises(NotFoundError):
            client.poll(job.job_id)
        assert client.health()


def test_a_daemon_gone_fails_submit_and_running_jobs(own_daemon):
    daemon = own_daemon
    with daemon.client(timeout_s=5) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT)
        keys = keys_for(2, "gone")
        assert client.submit_save(pool, [SaveSegment(keys, [0, 1])]).wait(10).done.all()
        first_session = client.session_id
        daemon.kill()
        # The submit fails at once if the client already saw its session's stream break;
        # otherwise (gRPC notices that on its own thread, a moment later) the job fails.
        try:
            gone = client.submit_load(pool, [LoadSegment(keys, [2, 3])])
        except UnavailableError:
            pass
        else:
            status = gone.wait(timeout_s=10)
            assert status.state is JobState.FAILED, status
            assert isinstance(status.error, UnavailableError), status.error
            assert not status.done.any()
        daemon.start()
        # A new session: the pool is registered again on the next job.
        job = client.submit_load(pool, [LoadSegment(keys, [2, 3])], layer_groups=2)
        status = job.wait(timeout_s=10)
        assert status.state is JobState.DONE and not status.done.any()  # L1 died with it
        assert client.session_id != first_session
        assert pool.binding.session_id == client.session_id


# -------------------------------------------------------------- asyncio jobs


async def test_async_client_jobs(daemon):
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        async with AsyncClient(daemon.address, namespace=daemon.namespace) as client:
            data = fill(shm, 4)
            pool = await client.register_pool(shm, LAYOUT)
            keys = keys_for(5, "async")
            expect = [page_bytes(data, p) for p in range(5)]
            save = await client.submit_save(pool, [SaveSegment(keys, range(5))])
            status = await client.wait(save.job_id, timeout_s=10)
            assert status.state is JobState.DONE and status.done.all()
            data[:] = 0
            load = await client.submit_load(
                pool, [LoadSegment(keys, range(20, 25))], layer_groups=[(0, 1), (1, 4)]
            )
            assert client.poll(load.job_id).kind is JobKind.LOAD
            mask = await load.wait_layers(1, timeout_s=10)
            assert mask is not None and mask.all()
            status = await load.wait(timeout_s=10)
            assert status.state is JobState.DONE and status.layers_done == LAYERS
            assert [page_bytes(data, p) for p in range(20, 25)] == expect

            other = await client.submit_load(pool, [LoadSegment(keys, range(25, 30))])
            await other.cancel()
            assert other.poll().finished
            assert await client.health()
            await asyncio.sleep(0)


def _raising(error: Exception):
    def call(*args, **kwargs):
        raise error

    call.future = call  # the blocking job sends with ``.future``
    return call


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_an_rpc_that_raises_outside_grpc_ends_the_job_failed(daemon, kind):
    """A part whose RPC raises something that is not a gRPC status (a request that does not
    encode, an answer that does not decode) fails with InternalError and the job ends; the
    asyncio job's task died with it and the job stayed RUNNING."""
    keys = keys_for(2, f"raise-{kind}")
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        if kind == "sync":
            with daemon.client() as client:
                pool = client.register_pool(shm, LAYOUT)
                client.stub.Put = _raising(RuntimeError("broken encoder"))
                job = client.submit_save(pool, [SaveSegment(keys, range(2))])
                status = job.wait(timeout_s=10)
        else:
            async with AsyncClient(daemon.address, namespace=daemon.namespace) as aclient:
                pool = await aclient.register_pool(shm, LAYOUT)
                aclient.stub.Put = _raising(RuntimeError("broken encoder"))
                job = await aclient.submit_save(pool, [SaveSegment(keys, range(2))])
                status = await job.wait(timeout_s=10)
    assert status.state is JobState.FAILED and isinstance(status.error, InternalError)
    assert "broken encoder" in str(status.error)


# ------------------------------------------------------------- hung daemon


def test_a_hung_daemon_fails_a_new_session_within_the_client_timeout(own_daemon):
    """Opening a session waits for the daemon's first event at most ``timeout_s``: an engine
    never hangs on a daemon that accepts connections but does not answer."""
    daemon = own_daemon
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        with (
            Client(daemon.address, timeout_s=0.5) as client,
            pytest.raises(DeadlineExceededError),
        ):
            client.lookup(keys_for(1, "hung"))

        async def open_async() -> None:
            async with AsyncClient(daemon.address, timeout_s=0.5) as aclient:
                await aclient.lookup(keys_for(1, "hung"))

        with pytest.raises(DeadlineExceededError):
            asyncio.run(open_async())
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    with daemon.client() as client:
        assert client.health()


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_job_with_more_parts_than_a_connection_takes_at_once(daemon, kind):
    """A load job sends all its parts at once; past the daemon's bound per connection (256)
    gRPC refuses the excess unrun (UNAVAILABLE), and the job sends those again as the
    client's own calls do: the job ends done, not failed with UnavailableError."""
    segments = [LoadSegment(keys_for(1, f"wide-{i}"), [i % 32]) for i in range(400)]
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        if kind == "sync":
            with daemon.client(timeout_s=60) as client:
                pool = client.register_pool(shm, LAYOUT)
                status = client.submit_load(pool, segments).wait(timeout_s=60)
        else:
            async with AsyncClient(
                daemon.address, timeout_s=60, namespace=daemon.namespace
            ) as client:
                pool = await client.register_pool(shm, LAYOUT)
                status = await (await client.submit_load(pool, segments)).wait(timeout_s=60)
    assert status.error is None, status.error
    assert status.state is JobState.DONE and not status.done.any()


class SignalHandlerError(BaseException):
    """What a signal's handler raises in an asyncio loop (a KeyboardInterrupt would go on out
    of the loop, which pytest's process does not outlive whole)."""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_regression_a_job_whose_start_was_interrupted_never_ended(daemon, monkeypatch, kind):
    """An interrupt that lands in a job's start, once its parts are taken to be sent and
    before each is handed to a call slot (injected: as the blocking job's second part takes
    its slot, as the asyncio job reads its pool's id), left the parts not handed over marked
    sent, never sent nor ended: the job, which the caller never got, stayed RUNNING for
    good. It is cancelled instead, and so ends."""
    keys = keys_for(2, f"start-{kind}")
    segment = LoadSegment(keys, range(2))
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        if kind == "sync":
            taken: list[bool] = []
            take_or_queue = CallSlots.take_or_queue

            def interrupted_take(self, grant):
                if taken:
                    raise KeyboardInterrupt
                taken.append(True)
                return take_or_queue(self, grant)

            with daemon.client() as client:
                pool = client.register_pool(shm, LAYOUT)
                monkeypatch.setattr(CallSlots, "take_or_queue", interrupted_take)
                with pytest.raises(KeyboardInterrupt):
                    client.submit_load(pool, [segment], layer_groups=[(0, 1), (1, 4)])
                monkeypatch.undo()
                assert taken
                (job,) = client._jobs.jobs.values()
                status = job.wait(timeout_s=5)
        else:
            async with AsyncClient(daemon.address, namespace=daemon.namespace) as aclient:
                pool = await aclient.register_pool(shm, LAYOUT)
                asked: list[bool] = []
                pool_id_of = aclient.pool_id_of

                async def interrupted_pool_id_of(binding):
                    if asked:  # the start's, after the submit's own
                        raise SignalHandlerError
                    asked.append(True)
                    return await pool_id_of(binding)

                monkeypatch.setattr(aclient, "pool_id_of", interrupted_pool_id_of)
                with pytest.raises(SignalHandlerError):
                    await aclient.submit_load(pool, [segment], layer_groups=[(0, 1), (1, 4)])
                (job,) = aclient._jobs.jobs.values()
                status = await job.wait(timeout_s=5)
    assert status.finished and status.state is JobState.CANCELLED


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_regression_a_save_s_next_part_an_interrupt_kept_from_its_send_never_ended(
    daemon, monkeypatch, kind
):
    """An interrupt that lands as a save's part has ended and its chain's next part is sent
    (taken to be sent, then injected as the send reads the session's ids: on the caller's
    thread, where the ending part's call, answered at once, ran its done callback; in the
    asyncio job, the part's task) left that next part marked sent, never sent nor ended: the
    job stayed RUNNING for good. Only the job's start cancelled the job on such an interrupt.
    Every send of parts taken to be sent does now, and the job ends."""
    keys = keys_for(2, f"next-part-{kind}")
    segment = SaveSegment(keys, range(2))  # two parts of one key: the second waits on the first
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        if kind == "sync":
            with daemon.client(max_calls_open=1, max_batch_blocks=1) as client:
                pool = client.register_pool(shm, LAYOUT)
                slots = client.call_slots
                assert slots.acquire(None)  # the one slot, held as by a call open
                job = client.submit_save(pool, [segment])
                assert slots.waiting == 1
                put = client.stub.Put

                def answered_future(*args, **kwargs):
                    fut = put.future(*args, **kwargs)
                    fut.result()  # answered before its callback is added: run on this thread
                    return fut

                def interrupted_ids(binding):
                    raise KeyboardInterrupt

                client.stub.Put = types.SimpleNamespace(future=answered_future)
                monkeypatch.setattr(client, "live_ids", interrupted_ids)
                with pytest.raises(KeyboardInterrupt):
                    slots.release()  # that call ends: the first part is sent on this thread
                status = job.wait(timeout_s=5)
        else:
            async with AsyncClient(
                daemon.address, namespace=daemon.namespace, max_batch_blocks=1
            ) as aclient:
                pool = await aclient.register_pool(shm, LAYOUT)
                session = aclient.session

                async def interrupted_session():
                    jobs = aclient._jobs.jobs.values()
                    if any(part.ended for job in jobs for part in job._plan.parts):
                        raise SignalHandlerError
                    return await session()

                monkeypatch.setattr(aclient, "session", interrupted_session)
                job = await aclient.submit_save(pool, [segment])
                status = await job.wait(timeout_s=5)
    assert status.finished and status.state is JobState.CANCELLED
    assert not status.pages_reusable  # the part taken may have been sent
