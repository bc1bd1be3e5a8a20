"""Wrong arguments to either client's calls raise InvalidArgumentError before anything is sent.

Protobuf refuses a value it cannot put on the wire (a negative or oversized integer, a str
where bytes go, a float page, a key list that is not a list) with its own ValueError or
TypeError; the client turns that, and its own argument checks, into InvalidArgumentError
naming the request and the field. Each case calls one public method of ``Client`` and of
``AsyncClient`` (their pools and flows, their transfer jobs) with one bad argument against a
real daemon, checks the error and its message, checks the daemon received no request for it,
and then that the same client still works.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    KvtierError,
    LoadSegment,
    Namespace,
    PoolLayout,
    SaveSegment,
    SharedMemoryPool,
    block_keys,
)

NS = Namespace(model="bad-arguments", kv_dtype="uint8", block_tokens=4)
TOKENS = list(range(12))
KEYS = block_keys(NS, TOKENS)  # three chained keys
KEY = KEYS[0]
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=8, block_tokens=4, chunk_bytes=64)
# Small batches, so that a bad value in a later batch of a flow or job must stop the call
# before its first batch is sent.
MAX_BATCH = 2

# (case id, the call with one bad argument, what the message says). The same call is made on
# a Client (and its RegisteredPool) and on an AsyncClient (and its AsyncRegisteredPool). Where
# protobuf's own words follow the field, the pattern asks only for the bad value's type:
# protobuf's implementations word it differently.
Call = Callable[[Any, Any], Any]
CASES: list[tuple[str, Call, str]] = [
    # block calls
    ("lookup-negative-lease", lambda c, p: c.lookup([KEY], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1$"),
    ("lookup-huge-lease", lambda c, p: c.lookup([KEY], lease_ms=2**40), r"^Lookup: lease_ms: value out of range: 1099511627776$"),
    ("lookup-float-lease", lambda c, p: c.lookup([KEY], lease_ms=1.5), r"^Lookup: lease_ms: expected int, not float$"),
    ("lookup-str-key", lambda c, p: c.lookup([KEY, "key"]), r"^Lookup: keys: .*\bstr\b"),
    ("lookup-none-key", lambda c, p: c.lookup([KEY, None]), r"^Lookup: keys: .*NoneType"),
    ("lookup-keys-not-a-list", lambda c, p: c.lookup(5), r"^Lookup: keys: expected a sequence, not int$"),
    ("lookup-one-key-not-a-list", lambda c, p: c.lookup(KEY), r"^Lookup: keys: expected a sequence, not bytes$"),
    ("lookup-int-namespace", lambda c, p: c.lookup([KEY], namespace=5), r"^Lookup: namespace: expected str, not int$"),
    ("put-negative-page", lambda c, p: c.put(p.pool_id, [KEY], [-1]), r"^Put: pages: value out of range: -1$"),
    ("put-huge-page", lambda c, p: c.put(p.pool_id, [KEY], [2**40]), r"^Put: pages: value out of range: 1099511627776$"),
    ("put-float-page", lambda c, p: c.put(p.pool_id, [KEY], [1.5]), r"^Put: pages: .*float"),
    ("put-str-key", lambda c, p: c.put(p.pool_id, ["key"], [0]), r"^Put: keys: .*\bstr\b"),
    ("put-none-key", lambda c, p: c.put(p.pool_id, [None], [0]), r"^Put: keys: .*NoneType"),
    ("put-negative-pool", lambda c, p: c.put(-1, [KEY], [0]), r"^Put: pool_id: value out of range: -1$"),
    ("put-str-parent", lambda c, p: c.put(p.pool_id, [KEY], [0], parent_key="k"), r"^Put: parent_key: expected bytes, not str$"),
    ("get-negative-page", lambda c, p: c.get(p.pool_id, [KEY], [-1]), r"^Get: pages: value out of range: -1$"),
    ("get-float-page", lambda c, p: c.get(p.pool_id, [KEY], [0.0]), r"^Get: pages: .*float"),
    ("put-too-few-pages", lambda c, p: c.put(p.pool_id, KEYS, [0, 1]), r"^Put: 2 pages for 3 keys$"),
    ("put-too-many-pages", lambda c, p: c.put(p.pool_id, [KEY], [0, 1]), r"^Put: 2 pages for 1 keys$"),
    ("get-too-few-pages", lambda c, p: c.get(p.pool_id, KEYS, [0]), r"^Get: 1 pages for 3 keys$"),
    ("get-negative-lease", lambda c, p: c.get(p.pool_id, [KEY], [0], lease_id=-1), r"^Get: lease_id: value out of range: -1$"),
    ("release-negative-lease", lambda c, p: c.release(-1), r"^Release: lease_id: value out of range: -1$"),
    ("release-huge-lease", lambda c, p: c.release(2**64), r"^Release: lease_id: value out of range: 18446744073709551616$"),
    ("prefetch-negative-deadline", lambda c, p: c.prefetch([KEY], deadline_ms=-1), r"^Prefetch: deadline_ms: value out of range: -1$"),
    ("prefetch-huge-priority", lambda c, p: c.prefetch([KEY], priority=2**31), r"^Prefetch: priority: value out of range: 2147483648$"),
    ("prefetch-str-key", lambda c, p: c.prefetch(["key"]), r"^Prefetch: keys: .*\bstr\b"),
    ("delete-none-key", lambda c, p: c.delete([None]), r"^Delete: keys: .*NoneType"),
    ("delete-int-tenant", lambda c, p: c.delete([KEY], tenant=5), r"^Delete: tenant: expected str, not int$"),
    ("evict-str-key", lambda c, p: c.evict(["key"], "L1"), r"^Evict: keys: .*\bstr\b"),
    ("evict-unknown-tier", lambda c, p: c.evict([KEY], "L9"), r"^Evict: tier: unknown tier 'L9'"),
    ("evict-float-tier", lambda c, p: c.evict([KEY], 1.5), r"^Evict: tier: expected int, not float$"),
    ("unregister-negative-pool", lambda c, p: c.unregister_pool(-1), r"^UnregisterPool: pool_id: value out of range: -1$"),
    ("check-negative-settle", lambda c, p: c.check(settle_s=-1), r"^Check: settle_s must be a number >= 0 \(got -1\)$"),
    ("check-nan-settle", lambda c, p: c.check(settle_s=float("nan")), r"^Check: settle_s must be a number >= 0 \(got nan\)$"),
    ("check-str-settle", lambda c, p: c.check(settle_s="1"), r"^Check: settle_s must be a number >= 0 \(got '1'\)$"),
    ("check-none-settle", lambda c, p: c.check(settle_s=None), r"^Check: settle_s must be a number >= 0 \(got None\)$"),
    ("drain-str-resume", lambda c, p: c.drain(resume="yes"), r"^Drain: resume: expected bool, not str$"),
    ("health-int-service", lambda c, p: c.health(5), r"^Health: service: expected str, not int$"),
    # flows: the high-level pair and the pools' calls
    ("store-keys-negative-page", lambda c, p: c.store_keys(p, KEYS, [0, 1, -1]), r"^Put: pages: value out of range: -1$"),
    ("store-keys-str-key", lambda c, p: c.store_keys(p, [*KEYS[:2], "key"], [0, 1, 2]), r"^Put: keys: .*\bstr\b"),
    ("store-keys-none-key", lambda c, p: c.store_keys(p, [*KEYS[:2], None], [0, 1, 2]), r"^Put: keys: .*NoneType"),
    ("store-keys-str-parent", lambda c, p: c.store_keys(p, KEYS, [0, 1, 2], parent_key="k"), r"^Put: parent_key: expected bytes, not str$"),
    ("store-keys-too-few-pages", lambda c, p: c.store_keys(p, KEYS, [0, 1]), r"^store: 2 pages for 3 keys$"),
    ("store-keys-not-a-list", lambda c, p: c.store_keys(p, 5, [0]), r"^store: keys: expected a sequence, not int$"),
    ("load-keys-negative-lease", lambda c, p: c.load_keys(p, KEYS, [0, 1, 2], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1$"),
    ("load-keys-negative-page", lambda c, p: c.load_keys(p, KEYS, [0, 1, -1]), r"^Get: pages: value out of range: -1$"),
    ("load-keys-float-page", lambda c, p: c.load_keys(p, KEYS, [0.5, 1, 2]), r"^Get: pages: .*float"),
    ("load-keys-str-key", lambda c, p: c.load_keys(p, [*KEYS[:2], "key"], [0, 1, 2]), r"^Lookup: keys: .*\bstr\b"),
    ("load-keys-pages-not-a-list", lambda c, p: c.load_keys(p, KEYS, 5), r"^load: pages: expected a sequence, not int$"),
    ("store-negative-token", lambda c, p: c.store(p, [-1, *TOKENS[1:]], [0, 1, 2]), r"^token_ids: token ids must lie in \[0, 2\*\*32\)$"),
    ("store-negative-page", lambda c, p: c.store(p, TOKENS, [0, 1, -1]), r"^Put: pages: value out of range: -1$"),
    ("load-negative-lease", lambda c, p: c.load(p, TOKENS, [0, 1, 2], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1$"),
    ("pool-store-huge-page", lambda c, p: p.store(TOKENS, [0, 1, 2**40]), r"^Put: pages: value out of range: 1099511627776$"),
    ("pool-load-float-token", lambda c, p: p.load([0.5, *TOKENS[1:]], [0, 1, 2]), r"^token_ids: token ids must be integers"),
    ("pool-store-keys-none-key", lambda c, p: p.store_keys([KEY, None], [0, 1]), r"^Put: keys: .*NoneType"),
    ("pool-load-keys-negative-lease", lambda c, p: p.load_keys(KEYS, [0, 1, 2], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1$"),
    # transfer jobs
    ("submit-load-negative-page", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, -1])]), r"^Get: pages: value out of range: -1$"),
    ("submit-load-str-key", lambda c, p: c.submit_load(p, [LoadSegment(["key"], [0])]), r"^Get: keys: .*\bstr\b"),
    ("submit-load-negative-lease", lambda c, p: c.submit_load(p, [LoadSegment([KEY], [0], lease_id=-1)]), r"^Get: lease_id: value out of range: -1$"),
    ("submit-load-page-count", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0])]), r"^load segment 0: 1 pages for 3 keys$"),
    ("submit-load-no-layer-groups", lambda c, p: c.submit_load(p, [LoadSegment([KEY], [0])], layer_groups=0), r"^layer groups must be at least 1$"),
    ("submit-save-negative-page", lambda c, p: c.submit_save(p, [SaveSegment(KEYS, [0, 1, -1])]), r"^Put: pages: value out of range: -1$"),
    ("submit-save-none-key", lambda c, p: c.submit_save(p, [SaveSegment([*KEYS[:2], None], [0, 1, 2])]), r"^Put: keys: .*NoneType"),
    ("submit-save-str-parent", lambda c, p: c.submit_save(p, [SaveSegment([KEY], [0], parent_key="k")]), r"^Put: parent_key: expected bytes, not str$"),
    ("submit-save-keys-not-a-list", lambda c, p: c.submit_save(p, [SaveSegment(5, [0])]), r"^save segment 0: keys: expected a sequence, not int$"),
]  # fmt: skip


# The calls a bad argument could have sent (not Stats, which the test itself sends, nor
# OpenSession, which another test's client ending may count at any moment).
SENDING = (
    "RegisterPool",
    "UnregisterPool",
    "Lookup",
    "Put",
    "Get",
    "Release",
    "Prefetch",
    "Delete",
    "Evict",
    "Check",
    "Drain",
    "grpc.health.v1.Health/Check",
)


def rpcs_sent(stats: Any) -> int:
    """Requests of the calls above that the daemon has answered, whatever the answer."""
    return sum(stats.counter("rpc_seconds_count", method=m) for m in SENDING)


@pytest.fixture(scope="module")
def shm() -> Any:
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        yield shm


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_client_refuses_bad_arguments_before_sending(shared_daemon, shm, call, message):
    with Client(shared_daemon.address, max_batch_blocks=MAX_BATCH) as client:
        pool = client.register_pool(shm, LAYOUT, NS)
        before = rpcs_sent(client.stats())
        with pytest.raises(InvalidArgumentError, match=message) as caught:
            call(client, pool)
        assert isinstance(caught.value, KvtierError) and caught.value.details == str(caught.value)
        assert rpcs_sent(client.stats()) == before
        assert client.store_keys(pool, KEYS, [0, 1, 2]) == len(KEYS)
        assert client.lookup(KEYS).prefix_len == len(KEYS)


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_async_client_refuses_bad_arguments_before_sending(shared_daemon, shm, call, message):
    async with AsyncClient(shared_daemon.address, max_batch_blocks=MAX_BATCH) as client:
        pool = await client.register_pool(shm, LAYOUT, NS)
        before = rpcs_sent(await client.stats())
        with pytest.raises(InvalidArgumentError, match=message):
            result = call(client, pool)
            assert inspect.isawaitable(result)
            await result
        assert rpcs_sent(await client.stats()) == before
        assert await client.store_keys(pool, KEYS, [0, 1, 2]) == len(KEYS)
        assert (await client.lookup(KEYS)).prefix_len == len(KEYS)


@pytest.mark.parametrize("client_type", [Client, AsyncClient])
def test_a_namespace_that_is_not_a_str_is_refused_at_construction(shared_daemon, client_type):
    with pytest.raises(InvalidArgumentError, match=r"^namespace: expected str, not int$"):
        client_type(shared_daemon.address, namespace=5)


def test_a_token_of_the_wrong_type_is_refused_when_the_session_opens(shared_daemon):
    with (
        Client(shared_daemon.address, token=5) as client,  # type: ignore[arg-type]
        pytest.raises(InvalidArgumentError, match=r"^OpenSession: token: expected bytes, not int$"),
    ):
        client.lookup([KEY])


async def test_an_async_token_of_the_wrong_type_is_refused_when_the_session_opens(shared_daemon):
    async with AsyncClient(shared_daemon.address, token=5) as client:  # type: ignore[arg-type]
        with pytest.raises(
            InvalidArgumentError, match=r"^OpenSession: token: expected bytes, not int$"
        ):
            await client.lookup([KEY])


def test_invalid_argument_errors_are_also_value_errors():
    """Callers that caught the ValueError of the client's own checks (a layer range, a page
    count) still catch them."""
    assert issubclass(InvalidArgumentError, ValueError)


@pytest.mark.parametrize("settle_s", [61.0, 1e12, float("inf")])
def test_a_check_settle_past_the_daemons_longest_wait_is_cut_to_it(settle_s):
    """``kvtier check --settle 1e12`` was refused with the wire field's overflow ("settle_ms:
    value out of range"); the daemon waits at most a minute, and so does such a request."""
    from kvtier.client.types import MAX_CHECK_SETTLE_S, check_request
    from kvtier.daemon.service import MAX_SETTLE_MS

    assert MAX_SETTLE_MS == MAX_CHECK_SETTLE_S * 1000
    assert check_request(settle_s).settle_ms == int(MAX_CHECK_SETTLE_S * 1000) == 60_000
    assert check_request(0.25).settle_ms == 250
