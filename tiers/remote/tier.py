"""L3: a key-addressed tier on Redis / Valkey (one server, or a Redis Cluster).

Invariants:
- Every verb is a coroutine on the daemon's event loop and never raises for a remote fault:
  an unreachable, slow or failing store answers misses (``probe`` none, ``probe_each``
  unknown, ``read`` None: nothing said of the block, ``write`` False) and shows in
  ``health()`` and ``stats()``.
  Exceptions are kept for programming errors (a buffer shorter than ``nbytes``).
- No round trip is waited for longer than ``op_timeout_s`` (``probe``: its caller gets an
  answer within ``probe_deadline_ms``; the round trip may go on in the background up to
  ``op_timeout_s``, so that a slow store, not a tight deadline, is what marks the tier down;
  on a cluster each master's part of it, the whole within ``_HAND_BACK_S`` more).
- A timeout or a connection fault marks the tier DOWN (on a cluster, one master's marks that
  master lost instead, while another serves): until the reconnection
  probe succeeds, every call answers at once without touching the network. The probe runs
  in the background with exponential backoff and jitter, on a fresh client each attempt (a
  restarted server or a failed-over cluster is seen afresh) with the password file read
  again (a rotated password is taken up); faults of calls that started on an older client
  are ignored. Each change of state is logged once.
- A Redis that restarts empty is a cold tier: nothing here remembers what it held.
- A removal the store did not confirm (unreachable, an error reply, its call cancelled before
  the reply, or still waiting for it at ``close``) is remembered and sent again once the
  store answers: until then ``probe`` and ``read`` answer its keys absent, so
  a Delete made while the store was down does not come back through a later lookup. A write
  of the key ends the removal (the block was stored again), also one still waiting for its
  connection or its replies: its UNLINK is not sent then, nor remembered if it fails. An
  UNLINK whose keys are fixed already (its connection taken, or being opened, or its
  replies on their way) may reach the store after a SET sent on another connection, so a
  write of one of its keys sends its block only once that UNLINK has ended (so such a write
  may wait up to ``op_timeout_s`` for the UNLINK, then again for its own round trip; an
  UNLINK that times out marks the tier down, and the write then answers at once).
  Remembered for at most ``ttl_s`` (the value has expired by then) and at most
  ``_UNREMOVED_MAX`` keys; across restarts where the tier keeps a ``RemovalJournal`` (its
  ``removals_file``, or one the daemon gives it: ``keep_removals_in``): a removal it
  remembers is recorded there before ``remove`` returns, and one confirmed, written again,
  expired or forgotten is dropped from it (a write waits for that drop before it sends the
  block, so that a restart does not delete a block written again after its removal; a drop
  that fails goes again with every later update, and at ``close``, until one is recorded:
  only a crash before then deletes it). Journal calls run on a worker thread, one at a
  time, in the order they were made.
- Values are framed by ``codec`` (magic, version, length, xxh3-64 of the bytes, key tag); a
  value that fails any check is a miss, counted by reason, and never reaches the caller's
  buffer as valid data.
- Writes beyond the write budget (bytes/s) are dropped and counted, never queued; a value
  larger than ``max_value_bytes`` is refused. An out-of-memory refusal from a server (on a
  cluster, a master) stops the writes to that server (not reads, nor the other masters'
  writes) for a backoff period.
- At most ``pool_size`` commands pipelines are in flight per server: probes and removes have
  their own share of the connections, so bulk reads and writes never starve a lookup.

Cluster resharding (MOVED, ASK) is followed by redis-py's cluster client, pipelines included.
A master is ``lost`` at once when a connection to it fails (refused, reset, closed) or it does
not answer within the op timeout (a hung process, a host gone): in a call (its commands answer
the fault, the other masters' are served within the same op timeout), or in the start's or a
reconnection's check while the others report ok. Its slots' keys are answered as when the tier
is DOWN (misses, declined, remembered removals), the others' as when UP; a call that waited for
a connection meanwhile sends it nothing. Before the cluster's verdict (``cluster-node-timeout``)
the others serve their slots all the same; once it is given, a cluster that requires full
coverage answers CLUSTERDOWN, which marks the tier DOWN.

Values are sent from the caller's buffers without joining header and bytes, and the client's
connections send and receive large values with fewer copies than redis-py's own (``wire``).
Batches of ``_OFFLOAD_BYTES`` or more are checksummed (write) or verified and copied (read)
on the tier's codec threads; a caller cancelled meanwhile unwinds only once they are done
with its buffers.

Thread-safety: one event loop owns the tier; the codec threads touch only the buffers of the
call they work for.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.tiers.base import (
    HEALTHY,
    PROBE_ABSENT,
    PROBE_UNKNOWN,
    BlockRef,
    Health,
    HostBuffers,
    PoolPages,
    RemovalJournal,
    TierHealth,
    TierKind,
    TierStats,
    TierUnavailable,
    leading_sizes,
)
from kvtier.tiers.buffers import get_block, put_block
from kvtier.tiers.remote.codec import (
    HEADER_BYTES,
    KeyNamer,
    Verdict,
    checksum,
    header,
    header_length,
    verify,
)
from kvtier.tiers.remote.journal import RemovalFile, RemovalFileError
from kvtier.tiers.remote.options import RemoteOptions, RemoteOptionsError, read_password
from kvtier.tiers.remote.state import Availability, Reach, TokenBucket, Transition, backoff_s

try:
    import redis.asyncio as aioredis
    from redis import exceptions as rx
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.crc import key_slot
except ImportError as e:  # pragma: no cover - the extra is part of the dev environment
    raise ImportError("the L3 tier needs redis-py: pip install 'kvtier[redis]'") from e

# After the check above: the wire module needs redis-py too.
from kvtier.tiers.remote.wire import (
    Framed,
    NodeFaults,
    noting_node_faults,
    releasing_bodies,
    use_tier_connections,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Faults that mean "the store cannot be reached": the tier goes DOWN. ClusterDownError and
# MasterDownError are replies, but they say the same of the slots they cover.
_UNREACHABLE: tuple[type[BaseException], ...] = (
    rx.ConnectionError,
    rx.TimeoutError,
    rx.ClusterDownError,
    rx.RedisClusterException,
    asyncio.TimeoutError,
    TimeoutError,
    OSError,
)
_UNREACHABLE_OR_REFUSED: tuple[type[BaseException], ...] = (*_UNREACHABLE, rx.RedisError)
_TIMEOUTS = (rx.TimeoutError, asyncio.TimeoutError, TimeoutError)
# What a cluster pipeline may take beyond the op timeout to hand its replies back: each
# master's part ends at the op timeout (``wire``: its connect, sends and reads), the rest is
# redis-py's bookkeeping on the event loop. Past it, the call as a whole is late: DOWN.
_HAND_BACK_S = 0.25
# Value buffers kept for reuse between writes: enough for a few batches of 2 MiB blocks in
# flight, small next to the host tier.
_STAGING_RETAIN_BYTES = 128 << 20
# Batches of at least this many bytes are framed (write) or verified and copied (read) on the
# tier's codec threads, so that the event loop sends and receives other batches meanwhile;
# smaller ones inline, where a thread hand-off would cost more than the work.
_OFFLOAD_BYTES = 1 << 20
_CODEC_THREADS = 2
# How much the client's parser asks of the socket at a time (redis-py's default is 64 KiB):
# a 2 MiB value then takes a few reads and parser calls instead of dozens (pipelined GETs of
# 2 MiB values measured 4-8% faster than with 64 KiB, never slower beyond noise).
SOCKET_READ_BYTES = 1 << 20
# Removals remembered while the store cannot confirm them (~250 bytes each): beyond this the
# oldest are forgotten (counted, logged), and may be found again if the store still has them.
_UNREMOVED_MAX = 1 << 17
# Keys whose drop from the journal failed kept to be tried again (as many, at most, as the
# removals remembered: ~250 bytes each); the oldest beyond are no longer tried (counted, logged).
_UNDROPPED_MAX = _UNREMOVED_MAX
# Keys per pipeline when removals are sent again.
_UNREMOVE_BATCH = 4096

COUNTERS = (
    # probe
    "probes",
    "probe_keys",
    "probe_found",
    "probe_late",
    "probe_skipped_down",
    # read
    "read_blocks",
    "read_hits",
    "read_absent",
    "read_bad_header",
    "read_bad_length",
    "read_bad_key",
    "read_bad_checksum",
    "read_errors",
    "read_skipped_down",
    "bytes_read",
    # write
    "write_blocks",
    "write_stored",
    "write_dropped_budget",
    "write_too_large",
    "write_errors",
    "write_no_space",
    "write_skipped_down",
    "bytes_written",
    # remove
    "remove_blocks",
    "remove_errors",
    "remove_skipped_down",
    "remove_retried",
    "remove_forgotten",
    "remove_unrecorded",
    "remove_drops_forgotten",
    # reachability
    "timeouts",
    "connection_errors",
    "down_transitions",
    "reconnect_attempts",
    "reconnects",
)


class _Unreachable(Exception):
    """A call could not reach the store; the tier has been marked DOWN."""


# The store refused the credentials (redis-py's AuthenticationError is a ConnectionError).
_REFUSED_CREDENTIALS: tuple[type[BaseException], ...] = (
    rx.AuthenticationError,
    rx.AuthenticationWrongNumberOfArgsError,
)
# A reply in place of a command not sent (its key's master is lost).
_NOT_ASKED = object()
# Faults of a connection to one server: on a cluster, that master is unreachable.
_UNREACHABLE_NODE: tuple[type[BaseException], ...] = (
    rx.ConnectionError,
    rx.TimeoutError,
    asyncio.TimeoutError,
    TimeoutError,
    OSError,
)


class _Paused(Exception):
    """A write found writes paused (out of memory) once it had a connection; nothing sent."""


class RemoteTier:
    """The L3 tier (see the module docstring). Construct, ``await start()``, use, ``await
    close()``.

    ``namespace_token`` maps a namespace id to the name its keys carry in the store; daemons
    that share blocks through one store must map a tenant to the same token (the default, the
    decimal id, is right only where ids are assigned the same way on every daemon).
    ``clock``, ``wall_clock`` (the journal's times: ``keep_removals_in``) and ``rng`` are
    injectable for tests.

    Thread-safety: none; one event loop owns the tier.
    """

    kind = TierKind.REMOTE

    def __init__(
        self,
        options: RemoteOptions,
        *,
        namespace_token: Callable[[int], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        try:
            options.check()
            self._endpoints = options.endpoints()
        except RemoteOptionsError as e:
            raise TierUnavailable(f"L3: {e}") from None
        self.options = options
        self._password = _password(options.password_file)
        self._password_problem = ""  # why the password file could not be read again
        self._clock = clock
        self._wall_clock = wall_clock
        self._names = KeyNamer(options.key_prefix, namespace_token)
        # One source of jitter for every backoff (a test's, when it injects one).
        self._rng = rng or random.Random()
        self._avail = Availability(options.backoff_initial_s, options.backoff_max_s, self._rng)
        # Per server out of memory (its name; "" for a single server): its writes paused
        # (``Reach.NOSPACE``) for a backoff, the other masters' going on. Gone once it takes
        # writes again. ``_avail`` itself is only UP or DOWN.
        self._full: dict[str, Availability] = {}
        # Masters whose connections failed or that did not answer in time, in a call or in the
        # start's or a reconnection's check, while others served: name -> why. Their slots'
        # blocks are misses, declined without touching the network, while the tier serves the
        # other masters' (UP); the monitor asks again, with a backoff as while DOWN
        # (``_lost_checks``: the checks that found them still lost), until they are back.
        self._lost: dict[str, str] = {}
        self._lost_retry_at = 0.0
        self._lost_checks = 0
        self._budget = TokenBucket(options.write_bytes_s, options.max_value_bytes, clock())
        self._counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._staging = _Staging(_STAGING_RETAIN_BYTES)
        self._codec: ThreadPoolExecutor | None = None
        # Probes and removes keep a quarter of the connections (at least one) for themselves.
        small = max(1, options.pool_size // 4)
        self._small_ops = asyncio.Semaphore(small)
        self._bulk_ops = asyncio.Semaphore(options.pool_size - small)
        self._client: Any = self._new_client()
        self._generation = 0
        self._inflight = 0
        # Calls in flight per client generation, and the replaced clients that still carry
        # some: each is closed once its last call ends, not under it (a lost master back
        # swaps the client while the tier serves).
        self._calls: Counter[int] = Counter()
        self._replaced: dict[int, Any] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        # Store key -> until when its removal must be sent again (see the module docstring);
        # in the order they were added, so the oldest go first at the limit.
        self._unremoved: dict[bytes, float] = {}
        self._resending: asyncio.Task[None] | None = None
        # While masters are lost: False once a resend found every remembered removal waiting
        # for a lost master, until one that may not is remembered. A Delete then starts no
        # resend, which would look up the master of every remembered key for nothing.
        self._resend_may_send = True
        self._unremoved_warned = False
        # Per removal awaiting its connection or its replies (by id): the keys of it that no
        # write has stored again since it began (``write`` takes its keys out).
        self._removing: dict[int, set[bytes]] = {}
        self._removal_ids = itertools.count()
        # Per UNLINK pipeline whose keys are fixed, until it ends (by id): those keys, and
        # what a write of one of them waits for before it sends its block.
        self._unlinking: dict[int, tuple[frozenset[bytes], asyncio.Future[None]]] = {}
        self._unlink_ids = itertools.count()
        # Where the remembered removals are kept across restarts, if anywhere; its updates
        # (not cancelled at close: each one's outcome stands) take turns in call order.
        self._journal: RemovalJournal | None = None
        self._own_journal: RemovalFile | None = None  # ``removals_file``'s, closed at close
        self._carried_from: RemovalJournal | None = None  # ``carry_removals_from``
        self._journal_turn = asyncio.Lock()
        self._journaling: set[asyncio.Task[None]] = set()
        # Keys whose drop from the journal failed (their entries may be there still), oldest
        # first: each update drops them too until one succeeds. Left there, a restart would
        # delete a value written again since. At most ``_UNDROPPED_MAX``.
        self._undropped: dict[bytes, None] = {}
        self._undropped_warned = False
        # Keys whose last record in the journal failed, and those whose record is on its way
        # (a count per update naming them): what a restart may not know (``close`` says).
        self._unrecorded: set[bytes] = set()
        self._adding: Counter[bytes] = Counter()
        # Keys whose drop from the journal is on its way (a count per update naming them): a
        # write of one waits for it, as for a failed one.
        self._dropping: Counter[bytes] = Counter()

    # ------------------------------------------------------------------ lifecycle

    async def keep_removals_in(self, journal: RemovalJournal) -> None:
        """Keep the removals the store does not confirm in ``journal`` from now on, and take
        up those it kept (a previous run's): their keys answer absent at once, and their
        UNLINKs are sent once the store answers. Call before ``start``. Entries past their
        expiry, and the oldest beyond ``_UNREMOVED_MAX``, are dropped from it."""
        self._journal = journal
        kept = await asyncio.to_thread(journal.removals)
        wall, now = self._wall_clock(), self._clock()
        # The oldest first, as the store drops them: the order ``_unremoved`` keeps.
        kept.sort(key=lambda entry: float("inf") if entry[1] is None else entry[1])
        live = [(k, until) for k, until in kept if until is None or until > wall]
        stale = [k for k, until in kept if until is not None and until <= wall]
        excess = max(0, len(live) - _UNREMOVED_MAX)
        stale += [k for k, _ in live[:excess]]
        for key, until in live[excess:]:
            self._unremoved[key] = float("inf") if until is None else now + (until - wall)
        if excess:
            self._counters["remove_forgotten"] += excess
        if self._unremoved:
            log.info(
                "L3: %d removals left unconfirmed by the previous run; their keys answer "
                "absent until the store confirms them",
                len(self._unremoved),
            )
        recording = self._record([], stale)
        if recording is not None:
            await asyncio.shield(recording)

    def carry_removals_from(self, journal: RemovalJournal) -> None:
        """With a ``removals_file``: ``journal`` kept the removals before it was set (L2's
        index); ``start`` moves its entries into the file. Left there, they were lost while
        the file was set, and came back once it was unset, deleting values written since
        under their keys. Call before ``start``."""
        self._carried_from = journal

    async def start(self) -> None:
        """Connect and start the reconnection monitor. A store that cannot be reached is not
        fatal (the tier starts DOWN and keeps trying); credentials the store refuses are
        (TierUnavailable): retrying would not fix them, and so is a ``removals_file`` that
        cannot be opened (removals would be lost). Removals taken up from a journal are sent
        again once connected."""
        if self.options.removals_file:
            try:
                journal = await asyncio.to_thread(RemovalFile, self.options.removals_file)
            except RemovalFileError as e:
                await self.close()
                raise TierUnavailable(str(e)) from None
            self._own_journal = journal
            if self._carried_from is not None:
                await asyncio.to_thread(_carry_removals, self._carried_from, journal)
            await self.keep_removals_in(journal)
        self._wake = asyncio.Event()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="l3-monitor")
        detail, lost = await self._check(self._client)
        if detail is None:
            self._set_lost(lost)
            log.info(
                "L3 %s store at %s: reachable (key prefix %r, ttl %ss, pool %d)",
                self.options.mode,
                ", ".join(f"{e.host}:{e.port}" for e in self._endpoints),
                self.options.key_prefix,
                self.options.ttl_s or "none",
                self.options.pool_size,
            )
            if self._unremoved:
                self._resend_removals()
            return
        if detail.startswith("refused credentials"):
            await self.close()
            raise TierUnavailable(f"L3 store {self.options.urls[0]}: {detail}")
        self._fail(self._generation, detail, timeout=detail == "timeout")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self._background)
        if self._monitor is not None:
            tasks.append(self._monitor)
        for task in tasks:
            task.cancel()
        # Bounded: a library call that ignores cancellation must not hold up shutdown.
        grace = self.options.connect_timeout_s + self.options.op_timeout_s
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        # A removal still waiting for its connection or replies is kept as one the store did
        # not confirm: its call may end after the journal has closed, or be cancelled with
        # the event loop, and the restart must send it again. The update also drops the keys
        # whose drops failed (every update does); without one, they are tried once more.
        in_flight = [k for pending in self._removing.values() for k in pending]
        if self._remember(in_flight) is None:
            self._record([], list(self._undropped))
        # Drops, and the records just made (a write's drop and a removal's record are awaited
        # by their callers): a drop left undone costs the restart an UNLINK sent again. Until
        # none is left: a removal the store confirms meanwhile begins its drop, which the
        # journal, closed once this is done, would refuse.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._journaling and (left_s := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._journaling), timeout=left_s)
        self._log_unremoved_at_close()
        self._journal = None  # closed, or about to be: calls ending later record nothing
        clients = [self._client, *self._replaced.values()]
        self._replaced.clear()
        await asyncio.wait(
            {asyncio.ensure_future(_close_client(c)) for c in clients}, timeout=grace
        )
        if self._own_journal is not None:
            self._own_journal.close()
        if self._codec is not None:
            # Jobs already handed over run to their end: their callers wait for them.
            self._codec.shutdown(wait=False)

    def _log_unremoved_at_close(self) -> None:
        """Say how many removals the store has not confirmed, and whether the restart
        knows of them (those whose record failed, or is not done, it does not)."""
        unremoved = self._unremoved
        if not unremoved:
            return
        if self._journal is None:
            log.warning(
                "L3: %d removed blocks were not yet removed from the store (unreachable); "
                "they may be found again after the restart, until their expiry",
                len(unremoved),
            )
            return
        unkept = sum(k in self._unrecorded or k in self._adding for k in unremoved)
        if unkept:
            log.warning(
                "L3: %d removals not yet confirmed by the store are kept for the restart; "
                "%d more are not, their record failed or did not end (remove_unrecorded): "
                "their blocks may be found again after the restart, until their expiry",
                len(unremoved) - unkept,
                unkept,
            )
        else:
            log.info(
                "L3: %d removals not yet confirmed by the store are kept for the restart",
                len(unremoved),
            )

    # --------------------------------------------------------------------- verbs

    async def probe(self, blocks: Sequence[BlockRef]) -> list[int]:
        """The size of each block of the present prefix of ``blocks`` (``probe_each``'s
        leading sizes): none found when the answer is late or the store cannot be reached."""
        return leading_sizes(await self.probe_each(blocks))

    async def probe_each(self, blocks: Sequence[BlockRef]) -> list[int]:
        """Each block's size, ``PROBE_ABSENT`` or ``PROBE_UNKNOWN``: one pipelined round trip
        (GETRANGE of each value's header; on a cluster, one pipeline per server, in parallel),
        answered within ``probe_deadline_ms``. The size is the header's length: a value
        whose header does not parse (``codec.header_length``: magic, version, its own key's
        tag), or that is not a string, is no block: absent. Late, down or failed: unknown,
        every block; a command's own error (but a key of another type): unknown, that block.

        Sizes come from the header the tier wrote, not from the value's length: a value cut
        short after its header still has its block's size (its read then fails, ``verify``:
        a miss), so a damaged value never makes a Get of the right size look like another
        layout's. Unlike EXISTS, GETRANGE counts as an access for the store's ``maxmemory``
        LRU, as the read that a found block's lookup usually precedes does."""
        if not blocks:
            return []
        c = self._counters
        c["probes"] += 1
        c["probe_keys"] += len(blocks)
        unknown = [PROBE_UNKNOWN] * len(blocks)
        if not self._avail.serves(self._clock()):
            c["probe_skipped_down"] += 1
            return unknown
        all_keys = [self._names.key(b.ns, b.key) for b in blocks]
        asked, heads = self._asking(all_keys, "GETRANGE", 0, HEADER_BYTES - 1)
        if not asked:
            c["probe_skipped_down"] += 1
            return [PROBE_ABSENT if k in self._unremoved else PROBE_UNKNOWN for k in all_keys]

        async def round_trip() -> list[Any]:
            try:
                return await self._pipeline(heads, self._small_ops)
            finally:
                # Counted once it has its connection (or none): masters lost before it
                # waited for one, or while it did, a late probe's included.
                if len(asked) < len(all_keys):
                    c["probe_skipped_down"] += 1

        # The round trip runs as its own task under the op timeout (a slow store is judged
        # by that), while the caller waits only for the probe deadline.
        task = self._spawn(round_trip())
        try:
            replies = await asyncio.wait_for(
                asyncio.shield(task), self.options.probe_deadline_ms / 1000.0
            )
        except (asyncio.TimeoutError, TimeoutError):
            c["probe_late"] += 1
            return unknown
        except _Unreachable:
            return unknown
        unremoved = self._unremoved
        if len(asked) < len(all_keys):
            # A lost master's keys: unknown, as the store could not be asked.
            by_position = dict(zip(asked, replies, strict=True))
            replies = [by_position.get(j, _NOT_ASKED) for j in range(len(all_keys))]
        answers: list[int] = []
        for key, reply in zip(all_keys, replies, strict=True):
            if unremoved and key in unremoved:
                answers.append(PROBE_ABSENT)  # removed here; the store has yet to confirm it
                continue
            if reply is _NOT_ASKED:
                answers.append(PROBE_UNKNOWN)
                continue
            if isinstance(reply, BaseException):
                answers.append(PROBE_ABSENT if _wrong_type(reply) else PROBE_UNKNOWN)
                continue
            # A missing key answers no bytes.
            size = header_length(reply, key)
            answers.append(PROBE_ABSENT if size is None else size)
        c["probe_found"] += sum(size >= 0 for size in answers)
        return answers

    async def value_ages(self, blocks: Sequence[BlockRef]) -> list[float]:
        """How long ago each value was written (``KeyTier.value_ages``): one pipelined PTTL
        each, under the op timeout, on the bulk share of the connections (its callers do
        not wait for it: it must not hold up a lookup's probe). Not part of the probe: PTTLs
        beside its GETRANGEs made a probe of 32 keys 1.6x as long. With ``ttl_s`` 0 nothing
        is asked."""
        ages = [0.0] * len(blocks)
        ttl_s = float(self.options.ttl_s)
        if not blocks or not ttl_s or not self._avail.serves(self._clock()):
            return ages
        all_keys = [self._names.key(b.ns, b.key) for b in blocks]
        asked, pttl = self._asking(all_keys, "PTTL")
        if not asked:
            return ages
        try:
            replies = await self._pipeline(pttl, self._bulk_ops)
        except _Unreachable:
            return ages
        for j, left_ms in zip(asked, replies, strict=True):
            # -1: no expiry; -2: no such key; or a command's error.
            if isinstance(left_ms, int) and left_ms >= 0:
                ages[j] = max(0.0, ttl_s - left_ms / 1000.0)
        return ages

    async def read(
        self, blocks: Sequence[BlockRef], nbytes: int, dest: HostBuffers | PoolPages
    ) -> list[bool | None]:
        """Copy each block into ``dest`` (``KeyTier.read``): False where the store answered
        that it holds no such block (absent, failed verification, removed here), None where it
        did not answer (down, a lost master's key, unreachable or timed out: counted in
        ``read_errors``, or ``read_skipped_down`` when not sent; a command's error, but
        WRONGTYPE: a value of another type, no block). A missed block's destination bytes are
        unspecified."""
        n = len(blocks)
        out: list[bool | None] = [None] * n
        if n == 0:
            return out
        _check_len(dest, n)
        c = self._counters
        c["read_blocks"] += n
        if not self._avail.serves(self._clock()):
            c["read_skipped_down"] += n
            return out
        keys = [self._names.key(b.ns, b.key) for b in blocks]
        asked, get = self._asking(keys, "GET")
        if not asked:
            c["read_skipped_down"] += n
            return out
        try:
            replies = await self._pipeline(get, self._bulk_ops)
        except _Unreachable:
            replies = None
        # A lost master's keys: misses, not asked (before the call waited, or while it did).
        c["read_skipped_down"] += n - len(asked)
        if replies is None:
            c["read_errors"] += len(asked)
            return out
        if len(asked) < n:
            # Their replies: None, as a missing key's (passed over below: ``not_asked``).
            by_position = dict(zip(asked, replies, strict=True))
            replies = [by_position.get(j) for j in range(n)]
            not_asked = set(range(n)).difference(asked)
        else:
            not_asked = set()
        if nbytes * n >= _OFFLOAD_BYTES:
            verdicts = await self._off_loop(_unframe_all, keys, replies, nbytes, dest)
        else:
            verdicts = _unframe_all(keys, replies, nbytes, dest)
        unremoved = self._unremoved
        for j, (key, reply, verdict) in enumerate(zip(keys, replies, verdicts, strict=True)):
            if j in not_asked:
                continue
            if unremoved and key in unremoved:
                out[j] = False
                c["read_absent"] += 1  # removed, though the store could not be told yet
            elif verdict is None:
                self._reply_error(reply, "read_errors")
                if _wrong_type(reply):
                    out[j] = False
            elif verdict is Verdict.OK:
                out[j] = True
                c["read_hits"] += 1
                c["bytes_read"] += nbytes
            else:
                out[j] = False
                c["read_" + verdict.value] += 1
                if verdict is not Verdict.ABSENT:
                    log.debug("L3 value %r refused: %s", key, verdict.value)
        return out

    async def write(
        self, blocks: Sequence[BlockRef], nbytes: int, src: HostBuffers | PoolPages
    ) -> list[bool]:
        """Store each block from ``src`` (SET with the TTL). False: not stored (store
        unreachable or out of memory, over the write budget, value too large, refused)."""
        n = len(blocks)
        out = [False] * n
        if n == 0:
            return out
        _check_len(src, n)
        c = self._counters
        c["write_blocks"] += n
        now = self._clock()
        if not self._avail.takes_writes(now):
            c["write_skipped_down"] += n
            return out
        size = HEADER_BYTES + nbytes
        if size > self.options.max_value_bytes:
            c["write_too_large"] += n
            return out
        all_keys = [self._names.key(b.ns, b.key) for b in blocks]
        # Each key's server is looked up (a cost per block) only while some server is paused
        # or lost: a full or lost server's blocks are declined, the other servers' go on.
        servers: list[str] | None = None
        open_ = list(range(n))
        if self._full or self._lost:
            servers = self._servers_of(all_keys)
            open_ = [j for j in open_ if self._takes_writes(servers[j], now)]
        c["write_skipped_down"] += n - len(open_)
        chosen = [j for j in open_ if self._budget.take(size, now)]
        c["write_dropped_budget"] += len(open_) - len(chosen)
        if not chosen:
            return out
        keys = [all_keys[j] for j in chosen]
        unremoved: list[bytes] = []
        if self._unremoved:
            # Stored again: whether this write lands or not, the block is no longer removed
            # (a value the store still holds under the key is the same block's).
            unremoved = [k for k in keys if self._unremoved.pop(k, None) is not None]
        if self._undropped or self._dropping:
            unremoved += [k for k in keys if k in self._undropped or k in self._dropping]
        for pending in self._removing.values():
            pending.difference_update(keys)  # nor by a removal still on its way
        # An UNLINK of one of the keys that was fixed before (its connection opened for it
        # meanwhile, or its replies on their way) may reach the store after this write's SET,
        # sent on another connection, and delete the block: sent once it has ended.
        unlinking = [done for named, done in self._unlinking.values() if not named.isdisjoint(keys)]
        recording = self._record([], unremoved)
        if recording is not None:
            # Out of the journal before the block is sent: a restart after the block landed
            # would delete it again.
            await asyncio.shield(recording)
        if unlinking:
            await asyncio.wait(unlinking)
        # A block in host memory is sent from where it is; pool pages are gathered first.
        gathered = (
            [self._staging.take(nbytes) for _ in chosen] if isinstance(src, PoolPages) else []
        )
        try:
            return await self._write_framed(
                chosen,
                keys,
                None if servers is None else [servers[j] for j in chosen],
                gathered,
                nbytes,
                src,
                out,
            )
        finally:
            self._staging.give(gathered)

    async def _write_framed(
        self,
        chosen: list[int],
        keys: list[bytes],
        servers: list[str] | None,
        gathered: list[bytearray],
        nbytes: int,
        src: HostBuffers | PoolPages,
        out: list[bool],
    ) -> list[bool]:
        c = self._counters
        if nbytes * len(chosen) >= _OFFLOAD_BYTES:
            values = await self._off_loop(_frame_all, gathered, src, chosen, nbytes, keys)
        else:
            values = _frame_all(gathered, src, chosen, nbytes, keys)
        ttl = self.options.ttl_s
        sent: list[int] = []  # positions in ``keys`` of the blocks the pipeline carries
        # Per full server, the out-of-memory pause this write is sent in.
        paused_since: dict[str, float] = {}

        async def put(pipe: Any) -> None:
            # Run once a connection is free: a pause may have begun (or a refusal extended
            # it) while this write waited for one.
            nonlocal sent, servers
            if servers is None and (self._full or self._lost):
                servers = self._servers_of(keys)
            if servers is None:
                sent = list(range(len(keys)))
            else:
                now = self._clock()
                known = servers
                sent = [i for i, server in enumerate(known) if self._takes_writes(server, now)]
                if not sent:
                    raise _Paused
                for server in {known[i] for i in sent}:
                    if (full := self._full.get(server)) is not None:
                        paused_since[server] = full.since
            for i in sent:
                if ttl:
                    pipe.execute_command("SET", keys[i], values[i], "EX", ttl)
                else:
                    pipe.execute_command("SET", keys[i], values[i])

        try:
            with releasing_bodies():  # the values' bodies are the caller's buffers
                replies = await self._pipeline(put, self._bulk_ops)
        except _Paused:
            c["write_skipped_down"] += len(chosen)
            self._budget.give_back(len(chosen) * (HEADER_BYTES + nbytes))
            return out
        except _Unreachable:
            return out
        # Declined unsent (paused meanwhile): their share of the budget was not spent.
        c["write_skipped_down"] += len(chosen) - len(sent)
        self._budget.give_back((len(chosen) - len(sent)) * (HEADER_BYTES + nbytes))
        no_space: dict[str, str] = {}
        stored: set[str] = set()
        for i, reply in zip(sent, replies, strict=True):
            if isinstance(reply, rx.OutOfMemoryError) or (
                isinstance(reply, rx.ResponseError) and str(reply).startswith("OOM")
            ):
                c["write_no_space"] += 1
                if servers is None:  # none was paused when it was sent: which one is now
                    servers = self._servers_of(keys)
                no_space[servers[i]] = str(reply)
            elif isinstance(reply, BaseException):
                self._reply_error(reply, "write_errors")
            elif reply:
                out[chosen[i]] = True
                if servers is not None:  # (else none was paused: no pause for it to end)
                    stored.add(servers[i])
                c["write_stored"] += 1
                c["bytes_written"] += nbytes
            else:
                c["write_errors"] += 1
        for server in no_space.keys() | stored:
            self._after_write(server, no_space.get(server, ""), paused_since.get(server))
        return out

    def _after_write(self, server: str, no_space: str, paused_since: float | None) -> None:
        """Start, extend or end ``server``'s out-of-memory pause after a write to it that it
        refused for lack of memory (``no_space``, its reply) or that stored something. Only
        a write sent during this pause (after its backoff: ``paused_since``) may extend or
        end it: one sent before was refused for the lack of memory that began the pause, or
        may have been stored before it."""
        if self._avail.state is Reach.DOWN:
            return  # the reconnection starts every server afresh
        full = self._full.get(server)
        sent_in_pause = full is not None and full.since == paused_since
        if no_space:
            if full is None:
                full = self._full[server] = Availability(
                    self.options.backoff_initial_s, self.options.backoff_max_s, self._rng
                )
            if full.state is not Reach.NOSPACE or sent_in_pause:
                self._log_transition(full.no_space(self._clock(), no_space), server=server)
        elif full is not None and sent_in_pause:
            self._log_transition(full.recovered(self._clock()), server=server)
            del self._full[server]

    def _takes_writes(self, server: str, now: float) -> bool:
        """Whether ``server`` is not lost, nor paused for lack of memory (or its backoff is
        over)."""
        if server in self._lost:
            return False
        full = self._full.get(server)
        return full is None or full.takes_writes(now)

    def _asking(
        self, keys: list[bytes], command: str, *args: Any
    ) -> tuple[list[int], Callable[[Any], Awaitable[None]]]:
        """The positions of ``keys`` whose master is not lost, and a pipeline's fill that
        sends ``command`` (the key, then ``args``) for each of them, asked again once the
        call has its connection: a master lost while it waited for one (a hung master,
        timed out by the calls ahead of it) is sent nothing, its keys dropped from the list
        (in place: the caller's list is what was sent), or each call queued behind them
        waited the op timeout in turn. The keys' servers are looked up once, and only while
        a master is lost."""
        servers = self._servers_of(keys) if self._lost else None
        asked = list(range(len(keys)))
        if servers is not None:
            asked = [j for j in asked if servers[j] not in self._lost]

        async def fill(pipe: Any) -> None:
            nonlocal servers
            if lost := self._lost:
                if servers is None:
                    servers = self._servers_of(keys)
                known = servers
                asked[:] = [j for j in asked if known[j] not in lost]
            for j in asked:
                pipe.execute_command(command, keys[j], *args)

        return asked, fill

    def _served(self, keys: list[bytes]) -> list[int]:
        """The positions of the keys whose master is not lost (every one while none is)."""
        if not self._lost:
            return list(range(len(keys)))
        return [j for j, server in enumerate(self._servers_of(keys)) if server not in self._lost]

    def unserved(self, blocks: Sequence[BlockRef]) -> list[int]:
        """``KeyTier.unserved``: every block while the tier is down, a lost master's (those
        ``read`` does not send); the keys are named and their servers looked up only while a
        master is lost."""
        if not self._avail.serves(self._clock()):
            return list(range(len(blocks)))
        if not self._lost:
            return []
        keys = [self._names.key(b.ns, b.key) for b in blocks]
        return [j for j, server in enumerate(self._servers_of(keys)) if server in self._lost]

    def _servers_of(self, keys: list[bytes]) -> list[str]:
        """The server each key goes to as the client knows the cluster now (its slot's
        master; "" for a single server, or a slot the client has no master for)."""
        client = self._client
        if not _is_cluster(client):
            return [""] * len(keys)
        nodes = client.nodes_manager
        out = []
        for k in keys:
            try:
                out.append(nodes.get_node_from_slot(key_slot(k)).name)
            except (rx.RedisClusterException, LookupError):
                out.append("")
        return out

    async def remove(self, blocks: Sequence[BlockRef]) -> None:
        """Forget the blocks (UNLINK: the store frees their memory in the background). What
        the store does not confirm is sent again once it answers, and is absent meanwhile
        (the module docstring)."""
        if not blocks:
            return
        c = self._counters
        c["remove_blocks"] += len(blocks)
        keys = [self._names.key(b.ns, b.key) for b in blocks]
        if not self._avail.serves(self._clock()):
            c["remove_skipped_down"] += len(blocks)
            await self._remember_removals(keys)
            return
        keys, holding = self._hold_for_lost(keys, first=True)
        if holding is not None:
            await asyncio.shield(holding)
        if not keys:
            return
        # (Probes that overlap the UNLINKs are the store's to mind: ``BlockStore.delete``.)
        removal = next(self._removal_ids)
        self._removing[removal] = set(keys)
        try:
            refused = await self._unlink(keys, pending=self._removing[removal])
        finally:
            del self._removing[removal]
        if refused == [] and self._unremoved and (self._resend_may_send or not self._lost):
            self._resend_removals()  # the store takes removals again: older ones may go too

    def _hold_for_lost(
        self, keys: list[bytes], *, first: bool
    ) -> tuple[list[bytes], asyncio.Task[None] | None]:
        """Of the removals of ``keys``, those whose master is not lost (every one while none
        is), to be sent. The others wait for it (sent at the reconnection that finds it
        back): a ``first`` send's are remembered (counted in ``remove_skipped_down``), with
        the journal's record of them if any (else None); a resend's are remembered already."""
        if not self._lost:
            return keys, None
        served = self._served(keys)
        if len(served) == len(keys):
            return keys, None
        recording = None
        if first:
            kept = set(served)
            held = [k for j, k in enumerate(keys) if j not in kept]
            self._counters["remove_skipped_down"] += len(held)
            recording = self._remember(held, waiting_for_lost=True)
        return [keys[j] for j in served], recording

    async def _remember_removals(
        self, keys: list[bytes], *, waiting_for_lost: bool = False
    ) -> None:
        """Remember ``keys`` as removals to send again; returns once the journal, if there
        is one, has them (a caller cancelled meanwhile leaves the record to go on).
        ``waiting_for_lost``: every key's master is lost."""
        recording = self._remember(keys, waiting_for_lost=waiting_for_lost)
        if recording is not None:
            await asyncio.shield(recording)

    def _remember(
        self, keys: list[bytes], *, waiting_for_lost: bool = False
    ) -> asyncio.Task[None] | None:
        """``_remember_removals`` without waiting: the journal's record, if any, goes on in
        the background (awaited at ``close``)."""
        if not waiting_for_lost:
            self._resend_may_send = True
        unremoved = self._unremoved
        until = self._clock() + self.options.ttl_s if self.options.ttl_s else float("inf")
        for k in keys:
            unremoved.pop(k, None)  # to the end: the order is the order of their deadlines
            unremoved[k] = until
        excess = len(unremoved) - _UNREMOVED_MAX
        forgotten: list[bytes] = []
        if excess > 0:
            forgotten = list(itertools.islice(unremoved, excess))
            for k in forgotten:
                del unremoved[k]
            self._counters["remove_forgotten"] += excess
            if not self._unremoved_warned:
                self._unremoved_warned = True
                log.warning(
                    "L3: more than %d removals wait for the store to confirm them; the oldest "
                    "are forgotten and may be found again until their expiry",
                    _UNREMOVED_MAX,
                )
        return self._record([k for k in keys if k in unremoved], forgotten)

    def _record(self, added: list[bytes], dropped: list[bytes]) -> asyncio.Task[None] | None:
        """Update the journal, if any, in the background (its turn after the updates begun
        before): ``added`` kept until ``ttl_s`` from now, ``dropped`` forgotten."""
        if self._journal is None or not (added or dropped):
            return None
        ttl = self.options.ttl_s
        until = self._wall_clock() + ttl if ttl else None
        self._dropping.update(dropped)
        self._adding.update(added)
        task = asyncio.ensure_future(
            self._journal_update(self._journal, [(k, until) for k in added], dropped)
        )
        self._journaling.add(task)
        task.add_done_callback(self._journaling.discard)
        return task

    async def _journal_update(
        self,
        journal: RemovalJournal,
        added: list[tuple[bytes, float | None]],
        dropped: list[bytes],
    ) -> None:
        keys = [k for k, _ in added]
        try:
            async with self._journal_turn:
                # Added after the drops: a key removed again since its drop failed stays.
                named_now = set(dropped)
                gone = [*dropped, *(k for k in self._undropped if k not in named_now)]
                try:
                    recorded = await asyncio.to_thread(journal.record_removals, added, gone)
                except Exception:
                    log.exception("L3: recording removals failed unexpectedly")
                    recorded = False
                self._unrecorded.difference_update(dropped)
                if recorded:
                    self._undropped.clear()
                    self._undropped_warned = False
                    self._unrecorded.difference_update(keys)
                else:
                    self._keep_undropped(dropped, keys)
                    self._unrecorded.update(keys)
        finally:
            for pending, named in ((self._dropping, dropped), (self._adding, keys)):
                pending.subtract(named)
                for k in named:
                    if pending[k] <= 0:
                        pending.pop(k, None)  # a key named twice goes at its first
        if not recorded:
            # The journal's own tier reports why; these stay remembered in memory only.
            self._counters["remove_unrecorded"] += len(added)

    def _keep_undropped(self, dropped: list[bytes], added: list[bytes]) -> None:
        """Note that ``dropped`` may still be in the journal (its update failed), but those
        ``added`` again (kept there: removals again), within ``_UNDROPPED_MAX``."""
        undropped = self._undropped
        for k in dropped:
            undropped.pop(k, None)  # to the end: the newest go last
            undropped[k] = None
        for k in added:
            undropped.pop(k, None)
        excess = len(undropped) - _UNDROPPED_MAX
        if excess <= 0:
            return
        for k in list(itertools.islice(undropped, excess)):
            del undropped[k]
        self._counters["remove_drops_forgotten"] += excess
        if not self._undropped_warned:
            self._undropped_warned = True
            log.warning(
                "L3: more than %d keys wait to be dropped from the removals journal, which "
                "keeps failing; the oldest are no longer tried: a restart sends their "
                "UNLINKs again (until their expiry), deleting what was written under them "
                "since",
                _UNDROPPED_MAX,
            )

    async def _unlink(
        self, keys: list[bytes], *, pending: set[bytes] | None = None
    ) -> list[bytes] | None:
        """UNLINK ``keys`` in one pipeline; those the store confirms stop being remembered
        as removals, the others are remembered (a first send: ``pending``, the keys of it no
        write stored again since it began) or stay so (a resend). Returns the keys the store
        refused; None if it could not be reached. Only the keys still ``pending``, or still
        remembered, once a connection is free are sent, and only they are remembered: one
        written meanwhile holds the block stored again, which the UNLINK would delete. From
        then until the UNLINK ends, a write of one of them waits (``_unlinking``). Those
        of a master lost by then wait for it (``_hold_for_lost``)."""
        wanted = self._unremoved if pending is None else pending
        unlinking = next(self._unlink_ids)
        holding: asyncio.Task[None] | None = None

        # Through execute_command: the cluster pipeline's own ``unlink`` is a coroutine that
        # splits keys by slot, unlike the plain pipeline's.
        async def unlink(pipe: Any) -> None:
            nonlocal keys, holding
            # A master lost while this waited for its connection (a hung one, timed out by
            # the calls ahead) is sent nothing, or this waited the op timeout for it too.
            keys, holding = self._hold_for_lost(
                [k for k in keys if k in wanted], first=pending is not None
            )
            if pending is None:  # counted as sent: not those held, nor those confirmed since
                self._counters["remove_retried"] += len(keys)
            else:  # those held are remembered now, not on their way (kept again by ``close``)
                pending.intersection_update(keys)
            done = asyncio.get_running_loop().create_future()
            self._unlinking[unlinking] = (frozenset(keys), done)
            for k in keys:
                pipe.execute_command("UNLINK", k)

        try:
            try:
                replies = await self._pipeline(unlink, self._small_ops)
            finally:
                # Ended here, not once the keys left unconfirmed are in the journal (a busy
                # one takes up to its busy timeout): the writes held back go no later than
                # the op timeout.
                if (sent := self._unlinking.pop(unlinking, None)) is not None:
                    sent[1].set_result(None)
        except _Unreachable:
            if pending is not None:
                await self._remember_removals([k for k in keys if k in pending])
            replies = None
        except asyncio.CancelledError:
            if pending is not None:
                # Cancelled before the store confirmed it (the UNLINK sent or not): kept as
                # one the store could not take, else the block stayed in the store and was
                # found again, by the next lookup or after a restart.
                self._remember([k for k in keys if k in pending])
                self._resend_removals()
            raise
        if holding is not None:
            await asyncio.shield(holding)
        if replies is None:
            return None
        refused = []
        confirmed = []
        for k, reply in zip(keys, replies, strict=True):
            if isinstance(reply, BaseException):
                self._reply_error(reply, "remove_errors")
                refused.append(k)
            elif self._unremoved.pop(k, None) is not None:
                confirmed.append(k)
        self._record([], confirmed)
        if pending is not None and refused:
            await self._remember_removals([k for k in refused if k in pending])
        return refused

    def _resend_removals(self) -> None:
        """Send the remembered removals again, in the background (one task at a time)."""
        if self._resending is None and not self._closed:
            # Outside any request's log context: the loop sends the removals of earlier
            # requests, and its lines are the daemon's, not the request whose call started it.
            self._resending = contextvars.Context().run(self._spawn, self._resend_loop())

    async def _resend_loop(self) -> None:
        try:
            while self._unremoved and self._avail.serves(self._clock()):
                now = self._clock()
                unremoved = self._unremoved
                expired = []
                while unremoved:  # the oldest first: the store has dropped expired ones
                    oldest = next(iter(unremoved))
                    if unremoved[oldest] > now:
                        break
                    del unremoved[oldest]
                    expired.append(oldest)
                self._record([], expired)
                if self._lost:
                    # A lost master's keys wait for it: sent at the reconnection that finds
                    # it back.
                    waiting = list(unremoved)
                    served = self._served(waiting)
                    keys = [waiting[j] for j in served[:_UNREMOVE_BATCH]]
                    self._resend_may_send = bool(keys)
                else:
                    keys = list(itertools.islice(unremoved, _UNREMOVE_BATCH))
                if not keys:
                    break
                if await self._unlink(keys) != []:
                    break  # unreachable or refused: again at the next removal or reconnection
        finally:
            self._resending = None

    def set_write_rate(self, bytes_s: int) -> None:
        self._budget.set_rate(bytes_s, self.options.max_value_bytes)

    def health(self) -> TierHealth:
        """DOWN while unreachable; DEGRADED_IO while masters are lost; DEGRADED_NOSPACE
        while an out-of-memory pause holds back the writes to a server (on a cluster, a
        master). The detail names each lost or paused master. ``partial`` while some master
        is neither (the detail says so): the daemon goes on offering blocks and the tier
        declines those of the others; once none is left (the others lost or full too) the
        tier accepts no write. Once a pause's backoff is over its master counts as taking
        writes again, though it stays paused until a write to it goes through: only a write
        sent after the backoff ends the pause (or, refused again, extends it)."""
        a = self._avail
        if a.state is Reach.DOWN:
            retry_in = max(0.0, a.retry_at - self._clock())
            return TierHealth(Health.DOWN, f"{a.detail}; retrying in {retry_in:.1f}s")
        if not self._lost and not self._full:
            return HEALTHY  # the common case: asked per Lookup and per put (the store)
        paused = self._paused(self._clock())
        if not self._lost and not paused:
            return HEALTHY
        details = [
            f"master {server} unreachable ({why}): its slots' blocks are misses"
            for server, why in self._lost.items()
        ]
        details += [
            f"master {server} out of memory ({full.detail}): its writes paused"
            if server
            else full.detail
            for server, full in paused.items()
        ]
        # By name, not by count: a paused master may have left the slot map since (a failover).
        held = self._lost.keys() | paused.keys()
        client = self._client
        partial = _is_cluster(client) and any(p.name not in held for p in client.get_primaries())
        if partial:
            # Said where the state is shown (kvtier health, stats): degraded_io and
            # degraded_nospace read as a tier that takes no write.
            details.append("the other masters serve and take writes")
        return TierHealth(
            Health.DEGRADED_IO if self._lost else Health.DEGRADED_NOSPACE,
            "; ".join(details),
            partial=partial,
        )

    def _paused(self, now: float) -> dict[str, Availability]:
        """The servers whose writes an out-of-memory pause holds back now."""
        return {s: full for s, full in self._pauses().items() if not full.takes_writes(now)}

    def _pauses(self) -> dict[str, Availability]:
        """The out-of-memory pauses of the servers that are masters as the client knows the
        cluster now. One that left the slot map since (its replica took over) is sent no
        write, so none would end its pause: it would count for good."""
        client = self._client
        if not self._full or not _is_cluster(client):
            return self._full
        primaries = {p.name for p in client.get_primaries()}
        return {s: full for s, full in self._full.items() if s in primaries}

    def stats(self) -> TierStats:
        now = self._clock()
        a = self._avail
        full = self._pauses()  # paused, or taking writes again only once one goes through
        # When the next attempt is due: the reconnection's while DOWN, else the soonest of
        # the pauses' ends and the lost masters' recheck.
        due = [a.retry_at] if a.state is not Reach.UP else [f.retry_at for f in full.values()]
        if self._lost:
            due.append(self._lost_retry_at)
        return TierStats(
            kind=TierKind.REMOTE,
            health=self.health(),
            capacity_bytes=0,  # the store's own; not tracked here
            used_bytes=0,
            counters=dict(self._counters),
            gauges={
                "up": 1.0 if a.state is Reach.UP and not full and not self._lost else 0.0,
                "state_age_s": max(0.0, now - a.since) if a.since else 0.0,
                "retry_in_s": max(0.0, min(due) - now) if due else 0.0,
                "inflight_ops": float(self._inflight),
                "removals_unconfirmed": float(len(self._unremoved)),
                # Only with tiers.l3.write_bytes_s: without one there is no budget to show.
                **({"write_budget_bytes": self._budget.tokens} if self._budget.rate else {}),
            },
        )

    # ------------------------------------------------------------------ internals

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._adopt(task)
        return task

    async def _bounded(self, coro: Awaitable[T], timeout_s: float) -> T:
        """``coro``'s result, or asyncio.TimeoutError after ``timeout_s``. Unlike wait_for,
        the caller is not held until the cancelled call has unwound: a library call that
        ignores or delays cancellation finishes in the background."""
        task = asyncio.ensure_future(coro)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            self._adopt(task)
            raise
        if not done:
            task.cancel()
            self._adopt(task)
            raise asyncio.TimeoutError
        return task.result()

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a codec thread. If the caller is cancelled meanwhile, it still
        waits for the thread to finish before unwinding: the thread reads or writes the
        caller's buffers, which must not be handed back while it does."""
        if self._closed:
            return fn(*args)  # no threads after close; a late call still gets its answer
        if self._codec is None:
            self._codec = ThreadPoolExecutor(_CODEC_THREADS, thread_name_prefix="l3-codec")
        fut = asyncio.get_running_loop().run_in_executor(self._codec, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({fut})
            raise

    def _adopt(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        # A probe's round trip may end after its caller stopped waiting: its outcome is
        # already accounted for; retrieve it so that asyncio does not report it as lost.
        if not task.cancelled():
            task.exception()

    async def _pipeline(
        self, fill: Callable[[Any], Awaitable[None]], share: asyncio.Semaphore
    ) -> list[Any]:
        """Run one pipeline (per-command errors come back in place) under the op timeout.
        Raises _Unreachable after marking the tier DOWN."""
        async with share:
            # The tier may have gone down while this call waited for a connection.
            if not self._avail.serves(self._clock()):
                raise _Unreachable
            client, generation = self._client, self._generation
            self._inflight += 1
            self._calls[generation] += 1
            # On a cluster, a master's connection fault answers its commands only, and so
            # does its silence: each master's part ends at the op timeout (``wire``), the
            # call as a whole only if it outlasts that.
            timeout_s = self.options.op_timeout_s
            faults = None
            if _is_cluster(client):
                faults = NodeFaults(asyncio.get_running_loop().time() + timeout_s)
                timeout_s += _HAND_BACK_S
            try:
                pipe = (
                    client.pipeline() if faults is not None else client.pipeline(transaction=False)
                )
                await fill(pipe)
                with noting_node_faults(faults):  # (its tasks start within)
                    replies = list(
                        await self._bounded(pipe.execute(raise_on_error=False), timeout_s)
                    )
            except _UNREACHABLE_OR_REFUSED as e:
                # Unreachable, or a fault of the whole pipeline (e.g. NOAUTH after a restart
                # with a new password): either way the store cannot serve us now.
                self._fail(generation, _describe(e), timeout=isinstance(e, _TIMEOUTS))
                raise _Unreachable from None
            finally:
                self._inflight -= 1
                self._call_ended(generation)
        # Per-command replies that say the store (or the server of that slot) is gone: a
        # master's connection fault or timeout, that master; any other, the store.
        lost: dict[str, str] = {}
        timed_out = False
        for reply in replies:
            if isinstance(reply, _UNREACHABLE):
                timeout = isinstance(reply, _TIMEOUTS)
                server = None if faults is None else faults.node_of(reply)
                if server is None:
                    self._fail(generation, _describe(reply), timeout=timeout)
                    break
                timed_out |= timeout
                lost.setdefault(server, _describe(reply))
        else:
            if lost:
                self._lose(generation, lost, timeout=timed_out)
        return replies

    def _lose(self, generation: int, lost: dict[str, str], *, timeout: bool) -> None:
        """Masters whose connections failed in a call (refused, reset, closed, or silent
        until the op timeout: each one's fault answered its own commands, the others' were
        served): lost at once, as when a reconnection finds them so, rather than the tier
        DOWN until the other nodes count them failed (``cluster-node-timeout``). The monitor
        asks after about ``backoff_initial_s`` whether they are back (a restarted server's
        closed connection costs no more), then doubling as for any lost master
        (``_set_lost``). Where none would be left serving, or a server is no master the
        client knows, the store is unreachable: DOWN."""
        if generation != self._generation or self._closed or self._avail.state is Reach.DOWN:
            return  # a fault of a client already replaced, or the reconnection's to judge
        fresh = {server: why for server, why in lost.items() if server not in self._lost}
        if not fresh:
            return
        masters = {p.name for p in self._client.get_primaries()}
        if not fresh.keys() <= masters or masters <= self._lost.keys() | fresh.keys():
            server, why = next(iter(fresh.items()))
            self._fail(generation, f"{why} at {server}", timeout=timeout)
            return
        self._counters["timeouts" if timeout else "connection_errors"] += 1
        self._set_lost(self._lost | fresh)

    def _replace_client(self, fresh: Any) -> None:
        """Serve through ``fresh`` from now on; the client it replaces is closed once the
        calls in flight on it end."""
        old, generation = self._client, self._generation
        self._client = fresh
        self._generation += 1
        if self._calls[generation]:
            self._replaced[generation] = old
        else:
            self._spawn(_close_client(old))

    def _call_ended(self, generation: int) -> None:
        calls = self._calls
        calls[generation] -= 1
        if calls[generation] > 0:
            return
        del calls[generation]
        if (replaced := self._replaced.pop(generation, None)) is not None:
            self._spawn(_close_client(replaced))

    def _reply_error(self, reply: BaseException, counter: str) -> None:
        """A per-command error inside a pipeline's replies (reachability is judged by
        ``_pipeline``)."""
        self._counters[counter] += 1
        log.debug("L3 command failed: %s", _describe(reply))

    def _fail(self, generation: int, detail: str, *, timeout: bool) -> None:
        if generation != self._generation or self._closed:
            return  # a fault of a client already replaced
        self._counters["timeouts" if timeout else "connection_errors"] += 1
        transition = self._avail.failed(self._clock(), detail)
        if transition is not None:
            self._full.clear()  # the reconnection finds out afresh which server is full
            self._lost.clear()  # and which is lost
            self._counters["down_transitions"] += 1
            self._log_transition(transition)
            if self._wake is not None:
                self._wake.set()

    def _log_transition(
        self, t: Transition | None, down_s: float = 0.0, *, server: str = ""
    ) -> None:
        if t is None:
            return
        store = f"master {server}" if server else "store"
        if t.after is Reach.DOWN:
            log.warning(
                "L3 unreachable (%s): serving without it; reconnecting in %.1fs",
                t.detail,
                t.retry_in_s,
            )
        elif t.after is Reach.NOSPACE:
            log.warning(
                "L3 %s is out of memory (%s): writes to it paused for %.1fs",
                store,
                t.detail,
                t.retry_in_s,
            )
        elif t.before is Reach.DOWN:
            log.info("L3 reachable again after %.1fs", down_s)
        else:
            log.info("L3 %s takes writes again", store)

    async def _monitor_loop(self) -> None:
        """While DOWN: after each backoff, try a fresh client; on success swap it in. While
        masters are lost (UP): after a backoff of its own (``_set_lost``), ask a fresh client
        whether they are back (or others lost), and swap it in if so."""
        assert self._wake is not None
        while True:
            self._wake.clear()
            down = self._avail.state is Reach.DOWN
            if not down and not self._lost:
                await self._wake.wait()
                continue
            delay = (self._avail.retry_at if down else self._lost_retry_at) - self._clock()
            if delay > 0:
                if down:
                    await asyncio.sleep(delay)
                else:
                    # Woken early by the tier going down: its own backoff then.
                    with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), delay)
                    continue
            self._counters["reconnect_attempts"] += 1
            self._reread_password()
            fresh = self._new_client()
            try:
                detail, lost = await self._check(fresh)
            except Exception as e:  # never let the monitor die
                log.exception("L3 reconnection attempt failed unexpectedly")
                detail, lost = _describe(e), {}
            if detail is None and (down or lost.keys() != self._lost.keys()):
                self._replace_client(fresh)
                if down:
                    self._counters["reconnects"] += 1
                    down_s = self._clock() - self._avail.since
                    self._log_transition(self._avail.recovered(self._clock()), down_s)
                self._set_lost(lost)
                self._resend_removals()
            else:
                self._spawn(_close_client(fresh))
                if down:
                    assert detail is not None
                    delay = self._avail.retry_failed(self._clock(), detail)
                    log.debug("L3 still unreachable (%s); next attempt in %.1fs", detail, delay)
                else:
                    # Still lost; or the check failed, which the verbs find out for themselves.
                    self._set_lost(self._lost)

    def _set_lost(self, lost: dict[str, str]) -> None:
        """The masters lost from now on (each change logged once), and when to ask again:
        after ``backoff_initial_s`` where they changed, doubling up to ``backoff_max_s`` for
        each check that finds the same ones lost (jittered), as while the tier is DOWN: a
        master back a few seconds after a call lost it (a restart) serves again a few
        seconds later, not ``backoff_max_s`` later."""
        still = lost.keys() == self._lost.keys()
        for server, why in lost.items():
            if server not in self._lost:
                log.warning(
                    "L3 master %s unreachable (%s) while the rest of the cluster serves: the "
                    "blocks of its slots are misses until it is back",
                    server,
                    why,
                )
        for server in self._lost.keys() - lost.keys():
            log.info("L3 master %s reachable again", server)
        self._lost = dict(lost)
        self._lost_checks = self._lost_checks + 1 if still and lost else 0
        if lost:
            o = self.options
            delay = backoff_s(o.backoff_initial_s, o.backoff_max_s, self._lost_checks, self._rng)
            self._lost_retry_at = self._clock() + delay
            if self._wake is not None:
                self._wake.set()

    def _reread_password(self) -> None:
        """Read the password file again before a reconnection attempt: a store restarted
        with a rotated password (the file rewritten to match) is reached again without
        restarting the daemon. A file that cannot be read now keeps the password read
        before; its problem is logged once."""
        path = self.options.password_file
        if not path:
            return
        try:
            found = read_password(path)
        except RemoteOptionsError as e:
            if str(e) != self._password_problem:
                log.warning("L3 %s; keeping the password read before", e)
                self._password_problem = str(e)
            return
        self._password_problem = ""
        if found is not None:
            self._password = found[0]

    async def _check(self, client: Any) -> tuple[str | None, dict[str, str]]:
        """(None, lost) if ``client`` can serve, else (why not, {}). Serving: every primary
        answers and reports the cluster ok, or some do and report ok while the others are
        ``lost`` (name -> why), the others serving their slots: those whose connection failed
        (refused, reset, closed) or that did not answer in time, as when a call meets them
        (``_lose``); not one, where every primary is so.
        Every primary, not one: a master back after an outage serves nothing for its first
        seconds while the others already report ok, and some of the others count it failed
        a while longer while it does; asked of one node, each reconnection found ok and the
        next call to another marked the tier down again, over and over. Asked of each node's
        own connections: a connection fault through the cluster client closes every
        node's."""
        timeout = self.options.connect_timeout_s + self.options.op_timeout_s
        try:
            if not _is_cluster(client):
                await self._bounded(client.ping(), timeout)
                return None, {}
            # The map from the startup nodes in turn, then the command table from slot 0's
            # master: a hung one may be met at both, an op timeout each.
            await self._bounded(_initialize(client), timeout + self.options.op_timeout_s)
            primaries = client.get_primaries()
            infos = await self._bounded(
                asyncio.gather(
                    *(p.execute_command("CLUSTER", "INFO") for p in primaries),
                    return_exceptions=True,
                ),
                timeout,
            )
            lost: dict[str, str] = {}
            for primary, info in zip(primaries, infos, strict=True):
                if isinstance(info, _REFUSED_CREDENTIALS):
                    raise info  # a ConnectionError to redis-py, but no lost master
                if isinstance(info, _UNREACHABLE_NODE):
                    lost[primary.name] = _describe(info)
                elif isinstance(info, BaseException):
                    raise info
                elif (state := _info_field(info, "cluster_state")) != "ok":
                    return f"cluster state is {state!r} at {primary.name}", {}
            if len(lost) == len(primaries):
                name, why = next(iter(lost.items()))
                return f"{why} at {name}", {}
            return None, lost
        except _REFUSED_CREDENTIALS as e:
            return f"refused credentials: {_describe(e)}", {}
        except rx.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                return f"refused credentials: {_describe(e)}", {}
            return _describe(e), {}
        except _UNREACHABLE_OR_REFUSED as e:
            return _describe(e), {}

    def _new_client(self) -> Any:
        o = self.options
        common: dict[str, Any] = {
            "username": o.username or None,
            "password": self._password,
            "socket_timeout": o.op_timeout_s,
            "socket_connect_timeout": o.connect_timeout_s,
            # One immediate retry on a fresh connection: a pooled connection may have been
            # closed by a server restart. The op timeout bounds the whole call regardless.
            "retry": Retry(NoBackoff(), 1),
            # Room for the reconnection probe beyond the verbs' own share.
            "max_connections": o.pool_size + 2,
            "decode_responses": False,
            "socket_read_size": SOCKET_READ_BYTES,
        }
        if self._endpoints[0].tls:
            common.update(
                ssl=True,
                ssl_ca_certs=o.tls_ca_file or None,
                ssl_certfile=o.tls_cert_file or None,
                ssl_keyfile=o.tls_key_file or None,
                ssl_cert_reqs="required",
            )
        client: Any
        if o.mode == "cluster":
            nodes = [ClusterNode(e.host, e.port) for e in self._endpoints]
            # A MOVED patches its slot only: redis-py's default (reinitialize_steps 5) also
            # closed every connection of the client at each fifth, the pipelines of other
            # calls in flight on them with it, so a reshard under load marked the tier down
            # over and over. A fault that needs the whole topology again marks the tier down
            # and the reconnection reads it afresh.
            client = RedisCluster(startup_nodes=nodes, reinitialize_steps=0, **common)
        else:
            e = self._endpoints[0]
            client = aioredis.Redis(host=e.host, port=e.port, **common)
        use_tier_connections(client)
        return client


def _carry_removals(source: RemovalJournal, dest: RemovalJournal) -> None:
    """Move every entry of ``source`` into ``dest``: out of ``source`` only once ``dest`` has
    them (a crash between leaves them in both; the next start moves them again)."""
    entries = source.removals()
    if entries and dest.record_removals(entries, []):
        source.record_removals([], [key for key, _ in entries])
        log.info("L3: %d removals moved into the removals_file", len(entries))


def _is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


async def _initialize(client: Any) -> None:
    """Read the cluster's map, and the command table from the first primary that answers.
    redis-py's ``initialize`` asks its default node only (the first primary of CLUSTER
    SLOTS: slot 0's), so with that master lost every client failed to start and the tier
    stayed down, though the other masters served."""
    try:
        await client.initialize()
        return
    except _UNREACHABLE_NODE:
        if not client.nodes_manager.slots_cache:
            raise  # no map: no startup node answered
        asked = getattr(client.commands_parser, "node", None)
        others = [p for p in client.get_primaries() if asked is None or p.name != asked.name]
        for node in others:
            try:
                await client.commands_parser.initialize(node)
            except _UNREACHABLE_NODE:
                continue
            client.set_default_node(node)
            # What a successful ``initialize`` sets: its calls no longer start it again, and
            # its close closes the connections.
            client._initialize = False
            return
        raise


def _info_field(info: Any, name: str) -> str | None:
    """A field of a CLUSTER INFO reply (``name:value`` lines)."""
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


class _Staging:
    """Reusable buffers for blocks gathered from pool pages before they are sent (a fresh
    2 MiB buffer is zero-filled and page-faulted every time). Buffers go back after the
    pipeline that sent them has ended: by then the store has them whole, or the connections
    that held them were aborted (``wire.releasing_bodies``).

    Thread-safety: none; the event loop owns it."""

    def __init__(self, retain_bytes: int) -> None:
        self.retain_bytes = retain_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._held = 0

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        if free:
            self._held -= size
            return free.pop()
        return bytearray(size)

    def give(self, bufs: list[bytearray]) -> None:
        for buf in bufs:
            if self._held + len(buf) > self.retain_bytes:
                return
            self._free.setdefault(len(buf), []).append(buf)
            self._held += len(buf)


def _frame(
    src: HostBuffers | PoolPages, j: int, nbytes: int, key: bytes, gather: bytearray | None
) -> Framed:
    """Block ``j``'s stored form: its header, then its bytes where they are (pool pages:
    gathered into ``gather`` first)."""
    body = get_block(src, j, nbytes, gather)
    if len(body) < nbytes:
        raise ValueError(f"source buffer {j} holds {len(body)} bytes, fewer than {nbytes}")
    return Framed(header(nbytes, checksum(body), key), body)


def _frame_all(
    gathered: list[bytearray],
    src: HostBuffers | PoolPages,
    chosen: list[int],
    nbytes: int,
    keys: list[bytes],
) -> list[Framed]:
    return [
        _frame(src, j, nbytes, key, gathered[i] if gathered else None)
        for i, (j, key) in enumerate(zip(chosen, keys, strict=True))
    ]


def _unframe_all(
    keys: list[bytes], replies: list[Any], nbytes: int, dest: HostBuffers | PoolPages
) -> list[Verdict | None]:
    """Each reply's verdict (None: a command error), the valid ones copied into ``dest``."""
    verdicts: list[Verdict | None] = []
    for j, (key, value) in enumerate(zip(keys, replies, strict=True)):
        if isinstance(value, BaseException):
            verdicts.append(None)
            continue
        verdict = verify(value, nbytes, key)
        if verdict is Verdict.OK:
            put_block(dest, j, memoryview(value)[HEADER_BYTES:], nbytes)
        verdicts.append(verdict)
    return verdicts


def _wrong_type(reply: BaseException) -> bool:
    """Whether a command's error is a key of another type's (WRONGTYPE): it holds no block."""
    return isinstance(reply, rx.ResponseError) and str(reply).startswith("WRONGTYPE")


def _check_len(buffers: HostBuffers | PoolPages, n: int) -> None:
    if len(buffers) < n:
        raise ValueError(f"{n} blocks but {len(buffers)} buffers")


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    name = type(e).__name__
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not text:
        return "timeout"
    return f"{name}: {text}" if text else name


async def _close_client(client: Any) -> None:
    close = getattr(client, "aclose", None) or client.close
    with contextlib.suppress(Exception):
        await close()


def _password(path: str) -> str | None:
    """The password in ``path`` (``read_password``), None without a path."""
    try:
        found = read_password(path)
    except RemoteOptionsError as e:
        raise TierUnavailable(f"L3 {e}") from None
    if found is None:
        return None
    password, everyone_reads = found
    if everyone_reads:
        log.warning("L3 password_file %s is readable by every user; chmod o-r it", path)
    return password
