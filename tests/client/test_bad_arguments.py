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

import asyncio
import inspect
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from peers import NOBODY, NOGROUP, run_as

from kvtier.client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    KvtierError,
    LoadSegment,
    Namespace,
    NotFoundError,
    PermissionDeniedError,
    PoolLayout,
    SaveSegment,
    SharedMemoryPool,
    Tier,
    block_keys,
    wait_until_serving,
)
from kvtier.client.sync import resolve_token
from kvtier.kernels.layout import MAX_LAYERS, LayoutError
from kvtier.kernels.runs import mla_layout

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
    ("lookup-negative-lease", lambda c, p: c.lookup([KEY], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("lookup-huge-lease", lambda c, p: c.lookup([KEY], lease_ms=2**40), r"^Lookup: lease_ms: value out of range: 1099511627776 \(a uint32: 0 to 4294967295\)$"),
    ("lookup-float-lease", lambda c, p: c.lookup([KEY], lease_ms=1.5), r"^Lookup: lease_ms: expected int, not float$"),
    ("lookup-str-key", lambda c, p: c.lookup([KEY, "key"]), r"^Lookup: keys: .*\bstr\b"),
    ("lookup-none-key", lambda c, p: c.lookup([KEY, None]), r"^Lookup: keys: .*NoneType"),
    ("lookup-keys-not-a-list", lambda c, p: c.lookup(5), r"^Lookup: keys: expected a sequence, not int$"),
    ("lookup-one-key-not-a-list", lambda c, p: c.lookup(KEY), r"^Lookup: keys: expected a sequence, not bytes$"),
    # keys given as an iterator, which protobuf's first build used up: its refusal named no field
    ("lookup-generator-str-key", lambda c, p: c.lookup(k for k in [KEY, "key"]), r"^Lookup: keys: .*\bstr\b"),
    ("put-iterator-negative-page", lambda c, p: c.put(p.pool_id, [KEY], iter([-1])), r"^Put: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("delete-generator-none-key", lambda c, p: c.delete(k for k in [KEY, None]), r"^Delete: keys: .*NoneType"),
    ("quarantine-generator-negative-slot", lambda c, p: c.quarantine(release=True, slots=(s for s in [1, -1])), r"^Quarantine: slots: value out of range: -1 \(a uint64: 0 to 18446744073709551615\)$"),
    ("lookup-int-namespace", lambda c, p: c.lookup([KEY], namespace=5), r"^Lookup: namespace: expected str, not int$"),
    ("put-negative-page", lambda c, p: c.put(p.pool_id, [KEY], [-1]), r"^Put: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("put-huge-page", lambda c, p: c.put(p.pool_id, [KEY], [2**40]), r"^Put: pages: value out of range: 1099511627776 \(a uint32: 0 to 4294967295\)$"),
    ("put-float-page", lambda c, p: c.put(p.pool_id, [KEY], [1.5]), r"^Put: pages: .*float"),
    ("put-str-key", lambda c, p: c.put(p.pool_id, ["key"], [0]), r"^Put: keys: .*\bstr\b"),
    ("put-none-key", lambda c, p: c.put(p.pool_id, [None], [0]), r"^Put: keys: .*NoneType"),
    ("put-negative-pool", lambda c, p: c.put(-1, [KEY], [0]), r"^Put: pool_id: value out of range: -1 \(a uint64: 0 to 18446744073709551615\)$"),
    ("put-str-parent", lambda c, p: c.put(p.pool_id, [KEY], [0], parent_key="k"), r"^Put: parent_key: expected bytes, not str$"),
    ("get-negative-page", lambda c, p: c.get(p.pool_id, [KEY], [-1]), r"^Get: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("get-float-page", lambda c, p: c.get(p.pool_id, [KEY], [0.0]), r"^Get: pages: .*float"),
    ("put-too-few-pages", lambda c, p: c.put(p.pool_id, KEYS, [0, 1]), r"^Put: 2 pages for 3 keys$"),
    ("put-too-many-pages", lambda c, p: c.put(p.pool_id, [KEY], [0, 1]), r"^Put: 2 pages for 1 keys$"),
    ("get-too-few-pages", lambda c, p: c.get(p.pool_id, KEYS, [0]), r"^Get: 1 pages for 3 keys$"),
    ("get-negative-lease", lambda c, p: c.get(p.pool_id, [KEY], [0], lease_id=-1), r"^Get: lease_id: value out of range: -1 \(a uint64: 0 to 18446744073709551615\)$"),
    ("release-negative-lease", lambda c, p: c.release(-1), r"^Release: lease_id: value out of range: -1 \(a uint64: 0 to 18446744073709551615\)$"),
    ("release-huge-lease", lambda c, p: c.release(2**64), r"^Release: lease_id: value out of range: 18446744073709551616 \(a uint64: 0 to 18446744073709551615\)$"),
    ("prefetch-negative-deadline", lambda c, p: c.prefetch([KEY], deadline_ms=-1), r"^Prefetch: deadline_ms: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("prefetch-huge-priority", lambda c, p: c.prefetch([KEY], priority=2**31), r"^Prefetch: priority: value out of range: 2147483648 \(an int32: -2147483648 to 2147483647\)$"),
    ("prefetch-str-key", lambda c, p: c.prefetch(["key"]), r"^Prefetch: keys: .*\bstr\b"),
    ("delete-none-key", lambda c, p: c.delete([None]), r"^Delete: keys: .*NoneType"),
    ("delete-int-tenant", lambda c, p: c.delete([KEY], tenant=5), r"^Delete: tenant: expected str, not int$"),
    ("evict-str-key", lambda c, p: c.evict(["key"], "L1"), r"^Evict: keys: .*\bstr\b"),
    ("evict-unknown-tier", lambda c, p: c.evict([KEY], "L9"), r"^Evict: tier: unknown tier 'L9'"),
    ("evict-float-tier", lambda c, p: c.evict([KEY], 1.5), r"^Evict: tier: expected int, not float$"),
    ("unregister-negative-pool", lambda c, p: c.unregister_pool(-1), r"^UnregisterPool: pool_id: value out of range: -1 \(a uint64: 0 to 18446744073709551615\)$"),
    ("check-negative-settle", lambda c, p: c.check(settle_s=-1), r"^Check: settle_s must be a number >= 0 \(got -1\)$"),
    ("check-nan-settle", lambda c, p: c.check(settle_s=float("nan")), r"^Check: settle_s must be a number >= 0 \(got nan\)$"),
    ("check-str-settle", lambda c, p: c.check(settle_s="1"), r"^Check: settle_s must be a number >= 0 \(got '1'\)$"),
    ("check-none-settle", lambda c, p: c.check(settle_s=None), r"^Check: settle_s must be a number >= 0 \(got None\)$"),
    ("drain-str-resume", lambda c, p: c.drain(resume="yes"), r"^Drain: resume: expected bool, not str$"),
    ("quarantine-str-release", lambda c, p: c.quarantine(release="yes"), r"^Quarantine: release: expected bool, not str$"),
    ("quarantine-negative-slot", lambda c, p: c.quarantine(release=True, slots=[-1]), r"^Quarantine: slots: value out of range: -1 \(a uint64: 0 to 18446744073709551615\)$"),
    ("quarantine-nan-timeout", lambda c, p: c.quarantine(timeout_s=float("nan")), r"^Quarantine: timeout_s: expected a finite number of seconds >= 0, not nan$"),
    ("health-int-service", lambda c, p: c.health(5), r"^Health: service: expected str, not int$"),
    ("health-service-not-utf8", lambda c, p: c.health("s\udcff"), r"^Health: service: not encodable as UTF-8 \(surrogates not allowed\)$"),
    # None is no "unset": protobuf took it as the field's default (lease 0, pool 0, no pin)
    ("release-none-lease", lambda c, p: c.release(None), r"^Release: lease_id: expected int, not NoneType$"),
    ("put-none-pool", lambda c, p: c.put(None, [KEY], [0]), r"^Put: pool_id: expected int, not NoneType$"),
    ("put-none-parent", lambda c, p: c.put(p.pool_id, [KEY], [0], parent_key=None), r"^Put: parent_key: expected bytes, not NoneType$"),
    ("lookup-none-keys", lambda c, p: c.lookup(None), r"^Lookup: keys: expected a sequence, not NoneType$"),
    ("lookup-none-lease", lambda c, p: c.lookup([KEY], lease_ms=None), r"^Lookup: lease_ms: expected int, not NoneType$"),
    ("lookup-none-pin", lambda c, p: c.lookup([KEY], pin=None), r"^Lookup: pin: expected bool, not NoneType$"),
    ("get-none-lease", lambda c, p: c.get(p.pool_id, [KEY], [0], lease_id=None), r"^Get: lease_id: expected int, not NoneType$"),
    ("prefetch-none-priority", lambda c, p: c.prefetch([KEY], priority=None), r"^Prefetch: priority: expected int, not NoneType$"),
    ("delete-none-tenant", lambda c, p: c.delete([KEY], tenant=None), r"^Delete: tenant: expected str, not NoneType$"),
    ("drain-none-resume", lambda c, p: c.drain(resume=None), r"^Drain: resume: expected bool, not NoneType$"),
    # a bool field takes a bool (or NumPy's), not any int: protobuf took 2 (and -1, and any
    # int up to C's long) as True, and one past it was its OverflowError
    ("lookup-int-pin", lambda c, p: c.lookup([KEY], pin=2), r"^Lookup: pin: expected bool, not int$"),
    ("lookup-one-pin", lambda c, p: c.lookup([KEY], pin=1), r"^Lookup: pin: expected bool, not int$"),
    ("lookup-numpy-int-pin", lambda c, p: c.lookup([KEY], pin=np.int64(1)), r"^Lookup: pin: expected bool, not int64$"),
    ("put-zero-durable", lambda c, p: c.put(p.pool_id, [KEY], [0], durable=0), r"^Put: durable: expected bool, not int$"),
    ("submit-save-int-durable", lambda c, p: c.submit_save(p, [SaveSegment(KEYS, [0, 1, 2])], durable=-1), r"^Put: durable: expected bool, not int$"),
    ("drain-int-resume", lambda c, p: c.drain(resume=2), r"^Drain: resume: expected bool, not int$"),
    ("quarantine-int-release", lambda c, p: c.quarantine(release=1), r"^Quarantine: release: expected bool, not int$"),
    ("lookup-huge-pin", lambda c, p: c.lookup([KEY], pin=2**64), r"^Lookup: pin: expected bool, not int$"),
    ("put-huge-durable", lambda c, p: c.put(p.pool_id, [KEY], [0], durable=-(2**70)), r"^Put: durable: expected bool, not int$"),
    ("submit-save-huge-durable", lambda c, p: c.submit_save(p, [SaveSegment(KEYS, [0, 1, 2])], durable=2**64), r"^Put: durable: expected bool, not int$"),
    ("drain-huge-resume", lambda c, p: c.drain(resume=2**64), r"^Drain: resume: expected bool, not int$"),
    ("release-lease-past-4300-digits", lambda c, p: c.release(10**5000), r"^Release: lease_id: value out of range: an int of 16610 bits \(a uint64: 0 to 18446744073709551615\)$"),
    ("put-page-past-4300-digits", lambda c, p: c.put(p.pool_id, [KEY], [-(10**5000)]), r"^Put: pages: value out of range: a negative int of 16610 bits \(a uint32: 0 to 4294967295\)$"),
    ("lookup-pin-past-4300-digits", lambda c, p: c.lookup([KEY], pin=10**5000), r"^Lookup: pin: expected bool, not int$"),
    ("store-keys-page-past-4300-digits", lambda c, p: c.store_keys(p, KEYS, [0, 1, 10**5000]), r"^Put: pages: value out of range: an int of 16610 bits \(a uint32: 0 to 4294967295\)$"),
    ("unregister-none-pool", lambda c, p: c.unregister_pool(None), r"^UnregisterPool: pool_id: expected int, not NoneType$"),
    # keys the daemon refuses, refused before sending
    ("lookup-short-key", lambda c, p: c.lookup([KEY, b"x"]), r"^Lookup: keys: key 1 has 1 bytes; keys are 32 bytes$"),
    ("lookup-long-key", lambda c, p: c.lookup([KEY + b"x"]), r"^Lookup: keys: key 0 has 33 bytes; keys are 32 bytes$"),
    ("lookup-no-keys", lambda c, p: c.lookup([]), r"^Lookup: keys: empty; a call names at least one key$"),
    ("put-short-key", lambda c, p: c.put(p.pool_id, [b"x"], [0]), r"^Put: keys: key 0 has 1 bytes; keys are 32 bytes$"),
    ("put-no-keys", lambda c, p: c.put(p.pool_id, [], []), r"^Put: keys: empty; a call names at least one key$"),
    ("put-short-parent", lambda c, p: c.put(p.pool_id, [KEY], [0], parent_key=b"x"), r"^Put: parent_key has 1 bytes; keys are 32 bytes$"),
    ("get-short-key", lambda c, p: c.get(p.pool_id, [b"x"], [0]), r"^Get: keys: key 0 has 1 bytes; keys are 32 bytes$"),
    ("prefetch-short-key", lambda c, p: c.prefetch([b"x"]), r"^Prefetch: keys: key 0 has 1 bytes; keys are 32 bytes$"),
    ("delete-short-key", lambda c, p: c.delete([b"x"]), r"^Delete: keys: key 0 has 1 bytes; keys are 32 bytes$"),
    ("evict-short-key", lambda c, p: c.evict([b"x"], "L1"), r"^Evict: keys: key 0 has 1 bytes; keys are 32 bytes$"),
    ("store-keys-short-parent", lambda c, p: c.store_keys(p, KEYS, [0, 1, 2], parent_key=b"x"), r"^Put: parent_key has 1 bytes; keys are 32 bytes$"),
    ("submit-save-short-key", lambda c, p: c.submit_save(p, [SaveSegment([KEY, b"x"], [0, 1])]), r"^Put: keys: key 1 has 1 bytes; keys are 32 bytes$"),
    # pages past the pool's last, which the client knows from its layout
    ("put-page-past-pool", lambda c, p: c.put(p.pool_id, [KEY], [8]), r"^Put: pages: page 8 is past the pool's last \(8 pages\)$"),
    ("get-page-past-pool", lambda c, p: c.get(p.pool_id, KEYS, [0, 1, 99]), r"^Get: pages: page 99 is past the pool's last \(8 pages\)$"),
    ("store-keys-page-past-pool", lambda c, p: c.store_keys(p, KEYS, [0, 1, 8]), r"^Put: pages: page 8 is past the pool's last \(8 pages\)$"),
    ("load-keys-page-past-pool", lambda c, p: c.load_keys(p, KEYS, [0, 1, 8]), r"^Get: pages: page 8 is past the pool's last \(8 pages\)$"),
    ("submit-load-page-past-pool", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 8])]), r"^Get: pages: page 8 is past the pool's last \(8 pages\)$"),
    ("submit-save-page-past-pool", lambda c, p: c.submit_save(p, [SaveSegment(KEYS, [0, 1, 8])]), r"^Put: pages: page 8 is past the pool's last \(8 pages\)$"),
    # tiers the client can tell are none
    ("evict-none-tier", lambda c, p: c.evict([KEY], None), r"^Evict: tier: expected int, not NoneType$"),
    ("evict-tier-99", lambda c, p: c.evict([KEY], 99), r"^Evict: tier: unknown tier 99; one of L0, L1, L2, L3$"),
    ("evict-tier-absent", lambda c, p: c.evict([KEY], 0), r"^Evict: tier: unknown tier 0; one of L0, L1, L2, L3$"),
    ("evict-tier-past-4300-digits", lambda c, p: c.evict([KEY], 10**5000), r"^Evict: tier: unknown tier an int of 16610 bits; one of L0, L1, L2, L3$"),
    ("check-settle-past-4300-digits", lambda c, p: c.check(settle_s=-(10**5000)), r"^Check: settle_s must be a number >= 0 \(got a negative int of 16610 bits\)$"),
    ("load-groups-past-4300-digits", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=-(10**5000)), r"^layer_groups: must be at least 1 \(got a negative int of 16610 bits\)$"),
    ("load-ranges-past-4300-digits", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=[(0, 10**5000)]), r"^layer_groups: ranges a list holding an int of more than 4,300 digits must tile \[0, 2\) in order$"),
    # numbers of seconds
    ("check-bool-settle", lambda c, p: c.check(settle_s=True), r"^Check: settle_s must be a number >= 0 \(got True\)$"),
    ("lookup-negative-timeout", lambda c, p: c.lookup([KEY], timeout_s=-1), r"^Lookup: timeout_s: expected a finite number of seconds >= 0, not -1$"),
    ("lookup-nan-timeout", lambda c, p: c.lookup([KEY], timeout_s=float("nan")), r"^Lookup: timeout_s: expected a finite number of seconds >= 0, not nan$"),
    ("lookup-inf-timeout", lambda c, p: c.lookup([KEY], timeout_s=float("inf")), r"^Lookup: timeout_s: expected a finite number of seconds >= 0, not inf$"),
    ("lookup-str-timeout", lambda c, p: c.lookup([KEY], timeout_s="1"), r"^Lookup: timeout_s: expected a number of seconds, not '1'$"),
    ("lookup-list-timeout-past-4300-digits", lambda c, p: c.lookup([KEY], timeout_s=[10**5000]), r"^Lookup: timeout_s: expected a number of seconds, not a list holding an int of more than 4,300 digits$"),
    ("lookup-years-timeout", lambda c, p: c.lookup([KEY], timeout_s=1e10), r"^Lookup: timeout_s: expected at most 1e\+09 seconds \(about 31 years\), not 10000000000.0$"),
    ("lookup-pin-years-timeout", lambda c, p: c.lookup([KEY], pin=True, timeout_s=2**63), r"^Lookup: timeout_s: expected at most 1e\+09 seconds \(about 31 years\), not 9223372036854775808$"),
    ("put-int-past-float-timeout", lambda c, p: c.put(p.pool_id, [KEY], [0], timeout_s=10**400), r"^Put: timeout_s: expected a finite number of seconds >= 0, not an int of 1329 bits$"),
    ("get-int-past-float-negative-timeout", lambda c, p: c.get(p.pool_id, [KEY], [0], timeout_s=-(10**400)), r"^Get: timeout_s: expected a finite number of seconds >= 0, not a negative int of 1329 bits$"),
    ("put-negative-timeout", lambda c, p: c.put(p.pool_id, [KEY], [0], durable=True, timeout_s=-1), r"^Put: timeout_s: expected a finite number of seconds >= 0, not -1$"),
    ("put-nan-timeout", lambda c, p: c.put(p.pool_id, [KEY], [0], timeout_s=float("nan")), r"^Put: timeout_s: expected a finite number of seconds >= 0, not nan$"),
    ("get-inf-timeout", lambda c, p: c.get(p.pool_id, [KEY], [0], timeout_s=float("inf")), r"^Get: timeout_s: expected a finite number of seconds >= 0, not inf$"),
    ("evict-str-timeout", lambda c, p: c.evict([KEY], "L1", timeout_s="1"), r"^Evict: timeout_s: expected a number of seconds, not '1'$"),
    # objects of the wrong kind
    ("register-str-shm", lambda c, p: c.register_pool("name", LAYOUT), r"^shm: expected SharedMemoryPool, not str$"),
    ("register-none-shm", lambda c, p: c.register_pool(None, LAYOUT), r"^shm: expected SharedMemoryPool, not NoneType$"),
    ("register-none-layout", lambda c, p: c.register_pool(p.binding.shm, None), r"^layout: expected PoolLayout, not NoneType$"),
    ("register-str-namespace", lambda c, p: c.register_pool(p.binding.shm, LAYOUT, "ns"), r"^namespace: expected Namespace, not str$"),
    ("register-namespace-other-block-size", lambda c, p: c.register_pool(p.binding.shm, LAYOUT, Namespace(model="m", kv_dtype="uint8", block_tokens=2)), r"^namespace: block_tokens 2 is not the layout's 4: a page holds one block of the layout's tokens$"),
    ("register-layout-blocks-past-4300-digits", lambda c, p: c.register_pool(p.binding.shm, PoolLayout.staging(num_layers=2, num_pages=8, block_tokens=10**5000, chunk_bytes=64), NS), r"^namespace: block_tokens 4 is not the layout's an int of 16610 bits: a page holds "),
    ("register-layout-dtype-past-4300-digits", lambda c, p: c.register_pool(p.binding.shm, PoolLayout(LAYOUT.layers, 8, 4, 10**5000)), r"^RegisterPool: layout: unknown dtype an int of 16610 bits; one of \['bfloat16', "),
    ("register-layout-list-dtype", lambda c, p: c.register_pool(p.binding.shm, PoolLayout(LAYOUT.layers, 8, 4, [])), r"^RegisterPool: layout: unknown dtype \[\]; one of \['bfloat16', "),
    ("register-closed-shm", lambda c, p: c.register_pool(closed_pool(), LAYOUT), r"^shm: the pool 'closed' was closed$"),
    ("register-cuda-shm", lambda c, p: c.register_cuda_pool(p.binding.shm, LAYOUT), r"^export: expected CudaIpcExport, not SharedMemoryPool$"),
    ("store-none-pool", lambda c, p: c.store(None, TOKENS, [0, 1, 2]), r"^pool: expected (Async)?RegisteredPool, not NoneType$"),
    ("load-int-pool", lambda c, p: c.load(p.pool_id, TOKENS, [0, 1, 2]), r"^pool: expected (Async)?RegisteredPool, not int$"),
    ("store-keys-str-pool", lambda c, p: c.store_keys("pool", KEYS, [0, 1, 2]), r"^pool: expected (Async)?RegisteredPool, not str$"),
    ("load-keys-none-pool", lambda c, p: c.load_keys(None, KEYS, [0, 1, 2]), r"^pool: expected (Async)?RegisteredPool, not NoneType$"),
    ("submit-load-none-pool", lambda c, p: c.submit_load(None, [LoadSegment([KEY], [0])]), r"^pool: expected (Async)?RegisteredPool, not NoneType$"),
    ("submit-save-none-pool", lambda c, p: c.submit_save(None, [SaveSegment([KEY], [0])]), r"^pool: expected (Async)?RegisteredPool, not NoneType$"),
    # flows: the high-level pair and the pools' calls
    ("store-keys-negative-page", lambda c, p: c.store_keys(p, KEYS, [0, 1, -1]), r"^Put: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("store-keys-str-key", lambda c, p: c.store_keys(p, [*KEYS[:2], "key"], [0, 1, 2]), r"^Put: keys: .*\bstr\b"),
    ("store-keys-none-key", lambda c, p: c.store_keys(p, [*KEYS[:2], None], [0, 1, 2]), r"^Put: keys: .*NoneType"),
    ("store-keys-str-parent", lambda c, p: c.store_keys(p, KEYS, [0, 1, 2], parent_key="k"), r"^Put: parent_key: expected bytes, not str$"),
    ("store-keys-too-few-pages", lambda c, p: c.store_keys(p, KEYS, [0, 1]), r"^store: 2 pages for 3 keys$"),
    ("store-keys-not-a-list", lambda c, p: c.store_keys(p, 5, [0]), r"^store: keys: expected a sequence, not int$"),
    ("load-keys-negative-lease", lambda c, p: c.load_keys(p, KEYS, [0, 1, 2], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("load-keys-negative-page", lambda c, p: c.load_keys(p, KEYS, [0, 1, -1]), r"^Get: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("load-keys-float-page", lambda c, p: c.load_keys(p, KEYS, [0.5, 1, 2]), r"^Get: pages: .*float"),
    ("load-keys-str-key", lambda c, p: c.load_keys(p, [*KEYS[:2], "key"], [0, 1, 2]), r"^Lookup: keys: .*\bstr\b"),
    ("load-keys-pages-not-a-list", lambda c, p: c.load_keys(p, KEYS, 5), r"^load: pages: expected a sequence, not int$"),
    ("store-keys-set-of-keys", lambda c, p: c.store_keys(p, set(KEYS), [0, 1, 2]), r"^store: keys: expected a sequence, not set$"),
    ("store-none-tokens", lambda c, p: c.store(p, None, [0, 1, 2]), r"^token_ids: expected a sequence, not NoneType$"),
    ("store-str-tokens", lambda c, p: c.store(p, "tokens", [0, 1, 2]), r"^token_ids: expected a sequence, not str$"),
    ("store-nested-tokens", lambda c, p: c.store(p, [TOKENS], [0, 1, 2]), r"^token_ids: token ids must be one-dimensional, not of shape \(1, 12\)$"),
    ("store-negative-token", lambda c, p: c.store(p, [-1, *TOKENS[1:]], [0, 1, 2]), r"^token_ids: token ids must lie in \[0, 2\*\*32\)$"),
    ("store-negative-page", lambda c, p: c.store(p, TOKENS, [0, 1, -1]), r"^Put: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("load-negative-lease", lambda c, p: c.load(p, TOKENS, [0, 1, 2], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("pool-store-huge-page", lambda c, p: p.store(TOKENS, [0, 1, 2**40]), r"^Put: pages: value out of range: 1099511627776 \(a uint32: 0 to 4294967295\)$"),
    ("pool-load-float-token", lambda c, p: p.load([0.5, *TOKENS[1:]], [0, 1, 2]), r"^token_ids: token ids must be integers"),
    ("pool-store-keys-none-key", lambda c, p: p.store_keys([KEY, None], [0, 1]), r"^Put: keys: .*NoneType"),
    ("pool-load-keys-negative-lease", lambda c, p: p.load_keys(KEYS, [0, 1, 2], lease_ms=-1), r"^Lookup: lease_ms: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    # transfer jobs
    ("submit-load-negative-page", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, -1])]), r"^Get: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
    ("submit-load-str-key", lambda c, p: c.submit_load(p, [LoadSegment(["key"], [0])]), r"^Get: keys: .*\bstr\b"),
    ("submit-load-negative-lease", lambda c, p: c.submit_load(p, [LoadSegment([KEY], [0], lease_id=-1)]), r"^Get: lease_id: value out of range: -1 \(a uint64: 0 to 18446744073709551615\)$"),
    ("submit-load-page-count", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0])]), r"^load segment 0: 1 pages for 3 keys$"),
    ("submit-load-no-layer-groups", lambda c, p: c.submit_load(p, [LoadSegment([KEY], [0])], layer_groups=0), r"^layer_groups: must be at least 1 \(got 0\)$"),
    ("submit-load-float-layer-groups", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=1.5), r"^layer_groups: expected int, not float$"),
    ("submit-load-bool-layer-groups", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=True), r"^layer_groups: expected int, not bool$"),
    ("submit-load-str-layer-groups", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups="2"), r"^layer_groups: expected int, not str$"),
    ("submit-load-float-layer-range", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=[(0, 1.5), (1.5, 2)]), r"^layer_groups: range 0: expected int, not float$"),
    ("submit-load-str-layer-range", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=[("0", "1"), ("1", "2")]), r"^layer_groups: range 0: expected int, not str$"),
    ("submit-load-triple-layer-range", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=[(0, 1, 2)]), r"^layer_groups: range 0: expected a \(begin, end\) pair, not \(0, 1, 2\)$"),
    ("submit-load-none-layer-range", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=[None]), r"^layer_groups: range 0: expected a \(begin, end\) pair, not None$"),
    ("submit-load-none-segments", lambda c, p: c.submit_load(p, None), r"^segments: expected a sequence, not NoneType$"),
    ("submit-load-tuple-segment", lambda c, p: c.submit_load(p, [(KEYS, [0, 1, 2])]), r"^load segment 0: expected LoadSegment, not tuple$"),
    ("submit-load-save-segment", lambda c, p: c.submit_load(p, [SaveSegment(KEYS, [0, 1, 2])]), r"^load segment 0: expected LoadSegment, not SaveSegment$"),
    ("submit-load-none-lease", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2], lease_id=None)]), r"^Get: lease_id: expected int, not NoneType$"),
    ("submit-load-negative-timeout", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], timeout_s=-1), r"^timeout_s: expected a finite number of seconds >= 0, not -1$"),
    ("submit-load-str-timeout", lambda c, p: c.submit_load(p, [LoadSegment(KEYS, [0, 1, 2])], timeout_s="1"), r"^timeout_s: expected a number of seconds, not '1'$"),
    ("submit-save-load-segment", lambda c, p: c.submit_save(p, [LoadSegment(KEYS, [0, 1, 2])]), r"^save segment 0: expected SaveSegment, not LoadSegment$"),
    ("submit-save-none-parent", lambda c, p: c.submit_save(p, [SaveSegment(KEYS, [0, 1, 2], parent_key=None)]), r"^Put: parent_key: expected bytes, not NoneType$"),
    ("submit-save-negative-page", lambda c, p: c.submit_save(p, [SaveSegment(KEYS, [0, 1, -1])]), r"^Put: pages: value out of range: -1 \(a uint32: 0 to 4294967295\)$"),
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
    "Quarantine",
    "grpc.health.v1.Health/Check",
)


def rpcs_sent(stats: Any) -> int:
    """Requests of the calls above that the daemon has answered, whatever the answer."""
    return sum(stats.counter("rpc_seconds_count", method=m) for m in SENDING)


def closed_pool() -> SharedMemoryPool:
    shm = SharedMemoryPool(4096, name="closed", backing="memfd")
    shm.close()
    return shm


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


def test_invalid_argument_errors_are_also_value_errors():
    """Callers that caught the ValueError of the client's own checks (a layer range, a page
    count) still catch them."""
    assert issubclass(InvalidArgumentError, ValueError)


@pytest.mark.parametrize("settle_s", [61.0, 1e12, float("inf"), 10**400])
def test_a_check_settle_past_the_daemons_longest_wait_is_cut_to_it(settle_s):
    """``kvtier check --settle 1e12`` was refused with the wire field's overflow ("settle_ms:
    value out of range"); the daemon waits at most a minute, and so does such a request. An
    int past a float's range, converted before the cut (e06e2b2), raised OverflowError."""
    from kvtier.client.types import MAX_CHECK_SETTLE_S, check_request
    from kvtier.daemon.service import MAX_SETTLE_MS

    assert MAX_SETTLE_MS == MAX_CHECK_SETTLE_S * 1000
    assert check_request(settle_s).settle_ms == int(MAX_CHECK_SETTLE_S * 1000) == 60_000
    assert check_request(0.25).settle_ms == 250


@pytest.mark.parametrize("settle_s", [np.int8(3), np.uint8(3), np.int16(40)])
def test_regression_a_check_settle_given_as_a_small_numpy_integer_was_refused(settle_s):
    """The wait was multiplied by 1000 in the caller's own type: ``check(settle_s=np.int8(3))``
    raised NumPy's OverflowError (not a client error), and ``np.int16(40)`` wrapped to a
    negative ``settle_ms`` that was refused for a field the caller never named."""
    from kvtier.client.types import check_request

    assert check_request(settle_s).settle_ms == int(settle_s) * 1000


def test_the_clients_check_list_bound_is_the_daemons():
    """kvtier check --list refuses past the client's bound; the daemon cuts to its own."""
    from kvtier.client.types import MAX_CHECK_LIST
    from kvtier.daemon.service import MAX_CHECK_LIST as DAEMONS

    assert MAX_CHECK_LIST == DAEMONS


# ------------------------------------------------------------ construction


@pytest.mark.parametrize("client_type", [Client, AsyncClient])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": "30"}, r"^timeout_s: expected a number of seconds, not '30'$"),
        ({"timeout_s": -1.0}, r"^timeout_s: expected a finite number of seconds >= 0, not -1.0$"),
        ({"timeout_s": float("nan")}, r"^timeout_s: expected a finite number .*, not nan$"),
        ({"timeout_s": 0}, r"^timeout_s: must be more than 0 \(got 0\)$"),
        (
            {"timeout_s": 1e10},
            r"^timeout_s: expected at most 1e\+09 seconds .*, not 10000000000.0$",
        ),
        (
            {"timeout_s": 10**400},
            r"^timeout_s: expected a finite number .*, not an int of 1329 bits$",
        ),
        ({"max_batch_blocks": 0}, r"^max_batch_blocks: must be at least 1 \(got 0\)$"),
        pytest.param(
            {"max_batch_blocks": -(10**5000)},
            r"^max_batch_blocks: must be at least 1 \(got a negative int of 16610 bits\)$",
            id="max_batch_blocks=-(10**5000)",
        ),
        pytest.param(
            {"max_calls_open": 10**5000},
            r"^max_calls_open: must be at most 255 \(got an int of 16610 bits\): ",
            id="max_calls_open=10**5000",
        ),
        ({"max_batch_blocks": 2.5}, r"^max_batch_blocks: expected int, not float$"),
        ({"max_batch_blocks": True}, r"^max_batch_blocks: expected int, not bool$"),
        ({"client_name": 5}, r"^client_name: expected str, not int$"),
        ({"token_file": 0}, r"^token_file: expected str or PathLike, not int$"),
        ({"token": 5}, r"^token: expected bytes or str, not int$"),
        ({"token": bytearray(b"t")}, r"^token: expected bytes or str, not bytearray$"),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]!r}"[:40] for k in v) if isinstance(v, dict) else "",
)
def test_a_clients_own_settings_are_checked_at_construction(client_type, kwargs, message):
    """A str timeout failed every call inside gRPC with a TypeError, a zero batch size every
    store with range()'s ValueError, and a token_file of 0 read the process's stdin. A
    timeout of more years than gRPC's deadline holds (1e10 s) failed every call at once with
    DEADLINE_EXCEEDED, and an int past a float's range raised OverflowError."""
    with pytest.raises(InvalidArgumentError, match=message):
        client_type("unix:/nonexistent.sock", **kwargs)


@pytest.mark.parametrize("client_type", [Client, AsyncClient])
@pytest.mark.parametrize(
    ("address", "kind"),
    [(Path("/run/kvtierd.sock"), "PosixPath"), (b"unix:/run/kvtierd.sock", "bytes"), (5, "int")],
)
def test_regression_an_address_that_is_no_str_raised_an_untyped_error(client_type, address, kind):
    """The address was read as a str before any check: a ``Path`` to the daemon's socket
    (which ``token_file`` takes) raised AttributeError ('PosixPath' object has no attribute
    'startswith'), bytes a TypeError, from the constructor, and so did
    ``wait_until_serving``; no KvtierError."""
    message = rf"^address: expected str, not {kind}$"
    with pytest.raises(InvalidArgumentError, match=message):
        client_type(address)
    with pytest.raises(InvalidArgumentError, match=message):
        wait_until_serving(address, timeout_s=30)  # at once: waiting will not mend it


@pytest.mark.parametrize(
    ("timeout_s", "message"),
    [
        (-1, r"expected a finite number of seconds >= 0, not -1$"),
        (float("nan"), r"expected a finite number of seconds >= 0, not nan$"),
        (float("inf"), r"expected a finite number of seconds >= 0, not inf$"),
        (1e10, r"expected at most 1e\+09 seconds \(about 31 years\), not 10000000000.0$"),
        ("30", r"expected a number of seconds, not '30'$"),
        (None, r"expected a number of seconds, not None$"),
        (True, r"expected a number of seconds, not True$"),
    ],
    ids=["negative", "nan", "inf", "years", "str", "None", "bool"],
)
def test_regression_wait_until_serving_took_any_timeout(shared_daemon, timeout_s, message):
    """``wait_until_serving`` read its ``timeout_s`` unchecked: a negative or NaN one raised
    TimeoutError without asking the daemon once ("not serving after nans"), an infinite
    one waited for ever on a daemon that never came, and a str one raised Python's
    TypeError. It is refused as the calls' timeouts are, with a serving daemon there."""
    with pytest.raises(InvalidArgumentError, match=r"^wait_until_serving: timeout_s: " + message):
        wait_until_serving(shared_daemon.address, timeout_s=timeout_s)
    wait_until_serving(shared_daemon.address, timeout_s=np.float32(30))


@pytest.mark.parametrize("client_type", [Client, AsyncClient])
def test_a_token_file_that_cannot_be_read_is_a_typed_error_naming_it(tmp_path, client_type):
    missing = tmp_path / "missing.token"
    with pytest.raises(InvalidArgumentError, match=rf"^token_file {missing}: cannot be read: "):
        client_type("unix:/nonexistent.sock", token_file=str(missing))
    with pytest.raises(InvalidArgumentError, match=rf"^token_file {tmp_path}: cannot be read: "):
        client_type("unix:/nonexistent.sock", token_file=tmp_path)  # a folder
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    with pytest.raises(InvalidArgumentError, match=rf"^token_file {empty}: holds no token$"):
        client_type("unix:/nonexistent.sock", token_file=str(empty))


@pytest.mark.parametrize("client_type", [Client, AsyncClient])
def test_regression_a_token_not_utf8_or_a_token_file_with_a_nul_raised_pythons_error(client_type):
    """A str token with a lone surrogate (from a byte that is not UTF-8 in an argument or an
    environment variable) raised UnicodeEncodeError from the constructor, and a token_file
    path holding a NUL character open()'s ValueError ("embedded null byte"): neither a
    KvtierError naming the argument."""
    with pytest.raises(InvalidArgumentError, match=r"^token: not encodable as UTF-8 \("):
        client_type("unix:/nonexistent.sock", token="t\udcff")
    with pytest.raises(
        InvalidArgumentError, match=r"^token_file 'a\\x00b': holds a NUL character$"
    ):
        client_type("unix:/nonexistent.sock", token_file="a\0b")


class _BytesPath:
    """A path-like object whose path is bytes, as ``os.scandir(b"dir")``'s entries are."""

    def __init__(self, path: bytes) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


@pytest.mark.parametrize("client_type", [Client, AsyncClient])
def test_regression_a_token_file_whose_path_is_bytes_raised_typeerror(tmp_path, client_type):
    """The NUL check of a token_file path looked for a str NUL in ``os.fspath`` of it, and a
    path-like object whose path is bytes (which open() reads, as before that check) raised
    Python's TypeError ("a bytes-like object is required") from the constructor. Its token
    is read; one holding a NUL is refused naming it."""
    secret = tmp_path / "tenant.token"
    secret.write_text("t0ken\n")
    client = client_type("unix:/nonexistent.sock", token_file=_BytesPath(os.fsencode(secret)))
    assert client._token.value == b"t0ken"
    if isinstance(client, Client):
        client.close()
    else:
        asyncio.run(client.close())
    with pytest.raises(InvalidArgumentError, match=r"^token_file .*: holds a NUL character$"):
        client_type("unix:/nonexistent.sock", token_file=_BytesPath(b"a\0b"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"size_bytes": 1.5}, r"^size_bytes: expected int, not float$"),
        ({"size_bytes": float("nan")}, r"^size_bytes: expected int, not float$"),
        ({"size_bytes": "4096"}, r"^size_bytes: expected int, not str$"),
        ({"size_bytes": None}, r"^size_bytes: expected int, not NoneType$"),
        ({"size_bytes": True}, r"^size_bytes: expected int, not bool$"),
        ({"size_bytes": np.zeros((2, 2))}, r"^size_bytes: expected int, not ndarray$"),
        ({"size_bytes": -1}, r"^size_bytes: must be at least 1 \(got -1\)$"),
        (
            {"size_bytes": 10**5000},
            r"^size_bytes: an int of 16610 bits is more than a memory file ",
        ),
        ({"name": 7}, r"^name: expected str, not int$"),
        ({"name": b"x"}, r"^name: expected str, not bytes$"),
        ({"name": "a\0b"}, r"^name: 'a\\x00b' holds a NUL character$"),
        ({"name": "a/b", "backing": "shm"}, r"^name: 'a/b' holds a '/'"),
        (
            {"backing": 10**5000},
            r"^backing: must be one of \('memfd', 'shm'\), not an int of 16610",
        ),
        ({"backing": np.zeros((2, 2))}, r"^backing: must be one of \('memfd', 'shm'\), not array"),
        ({"seal": np.zeros((2, 2))}, r"^seal: expected bool, not ndarray$"),
        ({"mode": 1.5}, r"^mode: expected int, not float$"),
        (
            {"mode": 10**30},
            r"^mode: must be a file mode, 0 to 0o7777 \(got 1000000000000000000000000000000\)$",
        ),
        ({"shm_dir": 3, "backing": "shm"}, r"^shm_dir: expected str or PathLike, not int$"),
    ],
)
def test_regression_a_shared_memory_pools_bad_arguments_raised_pythons_errors(kwargs, message):
    """``SharedMemoryPool``'s arguments went unchecked to ``os`` and ``mmap``: a float or NaN
    size raised TypeError, one past a C long OverflowError, a name that is no str
    TypeError from os.path.join, one with a NUL ValueError ("embedded null byte"), a
    backing of an int past 4,300 digits the ValueError of its own refusal's repr, an
    array as backing or seal numpy's "truth value ... is ambiguous"; a negative size or
    a wrong backing was a plain ValueError. Each is InvalidArgumentError naming it."""
    kwargs = {"size_bytes": 4096, **kwargs}
    with pytest.raises(InvalidArgumentError, match=message):
        SharedMemoryPool(**kwargs).close()


@pytest.mark.parametrize("name", ["x" * 250, "\u00e9" * 125])
def test_regression_a_memfd_name_over_249_bytes_raised_oserror(name):
    """Linux takes a memfd's name up to 249 bytes (its "memfd:" prefix and the name fill a
    file name): a longer one raised a bare OSError (EINVAL, "Invalid argument") from the
    constructor, naming neither the name nor the limit. InvalidArgumentError naming both;
    one of 249 bytes is taken."""
    says = rf"^name: a memfd's name holds at most 249 bytes, this one {len(name.encode())}$"
    with pytest.raises(InvalidArgumentError, match=says):
        SharedMemoryPool(4096, name=name, backing="memfd").close()
    SharedMemoryPool(4096, name="x" * 249, backing="memfd").close()


def test_regression_a_shm_pool_name_over_name_max_is_refused_naming_the_limit(tmp_path):
    """A ``backing="shm"`` name longer than a file name in its folder may be (NAME_MAX, in
    bytes) raised a bare OSError (ENAMETOOLONG) from ``os.open``; it is InvalidArgumentError
    naming the limit, and a name of the limit's length is a pool."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    with SharedMemoryPool(4096, name="x" * limit, shm_dir=str(tmp_path)) as pool:
        assert os.path.basename(pool.path) == "x" * limit
    for name in ("x" * (limit + 1), "\u00e9" * (limit // 2 + 1)):  # bytes are counted
        size = len(name.encode())
        says = rf"^name: a file name in {re.escape(str(tmp_path))} holds at most {limit} bytes "
        says += rf"\(its NAME_MAX\), this one {size}$"
        with pytest.raises(InvalidArgumentError, match=says):
            SharedMemoryPool(4096, name=name, shm_dir=str(tmp_path)).close()
    assert os.listdir(tmp_path) == []


def test_a_token_file_this_user_may_not_read_is_permission_denied(tmp_path):
    """Open raised a bare PermissionError (an OSError, no KvtierError) from the constructor."""
    secret = tmp_path / "secret.token"
    secret.write_text("a-token\n")
    secret.chmod(0)

    def read() -> str:
        try:
            resolve_token(None, str(secret))
        except PermissionDeniedError as e:
            return str(e)
        return "read"

    # Root reads any file: the reading is done as another user (a child of this process,
    # which makes plain system calls only, before any client exists).
    text = run_as(NOBODY, NOGROUP, read) if os.geteuid() == 0 else read()
    assert re.match(rf"^token_file {secret}: cannot be read: Permission denied$", text)


# ------------------------------------------------------------------- jobs

WAITS: list[tuple[str, Callable[[Any, Any], Any], str]] = [
    ("wait-str-timeout", lambda c, j: j.wait("1"), r"^timeout_s: expected a number of seconds, not '1'$"),
    ("wait-negative-timeout", lambda c, j: j.wait(-1), r"^timeout_s: expected a number of seconds >= 0, not -1$"),
    ("wait-nan-timeout", lambda c, j: j.wait(float("nan")), r"^timeout_s: expected a number of seconds >= 0, not nan$"),
    ("client-wait-str-timeout", lambda c, j: c.wait(j.job_id, "1"), r"^timeout_s: expected a number of seconds, not '1'$"),
    ("wait-layers-str", lambda c, j: j.wait_layers("1"), r"^end_layer: expected int, not str$"),
    ("wait-layers-none", lambda c, j: j.wait_layers(None), r"^end_layer: expected int, not NoneType$"),
    ("wait-layers-negative", lambda c, j: j.wait_layers(-1), r"^end_layer: must be at least 0 \(got -1\)$"),
    ("wait-layers-str-timeout", lambda c, j: j.wait_layers(1, "1"), r"^timeout_s: expected a number of seconds, not '1'$"),
    ("wait-tuple-timeout-past-4300-digits", lambda c, j: j.wait((10**5000,)), r"^timeout_s: expected a number of seconds, not a tuple holding an int of more than 4,300 digits$"),
    ("job-none-id", lambda c, j: c.job(None), r"^job_id: expected int, not NoneType$"),
    ("wait-layers-past-4300-digits", lambda c, j: j.wait_layers(-(10**5000)), r"^end_layer: must be at least 0 \(got a negative int of 16610 bits\)$"),
    ("poll-str-id", lambda c, j: c.poll("1"), r"^job_id: expected int, not str$"),
]  # fmt: skip


def test_regression_an_argument_past_4300_digits_failed_its_own_refusal(shared_daemon):
    """Python refuses the repr of an int past 4,300 digits (ValueError), and the messages of
    the client's refusals named the int they refused: ``job(10**5000)``, ``evict(keys,
    10**5000)``, ``max_calls_open=10**5000`` and the like (the cases above with "past-4300"
    in their ids) raised that ValueError, no KvtierError. A message now shows such an int
    by its sign and size."""
    with (
        Client(shared_daemon.address) as client,
        pytest.raises(NotFoundError, match=r"^no job an int of 16610 bits \(never "),
    ):
        client.job(10**5000)


def test_regression_an_int_field_past_4300_digits_was_refused_in_pythons_words(shared_daemon):
    """Protobuf's refusal of an integer out of its field's range shows the value, which
    Python refuses to print past 4,300 digits: ``release(10**5000)`` was refused as
    "lease_id: Exceeds the limit (4300 digits) for integer string conversion ...", and a
    bool field's (``lookup(keys, pin=10**5000)``) raised that ValueError, no
    InvalidArgumentError. The refusal names the field, the value by its size, and what the
    field holds (the cases above with "past-4300" in their ids, both clients); a bool field
    takes no int at all."""
    with Client(shared_daemon.address) as client:
        with pytest.raises(InvalidArgumentError, match=r"^Release: lease_id: .* 16610 bits \(a"):
            client.release(10**5000)
        with pytest.raises(InvalidArgumentError, match=r"^Lookup: pin: expected bool, not int$"):
            client.lookup([KEY], pin=10**5000)


def _layer_major_layout(*args: Any) -> PoolLayout:
    """``staging.layer_major_layout``, imported here: its module needs torch."""
    from kvtier.client.integrations.staging import layer_major_layout

    return layer_major_layout(*args)


@pytest.mark.parametrize(
    "num_layers",
    [pytest.param(MAX_LAYERS + 1, id="max-plus-1"), pytest.param(10**5000, id="past-4300-digits")],
)
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda n: PoolLayout.staging(num_layers=n, num_pages=8, block_tokens=4, chunk_bytes=64), id="staging"),
        pytest.param(lambda n: PoolLayout.vllm(num_layers=n, num_pages=8, block_tokens=4, num_kv_heads=1, head_dim=16, dtype="uint8"), id="vllm"),
        pytest.param(lambda n: PoolLayout.flashinfer(num_layers=n, num_pages=8, block_tokens=4, num_kv_heads=1, head_dim=16, dtype="uint8"), id="flashinfer"),
        pytest.param(lambda n: mla_layout(num_layers=n, num_pages=8, block_tokens=4, latent_dim=16, dtype="uint8"), id="mla"),
        pytest.param(lambda n: _layer_major_layout(n, 8, 4, 64, "uint8"), id="layer-major"),
    ],
)  # fmt: skip
def test_regression_a_layout_of_10_to_the_5000_layers_spun_in_its_caller(build, num_layers):
    """``PoolLayout.staging(num_layers=10**5000, ...)`` (and the vLLM and FlashInfer
    layouts) built one layer after another until memory ran out: only ``validate``, at
    registration, refused more than ``MAX_LAYERS``. The count is refused first, by every
    builder of a layout layer by layer (the MLA and the staging pools' layer-major ones
    built past ``MAX_LAYERS`` after 3eed33d)."""
    with pytest.raises(LayoutError, match=rf"^num_layers must be at most {MAX_LAYERS}$"):
        build(num_layers)
    assert len(build(MAX_LAYERS).layers) == MAX_LAYERS


def test_regression_a_timeout_that_is_no_number_holding_an_int_past_4300_digits_was_untyped(
    shared_daemon,
):
    """checked_seconds named a timeout that is no number by its repr, which Python refuses
    for a container holding an int past 4,300 digits: ``timeout_s=[10**5000]`` raised that
    ValueError, no InvalidArgumentError (4b58ce7 showed the numbers it refuses, not these)."""
    with (
        Client(shared_daemon.address) as client,
        pytest.raises(InvalidArgumentError, match=r"^Lookup: timeout_s: .*, not a list holding"),
    ):
        client.lookup([KEY], timeout_s=[10**5000])


def test_regression_a_layouts_block_size_past_4300_digits_failed_its_own_refusal(
    shared_daemon, shm
):
    """A pool registered with a namespace whose block size is not its layout's is refused
    naming both sizes, and a layout's past 4,300 digits failed that message's formatting
    with Python's ValueError, no InvalidArgumentError."""
    layout = PoolLayout.staging(num_layers=2, num_pages=8, block_tokens=10**5000, chunk_bytes=64)
    with (
        Client(shared_daemon.address) as client,
        pytest.raises(InvalidArgumentError, match=r"^namespace: block_tokens 4 is not the lay"),
    ):
        client.register_pool(shm, layout, NS)


@pytest.mark.parametrize(("call", "message"), [w[1:] for w in WAITS], ids=[w[0] for w in WAITS])
def test_a_jobs_waits_refuse_bad_arguments(shared_daemon, shm, call, message):
    """A str timeout or layer failed inside threading with a TypeError; a NaN timeout waited
    for the whole job in the sync client and not at all in the asyncio one."""
    with Client(shared_daemon.address) as client:
        pool = client.register_pool(shm, LAYOUT, NS)
        job = client.submit_load(pool, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=2)
        with pytest.raises(InvalidArgumentError, match=message):
            call(client, job)
        assert job.wait(float("inf")).finished  # no limit, as None
        assert job.wait_layers(2) is not None


@pytest.mark.parametrize(("call", "message"), [w[1:] for w in WAITS], ids=[w[0] for w in WAITS])
async def test_an_async_jobs_waits_refuse_bad_arguments(shared_daemon, shm, call, message):
    async with AsyncClient(shared_daemon.address) as client:
        pool = await client.register_pool(shm, LAYOUT, NS)
        job = await client.submit_load(pool, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=2)
        with pytest.raises(InvalidArgumentError, match=message):
            result = call(client, job)
            if inspect.isawaitable(result):
                await result
        assert (await job.wait(float("inf"))).finished
        assert await job.wait_layers(2) is not None


class HeldGets:
    """A stub's ``Get`` whose calls' answers reach the job only once ``gate`` is set."""

    def __init__(self, get: Any) -> None:
        self._get = get
        self.gate = threading.Event()

    def future(self, request: Any, **kwargs: Any) -> Any:
        fut = self._get.future(request, **kwargs)
        held = self

        class Held:
            def add_done_callback(self, fn: Callable[[Any], None]) -> None:
                def later(_: Any) -> None:
                    threading.Thread(target=lambda: (held.gate.wait(10), fn(fut))).start()

                fut.add_done_callback(later)

            def __getattr__(self, name: str) -> Any:
                return getattr(fut, name)

        return Held()


def _opened_once_waited(job: Any, gate: threading.Event) -> threading.Thread:
    """A thread that sets ``gate`` once a thread waits on ``job`` (at most 10 s)."""

    def opener() -> None:
        for _ in range(1000):  # a bound on the wait, not a timing
            if job._cond._waiters:
                break
            threading.Event().wait(0.01)
        gate.set()

    thread = threading.Thread(target=opener)
    thread.start()
    return thread


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout_s", [1e10, 2**63, 10**400], ids=["1e10", "2**63", "10**400"])
@pytest.mark.parametrize("which", ["wait", "wait_layers"])
def test_regression_a_jobs_wait_longer_than_threading_takes_raised_overflow_error(
    shared_daemon, shm, timeout_s, which
):
    """A wait of more years than a thread's wait takes (``threading.TIMEOUT_MAX``, some 292)
    raised OverflowError (no client error) where the job was still running, and an int past
    a float's range did in both clients: such a wait is as long as one without a limit, and
    is waited so."""
    with Client(shared_daemon.address) as client:
        pool = client.register_pool(shm, LAYOUT, NS)
        client.stub.Get = held = HeldGets(client.stub.Get)
        job = client.submit_load(pool, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=2)
        opener = _opened_once_waited(job, held.gate)
        try:
            if which == "wait":
                assert job.wait(timeout_s).finished
            else:
                assert job.wait_layers(2, timeout_s=timeout_s) is not None
        finally:
            held.gate.set()
            opener.join()
        assert client.wait(job.job_id, timeout_s).finished


@pytest.mark.parametrize("timeout_s", [1e10, 10**400], ids=["1e10", "10**400"])
async def test_regression_an_async_jobs_wait_of_an_int_past_a_float_raised_overflow_error(
    shared_daemon, shm, timeout_s
):
    async with AsyncClient(shared_daemon.address) as client:
        pool = await client.register_pool(shm, LAYOUT, NS)
        job = await client.submit_load(pool, [LoadSegment(KEYS, [0, 1, 2])], layer_groups=2)
        assert await job.wait_layers(2, timeout_s=timeout_s) is not None
        assert (await job.wait(timeout_s)).finished


# ------------------------------------------------- what works where ints go


def test_numpy_integers_and_torch_pages_work_where_ints_do(shared_daemon, shm):
    """NumPy integers are integers everywhere an int goes (``layer_groups=np.int64(2)`` was
    a TypeError: it is not an int, so it was taken for a list of ranges), and a torch tensor
    of page indices is a page list in every call that takes one."""
    torch = pytest.importorskip("torch")
    with Client(shared_daemon.address) as client:
        pool = client.register_pool(shm, LAYOUT, NS)
        pages = torch.tensor([0, 1, 2])
        assert client.store_keys(pool, KEYS, pages) == 3
        assert client.put(np.uint64(pool.pool_id), KEYS, pages).prefix_len == 3
        found = client.lookup(KEYS, pin=True, lease_ms=np.int64(5000))
        assert client.get(pool.pool_id, KEYS, pages, lease_id=found.lease_id).prefix_len == 3
        client.release(np.uint64(found.lease_id))
        assert client.load_keys(pool, KEYS, pages) == 3
        assert client.load(pool, np.arange(12), torch.tensor([0, 1, 2])) == 12
        job = client.submit_load(
            pool, [LoadSegment(KEYS, pages)], layer_groups=np.int64(2), timeout_s=np.float64(5)
        )
        assert job.wait_layers(np.int64(1), timeout_s=np.float32(10)) is not None
        assert client.wait(np.int64(job.job_id)).done.all()
        saved = client.submit_save(pool, [SaveSegment(KEYS, pages)]).wait()
        assert saved.done.all()
        ranges = [(np.int64(0), np.int32(1)), (np.uint8(1), np.int64(2))]
        job = client.submit_load(pool, [LoadSegment(KEYS, pages)], layer_groups=ranges)
        assert job.wait().done.all()
        assert client.evict(KEYS, np.int64(Tier.L1_HOST)).missing == 0
        assert client.check(settle_s=np.float64(0.1)).ok


def test_fence_pool_refuses_what_is_no_binding_or_no_timeout(shared_daemon, shm):
    """A RegisteredPool for its binding failed on a missing attribute, a str timeout inside
    gRPC with a TypeError; the pool stays registered."""
    with Client(shared_daemon.address) as client:
        pool = client.register_pool(shm, LAYOUT, NS)
        with pytest.raises(InvalidArgumentError, match=r"^binding: expected PoolBinding, not "):
            client.fence_pool(pool)
        with pytest.raises(InvalidArgumentError, match=r"^timeout_s: expected a number of "):
            client.fence_pool(pool.binding, timeout_s="1")
        assert client.store_keys(pool, KEYS, [0, 1, 2]) == len(KEYS)
        assert client.fence_pool(pool.binding) is True


def test_keys_and_pages_given_as_iterators_are_read_once(shared_daemon, shm):
    """An iterator (a generator of keys, ``iter(pages)``) is read once, into the request: the
    call it is given to works as with a list, and a refused one names its field (above)."""
    with Client(shared_daemon.address) as client:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert client.put(pool.pool_id, (k for k in KEYS), iter([0, 1, 2])).prefix_len == 3
        assert client.lookup(k for k in KEYS).prefix_len == 3
        assert client.get(pool.pool_id, iter(KEYS), (p for p in [0, 1, 2])).prefix_len == 3


async def test_an_async_clients_iterator_arguments_are_read_once(shared_daemon, shm):
    async with AsyncClient(shared_daemon.address) as client:
        pool = await client.register_pool(shm, LAYOUT, NS)
        assert (await client.put(pool.pool_id, iter(KEYS), iter([0, 1, 2]))).prefix_len == 3
        assert (await client.lookup(k for k in KEYS)).prefix_len == 3
        assert (await client.get(pool.pool_id, iter(KEYS), iter([0, 1, 2]))).prefix_len == 3


def test_numpy_bools_work_where_bools_do(shared_daemon, shm):
    """A bool field takes NumPy's bool as it takes Python's (and refuses ints, above)."""
    with Client(shared_daemon.address) as client:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert client.put(pool.pool_id, KEYS, [0, 1, 2], durable=np.False_).prefix_len == 3
        found = client.lookup(KEYS, pin=np.True_)
        assert found.prefix_len == 3 and found.lease_id != 0
        client.release(found.lease_id)


async def test_an_async_clients_numpy_bools_work_where_bools_do(shared_daemon, shm):
    async with AsyncClient(shared_daemon.address) as client:
        pool = await client.register_pool(shm, LAYOUT, NS)
        assert (await client.put(pool.pool_id, KEYS, [0, 1, 2], durable=np.False_)).stored >= 0
        found = await client.lookup(KEYS, pin=np.True_)
        assert found.prefix_len == 3 and found.lease_id != 0
        await client.release(found.lease_id)
