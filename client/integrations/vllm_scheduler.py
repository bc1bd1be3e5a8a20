"""The scheduler side of the vLLM connector (runs in vLLM's EngineCore process).

It answers vLLM's "how many more tokens can be loaded" from a kvtier ``Lookup``, pins the
blocks it promised once vLLM has given them engine blocks, and tells the workers each step
which blocks to load and which to store.

Invariants:
- ``get_num_new_matched_tokens`` changes nothing in kvtier (a plain Lookup, no pin) and
  only memoises per request (keys, the last answer), so vLLM may call it again and again.
  A request that must not read cached KV (``skip_reading_prefix_cache``: prompt logprobs,
  or asked for) is not looked up, nor hinted: vLLM would drop its hit.
- A hit never covers a request's last token (vLLM needs one token to compute), and stops at
  the first block that is absent from any rank or held only in a tier the configuration
  excludes.
- The loads handed to the workers never need more staging pages than a worker keeps for
  loads (``StagingPages.loads``; saves have pages of their own, so saves in flight never
  take them): a hit is cut to the pages that this step's loads planned so far and the async
  loads still in flight leave free (a worker stages each block of a load in a page of its
  own, and the pages of a step's loads are taken all at once, or none are: the whole step's
  loads then fail). A step's loads hold their pages until its forward pass ends; an async load, until
  the workers report its request in ``finished_recving``, which vLLM passes here even for a
  request aborted meanwhile, so its pages are counted as long as a worker holds them.
- Every block of a request that this engine computed is offered for storing exactly once:
  during the step whose forward pass completes it (``SaveSpec``), or, for blocks whose token
  ids were not known in time, when the request finishes (``request_finished`` returns True
  and vLLM keeps the blocks until the worker reports the request in ``finished_sending``).
  Blocks loaded from kvtier or found in vLLM's own prefix cache are not stored again;
  blocks that failed to load and were recomputed are (kvtier may have lost them: a block
  evicted after the lookup, or unreadable, which the daemon drops).
- A lease is released by this side (its owner) once a worker reports its load done, or
  expires in the daemon; it never outlives ``shutdown`` (the end of the session releases
  it there). While the breaker is open no release is sent: the lease expires, or goes with
  the session, in the daemon. A Release is sent from a thread of this side's own, so that
  vLLM returns the step's outputs without waiting for the daemon's answer; the next step's
  ``build_connector_meta`` (and ``shutdown``) waits for it, so a lease a step's output
  reported done is released before the next step is planned. A Release the daemon leaves
  unanswered trips the breaker: the Releases queued behind it are not sent.
- A kvtier failure costs at most one timeout per ``retry_after_s`` (``Breaker``), and a
  daemon that does not answer one timeout until a health check, off vLLM's thread, finds it
  serving again: meanwhile requests are scheduled as if nothing were cached and nothing is
  saved.
- While a worker says its staging pool is refused (``KVTierWorkerMetadata.staging_refused``)
  no request is looked up (no hit, no pin, no hint) and no save is planned but a finished
  request's: that worker cannot load. Hits answered before its first such metadata arrived
  (the step that failed to make the pool, and the one or two planned ahead of it with async
  scheduling) fail at once on that worker and are recomputed.
- A request whose LoRA adapter has no key (not a local folder; see ``vllm_config``) is never
  looked up nor saved.
- A request whose async load failed (a worker names it in
  ``KVTierWorkerMetadata.failed_loads``) is offered no hit until vLLM has scheduled it again:
  the failure puts it back in vLLM's queue with its valid prefix computed, and vLLM asks here
  at once; offered the same hit, a load that keeps failing for a reason of its own (data
  lost behind an index that still lists it, a worker that cannot stage) would go round
  forever. Once it has run, a later ask (after a preemption) is answered afresh, as any
  other (as vLLM's own offloading connector answers every ask): each such ask follows a
  preemption, which kvtier does not cause, so it cannot loop.
  A layer-wise load that fails leaves the request running (vLLM recomputes its failed
  blocks in place and never asks again for it), so it changes no later answer.

Thread-safety: none; vLLM calls the scheduler connector from one thread. The releasing
thread touches only the client (which threads may share) and the breaker's ``ok`` and
``trip`` (a trip racing one on vLLM's thread pauses kvtier either way; which of the two
pauses' ends is kept does not matter, and probing starts under the breaker's lock).
"""

from __future__ import annotations

import collections
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.errors import KvtierError, ResourceExhaustedError
from kvtier.client.integrations.breaker import UNANSWERED, Breaker, daemon_answers
from kvtier.client.integrations.fingerprint import AdapterDigests
from kvtier.client.integrations.vllm_config import (
    LORA_TAG,
    ConnectorConfig,
    KeyChain,
    ModelIdentity,
    lora_key,
    request_extras,
    resolve_load_mode,
    staging_pages,
)
from kvtier.client.integrations.vllm_meta import (
    RECENT_STEPS,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvtier.client.integrations.vllm_stats import Deltas
from kvtier.client.sync import Client

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    """What the scheduler side remembers of one request."""

    request: Any
    chains: list[KeyChain]
    lora: str = ""  # lora_key of its adapter; empty without one
    block_ids: list[int] = field(default_factory=list)
    saved: int | None = None  # blocks [0, saved) need no store; None until first scheduled
    hit_start: int = 0  # the last answer of get_num_new_matched_tokens: first block ...
    hit_blocks: int = 0  # ... and how many
    hit_tiers: list[int] = field(default_factory=list)
    leases: dict[int, int] = field(default_factory=dict)
    lookups: int = 0  # get_num_new_matched_tokens calls: more than one, the request waited
    hinted: bool = False
    load_failed: bool = False  # its async load failed: no hit until vLLM schedules it again

    def tokens(self) -> Any:
        return self.request.all_token_ids


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        identity: ModelIdentity,
        num_engine_blocks: int,
        client: Client | None = None,
    ) -> None:
        self.config = resolve_load_mode(config, identity)  # ``auto`` decided
        self.identity = identity
        self.block_tokens = identity.block_tokens
        self.namespaces = [identity.namespace(t, p) for t, p in identity.ranks()]
        # Pages a worker keeps for loads, as the worker sizes its pool.
        self.load_pages = staging_pages(config, identity, num_engine_blocks).loads
        self.client = client or Client(
            config.address or None,
            timeout_s=config.lookup_timeout_s,
            client_name=f"vllm scheduler pid {os.getpid()}",
        )
        self.breaker = Breaker(config.retry_after_s, "lookup", probe=daemon_answers(self.client))
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []  # this step's, until build_connector_meta
        # The engine blocks each of the last RECENT_STEPS steps loaded layer-wise, and all
        # of them (see SaveSpec.reads).
        self._recent_loads: collections.deque[set[int]] = collections.deque(maxlen=RECENT_STEPS + 1)
        self._recently_loaded: set[int] = set()
        self._async_loading: dict[str, int] = {}  # request id: pages its async load holds
        self._finish_saves: list[SaveSpec] = []
        self._rewound: set[str] = set()  # failed_loads seen since the last step's metadata
        self._lease_owner: dict[int, str] = {}
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-release")
        self._releasing: list[Future[None]] = []  # Releases sent, until waited for
        # A worker's staging pool is refused by the daemon (KVTierWorkerMetadata).
        self.staging_refused = False
        self._adapters = AdapterDigests(LORA_TAG)
        self._unkeyed_adapters: set[str] = set()  # warned about once each
        self.stats: dict[str, int] = {
            "lookups": 0,
            "lookup_errors": 0,
            "hit_blocks": 0,
            "pin_errors": 0,
            "pin_refused": 0,
            "pin_shortfall_blocks": 0,
            "save_blocks_planned": 0,
            "finish_save_requests": 0,
            "hints": 0,
            "hint_blocks": 0,
            "hint_errors": 0,
            "failed_load_requests": 0,
        }
        self._deltas = Deltas()

    # ---------------------------------------------------------------- lookups

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        state = self._state(request)
        if state is None:
            return 0, False
        state.hit_start, state.hit_blocks, state.hit_tiers = 0, 0, []
        if (
            not self.config.load
            or state.load_failed
            or not self.breaker.ok()
            or self.staging_refused
        ):
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # vLLM computes its whole prompt (it would set the hit to 0)
        n = self.block_tokens
        start = num_computed_tokens // n
        # At least one token must be computed, and a worker must be able to stage the hit
        # beside the other loads it runs meanwhile.
        limit = min((request.num_tokens - 1) // n, start + self._staging_left())
        if limit <= start:
            return 0, False
        found = limit - start
        tiers: list[int] = []
        self.stats["lookups"] += 1
        try:
            for chain in state.chains:
                keys = self._keys(state, chain, limit)[start:limit]
                result = self.client.lookup(keys)
                ok = 0
                for tier in result.tiers[:found]:
                    if int(tier) not in self.config.load_tier_values:
                        break
                    ok += 1
                found = min(found, ok)
                if not tiers:
                    tiers = [int(t) for t in result.tiers[:found]]
                if found == 0:
                    break
        except KvtierError as e:
            self.stats["lookup_errors"] += 1
            self.breaker.trip(e)
            return 0, False
        if found < self.config.min_load_blocks:
            return 0, False
        state.lookups += 1
        if state.lookups > 1 and not state.hinted and self.config.hint_ms:
            # vLLM asks again: the request is waiting in its queue. Name its hit to the daemon
            # so the blocks stay (and come up from lower tiers) until it runs.
            self._hint(state, start, found)
        state.hit_start, state.hit_blocks, state.hit_tiers = start, found, tiers[:found]
        return found * n, self.config.load_mode == "async"

    def _hint(self, state: _Request, start: int, found: int) -> None:
        state.hinted = True
        keys = [
            k for chain in state.chains for k in self._keys(state, chain, start + found)[start:]
        ]
        try:
            self.client.prefetch(keys, deadline_ms=self.config.hint_ms)
        except KvtierError as e:
            self.stats["hint_errors"] += 1
            self.breaker.trip(e)
            return
        self.stats["hints"] += 1
        self.stats["hint_blocks"] += found

    def hit_tiers(self, request: Any) -> list[int]:
        """Wire tiers of the blocks of the last hit answered for ``request``."""
        state = self._requests.get(request.request_id)
        return list(state.hit_tiers) if state is not None else []

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        (block_ids,) = blocks.get_block_ids()
        state.block_ids = list(block_ids)
        if num_external_tokens == 0:
            return
        nblocks = num_external_tokens // self.block_tokens
        start = state.hit_start
        if nblocks > state.hit_blocks:
            # vLLM only ever trims a hit; were it to ask for more, the extra blocks are
            # loaded like any other, and reported (so recomputed) if kvtier lacks them.
            log.warning(
                "kvtier connector: vLLM allocated %d external blocks for request %s, %d matched",
                nblocks,
                request.request_id,
                state.hit_blocks,
            )
        keys: dict[int, list[bytes]] = {}
        leases: dict[int, int] = {}
        for rank, chain in enumerate(state.chains):
            keys[rank] = self._keys(state, chain, start + nblocks)[start : start + nblocks]
            if not self.breaker.ok():
                continue  # the load will fail and vLLM recomputes: nothing to pin
            try:
                pinned = self.client.lookup(keys[rank], pin=True, lease_ms=self.config.lease_ms)
            except ResourceExhaustedError:
                # A limit, not a fault: the session's or tenant's leases, or what the tenant
                # may protect (policy.hint_max_share). The blocks load unpinned; any evicted
                # meanwhile are reported missing and recomputed. Tripping the breaker here
                # ran the engine without kvtier for retry_after_s at every busy step.
                self.stats["pin_refused"] += 1
                continue
            except KvtierError as e:
                self.stats["pin_errors"] += 1
                self.breaker.trip(e)
                continue
            if pinned.prefix_len < nblocks:
                # Evicted since the lookup: the worker will find them missing and report
                # them, and vLLM recomputes them.
                self.stats["pin_shortfall_blocks"] += nblocks - pinned.prefix_len
            if pinned.lease_id:
                leases[rank] = pinned.lease_id
                self._lease_owner[pinned.lease_id] = request.request_id
        state.leases.update(leases)
        self.stats["hit_blocks"] += nblocks
        self._loads.append(
            LoadSpec(request.request_id, list(block_ids[start : start + nblocks]), keys, leases)
        )
        if self.config.load_mode == "async":
            self._async_loading[request.request_id] = (
                self._async_loading.get(request.request_id, 0) + nblocks
            )

    def _staging_left(self) -> int:
        """Staging pages of a worker that no planned load holds (see the module docstring)."""
        if self.config.load_mode == "async":
            held = sum(self._async_loading.values())  # this step's loads among them
        else:
            held = sum(len(spec.block_ids) for spec in self._loads)
        return max(0, self.load_pages - held)

    # ------------------------------------------------------------------ steps

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        self._wait_for_releases()
        meta = KVTierConnectorMetadata(
            loads=self._loads, saves=self._finish_saves, rewound=self._rewound
        )
        self._loads, self._finish_saves, self._rewound = [], [], set()
        # Blocks recent steps load while they compute: a save computed over one says so.
        loading = set()
        if self.config.load_mode == "layerwise":
            loading = {b for spec in meta.loads for b in spec.block_ids}
        if loading or self._recently_loaded:
            self._recent_loads.append(loading)
            self._recently_loaded = set().union(*self._recent_loads)
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.load_failed = False  # it runs: a later ask is answered afresh
            state.block_ids = list(new.block_ids[0])
            # What vLLM found cached (its own prefix cache or kvtier) is not stored again.
            state.saved = new.num_computed_tokens // self.block_tokens
            self._plan_save(state, new.num_computed_tokens + num_scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            state.load_failed = False
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Resumed after preemption: these are all of its blocks now.
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            if state.saved is None:
                state.saved = cached.num_computed_tokens[i] // self.block_tokens
            computed_after = cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)
            self._plan_save(state, computed_after, meta)
        return meta

    def _plan_save(
        self, state: _Request, computed_tokens: int, meta: KVTierConnectorMetadata
    ) -> None:
        """Store the blocks that are complete once this step has run."""
        spec = self._save_spec(state, computed_tokens, state.block_ids, at_finish=False)
        if spec is not None:
            meta.saves.append(spec)

    def _save_spec(
        self, state: _Request, computed_tokens: int, block_ids: list[int], *, at_finish: bool
    ) -> SaveSpec | None:
        if self.config.save == "none" or state.saved is None:
            return None
        if not at_finish and (not self.breaker.ok() or self.staging_refused):
            # Paused, or a worker has no staging pool: planned later (a later step, or the
            # finish, which always tries: the worker drops it at once if it still cannot).
            return None
        request = state.request
        tokens = state.tokens()
        limit = min(computed_tokens, len(tokens)) // self.block_tokens
        if self.config.save == "prompt":
            limit = min(limit, request.num_prompt_tokens // self.block_tokens)
        limit = min(limit, len(block_ids))
        start = state.saved
        if limit <= start:
            return None
        keys: dict[int, list[bytes]] = {}
        parents: dict[int, bytes] = {}
        for rank, chain in enumerate(state.chains):
            keys[rank] = self._keys(state, chain, limit)[start:limit]
            parents[rank] = chain.parent_of(start)
        state.saved = limit
        self.stats["save_blocks_planned"] += limit - start
        loaded = self._recently_loaded
        reads = sorted(loaded.intersection(block_ids[:limit])) if loaded and not at_finish else []
        return SaveSpec(
            request.request_id, list(block_ids[start:limit]), keys, parents, at_finish, reads
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        spec = self._save_spec(state, request.num_computed_tokens, list(block_ids), at_finish=True)
        if spec is None:
            return False, None
        self._finish_saves.append(spec)
        self.stats["finish_save_requests"] += 1
        return True, None

    def update_connector_output(self, connector_output: Any) -> None:
        # Every worker has freed these requests' staging pages before reporting them.
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._async_loading.pop(req_id, None)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVTierWorkerMetadata):
            if meta.staging_refused is not None and meta.staging_refused != self.staging_refused:
                self.staging_refused = meta.staging_refused
                log.info(
                    "kvtier connector: %s",
                    "a worker's staging pool is refused by the daemon (its log says why): "
                    "no hit is offered, nothing is stored"
                    if meta.staging_refused
                    else "the workers' staging pools are registered: kvtier is used again",
                )
            for lease in meta.done_leases:
                self._release(lease)
            # The workers withhold these requests' saves until told that the steps
            # planned from here on know of the failure (see KVTierConnectorMetadata).
            self._rewound |= meta.failed_loads
            for req_id in meta.failed_loads:
                state = self._requests.get(req_id)
                if state is None:
                    continue
                self.stats["failed_load_requests"] += 1
                if self.config.load_mode == "async":
                    state.load_failed = True
                else:
                    # vLLM recomputes from its first failed block on; those blocks are stored
                    # once recomputed (kvtier may have lost them), from what vLLM's next step
                    # says it computed (see build_connector_meta).
                    state.saved = None

    def _release(self, lease: int) -> None:
        req_id = self._lease_owner.pop(lease, None)
        if req_id is None:
            return
        state = self._requests.get(req_id)
        if state is not None:
            state.leases = {r: x for r, x in state.leases.items() if x != lease}
        if not self.breaker.ok():
            # Nothing is sent while the breaker is open: to a daemon that does not answer,
            # each release would cost vLLM's thread a timeout; the daemon expires the lease
            # after lease_ms in any case.
            return
        # Off vLLM's thread: it returns the step's outputs after this (a hit's Release cost
        # it 1-4 ms on a busy 2-core host, a daemon that does not answer the timeout).
        self._releasing.append(self._releaser.submit(self._send_release, lease))

    def _send_release(self, lease: int) -> None:
        """On the releasing thread. A Release the daemon left unanswered trips the breaker,
        so the step's other Releases are not sent: each would cost a timeout, one after
        another, and the next ``build_connector_meta`` waits for them all."""
        if not self.breaker.ok():
            return  # the daemon expires the lease (see ``_release``)
        try:
            self.client.release(lease)
        except UNANSWERED as e:
            self.breaker.trip(e)
        except KvtierError:
            pass  # already expired, or the daemon restarted: nothing is pinned either way

    def _wait_for_releases(self) -> None:
        """Wait for the Releases sent so far (each bounded by the client's timeout; usually
        answered long before)."""
        releasing, self._releasing = self._releasing, []
        for sent in releasing:
            sent.result()

    def take_stats(self) -> dict[str, int]:
        """The counters' increments since the last call (vLLM's per-step connector stats)."""
        return self._deltas.take(self.stats, {})

    def shutdown(self) -> None:
        self.breaker.close()
        for lease in list(self._lease_owner):
            self._release(lease)
        self._wait_for_releases()
        self._releaser.shutdown()
        self.client.close()

    # ---------------------------------------------------------------- helpers

    def _state(self, request: Any) -> _Request | None:
        state = self._requests.get(request.request_id)
        if state is None:
            if getattr(request, "prompt_embeds", None) is not None:
                return None  # token ids are placeholders: nothing to key by
            lora = ""
            adapter = getattr(request, "lora_request", None)
            if adapter is not None:
                lora = lora_key(adapter, self._adapters) or ""
                if not lora:
                    self._warn_unkeyed(adapter)
                    return None
            state = _Request(request, [KeyChain(ns) for ns in self.namespaces], lora)
            self._requests[request.request_id] = state
        return state

    def _warn_unkeyed(self, adapter: Any) -> None:
        path = str(getattr(adapter, "lora_path", "") or "")
        if path in self._unkeyed_adapters:
            return
        self._unkeyed_adapters.add(path)
        log.warning(
            "kvtier connector: LoRA adapter %r (%r) is not a local folder whose files can be "
            "read here; its requests are not cached (pass a local path to cache them)",
            getattr(adapter, "lora_name", ""),
            path,
        )

    def _keys(self, state: _Request, chain: KeyChain, nblocks: int) -> list[bytes]:
        tokens = state.tokens()
        extras = request_extras(state.request, self.block_tokens, nblocks, state.lora)
        return chain.extend(tokens, nblocks, extras)
