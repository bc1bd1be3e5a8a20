"""kvtier as an SGLang HiCache storage backend (SGLang's third cache level, "L3").

Enable it with SGLang's own flags (see the README's SGLang section)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.client.integrations.sglang",
        "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "allocator": "shm"}'

SGLang's ``StorageBackendFactory`` builds ``KVTierHiCacheStorage(storage_config, kwargs)``,
then hands it the rank's host KV pool (``register_mem_pool_host``). Its cache controller then
asks ``batch_exists`` how many leading pages of a request kvtier holds, loads them into host
pages (``batch_get_v1``, or the legacy ``batch_get``) and stores pages it wrote back
(``batch_set_v1`` / ``batch_set``), from its prefetch and backup threads.

Invariants:
- No call raises into SGLang and none waits longer than its timeout (``lookup_timeout_s``
  for a lookup; ``io_timeout_s`` for a transfer, and for a lookup that tries a refused
  pool's registration again; plus the fence's ``io_timeout_s`` or ``late_copy_grace_s``
  after a direct transfer that ended without an answer): a failure, a daemon that is down
  or hung, or a bad argument is a miss (0 pages found, ``False`` per page, ``None`` per
  legacy page), logged, and then kvtier is not asked again for ``retry_after_s``
  (``Breaker``), or, for a daemon that did not answer, until a health check off SGLang's
  threads (every ``retry_after_s``) finds it serving again. Only a configuration that
  cannot work stops SGLang at start, with a ``ValueError`` naming the problem.
- A stored block is one SGLang flat data page under a key bound to the namespace
  (``sglang_config``), so a page loaded is byte for byte the page some engine of the same
  model, dtype (and KV cache format, where the pool's dtype hides it: FP8 held as uint8),
  layout, page size and rank stored.
- Zero copy: when SGLang's host pool lives in shared memory (``"allocator": "shm"``, a
  memfd), that memory is registered with the daemon and the v1 calls name its pages: the
  daemon copies straight between the host pool and its tiers. Otherwise, and for the legacy
  calls, pages go through a shared-memory staging pool (``StagingPool``) with one tensor
  copy each way. The start-up log line says which.
- A staged transfer that ended without an answer retires its staging pool (a late copy
  lands in memory nobody reuses). A direct one fences the host pool before SGLang gets its
  pages back: it unregisters the pool and waits up to ``io_timeout_s`` for the daemon's
  answer, which comes only once no copy uses that memory (the next transfer registers it
  again). Only when that answer does not come either does it wait ``late_copy_grace_s``
  instead; a daemon stopped mid-copy (SIGSTOP) for longer than both can still finish the
  copy later (see the README).
- A staging pool the daemon refuses (``staging.REFUSALS``: a limit below its size or count,
  memory it cannot use), when made or when registered again after a daemon restart (then
  it is retired: its memory goes), is said once as an ERROR, counted
  (``staging_refusals``), and tried again only as ``staging.RegistrationRefusals`` backs
  off (from ``retry_after_s``, doubling, up to ``staging.REFUSED_RETRY_MAX_S``), never a
  new region every ``retry_after_s``.
  Meanwhile staged transfers miss at once, and so do lookups when every transfer is staged
  (no hit that no load could fill), and the rest of a transfer that shared the pool when
  it was refused. Once the back-off is due, such a lookup tries the registration first
  and answers 0 if it is refused again. The breaker is not tripped: the daemon answers.
- SGLang's host pool refused in zero-copy mode (the same refusals, at its first
  registration or when it is registered again after a daemon restart or a fence) is
  handled the same way, counted as ``host_pool_refusals``: its zero-copy transfers and
  lookups miss at once while the refusal stands, and once it is due a lookup tries it
  first. The backend does not switch to staged transfers by itself; the ERROR says what
  the operator can change.
- A transfer that finds the staging pool held by two others for ``io_timeout_s`` misses,
  counted apart (``staging_busy``): a busy local pool is not an unanswered daemon, so the
  breaker is not tripped (the holders' own calls trip it if the daemon does not answer),
  as the vLLM connector fails a load that finds no free staging page without pausing.
- A new host pool (``register_mem_pool_host`` called again) retires the old staging pool,
  closed once the transfers holding its pages have ended, and unregisters the old host
  pool: a zero-copy transfer that named it meanwhile misses without tripping the breaker
  (the daemon answered for a pool it no longer has).
- Host pools other than the KV pool (hybrid models' Mamba, SWA, DSA indexer pools, and a
  speculative-decoding draft's own pool: SGLang's v2 calls) are refused at start; a draft
  whose layers SGLang packs into the KV pool (MTP) is bound in the namespace.

Thread-safety: every public method may be called from any thread (SGLang uses several);
the client is thread-safe, lazily created pools and the refusals' state are guarded by a
lock, the host pool is registered again in a new session by one thread at a time (the
others take its answer), and at most two transfers share the staging pool, each within its
own half.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvtier.client.errors import KvtierError, unclean
from kvtier.client.integrations.breaker import Breaker, daemon_answers
from kvtier.client.integrations.fingerprint import same_checkpoint
from kvtier.client.integrations.sglang_config import (
    BYTE_DTYPES,
    DraftModel,
    PageFormat,
    StorageOptions,
    describe_host_pool,
    draft_fingerprint,
    namespace_for,
    storage_key,
    storage_keys,
)
from kvtier.client.integrations.staging import REFUSALS, RegistrationRefusals, StagingPool
from kvtier.client.keys import Namespace
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.sync import Client, RegisteredPool
from kvtier.client.types import PutStatus
from kvtier.kernels.layout import PoolLayout

log = logging.getLogger(__name__)

_STAGING_MAX_PAGES = 256  # two of SGLang's 128-page storage batches

_T = TypeVar("_T")


class _NoPool(Exception):
    """A transfer that cannot have the pool it needs (the staging pool, or SGLang's host
    pool in zero-copy mode), from a daemon that answers: a miss, never a reason to pause
    kvtier (the breaker is not tripped)."""


class _PoolRefused(_NoPool):
    """The daemon refused the pool, now or at a try whose back-off has not ended
    (``RegistrationRefusals``)."""


class _StagingBusy(_NoPool):
    """Two other transfers held the staging pool's halves for ``io_timeout_s``."""


class _StagingRetired(_NoPool):
    """Another transfer retired the staging pool while this one held it (between two of its
    chunks, or before its Get or Put, with the pool no longer registered in the client's
    session): the daemon refused it when it was registered again (said by
    ``_staging_refused``), or a transfer ended without an answer (that one's own call trips
    the breaker)."""

    def __init__(self, generation: int) -> None:
        super().__init__(
            f"the staging pool generation {generation} was retired by another transfer"
        )


class _HostPoolReplaced(_NoPool):
    """SGLang's host pool was replaced (``register_mem_pool_host`` called again) while a
    zero-copy transfer named it: the daemon answered for a pool that this backend had
    unregistered meanwhile."""


def _kv_cache_dtype(page: PageFormat, options: StorageOptions) -> str:
    """SGLang's ``--kv-cache-dtype`` as this engine runs it, for a host pool whose dtype
    does not tell the cache's format (``BYTE_DTYPES``: either FP8 format is held as uint8,
    and an engine that loaded the other's pages would decode every value wrongly); empty
    for other pools. Raises ValueError when SGLang's setting cannot be read, unless the
    extra config's ``namespace.extra`` is set (the operator binds the format there)."""
    if page.dtype not in BYTE_DTYPES:
        return ""
    try:
        from sglang.srt.runtime_context import get_model

        return str(get_model().kv_cache_dtype)
    except (ImportError, ValueError, AttributeError) as e:
        if options.namespace.extra:
            return ""
        raise ValueError(
            f"kvtier HiCache storage: SGLang holds this KV cache as {page.dtype}, whichever "
            f"format --kv-cache-dtype chose, and kvtier cannot read that setting ({e}); set "
            '"namespace": {"extra": "<the --kv-cache-dtype>"} in the extra config, so that '
            "engines whose caches differ in format never share blocks"
        ) from e


def _draft(page: PageFormat, options: StorageOptions) -> str:
    """The ``draft_fingerprint`` of the speculative-decoding draft whose layers SGLang packs
    into this host pool (MTP drafts); empty for a pool without them. Two engines of one
    target whose drafts differ have pools alike (only the layer count shows), and one would
    load the other's draft KV. Raises ValueError when SGLang's settings cannot be read,
    unless the extra config's ``namespace.extra`` is set (the operator binds the draft
    there)."""
    if not page.draft_layers:
        return ""
    try:
        from sglang.srt.runtime_context import get_model, get_spec

        spec, model = get_spec(), get_model()
        path = str(spec.speculative_draft_model_path or model.model_path)
        draft = DraftModel(
            algorithm=str(spec.speculative_algorithm or ""),
            path=path,
            revision=str(spec.speculative_draft_model_revision or ""),
            load_format=str(spec.speculative_draft_load_format or ""),
            quantization=str(spec.speculative_draft_model_quantization or ""),
            own=same_checkpoint(path, str(model.model_path)),
        )
    except (ImportError, ValueError, AttributeError) as e:
        if options.namespace.extra:
            return ""
        raise ValueError(
            f"kvtier HiCache storage: SGLang packs {page.draft_layers} speculative-decoding "
            f"draft layer(s) into this host pool, and kvtier cannot read which draft ({e}); "
            'set "namespace": {"extra": "<the draft model>"} in the extra config, so that '
            "engines whose drafts differ never share blocks"
        ) from e
    return draft_fingerprint(draft, options.namespace.weights_fingerprint)


class KVTierHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a kvtier daemon; see the module docstring.

    ``kwargs`` is the dict of extra arguments SGLang's factory passes (unused)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        self.options = StorageOptions.from_extra_config(storage_config.extra_config)
        self.client = Client(
            self.options.address or None,
            timeout_s=self.options.io_timeout_s,
            client_name=(
                f"sglang hicache tp{storage_config.tp_rank}/pp{storage_config.pp_rank} "
                f"pid {os.getpid()}"
            ),
        )
        self.breaker = Breaker(
            self.options.retry_after_s, "HiCache storage", probe=daemon_answers(self.client)
        )
        self.page: PageFormat | None = None
        self.namespace: Namespace | None = None
        self.mode = "unregistered"  # "direct" or "staged" once a host pool is registered
        self._seed = b""
        self._host_pool: Any = None
        self._direct_shm: SharedMemoryPool | None = None
        self._direct: RegisteredPool | None = None
        self._staging: StagingPool | None = None
        self._staging_generation = 0
        self._staging_users = threading.BoundedSemaphore(2)
        # The daemon's refusals of the staging pool, and of the host pool in zero-copy
        # mode: when to try each again (under _lock).
        self.refusals = RegistrationRefusals(self.options.retry_after_s)
        self.host_pool_refusals = RegistrationRefusals(self.options.retry_after_s)
        self._warned_busy = False
        # Whether every transfer goes through the staging pool: a host pool not registered
        # itself, or SGLang's legacy calls (no "interface_v1": SGLang's own key).
        self._all_staged = True
        self._lock = threading.Lock()
        # Held while the host pool is registered again in a new session (_host_pool_id).
        self._registering = threading.Lock()
        self._closed = False
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self.counters: dict[str, int] = {
            "lookups": 0,
            "pages_found": 0,
            "pages_loaded": 0,
            "pages_stored": 0,
            "failures": 0,
            "skipped": 0,
            "staging_refusals": 0,
            "host_pool_refusals": 0,
            "staging_busy": 0,
        }

    # ------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the namespace to this rank's host pool and choose direct or staged
        transfers. Raises ValueError for a pool whose pages cannot be stored. Called again
        (a new host pool), it releases the old pools, and the new ones are registered at
        their first transfer, whatever the daemon's refusals of the old ones."""
        super().register_mem_pool_host(mem_pool_host)
        page = describe_host_pool(mem_pool_host)
        try:
            mem_pool_host.get_data_page(0, flat=True)
        except Exception as e:
            raise ValueError(
                f"kvtier HiCache storage: {page.pool_class} with layout {page.layout} has no "
                f"flat data pages ({e}); use layer_first, page_first or page_first_direct"
            ) from e
        namespace = namespace_for(
            self.storage_config,
            page,
            self.options,
            _kv_cache_dtype(page, self.options),
            _draft(page, self.options),
        )
        direct, why = self._direct_memory(mem_pool_host, page)
        with self._lock:
            self._release_pools("a new host pool replaced the one it staged")
            # The refusals were of the old host pool's registrations, or of a staging pool
            # sized for its pages: the new pools are tried at their first transfer.
            self.refusals.forget()
            self.host_pool_refusals.forget()
            self.page, self.namespace, self._host_pool = page, namespace, mem_pool_host
            self._seed = namespace.seed()
            self._direct_shm = direct
            self.mode = "direct" if direct is not None else "staged"
            interface_v1 = (self.storage_config.extra_config or {}).get("interface_v1", 0)
            self._all_staged = self.mode == "staged" or not bool(interface_v1)
        if direct is not None:
            how = "zero copy: the host pool (shared memory) is registered with the daemon"
        else:
            how = f"staged through a shared-memory pool ({why})"
        log.info(
            "kvtier HiCache storage: %s; namespace model=%s dtype=%s layout=%s page=%d "
            "tokens (%d bytes) tp=%d/%d pp=%d/%d; %s",
            self.client.address,
            namespace.model,
            namespace.kv_dtype,
            namespace.kv_layout,
            page.page_tokens,
            page.page_bytes,
            namespace.tp_rank,
            namespace.tp_size,
            namespace.pp_rank,
            namespace.pp_size,
            how,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Refuse every host pool but the KV pool (ValueError: SGLang stops). SGLang moves
        the others' pages (Mamba, SWA, indexer caches, a speculative-decoding draft's own
        pool) through the v2 calls, which this backend does not have. A draft's pool (EAGLE
        and standalone drafts: a sidecar) is registered after ``on_host_pools_registered``,
        through this call alone: refused only there, it was accepted, and every store and
        lookup of the engine then raised NotImplementedError in SGLang's threads."""
        name = str(host_pool_name)
        if name != "kv":
            # The operator needs a way to start: a draft can change, a hybrid model cannot.
            if name.startswith("draft"):
                what = (
                    "a speculative-decoding draft's own KV (EAGLE, EAGLE-3, a standalone "
                    "draft model); run it with a draft whose layers SGLang packs into the KV "
                    "pool (an MTP draft) or without speculative decoding, or drop "
                    "--hicache-storage-backend (kvtier)"
                )
            else:
                what = (
                    "a hybrid model's SWA, Mamba or indexer cache; run this model without "
                    "kvtier: drop its --hicache-storage-backend"
                )
            raise ValueError(
                "kvtier HiCache storage stores the KV pool only; this engine also has the "
                f"host pool {name!r}, {what}"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _direct_memory(
        self, host_pool: Any, page: PageFormat
    ) -> tuple[SharedMemoryPool | None, str]:
        """SGLang's host pool memory as a pool to register, when the host pool is one
        memory file that the page format locates; else why not."""
        if not self.options.register_host_pool:
            return None, "register_host_pool is false"
        if page.segments is None:
            return None, page.why_no_segments
        allocator = getattr(host_pool, "allocator", None)
        fds = [fd for fd in getattr(allocator, "fds", None) or [] if fd is not None]
        mms = getattr(allocator, "mms", None) or []
        if len(fds) != 1 or len(mms) != 1:
            return None, 'the host pool is not in shared memory (set "allocator": "shm")'
        buffer = host_pool.kv_buffer
        base = ctypes.addressof(ctypes.c_char.from_buffer(mms[0]))
        if buffer.data_ptr() != base:
            return None, "the host pool's buffer does not start its memory file"
        try:
            shm = SharedMemoryPool.from_fd(fds[0], label="sglang-host-pool")
        except (OSError, ValueError) as e:
            return None, f"its memory file cannot be mapped ({e})"
        if self._layout(page, shm.size_bytes) is None:
            shm.close()
            return None, "the host pool's pages lie beyond its memory file"
        return shm, ""

    @staticmethod
    def _layout(page: PageFormat, region_bytes: int) -> PoolLayout | None:
        assert page.segments is not None
        layout = PoolLayout(page.segments, page.num_pages, page.page_tokens, page.dtype)
        try:
            layout.validate(region_bytes)
        except ValueError:
            return None
        return layout

    def _direct_pool(self) -> tuple[RegisteredPool, int]:
        """SGLang's host pool, registered in the client's current session (again after a
        daemon restart or a fence), and its id there. Raises ``_PoolRefused`` while the
        daemon's refusal of it stands, and when it refuses it now (``_host_pool_refused``):
        registering it every ``retry_after_s`` would not change the daemon's answer."""
        with self._lock:
            if self.host_pool_refusals.standing():
                self._count("skipped", 1)
                raise _PoolRefused("the daemon refused the host pool; its next try is not due")
            pool = self._direct
            if pool is None:
                assert self._direct_shm is not None and self.page is not None
                layout = self._layout(self.page, self._direct_shm.size_bytes)
                assert layout is not None
                try:
                    pool = self.client.register_pool(self._direct_shm, layout)
                except REFUSALS as e:
                    self._host_pool_refused(e)
                    raise _PoolRefused(str(e)) from None
                self._direct = pool
        try:
            pool_id = self._host_pool_id(pool)
        except REFUSALS as e:
            with self._lock:
                if self._closed or self._direct is not pool:
                    raise  # closed meanwhile: its memory is gone, not refused by the daemon
                self._host_pool_refused(e)
            raise _PoolRefused(str(e)) from None
        if self.host_pool_refusals.refused:
            with self._lock:
                if self.host_pool_refusals.refused:
                    log.info(
                        "kvtier HiCache storage: the daemon took SGLang's host pool after %d "
                        "refusals; kvtier is used again",
                        self.host_pool_refusals.accepted(),
                    )
        return pool, pool_id

    def _host_pool_id(self, pool: RegisteredPool) -> int:
        """The host pool's id in the client's session, registering it there first if needed
        (a daemon restart, a fence) by one thread at a time: one that waited finds the
        other's answer, the id or a refusal whose back-off runs (``_PoolRefused``), instead
        of asking the daemon again (a refusal counted twice doubled the back-off)."""
        ids = self.client.live_ids(pool.binding)
        if ids is not None:
            return ids[1]
        with self._registering:
            if self.host_pool_refusals.standing():
                self._count("skipped", 1)
                raise _PoolRefused("the daemon refused the host pool; its next try is not due")
            return self.client.pool_id_of(pool.binding)

    @contextlib.contextmanager
    def _staging_half(self) -> Iterator[tuple[StagingPool, int]]:
        """The staging pool and how many pages this caller may hold at once."""
        if not self._staging_users.acquire(timeout=self.options.io_timeout_s):
            raise _StagingBusy(
                f"the staging pool stayed busy for io_timeout_s={self.options.io_timeout_s:g}s"
            )
        try:
            with self._lock:
                staging = self._staging_pool()
            yield staging, max(1, staging.num_pages // 2)
        finally:
            self._staging_users.release()

    def _staging_pool(self) -> StagingPool:
        """The staging pool, a new one when there is none or it was retired. Holds
        ``_lock``."""
        staging = self._staging
        if staging is None or staging.retired:
            staging = self._staging = self._new_staging()
        return staging

    def _loads_pool(self) -> None:
        """Register the pool that loads use, as a load would: SGLang's host pool when every
        v1 call is zero copy, else a new staging pool. Raises ``_PoolRefused`` when the
        daemon refuses it."""
        if self._all_staged:
            with self._lock:
                self._staging_pool()
        else:
            self._direct_pool()

    def _new_staging(self) -> StagingPool:
        """A new staging pool (a region of its whole size). Raises ``_PoolRefused`` while
        the daemon's refusal of the last one stands, and when it refuses this one: a region
        per ``retry_after_s`` for a refusal that waiting does not change would cost its
        memory and an RPC each time (``RegistrationRefusals``). Holds ``_lock``."""
        if self.refusals.standing():
            self._count("skipped", 1)
            raise _PoolRefused("the daemon refused the staging pool; its next try is not due")
        page = self.page
        assert page is not None
        pages = self._staging_pages()
        try:
            staging = StagingPool(
                self.client,
                num_layers=1,
                num_pages=pages,
                block_tokens=page.page_tokens,
                block_shape=(page.page_numel,),
                dtype=self._host_pool.dtype,
                generation=self._staging_generation + 1,
            )
        except REFUSALS as e:
            self._staging_refused(e, pages, page.page_bytes)
            raise _PoolRefused(str(e)) from None
        self._staging_generation += 1
        if self.refusals.refused:
            log.info(
                "kvtier HiCache storage: the daemon took the staging pool after %d refusals; "
                "kvtier is used again",
                self.refusals.accepted(),
            )
        return staging

    def _refusal(
        self, refusals: RegistrationRefusals, error: KvtierError, counter: str, pool: str
    ) -> tuple[bool, float]:
        """Count a refusal of ``pool`` and back off: (whether it is worth an ERROR, which the
        caller words, the wait before the next try). Another refusal of the same kind is
        one INFO line. Holds ``_lock``."""
        first = refusals.news(error)
        wait = refusals.refuse(error)
        self._count(counter, 1)
        if not first:
            log.info(
                "kvtier HiCache storage: %s was refused again (%s); next try in %.3gs",
                pool,
                error,
                wait,
            )
        return first, wait

    def _staging_refused(self, error: KvtierError, pages: int, page_bytes: int) -> None:
        """The daemon will not register the staging pool as asked (``staging.REFUSALS``: a
        limit below its size or count, memory it cannot use): one ERROR names what to change
        on either side, later refusals one INFO line per try, and tries back off from
        ``retry_after_s`` to ``staging.REFUSED_RETRY_MAX_S``. The breaker is not tripped:
        the daemon answers, and lookups and zero-copy transfers do not need this pool."""
        first, wait = self._refusal(self.refusals, error, "staging_refusals", "the staging pool")
        if not first:
            return
        pool_bytes = pages * page_bytes
        if self._all_staged:
            off = "kvtier is off for this rank: SGLang runs without it (no hit, nothing stored)"
        else:
            off = "SGLang's legacy calls miss; its zero-copy calls are not affected"
        log.error(
            "kvtier HiCache storage (tp %d, pp %d): the daemon refused the staging pool of %d "
            "bytes (%d pages of %d bytes, sized by the extra config's staging_bytes=%d) with "
            "%s: %s. %s. To use kvtier, change the daemon's setting named above in its "
            "config so that it allows this pool of %d bytes and restart the daemon (a SIGHUP "
            "does not apply it), or, for a limit on bytes, lower staging_bytes below it; the "
            "pool is tried again in %.3gs, then at doubling intervals up to %.0fs",
            self.storage_config.tp_rank,
            self.storage_config.pp_rank,
            pool_bytes,
            pages,
            page_bytes,
            self.options.staging_bytes,
            type(error).__name__,
            error,
            off,
            pool_bytes,
            wait,
            self.refusals.max_s,
        )

    def _host_pool_refused(self, error: KvtierError) -> None:
        """The daemon will not register SGLang's host pool (``staging.REFUSALS``: a limit
        below its size or count, memory it cannot use), the memory every zero-copy transfer
        names: handled as a refused staging pool is (``_staging_refused``), with its own
        back-off and counter. The backend does not stage these transfers instead (a staging
        pool is memory and a copy each way the operator did not ask for); the ERROR names
        that choice (``register_host_pool``) among what they can change. Holds ``_lock``."""
        first, wait = self._refusal(
            self.host_pool_refusals, error, "host_pool_refusals", "SGLang's host pool"
        )
        if not first:
            return
        assert self._direct_shm is not None and self.page is not None
        pool_bytes = self._direct_shm.size_bytes
        staging_pages = self._staging_pages()
        log.error(
            "kvtier HiCache storage (tp %d, pp %d): the daemon refused to register SGLang's "
            "host pool of %d bytes (its shared memory, which zero-copy transfers name) with "
            "%s: %s. kvtier is off for this rank: SGLang runs without it (no hit, nothing "
            "stored); the backend does not switch to staged transfers by itself. "
            "To use kvtier, change the daemon's setting named above in its config so that it "
            "allows this pool of %d bytes and restart the daemon (a SIGHUP does not apply it), "
            "or make SGLang's host pool smaller (--hicache-ratio or --hicache-size), or set "
            '"register_host_pool": false in the extra config to copy pages through a staging '
            "pool of %d bytes (staging_bytes=%d) instead; the host pool is tried again in "
            "%.3gs, then at doubling intervals up to %.0fs",
            self.storage_config.tp_rank,
            self.storage_config.pp_rank,
            pool_bytes,
            type(error).__name__,
            error,
            pool_bytes,
            staging_pages * self.page.page_bytes,
            self.options.staging_bytes,
            wait,
            self.host_pool_refusals.max_s,
        )

    def _staging_pages(self) -> int:
        """Pages of a staging pool: ``staging_bytes`` of them, at most ``_STAGING_MAX_PAGES``."""
        assert self.page is not None
        return max(1, min(_STAGING_MAX_PAGES, self.options.staging_bytes // self.page.page_bytes))

    # ---------------------------------------------------------------- guards

    def _ready(self, n: int, refusals: RegistrationRefusals) -> bool:
        """Whether to ask the daemon about ``n`` pages; ``refusals``: those of the pool the
        call needs (for a lookup, the pool its loads would use: no hit that no load could
        fill), so that it misses at once while the daemon's refusal of that pool stands."""
        if self.page is None or self._closed or not n:
            return False
        if not self.breaker.ok() or refusals.standing():
            self._count("skipped", 1)
            return False
        return True

    def _v1_refusals(self) -> RegistrationRefusals:
        """The refusals of the pool SGLang's v1 calls use: its host pool in zero-copy mode,
        else the staging pool."""
        return self.host_pool_refusals if self.mode == "direct" else self.refusals

    def _failed(self, what: str, error: BaseException) -> None:
        """A call that raised, answered as a miss. A daemon that failed or did not answer
        pauses kvtier (``Breaker``); a pool refused (said by ``_staging_refused`` or
        ``_host_pool_refused``), a staging pool another transfer retired between two
        chunks of this one (the retiring call said why, and trips the breaker itself if the
        daemon did not answer), a host pool replaced under a zero-copy transfer, or a
        staging pool held by other transfers past ``io_timeout_s`` does not: the daemon
        answers. A busy pool is counted apart, and
        said once: its holders wait on the daemon, and one that does not answer trips the
        breaker through their own calls."""
        if isinstance(error, (_PoolRefused, _StagingRetired, _HostPoolReplaced)):
            return
        if isinstance(error, _StagingBusy):
            self._count("staging_busy", 1)
            with self._metrics_lock:
                first, self._warned_busy = not self._warned_busy, True
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "kvtier HiCache storage: a %s missed: %s (two other transfers held it; not a "
                "daemon failure: kvtier stays on). A larger staging_bytes makes each transfer "
                "fewer round trips; counters['staging_busy'] counts these (said once)",
                what,
                error,
            )
            return
        self._count("failures", 1)
        log.debug("kvtier HiCache storage: %s failed", what, exc_info=error)
        self.breaker.trip(error)

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return storage_keys(self._seed, keys)

    def _parent(self, extra_info: HiCacheStorageExtraInfo | None) -> bytes:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return storage_key(self._seed, prefix[-1]) if prefix else b""

    def _host_pages(self, host_indices: torch.Tensor, n: int) -> tuple[list[int], list[int]]:
        """(first token slot, page index) of each of ``n`` pages named by token slots."""
        assert self.page is not None
        p = self.page.page_tokens
        idx = host_indices.reshape(-1).to(device="cpu", dtype=torch.int64)
        if idx.numel() != n * p:
            raise ValueError(f"{idx.numel()} host slots for {n} pages of {p} tokens")
        rows = idx.reshape(n, p)
        starts = rows[:, 0]
        if bool((starts % p != 0).any()) or not bool(
            (rows == starts[:, None] + torch.arange(p)).all()
        ):
            raise ValueError("host slots are not whole pages")
        first = starts.tolist()
        return first, [s // p for s in first]

    # -------------------------------------------------------------- lookups

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` the daemon holds: one Lookup. 0 while the
        daemon's refusal of the pool the loads would use stands; once its back-off is due,
        the lookup first tries that registration (as a load would, within
        ``io_timeout_s``): offering the hit first, a refusal again made the load that
        followed miss every page offered. It tries rather than answering 0 until a transfer
        has: a rank that stores nothing (an MLA replica) is offered no load without a hit."""
        loads = self.refusals if self._all_staged else self.host_pool_refusals
        if not self._ready(len(keys), loads):
            return 0
        try:
            if loads.refused:
                self._loads_pool()
            found = self.client.lookup(
                self._keys(keys), timeout_s=self.options.lookup_timeout_s
            ).prefix_len
        except Exception as e:  # any failure is a miss, never an error in SGLang
            self._failed("lookup", e)
            return 0
        found = max(0, min(int(found), len(keys)))
        self._count("lookups", 1)
        self._count("pages_found", found)
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ v1: host pages

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages into the host pool's pages named by ``host_indices``; per page,
        whether it was loaded (SGLang uses the leading run)."""
        n = len(keys)
        if not self._ready(n, self._v1_refusals()):
            return [False] * n
        start = time.perf_counter()
        try:
            starts, pages = self._host_pages(host_indices, n)
            if self.mode == "direct":
                loaded = self._direct_call(partial(self._get, keys=self._keys(keys), pages=pages))
            else:
                loaded = self._load_staged(self._keys(keys), starts)
        except Exception as e:
            self._failed("load", e)
            return [False] * n
        self._account("prefetch", sum(loaded), start)
        return loaded

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages named by ``host_indices`` under ``keys`` (one chain,
        continuing ``extra_info.prefix_keys`` when SGLang passes them); per page, whether
        it is stored as asked (see ``_put``)."""
        n = len(keys)
        if not self._ready(n, self._v1_refusals()):
            return [False] * n
        start = time.perf_counter()
        try:
            starts, pages = self._host_pages(host_indices, n)
            parent = self._parent(extra_info)
            if self.mode == "direct":
                stored, _ = self._direct_call(
                    partial(self._put, keys=self._keys(keys), pages=pages, parent=parent)
                )
            else:
                stored = self._store_staged(
                    self._keys(keys), parent, lambda i, dst: self._copy_out(starts[i], dst)
                )
        except Exception as e:
            self._failed("store", e)
            return [False] * n
        self._account("backup", sum(stored), start)
        return stored

    def _direct_call(self, call: Callable[[int], _T]) -> _T:
        pool, pool_id = self._direct_pool()
        try:
            return call(pool_id)
        except Exception as e:
            if unclean(e) and not self.client.fence_pool(pool.binding, self.options.io_timeout_s):
                # SGLang reuses these pages once we return. The daemon did not confirm that
                # no copy uses them (it did not answer the fence in time): give a copy it had
                # already started time to finish first.
                time.sleep(self.options.late_copy_grace_s)
            with self._lock:
                replaced = not self._closed and self._direct is not pool
            if replaced and not unclean(e):
                # Its answer (NOT_FOUND: the pool was unregistered) says nothing of the
                # daemon; tripping the breaker left the new host pool unused.
                raise _HostPoolReplaced(str(e)) from e
            raise

    def _get(self, pool_id: int, keys: list[bytes], pages: Sequence[int]) -> list[bool]:
        return [bool(x) for x in self.client.get(pool_id, keys, pages).loaded]

    def _put(
        self, pool_id: int, keys: list[bytes], pages: Sequence[int], parent: bytes
    ) -> tuple[list[bool], bool]:
        """Per page, whether it is stored as asked: held by the daemon and, with
        ``save_durable``, written by its disk tier (SGLang asked for it there); and whether
        the daemon holds every page, so that the chain can go on (a page held but not
        written is no gap in it)."""
        result = self.client.put(
            pool_id, keys, pages, parent_key=parent, durable=self.options.save_durable
        )
        held = [s != PutStatus.REJECTED_FULL for s in result.statuses]
        if result.persisted is None:
            return held, all(held)
        return [h and p for h, p in zip(held, result.persisted, strict=True)], all(held)

    def _copy_out(self, start: int, dst: torch.Tensor) -> None:
        view = self._host_pool.get_data_page(start, flat=False)
        dst.view(view.shape).copy_(view)

    # ---------------------------------------------------------- staged copies

    def _load_staged(
        self,
        keys: list[bytes],
        starts: Sequence[int] | None,
        targets: Sequence[torch.Tensor | None] | None = None,
    ) -> list[bool]:
        """Get through the staging pool, then copy each loaded page into the host pool
        (``starts``) or into ``targets`` (legacy)."""
        loaded = [False] * len(keys)
        with self._staging_half() as (staging, step):
            for c0 in range(0, len(keys), step):
                chunk = keys[c0 : c0 + step]
                pages = self._alloc(staging, len(chunk))
                try:
                    got = self._staged_rpc(staging, partial(self._get, keys=chunk, pages=pages))
                    for j, ok in enumerate(got):
                        if not ok:
                            continue
                        src = staging.layer(0)[pages[j]]
                        i = c0 + j
                        if starts is not None:
                            self._host_pool.set_from_flat_data_page(starts[i], src)
                        else:
                            target = targets[i] if targets is not None else None
                            assert target is not None
                            target.view(-1).copy_(src)
                        loaded[i] = True
                finally:
                    staging.free(pages)
                if not all(got):
                    break
        return loaded

    def _store_staged(
        self,
        keys: list[bytes],
        parent: bytes,
        fill: Callable[[int, torch.Tensor], None],
    ) -> list[bool]:
        """Fill staging pages (``fill(i, page)`` writes page ``i``), then Put them; per
        page, whether it is stored as asked (``_put``)."""
        stored = [False] * len(keys)
        with self._staging_half() as (staging, step):
            for c0 in range(0, len(keys), step):
                chunk = keys[c0 : c0 + step]
                pages = self._alloc(staging, len(chunk))
                try:
                    for j, page in enumerate(pages):
                        fill(c0 + j, staging.layer(0)[page])
                    ok, held = self._staged_rpc(
                        staging, partial(self._put, keys=chunk, pages=pages, parent=parent)
                    )
                finally:
                    staging.free(pages)
                stored[c0 : c0 + len(ok)] = ok
                if not held:
                    break  # a chain is stored from its head: the rest cannot follow
                parent = chunk[-1]
        return stored

    @staticmethod
    def _alloc(staging: StagingPool, n: int) -> list[int]:
        """``n`` pages of this caller's half. None only from a pool another transfer retired
        meanwhile (a half always has them): a miss, not a failure (``_StagingRetired``)."""
        pages = staging.alloc(n)
        if pages is None:
            raise _StagingRetired(staging.generation)
        return pages

    def _staged_rpc(self, staging: StagingPool, call: Callable[[int], _T]) -> _T:
        if staging.retired and self.client.live_ids(staging.pool.binding) is None:
            # Retired by another transfer (e.g. refused when registered again, after a
            # daemon restart) and not held in the current session: registering it again
            # would ask the daemon once more for a pool that goes, ahead of the back-off.
            raise _StagingRetired(staging.generation)
        try:
            pool_id = self.client.pool_id_of(staging.pool.binding)
        except REFUSALS as e:
            # Registered again in a new session (a daemon restart) and refused there: the
            # refusal a new pool gets, and the pool goes (its memory is not held while
            # refused; the next try, once due, makes a new one).
            with self._lock:
                if self._closed:
                    raise  # closed meanwhile: its memory is gone, not refused by the daemon
                self._staging_refused(e, staging.num_pages, staging.layer_block_bytes)
            staging.retire(
                f"the daemon refused it when it was registered again: {e}",
                unclean=False,
                said=True,
            )
            raise _PoolRefused(str(e)) from None
        try:
            return call(pool_id)
        except Exception as e:
            if unclean(e):
                # The daemon may still copy into or out of these pages: never reuse them.
                staging.retire(f"a transfer ended without an answer: {e}")
            raise

    # ----------------------------------------------------- legacy: page tensors

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Load pages into ``target_locations`` (flat data pages; new tensors if None);
        each loaded page's tensor, or None."""
        n = len(keys)
        if not self._ready(n, self.refusals):
            return [None] * n
        assert self.page is not None
        targets = list(target_locations) if target_locations is not None else [None] * n
        start = time.perf_counter()
        try:
            if len(targets) != n:
                raise ValueError(f"{len(targets)} target pages for {n} keys")
            for i, t in enumerate(targets):
                if t is None:
                    targets[i] = torch.empty(self.page.page_numel, dtype=self._host_pool.dtype)
                elif (
                    t.numel() != self.page.page_numel
                    or t.dtype != self._host_pool.dtype
                    or not t.is_contiguous()
                ):
                    raise ValueError(f"target {i} is not a contiguous flat data page")
            loaded = self._load_staged(self._keys(keys), None, targets)
        except Exception as e:
            self._failed("load", e)
            return [None] * n
        self._account("prefetch", sum(loaded), start)
        return [t if ok else None for t, ok in zip(targets, loaded, strict=True)]

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat data pages ``values`` under ``keys`` (one chain); True if every one
        is stored as asked (see ``_put``)."""
        n = len(keys)
        if not self._ready(n, self.refusals):
            return False
        assert self.page is not None
        page = self.page
        start = time.perf_counter()
        try:
            pages = list(values or [])
            if len(pages) != n:
                raise ValueError(f"{len(pages)} values for {n} keys")
            for i, v in enumerate(pages):
                if v.numel() != page.page_numel or v.dtype != self._host_pool.dtype:
                    raise ValueError(f"value {i} is not a flat data page of this pool")

            def fill(i: int, dst: torch.Tensor) -> None:
                dst.copy_(pages[i].reshape(-1))

            stored = self._store_staged(self._keys(keys), b"", fill)
        except Exception as e:
            self._failed("store", e)
            return False
        self._account("backup", sum(stored), start)
        return all(stored)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    # ----------------------------------------------------------------- misc

    def clear(self) -> bool:
        """Not supported: the daemon's blocks are shared by every engine on the node
        (``kvtier evict`` or ``Client.delete`` remove blocks)."""
        log.warning("kvtier HiCache storage: clear() is not supported; nothing was removed")
        return False

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call, when storage metrics are on."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

    def _account(self, kind: str, pages: int, start: float) -> None:
        self._count("pages_loaded" if kind == "prefetch" else "pages_stored", pages)
        if not self.storage_config.enable_storage_metrics or not pages or self.page is None:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * self.page.page_bytes / 1e9 / seconds)

    def _count(self, name: str, n: int) -> None:
        with self._metrics_lock:
            self.counters[name] += n

    def close(self) -> None:
        """Unregister the pools (without waiting; the staging pool once the transfers that
        hold its pages have ended) and close the connection; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release_pools("the backend closed")
        self.breaker.close()
        self.client.close()

    def _release_pools(self, why: str) -> None:
        if self._direct is not None:
            with contextlib.suppress(KvtierError):
                self.client.unregister_pool_nowait(self._direct.binding)
            self._direct = None
        if self._direct_shm is not None:
            self._direct_shm.close()
            self._direct_shm = None
        if self._staging is not None:
            # Retired, not closed: a transfer on another thread may be copying into its pages,
            # and unmapping them under the copy crashed the engine (SIGSEGV). It is closed
            # once the last transfer holding pages has ended.
            self._staging.retire(why, unclean=False, said=True)
            self._staging = None
